"""Gemma 4 assistant drafting is lossless: a random pair built with transformers.

The pair leans towards repeating tokens (`_gemma4.make_pair(repeat=...)`), so
decodes accept some drafts and reject others. Greedy MTP decoding (depths
1-3, batches 1, 3 and 8, prompts longer than the sliding window, compiled
and eager, per-stream commit and uniform repair) equals mlx-lm's greedy
decoding of the target alone (which keeps its sliding layers in a rotating
cache); so do greedy requests through the continuous-batching engine.
Sampled depth-2 decoding gives the target's joint distribution of its first
three tokens (G-test), and the same test rejects drafts verified against
another q than the distribution they were sampled from.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _engine import drive
from _gemma4 import WINDOW, make_pair
from _greedy import check_stream, reference
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.sampling import counts_with, distribution_from_logits
import _seed

N_NEW = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_pair")
    t, a = make_pair(folder, int(_seed.rng().integers(1 << 30)), repeat=0.25)
    return mtplx_ext.load(t, drafter=a)


@pytest.fixture(scope="module")
def refs(pair):
    """mlx-lm's greedy decoding of 8 prompts longer than the window, by prompt."""
    rng = _seed.rng()
    prompts = [rng.integers(0, pair.vocab_size, size=int(rng.integers(WINDOW + 1, 4 * WINDOW))).tolist() for _ in range(8)]
    return [(p, *reference(pair, p, N_NEW)) for p in prompts]


@pytest.mark.parametrize(
    "depth,batch,eager,mode",
    [(1, 1, False, "repair"), (2, 3, False, "repair"), (3, 8, False, "repair"), (3, 3, True, "repair"),
     (2, 3, True, "reforward")],
)
def test_greedy_mtp_equals_mlx_lm_decoding_of_the_target_alone(pair, refs, depth, batch, eager, mode):
    rows = refs[:batch]
    r = mtplx_ext.generate_greedy_batched(
        pair, [p for p, _, _ in rows], max_new_tokens=N_NEW, depth=depth, enforce_eager=eager, reject_mode=mode
    )
    for i, (s, (_, ref, gaps)) in enumerate(zip(r.streams, rows)):
        check_stream(i, s, ref, gaps, set(), N_NEW)
    # A cycle commits at least one token per live row, so the batch ends within N_NEW cycles (that
    # drafts get accepted is the next test's: a random pair's single stream may accept none here).
    assert r.cycles <= N_NEW and r.forwards < r.cycles * 2  # one verification per cycle


def test_the_pair_accepts_some_drafts_and_rejects_others(pair, refs):
    r = mtplx_ext.generate_greedy_batched(pair, [p for p, _, _ in refs], max_new_tokens=N_NEW, depth=3)
    assert 0.05 < r.acceptance_rate < 0.95, f"acceptance {r.acceptance_rate}: both paths must be exercised"


def test_greedy_requests_through_the_engine_equal_their_alone_decoding(pair, refs, rng):
    eng = Engine(pair, max_batch=3, depth=2, prefill_chunk=8)
    arrivals = [(int(rng.integers(0, 12)), dict(prompt=p, max_tokens=N_NEW)) for p, _, _ in refs[:5]]
    reqs = drive(eng, arrivals)
    for i, (r, (_, ref, gaps)) in enumerate(zip(reqs, refs)):
        assert r.error is None
        check_stream(i, r, ref, gaps, set(), N_NEW)
    assert eng.metrics()["mean_accepted_length"] > 0


def _chain_joint(rt, prompt: list[int], cfg: SamplerConfig, n: int) -> np.ndarray:
    """P(t_1..t_n) from full forwards of the target, float64, flat [V**n]."""
    V = rt.vocab_size
    joint, prefixes = np.ones(1), [[]]
    for _ in range(n):
        rows = np.array(rt.trunk(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32), np.float64)
        step = np.stack([distribution_from_logits(rows[i], cfg, counts_with(None, V, p)) for i, p in enumerate(prefixes)])
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return joint


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_small")
    t, a = make_pair(folder, int(_seed.rng().integers(1 << 30)), vocab=8, repeat=0.5)
    return mtplx_ext.load(t, drafter=a)


def _first_three(rt, rng):
    cfg = SamplerConfig(temperature=1.5, top_p=0.97)
    prompt = rng.integers(0, 8, size=int(rng.integers(WINDOW + 1, 2 * WINDOW))).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(6000)).tolist()
    res = mtplx_ext.generate_batched(rt, [prompt] * len(seeds), max_new_tokens=3, sampler=cfg, row_seeds=seeds, depth=2)
    seqs = np.array([s.tokens for s in res.streams])
    idx = np.ravel_multi_index(tuple(seqs.T), (8,) * 3)
    return res, g_test_pvalue(np.bincount(idx, minlength=8**3), _chain_joint(rt, prompt, cfg, 3))


def test_depth_2_sampling_gives_the_targets_joint_distribution_of_the_first_three_tokens(small_pair, rng):
    res, p = _first_three(small_pair, rng)
    assert res.reached[1] > 0, "no cycle reached the second draft"
    assert p >= ALPHA_EXACT, f"sampled decoding off the target's distribution: p = {p:.2e}"


def test_the_sampled_test_rejects_verification_against_another_q_than_the_drafts_were_sampled_from(
    small_pair, rng, monkeypatch
):
    import mtplx_ext.decode.policies as policies

    real = policies.SampledPolicy.draft

    def uniform_q(self, logits, *a, **k):  # drafts sampled from the assistant, verified as if from its mirror image
        d, _ = real(self, logits, *a, **k)
        return d, -logits

    monkeypatch.setattr(policies.SampledPolicy, "draft", uniform_q)
    _, p = _first_three(small_pair, rng)
    assert p < ALPHA_BROKEN


def test_a_pair_loaded_in_one_thread_decodes_in_another(tmp_path, refs):
    """The serving engine runs on its own thread: every array the pair holds (mlx-lm keeps Gemma 4's full-layer
    RoPE table outside its parameters) must be evaluated at load, or that thread fails on the loader's stream."""
    import threading

    seed = int(_seed.rng().integers(1 << 30))
    t, a = make_pair(tmp_path, seed, repeat=0.25)
    rt = mtplx_ext.load(t, drafter=a)  # loaded here, decoded on the thread below
    prompt = refs[0][0]
    out: dict = {}

    def run() -> None:
        eng = Engine(rt, max_batch=2, depth=2)
        r = eng.submit(prompt, max_tokens=N_NEW)
        eng.run_until_idle()
        out["tokens"], out["error"] = r.tokens, r.error

    th = threading.Thread(target=run)
    th.start()
    th.join(120)
    assert out.get("error") is None and len(out.get("tokens", [])) == N_NEW, out
    want, gaps = reference(rt, prompt, N_NEW)
    assert out["tokens"] == want or min(gaps) < 1e-3
