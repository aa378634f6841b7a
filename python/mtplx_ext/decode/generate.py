"""The reference fixed-batch loop: `generate_reference` and `generate_greedy_reference`.

`mtplx_ext.generate_batched` runs fixed batches on the engine
(`batching.fixed`); this loop (`decode.loop`) stays for what the engine does
not run: uniform repair (`reject_mode="reforward"`, and trunks whose
recurrent state cannot be captured per position), eager graphs
(`enforce_eager=True`), and the depth calibration, which measures cycles
without an engine's scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext._checks import as_depth, as_int, as_prompts, as_stop_ids, as_seed, as_seeds
from mtplx_ext.cache.ragged import check_kv_quantization
from mtplx_ext.decode import autodepth
from mtplx_ext.decode import cycle as cycle_mod
from mtplx_ext.decode.compaction import Compactor, compactable
from mtplx_ext.decode import session
from mtplx_ext.decode.constraint import Constraint, RowConstraints, forced_drafts
from mtplx_ext.decode.cycle import Cycle, Pending
from mtplx_ext.decode.loop import run_cycles
from mtplx_ext.decode.policies import make_policy
from mtplx_ext.decode.results import BatchedDecodeResult
from mtplx_ext.decode.streams import OnCommit, Streams

REJECT_MODES = ("repair", "reforward")


@dataclass(frozen=True)
class FixedBatchArgs:
    """A fixed batch's arguments, checked (`check_fixed_batch`): both loops start from these."""

    prompts: list[list[int]]
    max_new_tokens: int
    seed: int | None
    row_seeds: list[int] | None
    stop_ids: frozenset[int]
    use_mtp: bool  # MTP asked and, under depth="auto", chosen
    depth: int  # K >= 1 (the calibration's pick under "auto")
    kv: Any  # the KV quantization, or None for the runtime's


def check_fixed_batch(runtime: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None,
                      row_seeds: Sequence[int] | None, stop_token_ids: Sequence[int], use_mtp_draft: bool,
                      depth: int | str, reject_mode: str, on_commit: Any, kv_bits: int | None, kv_group_size: int,
                      enforce_eager: bool = False) -> FixedBatchArgs:
    """`generate_batched`'s arguments checked (errors name them) and depth="auto" resolved for this batch size.

    Raises:
        TypeError / ValueError: naming the bad argument; MTP asked of a runtime without a head.
    """
    vocab = int(runtime.vocab_size)
    prompts = as_prompts(prompts, vocab)
    # Python ints from here on: a NumPy integer would break mx calls in compiled steps.
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, lo=1)
    seed, row_seeds = as_seed("seed", seed), as_seeds("row_seeds", row_seeds)
    stop_ids = as_stop_ids(stop_token_ids, vocab)
    use_mtp = bool(use_mtp_draft)
    kv = None if kv_bits is None else check_kv_quantization(kv_bits, kv_group_size)
    if depth == autodepth.AUTO:
        with session.kv_setting(runtime, kv):
            chosen = auto_depth(runtime, len(prompts), enforce_eager) if use_mtp else 1
        use_mtp, depth = use_mtp and chosen > 0, max(chosen, 1)
    depth = as_depth(depth)
    if reject_mode not in REJECT_MODES:
        raise ValueError(f"reject_mode must be one of {REJECT_MODES}, got {reject_mode!r}")
    if on_commit is not None and not callable(on_commit):
        raise TypeError("on_commit must be callable or None")
    if use_mtp and not runtime.has_mtp:
        raise ValueError("use_mtp_draft=True needs a runtime with MTP head weights (this one has none)")
    return FixedBatchArgs(prompts, max_new_tokens, seed, row_seeds, stop_ids, use_mtp, depth, kv)


def generate_reference(
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
    """Decodes a batch of prompts with K MTP drafts verified in one forward per cycle, on the reference loop.

    Takes `mtplx_ext.generate_batched`'s arguments (documented there) and gives the same tokens; it runs
    them on `decode.loop` (a fixed batch, its own compaction) instead of the engine, so that uniform repair
    (`reject_mode="reforward"`), eager graphs (`enforce_eager=True`) and runtimes the engine cannot move rows
    of have a loop, and the depth calibration measures bare cycles.

    Returns:
        A `BatchedDecodeResult`.

    Raises:
        TypeError / ValueError: naming the bad argument.
        NotImplementedError: temperature > 0 without a SamplerConfig.
        RuntimeError: naming a stream whose logits or tokens became invalid.
    """
    a = check_fixed_batch(runtime, prompts, max_new_tokens, seed, row_seeds, stop_token_ids, use_mtp_draft, depth,
                          reject_mode, on_commit, kv_bits, kv_group_size, enforce_eager)
    prompts, max_new_tokens, seed, row_seeds, stop_ids = a.prompts, a.max_new_tokens, a.seed, a.row_seeds, a.stop_ids
    use_mtp_draft, depth, kv = a.use_mtp, a.depth, a.kv
    policy = make_policy(sampler, seed, row_seeds)
    if constraints is not None:
        constraints = list(constraints)
        if len(constraints) != len(prompts):
            raise ValueError(f"constraints has {len(constraints)} entries for {len(prompts)} prompts")
        if enforce_eager:
            raise ValueError("constraints need compiled steps (enforce_eager=False)")
        if not any(c is not None for c in constraints):
            constraints = None

    # One token per stream is the prefill's x0: nothing to draft or verify.
    mtp = use_mtp_draft and max_new_tokens > 1
    recurrent = session.has_recurrent_layers(runtime)
    capturable = recurrent and session.gated_delta_trunk(runtime)
    per_stream = mtp and reject_mode == "repair" and (not recurrent or capturable)
    if constraints is not None and mtp and not per_stream:
        raise ValueError("constraints need per-stream commit (reject_mode='repair' on a capturable trunk)")
    route = capturable and (per_stream or getattr(runtime, "cpu_ops_fused", False))
    with session.decode_session(runtime, route, kv):
        compiled = not bool(enforce_eager) and hasattr(policy, "state_attrs")
        return _generate(
            runtime, prompts, policy, max_new_tokens, stop_ids, mtp, depth if mtp else 0, serial, on_commit,
            per_stream, compiled, constraints, bool(compact_rows),
        )


def _generate(
    runtime: Any,
    prompts: list[list[int]],
    policy: Any,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    mtp: bool,
    depth: int,
    serial: bool,
    on_commit: OnCommit | None,
    per_stream: bool,
    compiled: bool,
    constraints: list[Constraint | None] | None = None,
    compact_rows: bool = False,
) -> BatchedDecodeResult:
    t0 = time.perf_counter()
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    pads = [width - n for n in lengths]
    padded = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    # (The ragged keyword only when used: runtimes without it still repair.)
    kw: dict[str, Any] = {"ragged": True} if per_stream else {}
    st = Streams(len(prompts), int(runtime.vocab_size), max_new_tokens, stop_ids, on_commit, depth, per_stream, width)
    if compiled:  # (attention layers only: recurrent ones keep their ArraysCache)
        head_room = max_new_tokens + 2 * depth + 1  # all of a short decode, else grown in steps
        kw = {"ragged": True, "capacity": width + min(head_room, cycle_mod.COMPILED_GROW_STEP)}
    cache = runtime.make_cache(pads, **kw)
    head_cache = runtime.make_head_cache(pads, **kw, depth=depth) if mtp else None
    cyc = Cycle(runtime, policy, cache, head_cache, depth, per_stream)
    guide = None if constraints is None else RowConstraints(constraints, int(runtime.vocab_size), depth + 1)
    if guide is not None:
        policy.mask = guide.current()
        serial = True
    tokens, info = cyc.prefill(padded)
    # A device barrier (no host read) so prefill and decode times separate.
    mx.eval(tokens, [c.state for c in cyc.caches()[0]])
    t1 = time.perf_counter()

    if compiled:
        cyc.compile_steps()
        st.result.compiled = True
    if guide is not None and mtp:  # the first verification's masks: x0 and the drafts on the host
        st.result.host_syncs += 1
        policy.mask, toks, forced = guide.probe(np.array(tokens))
        if forced is not None:
            tokens, info = forced_drafts(tokens, info, toks, forced)
    if not mtp:
        first = Pending(tokens)
    else:
        first = cyc.launch_first(tokens, info, st.slots_needed()) if compiled else cyc.verify(tokens, info, 1)
    st.result.forwards += int(mtp)
    if not serial:
        mx.async_eval(first.bundle)
    rows = None
    if compact_rows and not serial and guide is None and len(prompts) > 1 and compactable(policy, compiled, mtp, per_stream):
        rows = Compactor(runtime, cyc, pads, depth)
    try:
        run_cycles(cyc, st, first, mtp, serial, guide, rows)
    finally:
        (rows.cyc if rows is not None else cyc).release()
        policy.mask = None
        if rows is not None:
            st.result.compactions = rows.compactions
    if not mtp:  # the first read was the prefill's token: not a decode cycle (no forward)
        st.result.cycles -= 1
        st.result.host_syncs -= 1
        st.result.row_cycles -= len(prompts)
    st.result.prefill_s = t1 - t0
    st.result.decode_s = time.perf_counter() - t1
    if guide is not None:
        st.result.mask_s = guide.mask_s
    return st.result


def auto_depth(runtime: Any, batch: int, enforce_eager: bool = False) -> int:
    """The depth "auto" picks for `batch` streams (0: plain decoding), calibrating on first use."""
    costs = auto_costs(runtime, batch, enforce_eager)
    return 0 if costs is None else autodepth.choose_depth(costs)


def auto_costs(runtime: Any, batch: int, enforce_eager: bool = False) -> autodepth.DepthCosts | None:
    """The calibration "auto" decides from for `batch` streams (None without an MTP head), measured on first use."""
    if not getattr(runtime, "has_mtp", False):
        return None

    def decode(prompts: list[list[int]], n: int, k: int) -> tuple[float, int, list[int], list[int]]:
        r = generate_greedy_reference(runtime, prompts, max_new_tokens=n, use_mtp_draft=k > 0, depth=max(k, 1),
                                    enforce_eager=enforce_eager)
        return r.decode_s, r.cycles, list(r.accepted_at), list(r.reached)

    return autodepth.depth_costs(runtime, batch, decode)


def generate_greedy_reference(
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
    """Greedy batched MTP decoding on the reference loop: `generate_reference` at temperature 0."""
    return generate_reference(
        runtime,
        prompts,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        use_mtp_draft=use_mtp_draft,
        depth=depth,
        reject_mode=reject_mode,
        serial=serial,
        on_commit=on_commit,
        enforce_eager=enforce_eager,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        constraints=constraints,
        compact_rows=compact_rows,
    )
