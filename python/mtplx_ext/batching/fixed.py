"""Fixed-batch generation on the engine: `generate_batched` and `generate_greedy_batched`.

A fixed batch is every request admitted at step 0 of an `Engine` sized to
it: the prompts prefill together in one left-padded forward
(`batching.prefill`), decode in one batch, and finished rows leave by the
rule that serves continuous batching (`scheduler.needs_rebuild`), so a
feature of a request (per-row samplers and seeds, constraints, logit bias,
K) works the same offline and served. Two settings keep the reference loop
of `decode.generate` (same tokens, a plainer machine): `reject_mode=
"reforward"` (uniform repair: snapshot, restore, re-forward) and
`enforce_eager=True` (graphs built in Python every step); so do trunks whose
recurrent layers cannot be captured per position, and runtimes that keep
per-row state outside their caches (`keep_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mtplx_ext.batching.engine import Engine
from mtplx_ext.batching.options import EngineOptions
from mtplx_ext.batching.requests import Event
from mtplx_ext.decode import autodepth, session
from mtplx_ext.decode.constraint import Constraint
from mtplx_ext.decode.generate import check_fixed_batch, generate_reference
from mtplx_ext.decode.policies import derived_row_seeds, make_policy
from mtplx_ext.decode.results import BatchedDecodeResult, StreamResult
from mtplx_ext.decode.streams import OnCommit
from mtplx_ext.sampling import SamplerConfig


def generate_batched(
    runtime: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampler: Any = None,
    seed: int | None = None,
    row_seeds: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] = (),
    use_mtp_draft: bool = True,
    depth: int | str = autodepth.AUTO,
    reject_mode: str = "repair",
    serial: bool = False,
    on_commit: OnCommit | None = None,
    enforce_eager: bool = False,
    constraints: Sequence[Constraint | None] | None = None,
    compact_rows: bool = True,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> BatchedDecodeResult:
    """Decodes a batch of prompts with K MTP drafts verified in one forward per cycle.

    Args:
        runtime: an `MTPRuntime` (make_cache, make_head_cache, forward,
            head_states, head_logits, vocab_size, has_mtp).
        prompts: token-id lists, any lengths (left-padded into one prefill;
            padding never changes a stream's tokens).
        max_new_tokens: cap on each stream's generated tokens (exact).
        sampler: None or an object with `temperature` 0 for greedy
            decoding; a `mtplx_ext.SamplerConfig` (or a list, one per
            stream) for exact sampled speculative decoding.
        seed, row_seeds: seeds of the sampled path (unused when greedy):
            row_seeds gives each stream its own seed, so that its tokens do
            not depend on the other streams of the batch; with `seed` alone,
            stream i's seed derives from (seed, i).
        stop_token_ids: tokens that end a stream (the stop token is kept).
        use_mtp_draft: False decodes plainly, one token per forward (the
            baseline), through the same runtime.
        depth: drafts per cycle, K in 1..8: the head applied K times, then
            one [B, K + 1] verification forward; or "auto" (the default, as
            the CLI and the server): the K (0 = plain decoding) that decodes
            this batch size fastest on this model and machine
            (`mtplx_ext.decode.autodepth`: a short calibration the first
            time, cached on disk). The result's `depth` says which. A model
            without a head decodes plainly under "auto".
        reject_mode: "repair": per-stream commit (each stream keeps its
            accepted drafts, no extra forward) on attention-only trunks and
            on GatedDeltaNet hybrids (qwen3_next, qwen3_5: the recurrent
            state is captured at every verified position and selected per
            stream), else uniform repair; "reforward": always the uniform
            full-batch repair (snapshot restore, re-forward; the reference loop).
        serial: True reads each cycle before launching the next; False
            launches the next cycle first, so the host's bookkeeping overlaps
            the device. Same tokens and forwards either way.
        on_commit: called as on_commit(stream index, new token ids) when a
            stream commits tokens.
        enforce_eager: True builds every step's graph in Python (the
            reference loop); False traces each kind of step once with
            `mx.compile` and replays it. Same tokens either way, up to float
            rounding of fused element-wise kernels.
        constraints: one `decode.constraint.Constraint` (a grammar) or None
            per stream: a constrained stream's target distribution is masked
            at every position (MTP stays on). The constraint's stop token
            should be among `stop_token_ids`. Needs compiled steps and
            per-stream commit.
        compact_rows: True drops finished rows once at most half of the
            batch still decodes, so they stop costing forwards; False keeps
            every row to the end. Same tokens either way.
        kv_bits, kv_group_size: store this decode's keys and values
            quantized (2-8 bits, groups of 32/64/128: mlx-lm's
            `--kv-bits` layout; MTP stays exactly plain decoding at the same
            bits); None keeps the runtime's setting (`load(kv_bits=...)`,
            float KV by default).

    Returns:
        A `BatchedDecodeResult`.

    Raises:
        TypeError / ValueError: naming the bad argument.
        NotImplementedError: temperature > 0 without a SamplerConfig.
        RuntimeError: naming a stream whose logits or tokens became invalid.
    """
    args = dict(max_new_tokens=max_new_tokens, sampler=sampler, seed=seed, row_seeds=row_seeds,
                stop_token_ids=stop_token_ids, use_mtp_draft=use_mtp_draft, depth=depth, reject_mode=reject_mode,
                serial=serial, on_commit=on_commit, enforce_eager=enforce_eager, constraints=constraints,
                compact_rows=compact_rows, kv_bits=kv_bits, kv_group_size=kv_group_size)
    if needs_reference(runtime, reject_mode, enforce_eager):
        return generate_reference(runtime, prompts, **args)
    t0 = time.perf_counter()
    a = check_fixed_batch(runtime, prompts, max_new_tokens, seed, row_seeds, stop_token_ids, use_mtp_draft, depth,
                          reject_mode, on_commit, kv_bits, kv_group_size)
    prompts, max_new_tokens, use_mtp, depth = a.prompts, a.max_new_tokens, a.use_mtp, a.depth
    stop_ids = sorted(a.stop_ids)
    make_policy(sampler, a.seed, a.row_seeds)  # (the sampler's checks, as the reference loop makes them)
    samplers = _samplers(sampler, len(prompts))
    seeds = _row_seeds(a.seed, a.row_seeds, len(prompts))
    constraints = _constraints(constraints, len(prompts))
    mtp = use_mtp and max_new_tokens > 1  # one token per stream is the prefill's: nothing to draft
    width = max(len(p) for p in prompts)
    eng = Engine(runtime, EngineOptions(
        max_batch=len(prompts), depth=depth, use_mtp=mtp, prefill_chunk=width * len(prompts),
        context=width + max_new_tokens, kv_bits=kv_bits, kv_group_size=kv_group_size, launch_ahead=not serial,
        compact_rows=bool(compact_rows), detokenize=False, first_token_at_prefill=False))
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(eng.submit(p, max_tokens=max_new_tokens, sampler=samplers[i], stop_token_ids=stop_ids,
                               seed=seeds[i], constraint=constraints[i], on_event=_committer(on_commit, i)))
    eng.run_until_idle()
    t2 = time.perf_counter()
    eng.release()  # its traced steps go back to the runtime: the next fixed batch of these shapes replays them
    for i, r in enumerate(reqs):
        if r.error is not None:
            raise RuntimeError(f"stream {i}: {r.error}")
    res = eng.stats
    res.streams = [StreamResult(list(r.tokens), r.finish_reason) for r in reqs]
    res.compiled = True
    res.row_cycles = eng.counters["row_forwards"]
    t1 = max(r.first_token_s for r in reqs)  # the last prefill's token: decoding starts
    res.prefill_s, res.decode_s = t1 - t0, t2 - t1
    return res


def needs_reference(runtime: Any, reject_mode: str, enforce_eager: bool) -> bool:
    """Whether a decode needs the reference loop: uniform repair, eager graphs, recurrent layers the capture
    cannot route, a runtime keeping per-row state outside its caches (`keep_rows`, `decode.compaction`),
    whose rows could not move between the engine's batches, or one split across the ranks of a distributed
    group (`runtime.group`; its engine form is `LockstepEngine`, which agrees every step across the ranks)."""
    if reject_mode != "repair" or enforce_eager or hasattr(runtime, "keep_rows"):
        return True
    if getattr(runtime, "group", None) is not None:  # split across ranks: served in lockstep by LockstepEngine
        return True
    return session.has_recurrent_layers(runtime) and not session.gated_delta_trunk(runtime)


_GREEDY = SamplerConfig(temperature=0.0)  # (frozen: one shared)


def _samplers(sampler: Any, n: int) -> list[SamplerConfig]:
    if isinstance(sampler, SamplerConfig):
        return [sampler] * n
    if isinstance(sampler, Sequence) and not isinstance(sampler, (str, bytes)):
        if len(sampler) != n:
            raise ValueError(f"sampler has {len(sampler)} SamplerConfigs for {n} prompts")
        return list(sampler)
    return [_GREEDY] * n  # None, or greedy by temperature (make_policy checked it)


def _row_seeds(seed: int | None, row_seeds: Sequence[int] | None, n: int) -> list[int]:
    """Each stream's seed: row_seeds, else derived from `seed` as a policy's `prepare` derives them."""
    if row_seeds is not None:
        if len(row_seeds) != n:
            raise ValueError(f"row_seeds has {len(row_seeds)} entries for {n} prompts")
        return [int(s) for s in row_seeds]
    return derived_row_seeds(seed, n)


def _constraints(constraints: Sequence[Constraint | None] | None, n: int) -> list[Constraint | None]:
    if constraints is None:
        return [None] * n
    constraints = list(constraints)
    if len(constraints) != n:
        raise ValueError(f"constraints has {len(constraints)} entries for {n} prompts")
    return constraints


def _committer(on_commit: OnCommit | None, i: int) -> Any:
    if on_commit is None:
        return None

    def on_event(ev: Event) -> None:
        if ev.kind == "tokens" and ev.tokens:
            on_commit(i, list(ev.tokens))

    return on_event


def generate_greedy_batched(
    runtime: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    use_mtp_draft: bool = True,
    depth: int | str = autodepth.AUTO,
    reject_mode: str = "repair",
    serial: bool = False,
    on_commit: OnCommit | None = None,
    enforce_eager: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    constraints: Sequence[Constraint | None] | None = None,
    compact_rows: bool = True,
) -> BatchedDecodeResult:
    """Greedy batched MTP decoding: `generate_batched` at temperature 0.

    See `generate_batched` for the arguments and the result.
    """
    return generate_batched(
        runtime, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, use_mtp_draft=use_mtp_draft,
        depth=depth, reject_mode=reject_mode, serial=serial, on_commit=on_commit, enforce_eager=enforce_eager,
        kv_bits=kv_bits, kv_group_size=kv_group_size, constraints=constraints, compact_rows=compact_rows,
    )


__all__ = ["generate_batched", "generate_greedy_batched", "needs_reference"]
