"""The float64 host reference of mtplx_ext.sampling against its documented rules.

Each property is checked against an independent restatement of the rule
(per-token loops, brute-force sorts), on fresh random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from _stats import ALPHA_EXACT

from mtplx_ext.sampling import (
    SamplerConfig,
    clamp_uniform,
    counts_with,
    distribution_from_logits,
    pack_params,
    sample_from,
    sample_mtp_row_cycle,
    transform_row,
    verify_one_token,
)
import _seed


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def _random_config(rng: np.random.Generator, V: int) -> SamplerConfig:
    return SamplerConfig(
        temperature=float(rng.choice([0.3, 0.7, 1.0, 1.8])),
        top_k=int(rng.choice([0, 1, 3, V // 2, V, V + 5])),
        top_p=float(rng.choice([1.0, 0.5, 0.9, rng.uniform(0.05, 1.0)])),
        min_p=float(rng.choice([0.0, 0.02, rng.uniform(0.0, 0.5)])),
        presence_penalty=float(rng.choice([0.0, rng.normal()])),
        frequency_penalty=float(rng.choice([0.0, rng.normal()])),
        repetition_penalty=float(rng.choice([1.0, rng.uniform(0.5, 2.0)])),
    )


def _penalised_by_loop(logits, cfg, counts):
    """Per-token restatement of step 1 (float32-rounded parameters)."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    out = []
    for l, c in zip(np.asarray(logits, np.float64), counts):
        l = float(l)
        if c > 0:
            l = l / f32(cfg.repetition_penalty) if l > 0 else l * f32(cfg.repetition_penalty)
            l = l - (f32(cfg.frequency_penalty) * c + f32(cfg.presence_penalty))
        out.append(l)
    return np.array(out)


def test_distribution_is_normalised_and_zero_outside_the_kept_set(rng):
    for _ in range(200):
        V = int(rng.integers(2, 200))
        cfg = _random_config(rng, V)
        logits = rng.normal(size=V) * rng.uniform(0.1, 5)
        counts = rng.integers(0, 3, size=V) * (rng.random(V) < 0.2)
        t = transform_row(logits, cfg, counts)
        p = distribution_from_logits(logits, cfg, counts)
        assert abs(p.sum() - 1.0) < 1e-12
        outside = np.setdiff1d(np.arange(V), t.kept)
        assert np.all(p[outside] == 0)
        assert np.all(p[t.kept] > 0) or cfg.greedy


def test_kept_set_satisfies_top_k_top_p_and_min_p_by_brute_force(rng):
    for _ in range(300):
        V = int(rng.integers(2, 120))
        cfg = _random_config(rng, V)
        if cfg.greedy:
            continue
        # Few distinct values: plenty of exact ties at every threshold.
        logits = rng.integers(-4, 4, size=V).astype(np.float64) * rng.uniform(0.2, 2)
        counts = rng.integers(0, 2, size=V)
        z = _penalised_by_loop(logits, cfg, counts) / float(np.float32(cfg.temperature))
        # Brute force order: python sort by (-z, index).
        order = sorted(range(V), key=lambda i: (-z[i], i))
        e = np.exp(np.array([z[i] for i in order]) - z[order[0]])
        k = cfg.top_k if 0 < cfg.top_k < V else V
        top_p = float(np.float32(cfg.top_p))
        n_p = k
        if top_p < 1:
            for n in range(1, k + 1):
                if e[:n].sum() >= top_p * e[:k].sum() * (1 - 1e-12):
                    n_p = n
                    break
        min_p = float(np.float32(cfg.min_p))
        n_min = int(np.sum(e >= min_p)) if min_p > 0 else V
        m = max(1, min(k, n_p, n_min))
        t = transform_row(logits, cfg, counts)
        # Allow the top-p cut to differ only where the brute force sum sits
        # within rounding of the target.
        if top_p < 1 and abs(e[: t.m].sum() - top_p * e[:k].sum()) < 1e-9:
            continue
        assert list(t.kept) == order[:m]


def test_top_k_ties_keep_the_lowest_indices(rng):
    V = 50
    for _ in range(50):
        logits = rng.normal(size=V)
        tied = rng.choice(V, size=6, replace=False)
        logits[tied] = logits.max() + 1.0  # six-way tie at the top
        k = int(rng.integers(1, 6))
        t = transform_row(logits, SamplerConfig(top_k=k))
        assert sorted(t.kept) == sorted(np.sort(tied)[:k])


def test_greedy_is_a_point_mass_on_the_first_argmax_of_penalised_logits(rng):
    for _ in range(100):
        V = int(rng.integers(2, 300))
        logits = rng.integers(-3, 3, size=V).astype(np.float64)
        counts = rng.integers(0, 3, size=V)
        cfg = SamplerConfig(temperature=0, presence_penalty=0.7, repetition_penalty=1.3)
        p = distribution_from_logits(logits, cfg, counts)
        want = int(np.argmax(_penalised_by_loop(logits, cfg, counts)))
        assert p[want] == 1.0 and p.sum() == 1.0


def test_penalties_match_a_per_token_loop(rng):
    for _ in range(50):
        V = 64
        cfg = SamplerConfig(
            temperature=0.9,
            presence_penalty=float(rng.normal()),
            frequency_penalty=float(rng.normal()),
            repetition_penalty=float(rng.uniform(0.5, 2)),
        )
        logits = rng.normal(size=V) * 3
        counts = rng.integers(0, 4, size=V)
        z = _penalised_by_loop(logits, cfg, counts) / float(np.float32(0.9))
        want = np.exp(z - z.max())
        np.testing.assert_allclose(distribution_from_logits(logits, cfg, counts), want / want.sum(), rtol=1e-12)


def test_counts_with_adds_each_extra_token_once(rng):
    V = 20
    base = rng.integers(0, 3, size=V)
    extra = rng.integers(0, V, size=2)
    c = counts_with(base, V, extra)
    want = base.copy()
    for t in extra:
        want[t] += 1
    assert np.array_equal(c, want)


def test_inverse_cdf_never_draws_a_zero_weight_token(rng):
    for _ in range(200):
        V = int(rng.integers(2, 50))
        w = rng.random(V) * (rng.random(V) < 0.5)
        w[rng.integers(V)] += 0.1
        for u in (0.0, float(np.nextafter(1.0, 0.0)), 1.0, float(rng.random())):
            assert w[sample_from(w, u)] > 0


def test_inverse_cdf_follows_vocabulary_order(rng):
    V = 10
    w = rng.random(V) + 0.01
    c = np.cumsum(w) / w.sum()
    for _ in range(100):
        u = float(rng.random())
        t = sample_from(w, u)
        lo = c[t - 1] if t else 0.0
        assert lo <= u < c[t] + 1e-15


def test_clamp_uniform_maps_bad_values_into_unit_interval():
    assert clamp_uniform(float("nan")) == 0.0
    assert clamp_uniform(-0.5) == 0.0
    assert 0 < clamp_uniform(1.0) < 1.0
    assert clamp_uniform(7.0) == clamp_uniform(1.0)


def test_verify_accepts_when_draft_has_zero_draft_probability_but_positive_target(rng):
    V = 8
    p = rng.random(V)
    p /= p.sum()
    q = rng.random(V)
    d = int(rng.integers(V))
    q[d] = 0.0
    q /= q.sum()
    for u in (0.0, 0.5, float(np.nextafter(1.0, 0.0))):
        assert verify_one_token(p, q, d, u, 0.3) == (True, d)


def test_verify_rejects_zero_target_probability_even_with_uniform_zero(rng):
    V = 8
    p = rng.random(V)
    d = int(rng.integers(V))
    p[d] = 0.0
    p /= p.sum()
    q = rng.random(V)
    q /= q.sum()
    accepted, tok = verify_one_token(p, q, d, 0.0, float(rng.random()))
    assert not accepted and p[tok] > 0 and p[tok] > q[tok]


def test_verify_with_zero_residual_mass_falls_back_to_target(rng):
    V = 8
    p = rng.random(V)
    d = int(rng.integers(V))
    p[d] = 0.0  # the draft lies outside both supports and p == q
    p /= p.sum()
    for _ in range(20):
        u = float(rng.random())
        accepted, tok = verify_one_token(p, p.copy(), d, 0.0, u)
        assert not accepted and tok == sample_from(p, u)


def test_verify_equal_distributions_always_accept(rng):
    V = 16
    p = rng.random(V)
    p /= p.sum()
    for _ in range(100):
        d = int(rng.choice(V, p=p))
        assert verify_one_token(p, p, d, float(rng.random()), 0.5)[0]


def test_verify_one_token_output_follows_target_exactly(rng):
    # Integrate the accept test over u in closed form per draft and compare
    # with the simulated rule: the committed token must be distributed as p.
    V = 6
    p = rng.random(V) * (rng.random(V) < 0.8)
    p[0] += 0.1
    p /= p.sum()
    q = rng.random(V) * (rng.random(V) < 0.8)
    q[1] += 0.1
    q /= q.sum()
    n = 40000
    drafts = rng.choice(V, size=n, p=q)
    ua, ur = rng.random(n), rng.random(n)
    out = np.array([verify_one_token(p, q, int(d), a, r)[1] for d, a, r in zip(drafts, ua, ur)])
    obs = np.bincount(out, minlength=V)
    assert np.all(obs[p == 0] == 0)
    from scipy.stats import chisquare

    keep = p > 0
    assert chisquare(obs[keep], n * p[keep]).pvalue > ALPHA_EXACT


def test_row_cycle_bonus_uses_counts_with_x0_and_draft(rng):
    V = 30
    cfg = SamplerConfig(temperature=1.0, frequency_penalty=50.0)
    for _ in range(30):
        vl = rng.normal(size=(2, V))
        dl = vl[0] + 0.0  # q == p: always accepted
        x0 = int(rng.integers(V))
        d = int(sample_from(distribution_from_logits(dl, cfg, counts_with(None, V, [x0])), rng.random()))
        cyc = sample_mtp_row_cycle(vl, dl, x0, d, cfg, rng.random(3))
        assert cyc.accepted and cyc.second_token == d
        # A frequency penalty of 50 makes x0 and the draft all but impossible.
        assert cyc.bonus not in (x0, d)


def test_sampler_config_rejects_bad_values_naming_the_field():
    for field, bad in [
        ("temperature", -1.0),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", float("nan")),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplerConfig(**{field: bad})


def test_pack_params_rejects_wrong_length_and_types():
    with pytest.raises(ValueError, match="batch"):
        pack_params([SamplerConfig()] * 2, 3)
    with pytest.raises(TypeError, match=r"sampler\[1\]"):
        pack_params([SamplerConfig(), object()], 2)
