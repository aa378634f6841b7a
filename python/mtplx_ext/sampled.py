"""Fused sampled decoding primitives: sample_tokens and verify_sampled.

Both follow the sampler definition of `mtplx_ext.sampling` exactly (transform
order, kept-set tie rules, inverse CDF, acceptance rule); that module's
float64 NumPy functions are their reference.

On the CPU the rows of a batch run on a small persistent worker pool; the
result does not depend on the thread count. Environment:
    MTPLX_CPU_THREADS: threads of the CPU kernels (default: the CPUs this
        process may run on, at most 8; 1 runs every row on MLX's CPU stream
        thread). Anything but an integer in [1, 256] makes importing
        mtplx_ext raise ValueError naming the variable. Jobs too small to
        gain from a second thread run on one thread whatever the setting;
        larger ones mostly run the way (pool or one thread) that recent
        timings found faster, which keeps busy machines from losing time.

`_ext._set_cpu_threads(n)` overrides the count in-process for tests and
benchmarks (0 restores the variable's value); it is not public API.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mtplx_ext import _ext
from mtplx_ext._checks import as_int, as_seed, as_seeds, require_array, require_int_tokens, require_kind, require_logits
from mtplx_ext.sampling import PARAM_COLUMNS, SamplerConfig, pack_params

_ext._cpu_threads()  # validates MTPLX_CPU_THREADS up front (ValueError)

SamplerArg = SamplerConfig | Sequence[SamplerConfig] | mx.array


def sampler_params(sampler: SamplerArg, batch: int) -> mx.array:
    """Packs sampler settings into the [B, 7] float32 array the kernels read.

    Args:
        sampler: one SamplerConfig for every row, a sequence of B configs (one
            per row), or an already packed [B, 7] array (columns in
            `mtplx_ext.sampling.PARAM_COLUMNS` order).
        batch: B.

    Returns:
        [B, 7] float32 mx.array.

    Raises:
        TypeError: `sampler` is none of these (None included).
        ValueError: a wrong shape or number of configs.
    """
    if isinstance(sampler, (str, bytes)) or not (
        isinstance(sampler, (SamplerConfig, mx.array)) or hasattr(sampler, "__iter__")
    ):
        raise TypeError(
            "sampler must be a SamplerConfig, a list of B of them or a packed [B, 7] float array, "
            f"got {type(sampler).__name__}"
        )
    if isinstance(sampler, mx.array):
        want = (batch, len(PARAM_COLUMNS))
        if tuple(sampler.shape) != want:
            raise ValueError(f"sampler must have shape {want}, got {tuple(sampler.shape)}")
        if not mx.issubdtype(sampler.dtype, mx.floating):
            raise TypeError(f"sampler must be a float array, got {sampler.dtype}")
        return sampler.astype(mx.float32)
    return mx.array(pack_params(sampler, batch))


def _uniforms(name: str, value: object, shape: tuple[int, ...]) -> mx.array:
    return require_kind(name, value, shape, mx.floating, "a floating")


def _require_rows(name: str, a: mx.array) -> None:
    # Before packing the sampler: B = 0 would otherwise fail deep in NumPy.
    if a.shape[0] < 1:
        raise ValueError(f"{name} must have at least one row (B >= 1), got shape {tuple(a.shape)}")


def _counts(value: object | None, shape: tuple[int, int]) -> mx.array | None:
    return None if value is None else require_int_tokens("token_counts", value, shape)


def sample_tokens(
    logits: mx.array,
    uniforms: mx.array,
    sampler: SamplerArg,
    *,
    token_counts: mx.array | None = None,
    extra_tokens: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Draws one token per row from the sampler's distribution of its logits.

    Args:
        logits: [B, V] float32/float16/bfloat16 logits.
        uniforms: [B] float uniforms in [0, 1) (one per row; draw them with a
            per-row key so that rows are reproducible on their own).
        sampler: SamplerConfig, B of them, or packed [B, 7] parameters.
        token_counts: optional [B, V] integer counts the penalties see.
        extra_tokens: optional [B, E] ids (E <= 2) counted once more on top
            of `token_counts` (e.g. x0 when sampling the MTP draft); ids
            outside [0, V) such as -1 count nothing.
        stream: MLX stream or device to run on.

    Returns:
        [B] int32 tokens; -1 for a row whose logits hold NaN or +Inf, or no
        finite value.
    """
    lg = require_logits("logits", logits, 2)
    B, V = lg.shape
    _require_rows("logits", lg)
    u = _uniforms("uniforms", uniforms, (B,))
    counts = _counts(token_counts, (B, V))
    extra = None
    if extra_tokens is not None:
        extra = require_array("extra_tokens", extra_tokens)
        if extra.ndim != 2 or extra.shape[0] != B or extra.shape[1] > 2:
            raise ValueError(
                f"extra_tokens must have shape [B, E] with B = {B} and E <= 2, "
                f"got {tuple(extra.shape)}"
            )
        extra = require_int_tokens("extra_tokens", extra, tuple(extra.shape))
    params = sampler_params(sampler, B)
    return _ext.sample_tokens(lg, u, params, counts, extra, stream=stream)


def verify_sampled(
    verify_logits: mx.array,
    draft_logits: mx.array,
    tokens: mx.array,
    uniforms: mx.array,
    sampler: SamplerArg,
    *,
    token_counts: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Exact speculative verification of one sampled MTP draft per stream.

    With p the target distribution at the draft's position (from
    verify_logits[:, 0], counts + x0) and q the draft distribution recomputed
    from draft_logits with the same transforms and counts, the draft is
    accepted when ``u_accept * q(d) < p(d)``; otherwise ``second`` is drawn
    from normalise(max(p - q, 0)) with u_resample. When accepted, the bonus
    is drawn with u_bonus from verify_logits[:, 1] (counts + x0 + draft).

    Args:
        verify_logits: [B, 2, V] logits of the verification forward at the
            positions of x0 and of the draft.
        draft_logits: [B, V] logits the draft was sampled from, same dtype.
        tokens: [B, 2] integer (x0, draft).
        uniforms: [B, 3] float (u_accept, u_resample, u_bonus).
        sampler: SamplerConfig, B of them, or packed [B, 7] parameters.
        token_counts: optional [B, V] integer counts before x0.
        stream: MLX stream or device to run on.

    Returns:
        [B, 5] int32 bundle (x0, draft, second, accept, bonus): accept is 1 or
        0; bonus is -1 when the draft was rejected. accept is -1 (and second,
        bonus -1) when a logits row holds NaN or +Inf or no finite value, or
        when x0 or the draft lies outside [0, V).
    """
    vl = require_logits("verify_logits", verify_logits, 3)
    if vl.shape[1] != 2:
        raise ValueError(f"verify_logits must have shape [B, 2, V], got {tuple(vl.shape)}")
    B, _, V = vl.shape
    _require_rows("verify_logits", vl)
    dl = require_logits("draft_logits", draft_logits, 2)
    if tuple(dl.shape) != (B, V):
        raise ValueError(f"draft_logits must have shape {(B, V)}, got {tuple(dl.shape)}")
    if dl.dtype != vl.dtype:
        raise TypeError(
            f"draft_logits must have the dtype of verify_logits ({vl.dtype}), got {dl.dtype}"
        )
    tok = require_int_tokens("tokens", tokens, (B, 2))
    u = _uniforms("uniforms", uniforms, (B, 3))
    counts = _counts(token_counts, (B, V))
    params = sampler_params(sampler, B)
    return _ext.verify_sampled(vl, dl, tok, u, params, counts, stream=stream)


def row_uniforms(keys: mx.array, n: int) -> mx.array:
    """[B, n] float32 uniforms, row b drawn from its own key ``keys[b]``.

    A row's uniforms depend only on its key, so a stream's draws do not
    change with the batch's composition or order.

    Args:
        keys: [B, 2] uint32 PRNG keys (from ``mx.random.key``).
        n: uniforms per row.
    """
    keys = require_array("keys", keys)
    if keys.ndim != 2 or keys.shape[1] != 2:
        raise ValueError(f"keys must have shape [B, 2], got {tuple(keys.shape)}")
    n = as_int("n", n, lo=0)
    return mx.vmap(lambda k: mx.random.uniform(shape=(n,), key=k))(keys)


# -- decode-loop token policy -------------------------------------------------

#: Uniform streams of a sampled decode: one key per (row, step, call).
_CALL_PICK, _CALL_DRAFT, _CALL_ACCEPT, _CALL_RESAMPLE = range(4)


class SampledPolicy:
    """Token policy of `generate_batched` for a SamplerConfig (per stream).

    Exact speculative sampling: x0 and the MTP draft come from
    `sample_tokens`, the verification from `verify_sampled` (draft accepted
    with probability min(1, p/q), else a residual draw), so committed tokens
    follow the target's sampled distribution whatever the head proposes.

    Randomness: row b's uniform for (step, call) comes from its own key, so a
    stream's tokens depend only on its seed and its own logits: not on the
    batch's other streams or their order, nor on serial vs pipelined loops.
    The bonus drawn at cycle s and the x0 a repair forward picks for cycle
    s + 1 use the same uniform, so an accepted stream commits the same token
    whether or not another stream forced the batch to repair.

    Penalty counts (generated tokens only) live on the device as a [B, V]
    int32 array updated from each bundle; they are kept only when some
    stream has a penalty.
    """

    #: Array attributes that carry device state from one decode step to the
    #: next (a compiled step takes and returns them).
    state_attrs = ("counts", "x0", "_keys", "_params")

    def __init__(
        self,
        sampler: SamplerConfig | Sequence[SamplerConfig],
        seed: int | None = None,
        row_seeds: Sequence[int] | None = None,
    ):
        if isinstance(sampler, SamplerConfig):
            self._configs: list[SamplerConfig] | None = None
            self._shared = sampler
        else:
            configs = list(sampler)
            for i, c in enumerate(configs):
                if not isinstance(c, SamplerConfig):
                    raise TypeError(f"sampler[{i}] must be a SamplerConfig, got {type(c).__name__}")
            if not configs:
                raise ValueError("sampler is an empty list: give one SamplerConfig per stream")
            self._configs = configs
            self._shared = None
        self._seed = as_seed("seed", seed)
        self._row_seeds = as_seeds("row_seeds", row_seeds)
        self._ready = False
        # Device state (checkpointed by the pipelined loop with the caches).
        self.counts: mx.array | None = None
        self.x0: mx.array | None = None
        self.x0_is_bonus = False
        # False when the decode loop rolls rejecting streams back on their
        # own: such a stream commits only x0 this cycle and goes on from
        # `second`, which becomes its next x0.
        self.second_on_reject = True

    @property
    def configs(self) -> list[SamplerConfig] | SamplerConfig:
        return self._configs if self._configs is not None else self._shared

    @property
    def is_plain_greedy(self) -> bool:
        """True when every stream is greedy without penalties."""
        cs = self._configs if self._configs is not None else [self._shared]
        return all(c.greedy and not c.has_penalties for c in cs)

    def _setup(self, B: int, V: int) -> None:
        if self._ready:
            return
        if self._configs is not None and len(self._configs) != B:
            raise ValueError(f"sampler has {len(self._configs)} SamplerConfigs for {B} prompts")
        seeds = self._row_seeds
        if seeds is None:
            rng = np.random.default_rng(self._seed)
            seeds = [int(x) for x in rng.integers(0, 2**63, size=B)]
        elif len(seeds) != B:
            raise ValueError(f"row_seeds has {len(seeds)} entries for {B} prompts")
        words = np.array(seeds, dtype=np.uint64)
        raw = mx.array(np.stack([(words >> 32).astype(np.uint32), (words & 0xFFFFFFFF).astype(np.uint32)], axis=1))
        # Row keys through threefry: mx.random.key(s) is just the seed's two
        # words, so for nearby seeds the (step, call) counter xor-ed into the
        # low word would hand one row's uniforms to another row.
        self._keys = mx.vmap(lambda k: mx.random.split(k, 2)[0])(raw)
        self._params = sampler_params(self.configs, B)
        cs = self._configs if self._configs is not None else [self._shared]
        self._penalties = any(c.has_penalties for c in cs)
        self._V = V
        self._ready = True

    def _uniforms(self, step: int | mx.array, calls: Sequence[int]) -> mx.array:
        """[B, len(calls)] float32: row b's uniform of (step, call).

        `step` may be a device scalar (an input of a compiled decode step):
        the keys are derived on the device either way, so both agree.
        """
        step = step.astype(mx.uint32) if isinstance(step, mx.array) else mx.array(step, dtype=mx.uint32)
        cols = []
        for c in calls:
            key = mx.stack([self._keys[:, 0], self._keys[:, 1] ^ ((step << 2) | c)], axis=1)
            cols.append(mx.vmap(lambda kk: mx.random.uniform(shape=(), key=kk))(key))
        return mx.stack(cols, axis=1)

    def _add(self, counts: mx.array, tok: mx.array) -> mx.array:
        # Invalid (-1) tokens count nothing and are never used as an index.
        rows = mx.arange(tok.shape[0])
        return counts.at[rows, mx.maximum(tok, 0)].add((tok >= 0).astype(mx.int32))

    def pick(self, logits: mx.array, step: int = 0) -> mx.array:
        B, V = logits.shape
        self._setup(B, V)
        if self._penalties:
            if self.counts is None:
                self.counts = mx.zeros((B, V), mx.int32)
            if self.x0 is not None and not self.x0_is_bonus:
                # Plain decoding: the previous pick is now committed.
                self.counts = self._add(self.counts, self.x0)
        u = self._uniforms(step, [_CALL_PICK])[:, 0]
        tok = sample_tokens(logits, u, self._params, token_counts=self.counts)
        self.x0, self.x0_is_bonus = tok, False
        return tok

    def draft(self, head_logits: mx.array, step: int = 0) -> tuple[mx.array, mx.array]:
        B, V = head_logits.shape
        self._setup(B, V)
        u = self._uniforms(step, [_CALL_DRAFT])[:, 0]
        extra = None if self.x0 is None or not self._penalties else self.x0[:, None]
        d = sample_tokens(head_logits, u, self._params, token_counts=self.counts, extra_tokens=extra)
        return d, head_logits

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: mx.array, step: int = 0) -> mx.array:
        B, _, V = verify_logits.shape
        self._setup(B, V)
        u = mx.concatenate(
            [self._uniforms(step, [_CALL_ACCEPT, _CALL_RESAMPLE]), self._uniforms(step + 1, [_CALL_PICK])], axis=1
        )
        bundle = verify_sampled(verify_logits, draft_info, tokens, u, self._params, token_counts=self.counts)
        if self.second_on_reject:
            committed = bundle[:, 2]
            # The next x0 is the bonus, unless a repair forward picks it anew.
            nxt = bundle[:, 4]
        else:
            accepted = bundle[:, 3] == 1
            committed = mx.where(accepted, bundle[:, 1], -1)
            nxt = mx.where(accepted, bundle[:, 4], bundle[:, 2])
        if self._penalties:
            self.counts = self._add(self._add(self.counts, bundle[:, 0]), committed)
        self.x0, self.x0_is_bonus = nxt, True
        return bundle


__all__ = ["SampledPolicy", "row_uniforms", "sample_tokens", "sampler_params", "verify_sampled"]
