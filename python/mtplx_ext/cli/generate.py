"""`mtplx-ext generate`: decode prompts as one batch with MTP, streaming text."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mtplx_ext import _blas
from mtplx_ext.batching import admission
from mtplx_ext.cli import common, parallel
from mtplx_ext.cli.common import (
    CLIError,
    Stdout,
    TextStreamer,
    check_prompt_text,
    depth_flag,
    encode,
    positive,
    sampler_flag,
    seed_flag,
    stop_ids,
    tokenizer,
)
from mtplx_ext.batching import generate_batched, generate_greedy_batched
from mtplx_ext.sampling import SamplerConfig
from mtplx_ext.shipped import DEFAULT_PROMPT

def add_parser(sub: Any) -> None:
    """Adds the `generate` verb to the dispatcher's subparsers."""
    g = sub.add_parser("generate", help="decode prompts as one batch, streaming text")
    g.add_argument("prompt", nargs="*", help=f"prompt texts (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--model", help="model folder (default: the shipped model)")
    g.add_argument("--drafter", metavar="FOLDER", help="a Gemma 4 assistant folder drafting for --model")
    common.add_kv_flags(g)
    g.add_argument("--max-tokens", type=positive("--max-tokens"), default=128)
    g.add_argument("--temperature", type=sampler_flag("--temperature", "temperature"), default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=sampler_flag("--top-p", "top_p"), default=1.0)
    g.add_argument("--top-k", type=sampler_flag("--top-k", "top_k", int), default=0, help="0 = off")
    g.add_argument("--seed", type=seed_flag, default=0)
    g.add_argument("--no-mtp", action="store_true", help="plain autoregressive decoding")
    g.add_argument("--ignore-eos", action="store_true", help="decode --max-tokens tokens whatever the model emits")
    g.add_argument("--depth", type=depth_flag, default="auto",
                   help="MTP drafts per cycle, 1..8, or auto (default: the fastest here, plain where MTP would not pay)")
    common.add_recalibrate_flag(g)
    g.add_argument("--enforce-eager", action="store_true", help="build every decode step in Python (no mx.compile)")
    parallel.add_flags(g)
    g.set_defaults(func=run)

def decode(rt: Any, prompts: list[list[int]], args: argparse.Namespace, on_commit=None, stop=()) -> Any:
    if args.temperature > 0:
        sampler = SamplerConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        try:
            return generate_batched(
                rt, prompts, max_new_tokens=args.max_tokens, sampler=sampler, seed=args.seed,
                stop_token_ids=stop, use_mtp_draft=not args.no_mtp, on_commit=on_commit,
                enforce_eager=args.enforce_eager, depth=args.depth,
            )
        except NotImplementedError as e:
            raise CLIError(f"--temperature > 0 is not available in this build: {e}") from e
    return generate_greedy_batched(
        rt, prompts, max_new_tokens=args.max_tokens, stop_token_ids=stop,
        use_mtp_draft=not args.no_mtp, on_commit=on_commit, enforce_eager=args.enforce_eager, depth=args.depth,
    )


def run(args: argparse.Namespace) -> int:
    texts = args.prompt or [DEFAULT_PROMPT]
    check_prompt_text(texts)
    common.apply_recalibrate(args)
    dist = parallel.start(args)  # before stdout is taken: ranks > 0 print nothing
    out = Stdout()
    if not args.enforce_eager and common.mlx_kernel_cache_is_cold():
        print(
            "first compiled decode on this machine: MLX builds its fused CPU kernels with the C++ compiler "
            "(seconds, cached for later runs; --enforce-eager skips compiling)",
            file=sys.stderr,
        )
    rt = common.load_model(args.model, need_mtp=not args.no_mtp, drafter=args.drafter, **parallel.load_kwargs(dist),
                           kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    tok = tokenizer(rt, args.model)
    prompts = encode(tok, texts)
    context = admission.model_context(rt)
    for i, ids in enumerate(prompts):
        try:  # the server's rule: prompt + max_tokens within the model's context
            admission.check_context(len(ids), args.max_tokens, context)
        except ValueError as e:
            raise CLIError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
    if len(prompts) == 1:
        header = texts[0]
    else:
        header = "".join(f"[{i}] prompt: {t!r}\n" for i, t in enumerate(texts))
    streamer = TextStreamer(tok, len(prompts), out=out, header=header)
    with parallel.guard(dist):
        if args.depth == "auto" and not args.no_mtp:
            parallel.agree_depth(dist, rt, [len(prompts)], args.enforce_eager)
        res = decode(rt, prompts, args, on_commit=parallel.on_commit(dist, streamer), stop=() if args.ignore_eos else stop_ids(tok))
        parallel.finish(dist)
    streamer.finish()
    per_stream = res.generated_tokens / len(prompts)
    if args.no_mtp:
        mode = "plain decoding"
    elif res.depth == 0:
        mode = (f"plain decoding (--depth auto: MTP does not pay at batch {len(prompts)} on this model here; "
                f"{common.calibration_note(rt)})")
    else:
        per_depth = "/".join(f"{a:.2f}" for a in res.acceptance_per_depth)
        auto = f" (auto, {common.calibration_note(rt)})" if args.depth == "auto" else ""
        mode = (
            f"MTP depth {res.depth}{auto}, acceptance {res.acceptance_rate:.2f} (per depth {per_depth}), "
            f"mean accepted length {res.mean_accepted_length:.2f}"
        )
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"-- prefill: {prompt_tokens} prompt tokens in {res.prefill_s:.2f}s "
        f"({prompt_tokens / max(res.prefill_s, 1e-9):.0f} tokens/s); "
        f"decode: {res.generated_tokens} tokens in {res.decode_s:.2f}s: {res.tokens_per_s:.1f} tokens/s, "
        f"{mode}, {res.forwards / max(per_stream, 1):.2f} forwards/token, "
        f"batch {len(prompts)}, {'compiled' if res.compiled else 'eager'} steps, BLAS {_blas.status().name}",
        file=sys.stderr,
    )
    return 0
