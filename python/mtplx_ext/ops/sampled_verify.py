"""Fused sampled decoding primitives: sample_tokens, verify_sampled, verify_sampled_chain.

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

`mtplx_ext.ops.threads.set_cpu_threads(n)` overrides the count in-process for tests and
benchmarks (0 restores the variable's value); it is not public API.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import (
    MAX_DRAFTS,
    as_int,
    require_array,
    require_chain_logits,
    require_int_tokens,
    require_kind,
    require_logit_bias,
    require_logits,
)
from mtplx_ext.sampling import PARAM_COLUMNS, SamplerConfig, pack_params

_ext.cpu_threads()  # validates MTPLX_CPU_THREADS up front (ValueError)

SamplerArg = SamplerConfig | Sequence[SamplerConfig] | mx.array
#: Most extra tokens sample_tokens counts (x0 and up to MAX_DRAFTS - 1 chained drafts).
_MAX_EXTRA = MAX_DRAFTS


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
    logit_bias: tuple[mx.array, mx.array] | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Draws one token per row from the sampler's distribution of its logits.

    Args:
        logits: [B, V] float32/float16/bfloat16 logits.
        uniforms: [B] float uniforms in [0, 1) (one per row; draw them with a
            per-row key so that rows are reproducible on their own).
        sampler: SamplerConfig, B of them, or packed [B, 7] parameters.
        token_counts: optional [B, V] integer counts the penalties see.
        extra_tokens: optional [B, E] ids (E <= 8) counted once more on top
            of `token_counts` (e.g. x0, d_1..d_{i-1} when sampling the i-th
            chained draft); ids outside [0, V) such as -1 count nothing.
        logit_bias: optional (ids, values) [B, M] pair: values[b, e] is
            added to logit ids[b, e] of row b (in float32, before the
            penalties; ids outside [0, V) add nothing; a dense [B, V] row per
            stream on a GPU stream).
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
        if extra.ndim != 2 or extra.shape[0] != B or extra.shape[1] > _MAX_EXTRA:
            raise ValueError(
                f"extra_tokens must have shape [B, E] with B = {B} and E <= {_MAX_EXTRA}, "
                f"got {tuple(extra.shape)}"
            )
        extra = require_int_tokens("extra_tokens", extra, tuple(extra.shape))
    bias = require_logit_bias(logit_bias, B)
    params = sampler_params(sampler, B)
    if bias is None:
        return _ext.sample_tokens(lg, u, params, counts, extra, stream=stream)
    return _ext.sample_tokens(lg, u, params, counts, extra, bias[0], bias[1], stream=stream)


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
        token_counts: optional [B, V] integer counts before x0 (negative
            counts act as 0; counts saturate at 2**31 - 1).
        stream: MLX stream or device to run on.

    Returns:
        [B, 5] int32 bundle (x0, draft, second, accept, bonus): accept is 1 or
        0; bonus is -1 when the draft was rejected. accept is -1 (and second,
        bonus -1) when a verification row holds NaN or +Inf or no finite
        value, or when x0 or the draft lies outside [0, V). An unusable
        draft_logits row (a broken MTP head) rejects the draft, and second
        is drawn from p.
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


def verify_sampled_chain(
    verify_logits: mx.array,
    draft_logits: mx.array,
    tokens: mx.array,
    uniforms: mx.array,
    sampler: SamplerArg,
    token_counts: mx.array | None = None,
    *,
    logit_bias: tuple[mx.array, mx.array] | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Exact speculative verification of K chained sampled drafts per stream.

    Position i = 1..K: p_i from verify_logits[:, i-1] and q_i from
    draft_logits[:, i-1], both with counts + x0 + d_1..d_{i-1}. d_i is
    accepted when ``u_accept_i * q_i(d_i) < p_i(d_i)``, in order; the first
    rejection commits a draw from normalise(max(p_i - q_i, 0)) with
    u_resample; when all K are accepted the bonus is drawn from
    verify_logits[:, K] (counts + x0 + d_1..d_K) with u_bonus. A draft
    outside [0, V) or an unusable draft row is rejected and the token drawn
    from p_i. See `mtplx_ext.sampling.sample_mtp_chain_row`.

    Args:
        verify_logits: [B, K + 1, V] logits of the verification forward of
            [x0, d_1..d_K], K in 1..8.
        draft_logits: [B, K, V] logits the drafts were sampled from, same
            dtype.
        tokens: [B, K + 1] integer (x0, d_1..d_K).
        uniforms: [B, K + 2] float (u_accept_1..u_accept_K, u_resample,
            u_bonus).
        sampler: SamplerConfig, B of them, or packed [B, 7] parameters.
        token_counts: optional [B, V] integer counts before x0 (negative
            counts act as 0; counts saturate at 2**31 - 1).
        logit_bias: optional (ids, values) [B, M] pair added to every
            verification row and every draft row of stream b (as in
            `sample_tokens`): the target is the biased distribution, and q is
            the biased draft distribution, since the drafts are sampled with
            the same bias.
        stream: MLX stream or device to run on.

    Returns:
        [B, K + 3] int32 chain bundle: x0, n (accepted drafts), c_1..c_{K+1}
        (c_j = -1 for j > n + 1). n = -1 (and every c -1) when x0 lies
        outside [0, V) or a needed verification row (0..n) holds NaN or +Inf
        or no finite value.
    """
    vl, K = require_chain_logits("verify_logits", verify_logits, MAX_DRAFTS)
    B, _, V = vl.shape
    dl = require_logits("draft_logits", draft_logits, 3)
    if tuple(dl.shape) != (B, K, V):
        raise ValueError(f"draft_logits must have shape {(B, K, V)}, got {tuple(dl.shape)}")
    if dl.dtype != vl.dtype:
        raise TypeError(
            f"draft_logits must have the dtype of verify_logits ({vl.dtype}), got {dl.dtype}"
        )
    tok = require_int_tokens("tokens", tokens, (B, K + 1))
    u = _uniforms("uniforms", uniforms, (B, K + 2))
    counts = _counts(token_counts, (B, V))
    bias = require_logit_bias(logit_bias, B)
    params = sampler_params(sampler, B)
    if bias is None:
        return _ext.verify_sampled_chain(vl, dl, tok, u, params, counts, stream=stream)
    return _ext.verify_sampled_chain(
        vl, dl, tok, u, params, counts, logit_bias_ids=bias[0], logit_bias_values=bias[1],
        stream=stream,
    )


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


__all__ = ["row_uniforms", "sample_tokens", "sampler_params", "verify_sampled", "verify_sampled_chain"]
