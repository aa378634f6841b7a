"""Batched MTP decoding: one [B, 2] verification forward and one host read per cycle.

Each cycle, for every stream of the batch: x0 (the target's token, from the
previous cycle or the prefill) and the head's draft of the token after x0;
one [B, 2] verification forward of [x0, draft]; one bundle
(x0, draft, second, accept, bonus) per stream from the token policy; ONE
blocking host read of that bundle. `second` is the draft when accepted, the
target's own token when not.

How a rejected draft is undone (`reject_mode`):

* "repair" on attention-only trunks (per-stream rollback): KV caches are
  `RaggedKVCache`s. A stream that accepted commits x0 and the draft and
  goes on from the bonus; a stream that rejected commits x0, drops the
  draft's KV slot (a device-side subtraction) and goes on from `second`,
  which the next verification forward consumes. No extra forward, and the
  next cycle never waits for the host: what each stream does is decided on
  the device from the bundle.
* "repair" on trunks with recurrent layers, and "reforward" everywhere
  (uniform full-batch repair): a stream commits x0 and `second`; when any
  live stream rejected, the whole batch rolls back to before the
  verification (recurrent snapshot restored, KV trimmed by 2) and
  re-forwards [x0, second]; streams that accepted come out unchanged.

The head keeps a KV cache of (hidden at t, token t + 1) pairs in step with
the trunk: after each cycle it consumes the committed positions, and its
output at the last one is the next draft.

All arrays stay on the device between cycles; the host only reads bundles.

Unless `enforce_eager`, every step runs through `mx.compile`: the attention
caches get a fixed capacity (grown in steps as needed), each kind of step
is traced once and replayed (`CompiledStep`), with the cycle number, the
caches, the recurrent state and the policy's device state as inputs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.generate import wired_limit

from mtplx_ext import cache_state
from mtplx_ext._checks import as_int, as_seed, as_seeds
from mtplx_ext.compiled_step import CompiledStep
from mtplx_ext.verify import (
    COL_ACCEPT,
    COL_BONUS,
    COL_SECOND,
    COL_X0,
    INVALID,
    verify_greedy,
)

REJECT_MODES = ("repair", "reforward")
#: Prompt tokens forwarded per prefill step (bounds the prefill's memory).
PREFILL_STEP = 2048
#: Cache slots compiled steps start with after the prompt, and grow by.
COMPILED_GROW_STEP = 256

OnCommit = Callable[[int, list[int]], None]


@dataclass
class StreamResult:
    """One stream's generated tokens.

    Attributes:
        tokens: committed token ids (a final stop token is kept).
        finish_reason: "stop" (a stop token was committed) or "length"
            (max_new_tokens reached).
    """

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class BatchedDecodeResult:
    """Tokens and statistics of one batched decode.

    Attributes:
        streams: one `StreamResult` per prompt, in prompt order.
        cycles: decode cycles, each ending in one bundle read.
        forwards: trunk forwards during decode: verification and repair
            forwards (MTP), or one per token after the first (plain
            decoding). The prefill is not counted.
        repair_cycles: cycles that ran a repair forward.
        drafted: drafts whose verdict mattered (the stream went on after x0).
        accepted: those drafts that were accepted (committed).
        host_syncs: blocking host reads during decode (one per cycle).
        sync_wait_s: seconds the host spent blocked in those reads (the
            rest of decode_s is host work the device did not hide).
        compiled: whether the decode steps ran through `mx.compile`.
        prefill_s: seconds from the call to the end of the prefill.
        decode_s: seconds of the decode cycles.
    """

    streams: list[StreamResult]
    cycles: int = 0
    forwards: int = 0
    repair_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    host_syncs: int = 0
    sync_wait_s: float = 0.0
    compiled: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def generated_tokens(self) -> int:
        """Tokens committed over all streams."""
        return sum(len(s.tokens) for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens over all streams per second of decode."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0


class TokenPolicy(Protocol):
    """The pluggable token choice and verification step of the loop.

    Every method only builds device graph; nothing is read on the host.
    Tokens a policy cannot choose (non-finite logits) come out as INVALID.
    `step` is the cycle the call belongs to (0 for the prefill): a sampled
    policy derives its uniforms from (seed, row, step, call) so serial and
    pipelined runs draw the same numbers (`step` may be a device scalar:
    in compiled steps it is an input). The pipelined loop checkpoints
    the policy's attributes (arrays aliased, as for caches) together with
    the caches and restores them when it drops a graph it built ahead, so
    per-stream state (e.g. penalty counts updated from bundles on the
    device) belongs in plain attributes, listed in `state_attrs` (compiled
    steps pass them in and out; a policy without `state_attrs` runs eagerly).
    """

    state_attrs: tuple[str, ...]

    def pick(self, logits: mx.array, step: int) -> mx.array:
        """[B, V] target logits -> [B] int32 token (prefill, repair, plain decoding)."""

    def draft(self, head_logits: mx.array, step: int) -> tuple[mx.array, Any]:
        """[B, V] head logits -> ([B] int32 draft, what `verify` needs of it, e.g. its logits)."""

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: Any, step: int) -> mx.array:
        """[B, 2, V] logits at (x0, draft), [B, 2] tokens -> [B, 5] int32 bundle."""


class GreedyPolicy:
    """Temperature 0: argmax choices, draft accepted iff it equals the argmax."""

    #: Device state carried between steps (see `SampledPolicy.state_attrs`).
    state_attrs: tuple[str, ...] = ()

    def pick(self, logits: mx.array, step: int = 0) -> mx.array:
        # The fused verify primitive doubles as a NaN-safe argmax: x1 is the
        # argmax of the first row, accept is -1 when that row is unusable.
        b = verify_greedy(mx.stack([logits, logits], axis=1), mx.zeros((logits.shape[0], 2), mx.int32))
        return mx.where(b[:, COL_ACCEPT] < 0, INVALID, b[:, COL_SECOND])

    def draft(self, head_logits: mx.array, step: int = 0) -> tuple[mx.array, Any]:
        # A plain argmax: a draft from unusable head logits is only a wrong
        # proposal, which verification rejects (or flags when the target's
        # logits are unusable too).
        return mx.argmax(head_logits, axis=-1).astype(mx.int32), None

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: Any, step: int = 0) -> mx.array:
        return verify_greedy(verify_logits, tokens)


def make_policy(sampler: Any = None, seed: int | None = None, row_seeds: Sequence[int] | None = None) -> TokenPolicy:
    """The token policy for a sampler setting.

    Args:
        sampler: None; a `SamplerConfig` or one per stream (sampled
            speculative decoding, exact: `mtplx_ext.sampled.SampledPolicy`);
            or any object with `temperature` 0 (greedy).
        seed, row_seeds: random seeds of the sampled path; row_seeds (one
            per stream) make each stream independent of the batch.

    Raises:
        NotImplementedError: temperature > 0 without a SamplerConfig.
        TypeError / ValueError: for an unusable sampler.
    """
    if sampler is None:
        return GreedyPolicy()
    from mtplx_ext.sampled import SampledPolicy  # noqa: PLC0415 (import cycle)
    from mtplx_ext.sampling import SamplerConfig  # noqa: PLC0415

    if isinstance(sampler, SamplerConfig) or (
        isinstance(sampler, Sequence) and len(sampler) > 0 and all(isinstance(c, SamplerConfig) for c in sampler)
    ):
        sampled = SampledPolicy(sampler, seed=seed, row_seeds=row_seeds)
        return GreedyPolicy() if sampled.is_plain_greedy else sampled
    temperature = getattr(sampler, "temperature", None)
    if temperature is None:
        raise TypeError(f"sampler must be None or have a temperature, got {type(sampler).__name__}")
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"sampler.temperature must be >= 0, got {temperature}")
    if temperature == 0.0:
        return GreedyPolicy()
    raise NotImplementedError(
        "sampled decoding (temperature > 0) takes a mtplx_ext.SamplerConfig (or one per stream)"
    )


# -- argument checks ---------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes, mx.array)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, np.ndarray) and p.ndim == 1:
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        for j, t in enumerate(p):
            if not _is_int(t):
                raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {type(t).__name__}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompts[{i}][{j}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def _check_stop_ids(stop_token_ids: object, vocab_size: int) -> frozenset[int]:
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise TypeError("stop_token_ids must be a collection of int token ids")
    ids = list(stop_token_ids)
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"stop_token_ids must hold int token ids, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
    return frozenset(int(t) for t in ids)


def _model_tokens(tokens: mx.array) -> mx.array:
    # INVALID rows only occur for finished or failing streams; feed them a
    # valid id so the embedding never reads out of bounds (the raw ids still
    # go to verification, which flags them).
    return mx.maximum(tokens, 0)


# -- the loop ------------------------------------------------------------------


@dataclass
class _Pending:
    """A launched verification (or plain) step whose bundle is not read yet."""

    bundle: mx.array
    hidden: mx.array | None = None
    snapshot: cache_state.RecurrentSnapshot | None = None
    # The next (x0, draft) and its draft info, when the step already built
    # them (compiled steps).
    next_tokens: mx.array | None = None
    next_info: Any = None


class _Decoder:
    """Device-graph builders of one batched decode (no host reads here)."""

    def __init__(
        self, runtime: Any, policy: TokenPolicy, cache: list, head_cache: list | None, rollback: bool = False
    ):
        self.rt = runtime
        self.policy = policy
        self.cache = cache
        self.head_cache = head_cache
        self.recurrent = cache_state.has_recurrent_state(cache)
        # Per-stream rollback (RaggedKVCache layers) instead of batch repair.
        self.rollback = rollback
        # Compiled steps by kind (see `compile_steps`), or None (eager).
        self.compiled: dict[str, CompiledStep] | None = None

    def compile_steps(self) -> None:
        """Replays every later step through `mx.compile` (after the prefill).

        Needs fixed-capacity ragged caches and a policy that lists its device
        state in `state_attrs`. Kinds: "plain"; "rollback" (MTP, per-stream
        rollback: one step per cycle); "first", "accept" and "repair" (MTP,
        uniform repair: the host picks accept or repair from the bundle).
        All kinds share the caches and the policy's state.
        """
        holders = [(self.policy, a) for a in self.policy.state_attrs if getattr(self.policy, a, None) is not None]
        if self.head_cache is None:
            units = {"plain": self._plain_unit}
        elif self.rollback:
            units = {"rollback": self._rollback_unit}
        else:
            units = {"first": self._first_unit, "accept": self._accept_unit, "repair": self._repair_unit}
        # The snapshot's layout, from snapshot_recurrent itself (its arrays
        # stay lazy and are dropped unevaluated).
        self._snapshot_slots = cache_state.snapshot_recurrent(self.cache).slots if self.recurrent else []
        lists = self.caches()
        self.compiled = {k: CompiledStep(u, lists, holders, grow_step=COMPILED_GROW_STEP) for k, u in units.items()}
        # All kinds share one state: any of them can reserve, save or load it.
        self._shared = next(iter(self.compiled.values()))

    def _rollback_unit(self, step: mx.array, tokens: mx.array, *info: mx.array) -> tuple[mx.array, ...]:
        # Cycle `step`'s verification, then the head's draft for cycle step + 1.
        p = self.verify_step(tokens, info[0] if info else None, step)
        nxt, nxt_info = self.after_rollback(p, step + 1)
        return (p.bundle, nxt) + (() if nxt_info is None else (nxt_info,))

    def _plain_unit(self, step: mx.array, tokens: mx.array) -> mx.array:
        return self.plain_step(tokens, step).bundle

    @staticmethod
    def _pending_arrays(p: _Pending) -> tuple[mx.array, ...]:
        return (p.bundle, p.hidden) + tuple(p.snapshot.arrays if p.snapshot is not None else ())

    def _first_unit(self, step: mx.array, tokens: mx.array, *info: mx.array) -> tuple[mx.array, ...]:
        return self._pending_arrays(self.verify_step(tokens, info[0] if info else None, step))

    def _accept_unit(self, step: mx.array, bundle: mx.array, hidden: mx.array) -> tuple[mx.array, ...]:
        return self._pending_arrays(self.verify_step(*self.after_accept(_Pending(bundle, hidden), step), step))

    def _repair_unit(self, step: mx.array, bundle: mx.array, hidden: mx.array, *snap: mx.array) -> tuple:
        p = _Pending(bundle, hidden, self._snapshot(snap))
        return self._pending_arrays(self.verify_step(*self.after_repair(p, step), step))

    def _snapshot(self, arrays: Sequence[mx.array]) -> cache_state.RecurrentSnapshot | None:
        if not self.recurrent:
            return None
        return cache_state.RecurrentSnapshot(slots=list(self._snapshot_slots), arrays=list(arrays))

    def launch(self, kind: str, step: int, slots: int, *args: mx.array) -> _Pending:
        """Compiled step `kind` of cycle `step` (see `compile_steps` for its inputs).

        `slots`: cache slots (prompt included) that live streams may need.
        """
        self.reserve(slots)
        out = self.compiled[kind](mx.array(step, dtype=mx.uint32), *args)
        if kind == "plain":
            return _Pending(out)
        if kind == "rollback":
            return _Pending(out[0], next_tokens=out[1], next_info=out[2] if len(out) > 2 else None)
        return _Pending(out[0], out[1], self._snapshot(out[2:]))

    def launch_first(self, tokens: mx.array, info: Any, slots: int) -> _Pending:
        """The compiled first verification (cycle 1) from the prefill's (x0, draft)."""
        extra = () if info is None else (info,)
        return self.launch("rollback" if self.rollback else "first", 1, slots, tokens, *extra)

    def reserve(self, slots: int) -> None:
        """Grows the caches the compiled steps share to `slots` slots, if needed."""
        self._shared.reserve(slots)

    def save_compiled(self) -> list[mx.array]:
        """The state the compiled steps share (to undo a step built and never run)."""
        return self._shared.state()

    def load_compiled(self, state: list[mx.array]) -> None:
        self._shared.load(state)

    def caches(self) -> list[list]:
        return [self.cache] + ([self.head_cache] if self.head_cache is not None else [])

    def prefill(self, padded: mx.array) -> tuple[mx.array, Any]:
        """Chunked prompt forward and the head's prefill.

        Returns:
            ([B, 2] (x0, draft), draft info), or ([B, 1] x0, None) without a head.
        """
        T = padded.shape[1]
        starts = list(range(0, T, PREFILL_STEP))
        for s in starts:
            logits, hidden = self.rt.forward(padded[:, s : s + PREFILL_STEP], self.cache, last_logits_only=True)
            # The head consumes (hidden at t, token t + 1); the last chunk's
            # final pair needs x0, so that chunk waits for it.
            if self.head_cache is not None and s != starts[-1]:
                self.rt.head_forward(hidden, padded[:, s + 1 : s + PREFILL_STEP + 1], self.head_cache)
            mx.async_eval([c.state for cl in self.caches() for c in cl])
        x0 = self.policy.pick(logits[:, -1], 0)
        cache_state.finish_prefill(self.cache)
        if self.head_cache is None:
            return x0[:, None], None
        nxt = mx.concatenate([padded[:, starts[-1] + 1 :], _model_tokens(x0)[:, None]], axis=1)
        head_logits = self.rt.head_forward(hidden, nxt, self.head_cache)
        cache_state.finish_prefill(self.head_cache)
        draft, info = self.policy.draft(head_logits[:, -1], 0)
        return mx.stack([x0, draft], axis=1), info

    def verify_step(self, tokens: mx.array, info: Any, step: int) -> _Pending:
        """Snapshot, [B, 2] verification forward and the bundle."""
        snap = cache_state.snapshot_recurrent(self.cache) if self.recurrent else None
        logits, hidden = self.rt.forward(_model_tokens(tokens), self.cache)
        return _Pending(self.policy.verify(logits, tokens, info, step), hidden, snap)

    def _head_step(self, hidden: mx.array, second: mx.array, x0_next: mx.array, step: int) -> tuple[mx.array, Any]:
        nxt = _model_tokens(mx.stack([second, x0_next], axis=1))
        head_logits = self.rt.head_forward(hidden, nxt, self.head_cache)
        draft, info = self.policy.draft(head_logits[:, -1], step)
        return mx.stack([x0_next, draft], axis=1), info

    def after_accept(self, p: _Pending, step: int) -> tuple[mx.array, Any]:
        """Next cycle's (x0, draft) when no live stream rejected."""
        b = p.bundle
        return self._head_step(p.hidden, b[:, COL_SECOND], b[:, COL_BONUS], step)

    def after_repair(self, p: _Pending, step: int) -> tuple[mx.array, Any]:
        """Rolls the batch back and re-forwards [x0, second]; next (x0, draft)."""
        if p.snapshot is not None:
            cache_state.restore_recurrent(self.cache, p.snapshot)
        cache_state.trim_kv(self.cache, 2)
        b = p.bundle
        pair = mx.stack([b[:, COL_X0], b[:, COL_SECOND]], axis=1)
        logits, hidden = self.rt.forward(_model_tokens(pair), self.cache)
        return self._head_step(hidden, b[:, COL_SECOND], self.policy.pick(logits[:, -1], step), step)

    def after_rollback(self, p: _Pending, step: int) -> tuple[mx.array, Any]:
        """Next (x0, draft) per stream, rejected streams rolled back on the device."""
        b = p.bundle
        accepted = b[:, COL_ACCEPT] == 1
        second, bonus = b[:, COL_SECOND], b[:, COL_BONUS]
        # Head pairs (hidden at x0, second) and (hidden at draft, bonus); a
        # rejected stream keeps only the first, and drafts from it.
        head_logits = self.rt.head_forward(p.hidden, _model_tokens(mx.stack([second, bonus], axis=1)), self.head_cache)
        draft, info = self.policy.draft(mx.where(accepted[:, None], head_logits[:, 1], head_logits[:, 0]), step)
        dropped = 1 - accepted.astype(mx.int32)
        cache_state.rollback_streams(self.cache, dropped)
        cache_state.rollback_streams(self.head_cache, dropped)
        return mx.stack([mx.where(accepted, bonus, second), draft], axis=1), info

    def plain_step(self, tokens: mx.array, step: int) -> _Pending:
        """One autoregressive forward of [B, 1] tokens; bundle = next tokens."""
        logits, _ = self.rt.forward(_model_tokens(tokens), self.cache)
        return _Pending(self.policy.pick(logits[:, -1], step)[:, None])


class _Streams:
    """Host-side bookkeeping: committed tokens, finish reasons, statistics."""

    def __init__(
        self,
        n: int,
        vocab_size: int,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        on_commit: OnCommit | None,
        second_on_reject: bool = True,
        width: int = 0,
    ):
        self.vocab_size = vocab_size
        # False with per-stream rollback: a rejecting stream commits only x0
        # now, and `second` as the next cycle's x0.
        self.second_on_reject = second_on_reject
        self.result = BatchedDecodeResult(streams=[StreamResult() for _ in range(n)])
        self.max_new = max_new_tokens
        self.stop_ids = stop_ids
        self.on_commit = on_commit
        self.done = np.zeros(n, dtype=bool)
        self.count = np.zeros(n, dtype=np.int64)
        self.width = width  # prompt slots of the caches

    def decide(self, tokens: np.ndarray, accept: np.ndarray | None) -> tuple[list, bool]:
        """Which tokens each stream commits this cycle, and whether to repair.

        Args:
            tokens: [B, k] candidate tokens in order (k = 2: x0, second).
            accept: [B] accept column, or None for plain decoding.

        Returns:
            (commits, repair): per stream (index, tokens, finish reason or
            None); repair is True when a stream that goes on rejected.

        Raises:
            RuntimeError: naming the first stream that needs a token from an
                invalid row (accept = -1 or an out-of-vocabulary token).
        """
        commits = []
        repair = False
        for i in np.flatnonzero(~self.done):
            new: list[int] = []
            reason = None
            for j in range(tokens.shape[1]):
                if j == 1:
                    # The second token is needed only if the stream goes on
                    # after x0, so only then is an invalid row an error.
                    if accept[i] < 0:
                        self._fail(i, "non-finite verification logits")
                    self.result.drafted += 1
                    self.result.accepted += int(accept[i] == 1)
                    if accept[i] == 0 and not self.second_on_reject:
                        break
                t = int(tokens[i, j])
                if not 0 <= t < self.vocab_size:
                    self._fail(i, f"token {t} outside the vocabulary (non-finite logits)")
                new.append(t)
                if t in self.stop_ids:
                    reason = "stop"
                elif self.count[i] + len(new) >= self.max_new:
                    reason = "length"
                if reason:
                    break
            self.count[i] += len(new)
            if reason:
                self.done[i] = True
            elif accept is not None and accept[i] == 0 and self.second_on_reject:
                repair = True
            commits.append((int(i), new, reason))
        return commits, repair

    def _fail(self, i: int, why: str) -> None:
        raise RuntimeError(f"stream {i}: invalid decode row ({why}) after {self.count[i]} committed tokens")

    def apply(self, commits: list) -> None:
        """Appends committed tokens and calls the on_commit callback."""
        for i, new, reason in commits:
            s = self.result.streams[i]
            s.tokens.extend(new)
            if reason:
                s.finish_reason = reason
            if self.on_commit is not None:
                self.on_commit(i, new)

    def may_all_finish(self, k: int) -> bool:
        """Whether committing k more tokens would bring every live stream to its cap."""
        live = ~self.done
        return bool(np.all(self.count[live] + k >= self.max_new))

    def any_live(self) -> bool:
        return not bool(self.done.all())

    def slots_needed(self) -> int:
        """Cache slots (prompt included) the next launched step may write for live streams.

        A step writes at most 2 slots after a stream's committed tokens, and
        the step before it (launched, not read yet) commits at most 2 more.
        A stream whose count would pass max_new_tokens is finished: its
        writes are clamped and ignored.
        """
        live = self.count[~self.done]
        most = int(live.max()) if live.size else 0
        return self.width + min(most + 4, self.max_new + 2)


def _read_bundle(p: _Pending, streams: _Streams) -> np.ndarray:
    t = time.perf_counter()
    b = np.array(p.bundle)
    streams.result.sync_wait_s += time.perf_counter() - t
    streams.result.host_syncs += 1
    return b


def _split_bundle(b: np.ndarray, mtp: bool) -> tuple[np.ndarray, np.ndarray | None]:
    if mtp:
        return b[:, [COL_X0, COL_SECOND]], b[:, COL_ACCEPT]
    return b, None


def _next_step(dec: _Decoder, p: _Pending, mtp: bool, repair: bool, step: int, slots: int = 0) -> _Pending:
    """Builds cycle `step` after `p`: (repair and) head step, then verification."""
    if dec.compiled is not None:
        if not mtp:
            return dec.launch("plain", step, slots, p.bundle)
        if dec.rollback:
            return dec.launch("rollback", step, slots, p.next_tokens, *(() if p.next_info is None else (p.next_info,)))
        if repair:
            return dec.launch("repair", step, slots, p.bundle, p.hidden, *(p.snapshot.arrays if p.snapshot else ()))
        return dec.launch("accept", step, slots, p.bundle, p.hidden)
    if not mtp:
        return dec.plain_step(p.bundle, step)
    if dec.rollback:
        return dec.verify_step(*dec.after_rollback(p, step), step)
    nxt = dec.after_repair(p, step) if repair else dec.after_accept(p, step)
    return dec.verify_step(*nxt, step)


#: Weight of the newest cycle in the pipelined loop's estimate of how often
#: cycles repair (it builds the likelier path ahead).
_REPAIR_EMA = 0.25


def _run_cycles(dec: _Decoder, st: _Streams, first: _Pending, mtp: bool, serial: bool) -> None:
    """The decode cycles, serial or pipelined (same graphs, same forwards)."""
    res = st.result
    p = first
    repair_rate = 0.0
    while True:
        res.cycles += 1
        if serial:
            b = _read_bundle(p, st)
            commits, repair = st.decide(*_split_bundle(b, mtp))
            st.apply(commits)
            if not st.any_live():
                return
        elif not mtp or dec.rollback:
            # Pipelined, and the next cycle depends only on device arrays
            # (plain decoding, per-stream rollback): build and launch it
            # before reading this one, so the device never waits for the
            # host; unless this cycle may end every stream at its cap.
            spec = _next_step(dec, p, mtp, False, res.cycles + 1, st.slots_needed())
            early = not st.may_all_finish(2 if mtp else 1)
            if early:
                mx.async_eval(spec.bundle)
            b = _read_bundle(p, st)
            commits, repair = st.decide(*_split_bundle(b, mtp))
            if not st.any_live():
                st.apply(commits)
                if early:
                    # A stop token ended them early: the launched cycle is
                    # wasted work, and the decode time includes it.
                    mx.eval(spec.bundle)
                return
            if not early:
                mx.async_eval(spec.bundle)
        else:
            # Pipelined with uniform repair: while the device runs this
            # cycle, build the next one along the likelier path (all accept,
            # or repair: both need only device arrays). Start it once the
            # bundle confirms the guess; else drop it unevaluated (no extra
            # forward) and build the other path.
            guess = repair_rate > 0.5
            slots = st.slots_needed()
            if dec.compiled is not None:
                # Grow first: a restored state must fit the caches' shapes.
                dec.reserve(slots)
                saved = dec.save_compiled()
                ckpt = None
            else:
                ckpt = cache_state.checkpoint_caches(*dec.caches(), [dec.policy])
            spec = _next_step(dec, p, mtp, guess, res.cycles + 1, slots)
            b = _read_bundle(p, st)
            commits, repair = st.decide(*_split_bundle(b, mtp))
            if repair != guess or not st.any_live():
                if ckpt is None:
                    dec.load_compiled(saved)
                else:
                    cache_state.rollback_caches(ckpt)
            if not st.any_live():
                st.apply(commits)
                return
            if repair != guess:
                spec = _next_step(dec, p, mtp, repair, res.cycles + 1, slots)
            # No stale handles on the caches' arrays: MLX may update them in place.
            del ckpt
            saved = None
            mx.async_eval(spec.bundle)
            repair_rate += _REPAIR_EMA * (float(repair) - repair_rate)
        res.forwards += 1 + int(repair)
        res.repair_cycles += int(repair)
        if serial:
            p = _next_step(dec, p, mtp, repair, res.cycles + 1, st.slots_needed())
        else:
            # Late commit: host bookkeeping and callbacks overlap the device.
            st.apply(commits)
            p = spec


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
    reject_mode: str = "repair",
    serial: bool = False,
    on_commit: OnCommit | None = None,
    enforce_eager: bool = False,
) -> BatchedDecodeResult:
    """Decodes a batch of prompts with MTP drafts verified in one forward per cycle.

    Args:
        runtime: an `MTPRuntime` (make_cache, make_head_cache, forward,
            head_forward, vocab_size, has_mtp).
        prompts: token-id lists, any lengths (left-padded into one batch;
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
        reject_mode: "repair": rejected streams are rolled back on their own
            when the trunk is attention-only (no extra forward), else the
            batch is repaired uniformly (snapshot restore, re-forward);
            "reforward": always the uniform full-batch repair.
        serial: True runs the plain loop; False pipelines graph building
            and host bookkeeping with the device work. Same tokens and
            forwards either way.
        on_commit: called as on_commit(stream index, new token ids) when a
            stream commits tokens.
        enforce_eager: True builds every step's graph in Python; False
            traces each kind of step once with `mx.compile` and replays it.
            Same tokens either way, up to float rounding of fused
            element-wise kernels.

    Returns:
        A `BatchedDecodeResult`.

    Raises:
        TypeError / ValueError: naming the bad argument.
        NotImplementedError: temperature > 0 without a SamplerConfig.
        RuntimeError: naming a stream whose logits or tokens became invalid.
    """
    vocab = int(runtime.vocab_size)
    prompts = _check_prompts(prompts, vocab)
    # Python ints from here on: a NumPy integer would break mx calls in compiled steps.
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, lo=1)
    seed, row_seeds = as_seed("seed", seed), as_seeds("row_seeds", row_seeds)
    stop_ids = _check_stop_ids(stop_token_ids, vocab)
    if reject_mode not in REJECT_MODES:
        raise ValueError(f"reject_mode must be one of {REJECT_MODES}, got {reject_mode!r}")
    if on_commit is not None and not callable(on_commit):
        raise TypeError("on_commit must be callable or None")
    use_mtp_draft = bool(use_mtp_draft)
    if use_mtp_draft and not runtime.has_mtp:
        raise ValueError("use_mtp_draft=True needs a runtime with MTP head weights (this one has none)")
    policy = make_policy(sampler, seed, row_seeds)

    # One token per stream is the prefill's x0: nothing to draft or verify.
    mtp = use_mtp_draft and max_new_tokens > 1
    with wired_limit(runtime), _fused_attention(runtime):
        attention_only = not _has_recurrent_layers(runtime)
        rollback = mtp and reject_mode == "repair" and attention_only
        compiled = not bool(enforce_eager) and hasattr(policy, "state_attrs")
        return _generate(
            runtime, prompts, policy, max_new_tokens, stop_ids, mtp, serial, on_commit, rollback, compiled
        )


def _fused_attention(runtime: Any) -> Any:
    # Process-wide while decoding, so only for runtimes that opted in.
    if getattr(runtime, "cpu_ops_fused", False):
        from mtplx_ext.fused import patch_mlx_lm_attention  # noqa: PLC0415

        return patch_mlx_lm_attention()
    return contextlib.nullcontext()


def _has_recurrent_layers(runtime: Any) -> bool:
    flag = getattr(runtime, "has_recurrent_layers", None)
    return True if flag is None else bool(flag)


def _generate(
    runtime: Any,
    prompts: list[list[int]],
    policy: TokenPolicy,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    mtp: bool,
    serial: bool,
    on_commit: OnCommit | None,
    rollback: bool = False,
    compiled: bool = False,
) -> BatchedDecodeResult:
    t0 = time.perf_counter()
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    pads = [width - n for n in lengths]
    padded = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    # (The ragged keyword only when used: runtimes without it still repair.)
    kw = {"ragged": True} if rollback else {}
    if compiled:  # (attention layers only: recurrent ones keep their ArraysCache)
        kw = {"ragged": True, "capacity": width + min(max_new_tokens + 2, COMPILED_GROW_STEP)}
    cache = runtime.make_cache(pads, **kw)
    head_cache = runtime.make_head_cache(pads, **kw) if mtp else None
    if rollback and hasattr(policy, "second_on_reject"):
        policy.second_on_reject = False
    dec = _Decoder(runtime, policy, cache, head_cache, rollback)
    tokens, info = dec.prefill(padded)
    # A device barrier (no host read) so prefill and decode times separate.
    mx.eval(tokens, [c.state for c in dec.caches()[0]])
    t1 = time.perf_counter()

    st = _Streams(len(prompts), int(runtime.vocab_size), max_new_tokens, stop_ids, on_commit, not rollback, width)
    if compiled:
        dec.compile_steps()
        st.result.compiled = True
    if not mtp:
        first = _Pending(tokens)
    else:
        first = dec.launch_first(tokens, info, st.slots_needed()) if compiled else dec.verify_step(tokens, info, 1)
    st.result.forwards += int(mtp)
    if not serial:
        mx.async_eval(first.bundle)
    _run_cycles(dec, st, first, mtp, serial)
    st.result.prefill_s = t1 - t0
    st.result.decode_s = time.perf_counter() - t1
    return st.result


def generate_greedy_batched(
    runtime: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    use_mtp_draft: bool = True,
    reject_mode: str = "repair",
    serial: bool = False,
    on_commit: OnCommit | None = None,
    enforce_eager: bool = False,
) -> BatchedDecodeResult:
    """Greedy batched MTP decoding: `generate_batched` at temperature 0.

    See `generate_batched` for the arguments and the result.
    """
    return generate_batched(
        runtime,
        prompts,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        use_mtp_draft=use_mtp_draft,
        reject_mode=reject_mode,
        serial=serial,
        on_commit=on_commit,
        enforce_eager=enforce_eager,
    )
