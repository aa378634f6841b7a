"""The sampler and the exact MTP acceptance rule, with a float64 host reference.

This module is the one definition of sampled decoding in mtplx_ext. The fused
primitives (``sample_tokens``, ``verify_sampled``) implement exactly these
rules; the NumPy float64 functions here are the reference they are tested
against.

Transform order, for one row of logits ``l`` (length V) and the token counts
``c`` the penalties see:

0. Logit bias (``SamplerConfig.logit_bias``): ``l[t] = float32(float32(l[t])
   + float32(bias))`` for each entry, in float32 as the kernels add it, in
   the target and the draft rows alike (the drafts are sampled with it, so
   q stays the distribution a draft was drawn from).
1. Penalties on the (biased) logits, for every token with ``c[t] > 0``:
   ``l = l / repetition if l > 0 else l * repetition``, then
   ``l = l - (frequency * c[t] + presence)``.
2. Temperature: ``z = l / temperature``. Temperature 0 is greedy: the
   distribution is a point mass on the argmax of the penalised logits (ties go
   to the lowest index); top-k, top-p and min-p do not apply.
3. Order the tokens by ``z`` descending, ties lowest index first. The kept set
   is the prefix of that order of length ``m = min(m_k, m_p, m_min)``, where
   with ``e = exp(z - max(z))``:

   * ``m_k = top_k`` if ``0 < top_k < V`` else ``V`` (top-k);
   * ``m_p``: the smallest ``n <= m_k`` whose first ``n`` values of ``e`` sum
     to at least ``top_p`` times the sum of the first ``m_k`` (top-p on the
     top-k-renormalised distribution; off when ``top_p >= 1``);
   * ``m_min``: the number of tokens with ``e >= min_p`` (min-p: probability
     at least ``min_p`` times the largest; off when ``min_p <= 0``).

4. Renormalise: ``p[t] = e[t] / sum(e[kept])`` on the kept set, 0 elsewhere.

Sampling is by inverse CDF in vocabulary order: with ``C = cumsum(w)`` the
token is the smallest ``t`` with ``C[t] > u * C[-1]``; if rounding leaves no
such ``t``, the last token of positive weight. A zero-weight token is never
drawn, even with ``u == 0``.

Verification of a draft ``d`` drawn from ``q`` against the target ``p``
(Leviathan et al. / Chen et al. speculative sampling): accept when
``u_accept * q[d] < p[d]`` (probability ``min(1, p[d] / q[d])``; with
``q[d] == 0`` that is "accept when ``p[d] > 0``"). On rejection the token is
drawn with ``u_resample`` from ``normalise(max(p - q, 0))``; if that residual
has no mass (``p == q`` up to rounding, where rejection has probability 0),
from ``p``.

Penalty counts: ``token_counts`` holds how often each token occurs in the text
the penalties see; the decode loop counts the generated tokens (not the
prompt), for all three penalties. Positions inside one MTP cycle are exact:
the draft position's distribution counts ``x0`` once more, the bonus
position's counts ``x0`` and the draft. On the device the counts travel as a
[B, V] int32 array and the primitives add ``x0`` / the draft themselves.

Penalty counts are clipped: a negative count acts as 0, and a count plus the
occurrences inside the cycle saturates at ``2**31 - 1`` (the device counts
are int32; wider counts are clipped into that range before they travel), so
a huge count stays penalised instead of wrapping negative.

Depth-K chains (``verify_greedy_chain`` / ``verify_sampled_chain``): one
verification forward of ``[x0, d_1..d_K]`` (K = 1..8) checks K chained
drafts. Greedy: with ``a_j`` the argmax of verification row ``j``, draft
``d_i`` is accepted when ``d_i == a_{i-1}`` and every earlier draft was; with
``n`` accepted drafts the commit is ``d_1..d_n, a_n``. Sampled (standard
multi-draft speculative sampling): position ``i`` has the target ``p_i``
(verification row ``i - 1``) and the draft distribution ``q_i`` (draft row
``i - 1``), both with the counts plus ``x0, d_1..d_{i-1}``. In order, ``d_i``
is accepted when ``u_accept_i * q_i(d_i) < p_i(d_i)``; at the first
rejection the commit ends with a draw from ``normalise(max(p_i - q_i, 0))``
(from ``p_i`` when that has no mass) with ``u_resample``; when all K are
accepted it ends with a bonus drawn from ``p_{K+1}`` (row ``K``, counts plus
``x0, d_1..d_K``) with ``u_bonus``. A draft outside ``[0, V)`` or a draft row
that is unusable (NaN head) is rejected and the token drawn from ``p_i``
(acceptance probability 0 keeps the rule exact). The row is invalid (``n =
-1``) only when ``x0`` lies outside ``[0, V)`` or a verification row the
chain needs (rows ``0..n``) is unusable. `greedy_chain_row` and
`sample_mtp_chain_row` are the references.

Numbers: the device takes sampler parameters and uniforms as float32; the
reference rounds parameters to float32 too, so both use the same values.
Every float parameter must be 0 or, rounded to float32, a normal number
(magnitude 1.1754944e-38 to 3.4028235e+38; `check_field`): past that range a
value would round to Inf or 0 (or a subnormal, which Metal flushes) and
silently mean something else, so SamplerConfig rejects it.
Uniforms are clamped to [0, 1): a value of 1 or more acts as the largest
double below 1, NaN or a negative value as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mtplx_ext.sampling.config import SamplerConfig

_ONE_BELOW = float(np.nextafter(1.0, 0.0))


def _f32(x: float) -> float:
    return float(np.float32(x))


def clamp_uniform(u: float) -> float:
    """The uniform the kernels use: [0, 1), with NaN / negative as 0."""
    u = float(u)
    if not u >= 0.0:
        return 0.0
    return min(u, _ONE_BELOW)


def row_is_valid(logits: np.ndarray) -> bool:
    """A row is usable when it holds no NaN or +Inf and some finite value."""
    x = np.asarray(logits, dtype=np.float64)
    return bool(not np.isnan(x).any() and not np.isposinf(x).any() and np.isfinite(x).any())


#: Largest penalty count: counts saturate here (int32 on the device).
MAX_COUNT = 2**31 - 1


def counts_with(
    token_counts: np.ndarray | None, vocab: int, extra: Sequence[int] = ()
) -> np.ndarray:
    """Counts seen by a later position: `token_counts` plus the `extra` tokens.

    Negative counts act as 0 and the sum saturates at `MAX_COUNT`, as on the
    device.
    """
    c = np.zeros(vocab, np.int64) if token_counts is None else np.asarray(token_counts, np.int64).copy()
    c = np.clip(c, 0, MAX_COUNT)
    for t in extra:
        c[int(t)] += 1
    return np.minimum(c, MAX_COUNT)


def biased_logits(logits: np.ndarray, logit_bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """Step 0: the logits in float64 with the bias added in float32 (ids outside [0, V) add nothing)."""
    if not logit_bias:
        return np.asarray(logits, dtype=np.float64).copy()
    x = np.asarray(logits).astype(np.float32)
    for t, v in logit_bias:
        if 0 <= t < x.shape[-1]:
            x[..., t] = x[..., t] + np.float32(v)
    return x.astype(np.float64)


def penalised_logits(logits: np.ndarray, sampler: SamplerConfig, token_counts: np.ndarray | None) -> np.ndarray:
    """Steps 0 and 1: the logits in float64 with the bias and the penalties applied."""
    l = biased_logits(logits, sampler.logit_bias)
    if token_counts is None:
        return l
    c = np.asarray(token_counts, dtype=np.int64)
    seen = c > 0
    rep = _f32(sampler.repetition_penalty)
    ls = l[seen]
    ls = np.where(ls > 0, ls / rep, ls * rep)
    ls = ls - (_f32(sampler.frequency_penalty) * c[seen].astype(np.float64) + _f32(sampler.presence_penalty))
    l[seen] = ls
    return l


@dataclass
class RowTransform:
    """Intermediate values of the transform of one row (for tests and tools).

    Attributes:
        z: penalised, temperature-scaled logits (penalised logits if greedy).
        order: token ids by z descending, ties lowest index first.
        e: exp(z - max z) in `order` (None if greedy).
        m_k, m_p, m_min, m: prefix lengths of the kept set (step 3).
        kept: the kept token ids, in `order`.
        p: the final distribution over the vocabulary.
    """

    z: np.ndarray
    order: np.ndarray
    e: np.ndarray | None
    m_k: int
    m_p: int
    m_min: int
    m: int
    kept: np.ndarray
    p: np.ndarray


def transform_row(
    logits: np.ndarray, sampler: SamplerConfig, token_counts: np.ndarray | None = None
) -> RowTransform:
    """Runs the documented transform on one valid row, keeping every step."""
    V = int(np.asarray(logits).shape[-1])
    l = penalised_logits(logits, sampler, token_counts)
    idx = np.arange(V)
    if sampler.greedy:
        order = np.lexsort((idx, -l))
        p = np.zeros(V)
        p[order[0]] = 1.0
        return RowTransform(l, order, None, 1, 1, 1, 1, order[:1], p)
    z = l / _f32(sampler.temperature)
    order = np.lexsort((idx, -z))
    e = np.exp(z[order] - z[order[0]])
    k = int(sampler.top_k)
    m_k = k if 0 < k < V else V
    m_p = m_k
    top_p = _f32(sampler.top_p)
    if top_p < 1.0:
        head = e[:m_k]
        cum = np.cumsum(head)
        hit = np.nonzero(cum >= top_p * head.sum())[0]
        if hit.size:
            m_p = int(hit[0]) + 1
    min_p = _f32(sampler.min_p)
    m_min = int(np.count_nonzero(e >= min_p)) if min_p > 0 else V
    m = max(1, min(m_k, m_p, m_min))
    kept = order[:m]
    p = np.zeros(V)
    p[kept] = e[:m] / e[:m].sum()
    return RowTransform(z, order, e, m_k, m_p, m_min, m, kept, p)


def distribution_from_logits(
    logits: np.ndarray, sampler: SamplerConfig, token_counts: np.ndarray | None = None
) -> np.ndarray:
    """The sampling distribution of one row of logits, in float64.

    Args:
        logits: [V] logits (any float dtype; widened exactly to float64).
        sampler: the sampler settings.
        token_counts: [V] counts the penalties see, or None for no history.

    Returns:
        [V] float64 probabilities, zero outside the kept set.

    Raises:
        ValueError: the row holds NaN or +Inf, or no finite logit.
    """
    if not row_is_valid(logits):
        raise ValueError("logits row holds NaN or +Inf, or no finite value")
    return transform_row(logits, sampler, token_counts).p


def sample_from(w: np.ndarray, u: float) -> int:
    """Inverse-CDF draw in vocabulary order from weights `w` (need not sum to 1)."""
    c = np.cumsum(np.asarray(w, dtype=np.float64))
    t = int(np.searchsorted(c, clamp_uniform(u) * c[-1], side="right"))
    if t >= c.size:
        t = int(np.nonzero(np.asarray(w) > 0)[0][-1])
    return t


def verify_one_token(
    p: np.ndarray, q: np.ndarray, draft: int, u_accept: float, u_resample: float
) -> tuple[bool, int]:
    """Speculative-sampling decision for one draft token.

    Args:
        p: [V] target distribution at the draft's position.
        q: [V] distribution the draft was drawn from.
        draft: the drafted token id.
        u_accept: uniform for the accept test.
        u_resample: uniform for the residual draw on rejection.

    Returns:
        (accepted, token): token is the draft when accepted, else a draw from
        normalise(max(p - q, 0)) (from p when that residual has no mass).
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if clamp_uniform(u_accept) * q[draft] < p[draft]:
        return True, int(draft)
    r = np.maximum(p - q, 0.0)
    if r.sum() > 0:
        return False, sample_from(r, u_resample)
    return False, sample_from(p, u_resample)


@dataclass(frozen=True)
class RowCycle:
    """Result of one sampled MTP cycle of one stream.

    Attributes:
        accepted: whether the draft was accepted.
        second_token: the committed token after x0 (the draft or the residual
            draw).
        bonus: the token sampled at the draft's position when accepted, else
            None (or when the bonus is omitted).
    """

    accepted: bool
    second_token: int
    bonus: int | None


def sample_mtp_row_cycle(
    verify_logits: np.ndarray,
    draft_logits: np.ndarray,
    x0: int,
    draft: int,
    sampler: SamplerConfig,
    uniforms: Sequence[float],
    token_counts: np.ndarray | None = None,
    omit_bonus: bool = False,
) -> RowCycle:
    """One stream's sampled verification, the reference for `verify_sampled`.

    Args:
        verify_logits: [2, V] logits of the verification forward at x0's and
            the draft's positions.
        draft_logits: [V] logits the draft was drawn from (MTP head).
        x0: the committed primary token.
        draft: the drafted token.
        sampler: sampler settings of this stream (target and draft alike).
        uniforms: (u_accept, u_resample, u_bonus).
        token_counts: [V] counts before x0, or None.
        omit_bonus: skip the bonus draw.

    Returns:
        The cycle's decision.
    """
    V = int(np.asarray(draft_logits).shape[-1])
    c1 = counts_with(token_counts, V, (x0,))
    p = distribution_from_logits(verify_logits[0], sampler, c1)
    q = distribution_from_logits(draft_logits, sampler, c1)
    accepted, second = verify_one_token(p, q, draft, uniforms[0], uniforms[1])
    bonus = None
    if accepted and not omit_bonus:
        p1 = distribution_from_logits(verify_logits[1], sampler, counts_with(token_counts, V, (x0, draft)))
        bonus = sample_from(p1, uniforms[2])
    return RowCycle(accepted, second, bonus)


def greedy_chain_row(verify_logits: np.ndarray, tokens: Sequence[int]) -> tuple[int, list[int]]:
    """One stream's greedy depth-K chain, the reference for `verify_greedy_chain`.

    Args:
        verify_logits: [K + 1, V] logits of the verification forward at the
            positions of x0, d_1..d_K.
        tokens: (x0, d_1..d_K).

    Returns:
        (n, committed): n accepted drafts and the n + 1 committed tokens
        d_1..d_n, argmax(row n); (-1, []) when x0 is outside [0, V) or a
        needed row (0..n) is unusable.
    """
    lg = np.asarray(verify_logits, dtype=np.float64)
    K, V = lg.shape[0] - 1, lg.shape[1]
    if not 0 <= int(tokens[0]) < V:
        return -1, []
    committed: list[int] = []
    for j in range(K + 1):
        if not row_is_valid(lg[j]):
            return -1, []
        a = int(np.argmax(lg[j]))  # first maximum, as the kernels
        if j == K or int(tokens[j + 1]) != a:
            return j, committed + [a]
        committed.append(a)
    raise AssertionError("unreachable")


def sample_mtp_chain_row(
    verify_logits: np.ndarray,
    draft_logits: np.ndarray,
    tokens: Sequence[int],
    sampler: SamplerConfig,
    uniforms: Sequence[float],
    token_counts: np.ndarray | None = None,
) -> tuple[int, list[int]]:
    """One stream's sampled depth-K chain, the reference for `verify_sampled_chain`.

    Args:
        verify_logits: [K + 1, V] logits of the verification forward at the
            positions of x0, d_1..d_K.
        draft_logits: [K, V] logits each draft was drawn from (row i - 1 for
            d_i).
        tokens: (x0, d_1..d_K).
        sampler: sampler settings of this stream (target and drafts alike).
        uniforms: (u_accept_1..u_accept_K, u_resample, u_bonus).
        token_counts: [V] counts before x0, or None.

    Returns:
        (n, committed): n accepted drafts and the n + 1 committed tokens;
        (-1, []) when x0 is outside [0, V) or a needed verification row is
        unusable.
    """
    vl = np.asarray(verify_logits)
    K, V = vl.shape[0] - 1, vl.shape[1]
    toks = [int(t) for t in tokens]
    if not 0 <= toks[0] < V:
        return -1, []
    committed: list[int] = []
    for i in range(1, K + 1):
        counts = counts_with(token_counts, V, toks[:i])
        if not row_is_valid(vl[i - 1]):
            return -1, []
        p = distribution_from_logits(vl[i - 1], sampler, counts)
        d = toks[i]
        if not (0 <= d < V and row_is_valid(draft_logits[i - 1])):
            # A bad proposal: rejected, the token drawn from p.
            return i - 1, committed + [sample_from(p, uniforms[K])]
        q = distribution_from_logits(draft_logits[i - 1], sampler, counts)
        accepted, token = verify_one_token(p, q, d, uniforms[i - 1], uniforms[K])
        committed.append(token)
        if not accepted:
            return i - 1, committed
    if not row_is_valid(vl[K]):
        return -1, []
    p = distribution_from_logits(vl[K], sampler, counts_with(token_counts, V, toks))
    return K, committed + [sample_from(p, uniforms[K + 1])]
