"""The test-only broken rules (`tests/_broken_rules.py`): their exact baseline is the shipped rule.

Each broken rule is the exact rule with one change; for the statistical
tests' rejections of them to say anything about the kernels, the exact
baseline must commit what the shipped chain kernel commits from the same
inputs and uniforms, and every broken rule must change some commits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.ops.sampled_verify import verify_sampled_chain
from mtplx_ext.sampling import SamplerConfig
from _broken_rules import RULES, sampled_chain

V, N = 12, 3000
CFGS = {
    "plain": SamplerConfig(temperature=0.8),
    "cuts_penalties": SamplerConfig(temperature=1.3, top_k=8, top_p=0.8, presence_penalty=0.5,
                                    frequency_penalty=0.2, repetition_penalty=1.2),
    "bias": SamplerConfig(temperature=1.1, top_p=0.9, logit_bias={1: 2.5, 4: -1.5, 7: 1.0}),
}


def _inputs(rng, K: int):
    vl = (rng.normal(size=(N, K + 1, V)) * 2).astype(np.float32)
    dl = (vl[:, :K] + rng.normal(size=(N, K, V)) * 1.5).astype(np.float32)
    toks = rng.integers(0, V, size=(N, K + 1))
    # Drafts agree with the target's argmax half of the time, so that chains run long.
    agree = rng.random((N, K)) < 0.5
    toks[:, 1:] = np.where(agree, vl[:, :K].argmax(-1), toks[:, 1:])
    u = rng.random((N, K + 2)).astype(np.float32)
    counts = rng.integers(0, 3, size=V).astype(np.int32)
    return vl, dl, toks, u, counts


def _kernel(vl, dl, toks, u, cfg, counts):
    bias = None
    if cfg.logit_bias:
        ids = np.array([[t for t, _ in cfg.logit_bias]] * N, np.int32)
        vals = np.array([[v for _, v in cfg.logit_bias]] * N, np.float32)
        bias = (mx.array(ids), mx.array(vals))
    c = mx.array(np.tile(counts, (N, 1)))
    return np.array(verify_sampled_chain(mx.array(vl), mx.array(dl), mx.array(toks.astype(np.int32)), mx.array(u),
                                         cfg, c, logit_bias=bias, stream=mx.cpu))


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("K", [1, 3])
def test_the_exact_baseline_commits_what_the_chain_kernel_commits(rng, K, name):
    cfg = CFGS[name]
    vl, dl, toks, u, counts = _inputs(rng, K)
    want = _kernel(vl, dl, toks, u, cfg, counts)
    got = sampled_chain(vl, dl, toks, u, cfg, counts)
    same = np.all(got == want, axis=1)
    # float64 both sides: only a uniform within rounding of a CDF step may differ.
    assert same.mean() >= 0.999, (np.nonzero(~same)[0][:5], got[~same][:3], want[~same][:3])


@pytest.mark.parametrize("rule", RULES[1:])
def test_every_broken_rule_changes_some_commits(rng, rule):
    cfg = CFGS["bias"] if rule.startswith("bias") else CFGS["cuts_penalties"]
    vl, dl, toks, u, counts = _inputs(rng, 2)
    exact = sampled_chain(vl, dl, toks, u, cfg, counts)
    broken = sampled_chain(vl, dl, toks, u, cfg, counts, rule=rule)
    assert np.any(np.any(broken != exact, axis=1)), f"{rule} commits exactly what the exact rule commits"


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="rule"):
        sampled_chain(np.zeros((1, 2, 3)), np.zeros((1, 1, 3)), np.zeros((1, 2)), np.zeros((1, 3)),
                      SamplerConfig(temperature=1.0), rule="nope")
