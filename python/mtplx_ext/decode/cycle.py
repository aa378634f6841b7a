"""One decode cycle's device graph: draft -> verify -> commit (no host reads here).

Each cycle, for every stream: x0 (the target's token, decided by the cycle
before or the prefill) and K drafts d_1..d_K from the MTP head applied K
times (each step fed the head's own output state and its own draft, as
vLLM's MTP proposer applies one MTP layer recursively); ONE [B, K + 1]
verification forward of [x0, d_1..d_K]; the token policy's chain bundle
(x0, n accepted, c_1..c_{K+1}); the host reads only that bundle.

How a rejected draft is undone (the commit):

* per-stream commit (attention-only trunks, `reject_mode="repair"`): each
  stream keeps its first n + 1 new KV slots and drops the other K - n by
  moving its end slot on the device (`rollback.rollback_streams`, no
  copy); it commits x0, d_1..d_n and goes on from c_{n+1}. No extra
  forward, and the next cycle is built from device arrays alone.
  On hybrid trunks the verification forward runs through
  `gated_delta.capture`, which keeps every GatedDeltaNet layer's state after
  each position and its conv input; the commit selects each stream's state
  at its own n (`rollback.commit_streams`): no snapshot, no re-forward.
* uniform repair (`reject_mode="reforward"`): the host
  finds r, the tokens after x0 that every stream going on can commit (r = K
  when they all accepted every draft); below K the whole batch restores its
  recurrent snapshot, trims K + 1 KV slots and re-forwards [x0, c_1..c_r].

The head keeps a KV cache of (hidden at t, token t + 1) pairs in step with
the trunk: after each cycle it consumes the committed positions, drafts from
its output at the last one, and drops the slots its chained steps wrote
(`engine.drafter`: one MTP module applied recursively, or several applied in
sequence).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtplx_ext.cache import rollback
from mtplx_ext.ops import gated_delta
from mtplx_ext.cache.compiled_step import CompiledStep, weight_ids
from mtplx_ext.decode import bundle as chain
from mtplx_ext.decode.drafter import make_drafter, model_tokens
from mtplx_ext.decode.logprobs import packed_logprobs

#: Prompt tokens forwarded per prefill step (bounds the prefill's memory).
PREFILL_STEP = 2048
#: Cache slots compiled steps start with after the prompt, and grow by.
COMPILED_GROW_STEP = 256
#: Compiled steps kept between decodes, per runtime (least recently used dropped first).
STEP_CACHE_SIZE = 32


class _KeptSteps:
    """A runtime's released compiled steps: key -> (runtime, CompiledStep).

    A later decode of the same runtime (same weights), mode, depth and policy
    kind rebinds a step instead of tracing it again (tracing a depth-5 cycle
    costs tens of milliseconds). Kept on the runtime itself, so the traced
    graphs (which hold the weights) go when the runtime goes; an entry holds
    the object it was traced for (a wrapper may share its runtime's store),
    so that object's id is not reused while the entry lives.
    """

    def __init__(self) -> None:
        self.steps: OrderedDict[tuple, tuple[Any, CompiledStep]] = OrderedDict()


def _kept_steps(runtime: Any) -> OrderedDict[tuple, tuple[Any, CompiledStep]]:
    kept = getattr(runtime, "mtplx_kept_steps", None)
    if not isinstance(kept, _KeptSteps):
        kept = _KeptSteps()
        setattr(runtime, "mtplx_kept_steps", kept)
    return kept.steps


def forget_kept_steps(runtime: Any) -> None:
    """Drops the compiled steps kept for `runtime`: the next decode traces its steps again (for code that
    changes what a step traces, e.g. a policy replaced in a test, which the kept graphs would not see)."""
    _kept_steps(runtime).clear()


@dataclass
class Pending:
    """A launched verification (or plain) step whose bundle is not read yet."""

    bundle: mx.array
    hidden: mx.array | None = None
    snapshot: rollback.RecurrentSnapshot | None = None
    # The next cycle's (x0, d_1..d_K) and draft info, when the step already
    # built them (per-stream commit).
    next_tokens: mx.array | None = None
    next_info: Any = None
    # Per-stream commit on hybrid trunks: the recurrent layers' captures.
    capture: gated_delta.Capture | None = None
    # [B, T, logprobs.COLUMNS] logprobs of the verified positions' tokens
    # (c_1..c_T, or the plain pick), when the cycle computes them.
    logprobs: mx.array | None = None


class Cycle:
    """Device-graph builders of one batched decode.

    Args:
        runtime: an `MTPRuntime`.
        policy: the token policy (`engine.policies`).
        cache: the trunk's caches.
        head_cache: the head's caches, or None for plain decoding.
        depth: drafts per cycle (K).
        per_stream: per-stream commit instead of uniform repair (recurrent
            layers are captured during verification; needs
            `gated_delta.route_gated_delta()` active on hybrid trunks).
        logprobs: also compute the committed tokens' logprobs from the
            verification (or plain step, or prefill) logits
            (`engine.logprobs`): `Pending.logprobs`, `prefill_logprobs`.
    """

    def __init__(
        self,
        runtime: Any,
        policy: Any,
        cache: list,
        head_cache: list | None,
        depth: int = 1,
        per_stream: bool = False,
        logprobs: bool = False,
    ):
        self.logprobs = logprobs
        self.prefill_logprobs: mx.array | None = None
        self.rt = runtime
        self.policy = policy
        self.cache = cache
        self.head_cache = head_cache
        self.depth = depth
        self.recurrent = rollback.has_recurrent_state(cache)
        self.per_stream = per_stream
        # Depth 0 (a batch the engine runs without drafts): the head's caches ride along, unused by the
        # cycles; a depth-0 prefill still runs the head over the prompt (its pairs), so a row drafts well later.
        self.drafter = None if head_cache is None else make_drafter(runtime, policy, head_cache, max(depth, 1), cache)
        # [B] int32 most drafts row b may accept (<= K), or None (K for all).
        self.row_depth: mx.array | None = None
        # Compiled steps by kind (see `compile_steps`), or None (eager).
        self.compiled: dict[str, CompiledStep] | None = None

    def caches(self) -> list[list]:
        return [self.cache] + ([self.head_cache] if self.head_cache is not None else [])

    def prefill(self, padded: mx.array) -> tuple[mx.array, Any]:
        """Chunked prompt forward, the first x0 and the head's first drafts.

        Returns:
            ([B, K + 1] (x0, d_1..d_K), draft info), or ([B, 1] x0, None) without a head.
        """
        steps = self.prefill_steps(padded)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(
        self, padded: mx.array, chunk: int = PREFILL_STEP, start: int = 0
    ) -> Generator[None, None, tuple[mx.array, Any]]:
        """`prefill` one chunk of `chunk` prompt tokens per step: yields between chunks.

        A scheduler runs decode cycles of other streams between the steps, so
        a long prompt never stalls them for its whole prefill. The generator's
        return value is `prefill`'s. With `start` > 0 the caches already hold
        positions 0..start - 1 (the trunk's KV, and the head's pairs up to
        hidden at start - 1: a prefix cache's entry), and the forward resumes
        at `start` (< the prompt's length).
        """
        T = padded.shape[1]
        if not 0 <= start < T:
            raise ValueError(f"prefill start must be in [0, {T}), got {start}")
        starts = list(range(start, T, chunk))
        for s in starts:
            logits, hidden = self.rt.forward(padded[:, s : s + chunk], self.cache, last_logits_only=True)
            # The head consumes (hidden at t, token t + 1); the last chunk's
            # final pair needs x0, so that chunk waits for it.
            if self.head_cache is not None and s != starts[-1]:
                self.drafter.pairs(hidden, padded[:, s + 1 : s + chunk + 1])
            mx.async_eval([c.state for cl in self.caches() for c in cl])
            if s != starts[-1]:
                yield
        x0 = self.policy.pick(logits[:, -1], 0)
        if self.logprobs:
            self.prefill_logprobs = packed_logprobs(logits[:, -1:], x0[:, None])
        rollback.finish_prefill(self.cache)
        if self.head_cache is None:
            return x0[:, None], None
        nxt = mx.concatenate([padded[:, starts[-1] + 1 :], model_tokens(x0)[:, None]], axis=1)
        start = self.drafter.pairs(hidden, nxt)
        rollback.finish_prefill(self.head_cache)
        if self.depth == 0:  # no drafts: the head's pairs are kept, its drafting skipped
            return x0[:, None], None
        return self.drafter.draft(start, x0, 0)

    # -- verify --------------------------------------------------------------

    def verify(self, tokens: mx.array, info: Any, step: Any) -> Pending:
        """Snapshot (recurrent trunks), [B, K + 1] verification forward, chain bundle."""
        if self.recurrent and self.per_stream:
            with gated_delta.capture(rollback.recurrent_caches(self.cache)) as cap:
                logits, hidden = self.rt.forward(model_tokens(tokens), self.cache)
            return self._with_logprobs(Pending(self._verdict(logits, tokens, info, step), hidden, capture=cap),
                                       logits)
        snap = rollback.snapshot_recurrent(self.cache) if self.recurrent else None
        logits, hidden = self.rt.forward(model_tokens(tokens), self.cache)
        return self._with_logprobs(Pending(self._verdict(logits, tokens, info, step), hidden, snap), logits)

    def _verdict(self, logits: mx.array, tokens: mx.array, info: Any, step: Any) -> mx.array:
        """The policy's chain bundle; a row accepts at most its `row_depth` drafts (`chain.drop_drafts_beyond`)."""
        if self.row_depth is not None:
            tokens = chain.drop_drafts_beyond(tokens, self.row_depth)
        return self.policy.verify(logits, tokens, info, step)

    def _with_logprobs(self, p: Pending, logits: mx.array) -> Pending:
        # Row j of the verification gives c_{j+1} (accepted draft or the
        # target's own token): no extra forward.
        if self.logprobs:
            p.logprobs = packed_logprobs(logits, chain.committed_tokens(p.bundle))
        return p

    # -- commit --------------------------------------------------------------

    def commit_per_stream(self, p: Pending, step: Any) -> tuple[mx.array, Any]:
        """Each stream keeps x0, d_1..d_n on the device and drafts from c_{n+1}.

        Returns:
            The next cycle's ([B, K + 1] tokens, draft info).
        """
        b = p.bundle
        n = chain.accepted_count(b)
        c = chain.committed_tokens(b)
        x0 = mx.take_along_axis(c, n[:, None], axis=1)[:, 0]
        dropped = self.depth - n
        # Head pairs (h_j, c_{j+1}) for j = 0..K; a stream keeps the first n + 1.
        start = self.drafter.pairs(p.hidden, c, n, dropped)
        if p.capture is not None:
            rollback.commit_streams(self.cache, n, self.depth, p.capture)
        else:
            rollback.rollback_streams(self.cache, dropped)
        self.policy.commit(b, n)
        self.policy.set_next(x0)
        return self.drafter.draft(start, x0, step)

    def commit_all(self, p: Pending, step: Any) -> tuple[mx.array, Any]:
        """Uniform repair, no stream going on rejected: commit x0, d_1..d_K; go on from c_{K+1}."""
        b = p.bundle
        c = chain.committed_tokens(b)
        start = self.drafter.pairs(p.hidden, c)
        x0 = c[:, -1]
        self.policy.commit(b, self.depth)
        self.policy.set_next(x0)
        return self.drafter.draft(start, x0, step)

    def repair(self, p: Pending, r: int, step: Any) -> tuple[mx.array, Any]:
        """Uniform repair: roll the batch back and re-forward [x0, c_1..c_r]."""
        if p.snapshot is not None:
            rollback.restore_recurrent(self.cache, p.snapshot)
        rollback.trim_kv(self.cache, self.depth + 1)
        b = p.bundle
        c = chain.committed_tokens(b)
        seq = mx.concatenate([b[:, chain.COL_X0 : chain.COL_X0 + 1], c[:, :r]], axis=1)
        logits, hidden = self.rt.forward(model_tokens(seq), self.cache)
        self.policy.commit(b, r)
        x0 = self.policy.pick(logits[:, -1], step)
        start = self.drafter.pairs(hidden, mx.concatenate([c[:, :r], x0[:, None]], axis=1))
        return self.drafter.draft(start, x0, step)

    def zero_draft_step(self, tokens: mx.array, step: Any) -> Pending:
        """A depth-0 cycle with per-stream commit semantics: [B, 1] x0 (not committed yet) forwarded alone.

        The chain rule with no drafts: x0 is committed and the token after it
        is drawn as a bonus (uniforms of cycle `step + 1`'s pick), so a row
        keeps the state of an MTP row (`next` = its uncommitted x0) and moves
        to and from batches of any K; bundle [B, 3] = (x0, n, c_1), n = -1
        where the row is unusable. The head's caches are not touched.
        """
        logits, _ = self.rt.forward(model_tokens(tokens), self.cache)
        x0 = tokens[:, 0].astype(mx.int32)
        zero = mx.zeros_like(x0)
        self.policy.commit(mx.stack([x0, zero, zero], axis=1), 0)  # x0 counts for the token after it
        c1 = self.policy.pick(logits[:, -1], step + 1)
        self.policy.set_next(c1)
        bundle = mx.stack([x0, mx.where(c1 < 0, -1, zero), c1], axis=1)
        p = Pending(bundle, next_tokens=c1[:, None])
        if self.logprobs:
            p.logprobs = packed_logprobs(logits[:, -1:], c1[:, None])
        return p

    def plain_step(self, tokens: mx.array, step: Any) -> Pending:
        """One autoregressive forward of [B, 1] tokens; bundle = next tokens."""
        logits, _ = self.rt.forward(model_tokens(tokens), self.cache)
        tok = self.policy.pick(logits[:, -1], step)[:, None]
        return Pending(tok, logprobs=packed_logprobs(logits[:, -1:], tok) if self.logprobs else None)

    # -- compiled steps ------------------------------------------------------

    def compile_steps(self) -> None:
        """Replays every later step through `mx.compile` (after the prefill).

        Needs fixed-capacity ragged caches and a policy that lists its device
        state in `state_attrs`. Kinds: "plain"; "stream" (per-stream commit:
        one step per cycle); "first", "accept" and "repair{r}" (uniform
        repair: the host picks one from the bundle; a repair kind is traced
        when first needed). All kinds share the caches and the policy's state.
        """
        self._holders = [(self.policy, a) for a in self.policy.state_attrs if getattr(self.policy, a, None) is not None]
        self._holders += [(self, "row_depth")] if self.row_depth is not None else []
        if self.head_cache is None:
            units = {"plain": self._plain_unit}
        elif self.per_stream:
            units = {"stream": self._zero_unit if self.depth == 0 else self._stream_unit}
        else:
            units = {"first": self._first_unit, "accept": self._accept_unit}
        # The snapshot's layout, from snapshot_recurrent itself (its arrays
        # stay lazy and are dropped unevaluated).
        uniform = self.recurrent and not self.per_stream
        self._snapshot_slots = rollback.snapshot_recurrent(self.cache).slots if uniform else []
        self._sig = self._signature()
        self.compiled = {k: self._compile(k, u) for k, u in units.items()}
        # All kinds share one state: any of them can reserve, save or load it.
        self._shared = next(iter(self.compiled.values()))

    def _signature(self) -> tuple:
        """What decides a compiled step's graph besides its kind, and the shapes it is first called with.

        The shapes (rows and slots of the first layer's cache) make a kept step one that has already traced
        them: decodes of two batch sizes keep one step each instead of taking turns re-tracing one.
        """
        weights = weight_ids(self.rt)
        policy = (type(self.policy).__name__, tuple(n for _, n in self._holders), getattr(self.policy, "penalties", None))
        layout = tuple(type(c).__name__ for cl in self.caches() for c in cl)
        shapes = tuple(tuple(a.shape) for a in self.caches()[0][0].state if isinstance(a, mx.array))
        return (id(self.rt), weights, self.depth, self.per_stream, policy, layout, COMPILED_GROW_STEP, self.logprobs,
                shapes)

    def _compile(self, kind: str, unit: Any) -> CompiledStep:
        # A released step of an earlier decode, taken out of the cache: it
        # is this Cycle's until `release` puts it back (another live Cycle,
        # e.g. a scheduler's, never shares it).
        kept = _kept_steps(self.rt).pop(self._sig + (kind,), None)
        if kept is not None:
            kept[1].bind(unit, self.caches(), self._holders)
            return kept[1]
        return CompiledStep(unit, self.caches(), self._holders, grow_step=COMPILED_GROW_STEP)

    def release(self) -> None:
        """Unbinds the compiled steps from this decode's caches and keeps them for the next decode.

        Steps of a Cycle that is never released are not kept (nor the caches
        they reference).
        """
        kept = _kept_steps(self.rt)
        for kind, step in (self.compiled or {}).items():
            step.release()
            kept[self._sig + (kind,)] = (self.rt, step)
        while len(kept) > STEP_CACHE_SIZE:
            kept.popitem(last=False)
        self.compiled = None

    def _stream_unit(self, step: mx.array, tokens: mx.array, *info: mx.array) -> tuple[mx.array, ...]:
        # Cycle `step`'s verification, then the drafts for cycle step + 1.
        p = self.verify(tokens, info[0] if info else None, step)
        nxt, nxt_info = self.commit_per_stream(p, step + 1)
        lp = (p.logprobs,) if p.logprobs is not None else ()
        return (p.bundle, nxt) + (() if nxt_info is None else (nxt_info,)) + lp

    def _zero_unit(self, step: mx.array, tokens: mx.array) -> tuple[mx.array, ...]:
        p = self.zero_draft_step(tokens, step)
        return (p.bundle, p.next_tokens) + ((p.logprobs,) if p.logprobs is not None else ())

    def _plain_unit(self, step: mx.array, tokens: mx.array) -> Any:
        p = self.plain_step(tokens, step)
        return p.bundle if p.logprobs is None else (p.bundle, p.logprobs)

    @staticmethod
    def _pending_arrays(p: Pending) -> tuple[mx.array, ...]:
        return (p.bundle, p.hidden) + tuple(p.snapshot.arrays if p.snapshot is not None else ())

    def _first_unit(self, step: mx.array, tokens: mx.array, *info: mx.array) -> tuple[mx.array, ...]:
        return self._pending_arrays(self.verify(tokens, info[0] if info else None, step))

    def _accept_unit(self, step: mx.array, bundle: mx.array, hidden: mx.array) -> tuple[mx.array, ...]:
        return self._pending_arrays(self.verify(*self.commit_all(Pending(bundle, hidden), step), step))

    def _repair_unit(self, r: int) -> Any:
        def unit(step: mx.array, bundle: mx.array, hidden: mx.array, *snap: mx.array) -> tuple:
            p = Pending(bundle, hidden, self._snapshot(snap))
            return self._pending_arrays(self.verify(*self.repair(p, r, step), step))

        return unit

    def _snapshot(self, arrays: Sequence[mx.array]) -> rollback.RecurrentSnapshot | None:
        if not self.recurrent:
            return None
        return rollback.RecurrentSnapshot(slots=list(self._snapshot_slots), arrays=list(arrays))

    def launch(self, kind: str, step: int, slots: int, *args: mx.array) -> Pending:
        """Compiled step `kind` of cycle `step` (see `compile_steps` for its inputs).

        `slots`: cache slots (prompt included) that live streams may need.
        """
        assert self.compiled is not None
        if kind not in self.compiled:  # "repair{r}", traced when first needed
            self.compiled[kind] = self._compile(kind, self._repair_unit(int(kind[len("repair") :])))
        self.reserve(slots)
        out = self.compiled[kind](mx.array(step, dtype=mx.uint32), *args)
        lp = None
        if self.logprobs and kind in ("plain", "stream"):
            out, lp = out[:-1], out[-1]
        if kind == "plain":
            return Pending(out[0] if isinstance(out, (list, tuple)) else out, logprobs=lp)
        if kind == "stream":
            return Pending(out[0], next_tokens=out[1], next_info=out[2] if len(out) > 2 else None, logprobs=lp)
        return Pending(out[0], out[1], self._snapshot(out[2:]))

    def launch_first(self, tokens: mx.array, info: Any, slots: int) -> Pending:
        """The compiled first verification (cycle 1) from the prefill's drafts."""
        extra = () if info is None else (info,)
        return self.launch("stream" if self.per_stream else "first", 1, slots, tokens, *extra)

    def reserve(self, slots: int) -> None:
        """Grows the caches the compiled steps share to `slots` slots, if needed."""
        self._shared.reserve(slots)

    def save_compiled(self) -> list[mx.array]:
        """The state the compiled steps share (to undo a step built and never run)."""
        return self._shared.state()

    def load_compiled(self, state: list[mx.array]) -> None:
        self._shared.load(state)

    def next_step(self, p: Pending, mtp: bool, r: int | None, step: int, slots: int = 0) -> Pending:
        """Builds cycle `step` after `p`.

        Args:
            r: uniform repair only: None to commit every draft (no stream
                going on rejected), else the tokens after x0 to re-forward.
        """
        if self.compiled is not None:
            if not mtp:
                return self.launch("plain", step, slots, p.bundle)
            if self.per_stream:
                extra = () if p.next_info is None else (p.next_info,)
                return self.launch("stream", step, slots, p.next_tokens, *extra)
            if r is not None:
                snap = p.snapshot.arrays if p.snapshot else ()
                return self.launch(f"repair{r}", step, slots, p.bundle, p.hidden, *snap)
            return self.launch("accept", step, slots, p.bundle, p.hidden)
        if not mtp:
            return self.plain_step(p.bundle, step)
        if self.per_stream:
            return self.verify(*self.commit_per_stream(p, step), step)
        nxt = self.repair(p, r, step) if r is not None else self.commit_all(p, step)
        return self.verify(*nxt, step)
