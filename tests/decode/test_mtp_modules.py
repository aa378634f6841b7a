"""Checkpoints with several MTP modules: draft i from module (i - 1) % M at sequential depth i - 1.

The cached, per-stream drafter (`engine.drafter.ModuleChain`) must draft
exactly what the modules compute when run over each stream's whole
committed sequence without caches, as DeepSeek-style sequential MTP modules
are trained: depth j at position t combines depth j - 1's output at t with
the token at t + 1 + j (the cycle's own drafts past the committed tokens).
Checked on the drafts' logits of a sampled policy, cycle by cycle, for
per-stream commit and uniform repair, ragged prompts down to one token; two
broken drafters (module 0 at every depth, a carry never updated) must fail
the same comparison. Decoding stays lossless (mlx-lm's greedy decoding, the
Engine, seeded sampling alone == in a batch), depth 1 is the first module
alone, and folders save and load every module.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from _greedy import _prompts, _rng, check_stream, reference

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.decode import bundle as chain
from mtplx_ext.decode import drafter as drafter_mod
from mtplx_ext.decode.cycle import Cycle
from mtplx_ext.decode.policies import SampledPolicy
from mtplx_ext.batching import Engine

#: Trunk families of every head layout (qwen3, qwen3_5: qwen3_next; deepseek_v3, glm4_moe: deepseek; mimo).
FAMILIES = ["qwen3", "deepseek_v3", "glm4_moe", "mimo", "qwen3_5"]
#: A small vocabulary and hot sampling: drafts are accepted often enough
#: that every accepted length occurs.
VOCAB = 12


def _multi(family: str, rng: np.random.Generator, modules: int = 2, **kw):
    rt = mtplx_ext.init_random(
        family, seed=int(rng.integers(1 << 30)), num_nextn_predict_layers=modules, mtp_num_hidden_layers=modules, **kw
    )
    assert len(rt.mtp_modules) == modules
    return rt


def _reference_draft_logits(rt, seq: list[int], drafts: list[int], depth: int) -> list[np.ndarray]:
    """Each draft's head logits from the modules over the whole sequence, no caches.

    seq: committed tokens x_0..x_P (x_P: the cycle's x0); drafts: d_1..d_K.
    """
    M = len(rt.mtp_modules)
    P = len(seq) - 1
    _, prev = rt.forward(mx.array([seq[:-1]]))  # trunk hidden at t = 0..P-1
    ext = seq + drafts[: depth - 1]
    out = []
    for j in range(depth):
        tokens = mx.array([ext[1 + j : 1 + j + P]])  # the token at t + 1 + j
        prev, normed = rt.head_states(prev, tokens, None, j % M)
        out.append(np.array(rt.head_logits(normed[:, -1:], j % M)[0, 0], dtype=np.float64))
    return out


def _drive_and_compare(rt, rng, depth: int, uniform: bool, cycles: int = 10) -> tuple[float, set[int]]:
    """Runs cycles by hand; returns the worst draft-logit error and the accepted lengths seen."""
    B = 3
    prompts = _prompts(rng, rt.vocab_size, B, max_len=9)
    W = max(map(len, prompts))
    pads = [W - len(p) for p in prompts]
    padded = mx.array([[0] * pad + p for pad, p in zip(pads, prompts)], dtype=mx.int32)
    # Hot sampling, hotter for uniform repair: there every stream must accept for the batch to commit a draft.
    temperature = 30.0 if uniform else 4.0
    policy = SampledPolicy([SamplerConfig(temperature=temperature)] * B, row_seeds=rng.integers(0, 2**62, B).tolist())
    kw = {} if uniform else {"ragged": True}
    cache = rt.make_cache(pads, **kw)
    head = rt.make_head_cache(pads, **kw, depth=depth)
    cyc = Cycle(rt, policy, cache, head, depth, per_stream=not uniform)
    tokens, info = cyc.prefill(padded)
    seqs = [list(p) for p in prompts]
    worst, seen = 0.0, set()
    for step in range(1, cycles + 1):
        tk, q = np.array(tokens), np.array(info, dtype=np.float64)
        for b in range(B):
            ref = _reference_draft_logits(rt, seqs[b] + [int(tk[b, 0])], [int(x) for x in tk[b, 1:]], depth)
            for j in range(depth):
                worst = max(worst, float(np.max(np.abs(q[b, j] - ref[j]))))
        p = cyc.verify(tokens, info, step)
        bundle = np.array(p.bundle)
        n = bundle[:, chain.COL_N]
        c = np.array(chain.committed_tokens(p.bundle))
        if uniform:
            r = int(n.min())
            tokens, info = cyc.commit_all(p, step + 1) if r == depth else cyc.repair(p, r, step + 1)
            n = np.full(B, r)
        else:
            tokens, info = cyc.commit_per_stream(p, step + 1)
        seen.update(n.tolist())
        for b in range(B):
            seqs[b] += [int(tk[b, 0])] + [int(x) for x in c[b, : n[b]]]
    return worst, seen


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "mimo"])
@pytest.mark.parametrize("uniform", [False, True], ids=["per-stream", "uniform-repair"])
def test_each_cycles_drafts_equal_the_modules_run_over_the_whole_committed_sequence(family, uniform):
    rng = _rng()
    rt = _multi(family, rng, vocab_size=VOCAB)
    worst, seen = _drive_and_compare(rt, rng, depth=3, uniform=uniform)  # depth 3 > 2 modules: module 0 again
    assert worst < 1e-4, worst
    assert len(seen) >= 2, seen  # commits of different lengths happened


def _module_0_everywhere(self, j, hidden, tokens):
    return self.rt.head_states(hidden, drafter_mod.model_tokens(tokens), self.kv[j], 0)


def _stale_carry(self, j, like):
    return mx.zeros_like(like[:, :1])


@pytest.mark.parametrize(
    "name,broken",
    [("_run", _module_0_everywhere), ("_carry", _stale_carry)],
    ids=["module-0-at-every-depth", "carry-never-updated"],
)
def test_the_recomputation_check_rejects_broken_drafters(name, broken, monkeypatch):
    rng = _rng()
    rt = _multi("deepseek_v3", rng, vocab_size=VOCAB)
    monkeypatch.setattr(drafter_mod.ModuleChain, name, broken)
    worst, _ = _drive_and_compare(rt, rng, depth=3, uniform=False, cycles=4)
    assert worst > 1e-2, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stream_equals_mlx_lm_greedy_decoding_with_two_modules(family):
    rng = _rng()
    rt = _multi(family, rng, vocab_size=VOCAB)
    prompts = _prompts(rng, rt.vocab_size, 3, max_len=10)
    cap = int(rng.integers(8, 16))
    refs = [reference(rt, p, cap) for p in prompts]
    for depth in (1, 2, 3):
        for reject_mode in ("repair", "reforward"):
            r = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=cap, depth=depth, reject_mode=reject_mode)
            for i, s in enumerate(r.streams):
                check_stream(i, s, *refs[i], set(), cap)
            if reject_mode == "repair":
                assert r.repair_cycles == 0


def test_compiled_equals_eager_and_a_batch_equals_each_prompt_alone_when_sampling():
    rng = _rng()
    rt = _multi("qwen3", rng, modules=3, vocab_size=VOCAB)
    prompts = _prompts(rng, rt.vocab_size, 3, max_len=10)
    seeds = rng.integers(0, 2**62, 3).tolist()
    cfg = SamplerConfig(temperature=2.0)
    runs = {
        eager: mtplx_ext.generate_batched(
            rt, prompts, max_new_tokens=14, sampler=cfg, row_seeds=seeds, depth=3, enforce_eager=eager
        )
        for eager in (False, True)
    }
    batched = [s.tokens for s in runs[False].streams]
    assert batched == [s.tokens for s in runs[True].streams]
    assert runs[False].accepted > 0
    alone = [
        mtplx_ext.generate_batched(rt, [p], max_new_tokens=14, sampler=cfg, row_seeds=[s], depth=3).streams[0].tokens
        for p, s in zip(prompts, seeds)
    ]
    assert batched == alone


def test_depth_1_uses_the_first_module_alone():
    from mtplx_ext.models.runtime import MTPRuntime

    rng = _rng()
    rt = _multi("deepseek_v3", rng, vocab_size=VOCAB)
    first_only = MTPRuntime(rt.trunk, rt.head, rt.config)
    prompts = _prompts(rng, rt.vocab_size, 3, max_len=10)
    seeds = rng.integers(0, 2**62, 3).tolist()
    cfg = SamplerConfig(temperature=2.0)
    a, b = (
        mtplx_ext.generate_batched(m, prompts, max_new_tokens=12, sampler=cfg, row_seeds=seeds, depth=1)
        for m in (rt, first_only)
    )
    assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]


def test_the_engine_serves_several_modules_as_decoding_alone():
    rng = _rng()
    rt = _multi("qwen3_5", rng, vocab_size=VOCAB)
    prompts = _prompts(rng, rt.vocab_size, 5, max_len=10)
    cfg = SamplerConfig(temperature=2.0)
    seeds = rng.integers(0, 2**62, 5).tolist()
    alone = [
        mtplx_ext.generate_batched(rt, [p], max_new_tokens=12, sampler=cfg, row_seeds=[s], depth=2).streams[0].tokens
        for p, s in zip(prompts, seeds)
    ]
    eng = Engine(rt, max_batch=3, depth=2)
    reqs = [eng.submit(p, max_tokens=12, sampler=cfg, seed=s) for p, s in zip(prompts, seeds)]
    eng.run_until_idle()
    assert [r.tokens for r in reqs] == alone
    assert eng.metrics()["mean_accepted_length"] > 0


def test_head_caches_hold_one_cache_per_depth_shifted_by_its_depth_and_the_carries():
    from mlx_lm.models.cache import ArraysCache

    from mtplx_ext.cache.ragged import RaggedKVCache

    rt = _multi("qwen3", _rng(), modules=2)
    hc = rt.make_head_cache([2, 0], ragged=True, capacity=32, depth=3)
    kv, carries = hc[:3], hc[3:]
    assert all(isinstance(c, RaggedKVCache) for c in kv) and len(carries) == 2
    assert all(isinstance(c, ArraysCache) and c.cache == [None] for c in carries)
    assert [np.array(c.positions.left_padding).tolist() for c in kv] == [[2, 0], [3, 1], [4, 2]]
    assert len({id(c.positions) for c in kv}) == 3  # each depth moves on its own
    with pytest.raises(ValueError, match="depth"):
        rt.make_head_cache([0], depth=0)
    with pytest.raises(ValueError, match="module"):
        rt.head_forward(mx.zeros((1, 1, rt.trunk.args.hidden_size)), mx.zeros((1, 1), mx.int32), module=2)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "mimo"])
def test_a_saved_folder_keeps_every_module(tmp_path, family):
    rng = _rng()
    rt = _multi(family, rng, modules=3)
    rt.save(tmp_path)
    back = mtplx_ext.load(tmp_path, fuse_cpu_ops=False)
    assert len(back.mtp_modules) == 3
    x = mx.array(rng.integers(0, rt.vocab_size, (2, 6)))
    _, h = rt.forward(x)
    for i in range(3):
        assert mx.array_equal(rt.head_forward(h, x, module=i), back.head_forward(h, x, module=i)).item()
    assert not mx.array_equal(rt.head_forward(h, x, module=0), rt.head_forward(h, x, module=1)).item()


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "mimo"])
def test_a_checkpoint_missing_a_middle_mtp_layer_is_refused_naming_it(family):
    from mtplx_ext import models
    from mtplx_ext.checkpoints import build_runtime, head_checkpoint_weights

    rt = _multi(family, _rng(), modules=3)
    weights = dict(tree_flatten(rt.trunk.parameters())) | head_checkpoint_weights(rt)
    gone = models.layout_module(rt.head_layout).layer_prefix(rt.config, 1)
    weights = {k: v for k, v in weights.items() if not k.startswith(gone)}
    with pytest.raises(mtplx_ext.CheckpointError, match="MTP layer 2 .* layer 1 is missing"):
        build_runtime(rt.config, weights)
