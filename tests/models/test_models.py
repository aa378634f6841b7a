"""MTPRuntime: forward against mlx-lm, head hidden source, head caches, bad input."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
import _seed

# (trunk family, head layout) pairs; each layout at least once on its own family.
CASES = [
    ("qwen3", "qwen3_next"),
    ("qwen3_next", "qwen3_next"),
    ("qwen3_5", "qwen3_next"),
    ("deepseek_v3", "deepseek"),
    ("glm4_moe", "deepseek"),
    ("mimo", "mimo"),
]
IDS = [f"{f}-{h}" for f, h in CASES]


@pytest.fixture(scope="module")
def seed() -> int:
    s = _seed.fresh()
    print(f"random seed {s}")
    return s


@pytest.fixture(scope="module")
def runtimes(seed):
    return {case: mtplx_ext.init_random(case[0], seed=seed, head_layout=case[1]) for case in CASES}


def _tokens(rng: np.random.Generator, shape, vocab: int) -> mx.array:
    return mx.array(rng.integers(0, vocab, size=shape), dtype=mx.int32)


def _rms64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_logits_equal_mlx_lm_trunk_call(runtimes, seed, case):
    rt = runtimes[case]
    rng = np.random.default_rng(seed)
    tokens = _tokens(rng, (3, int(rng.integers(3, 9))), rt.vocab_size)
    logits, hidden = rt.forward(tokens)
    assert logits.shape == (*tokens.shape, rt.vocab_size)
    assert hidden.shape == (*tokens.shape, rt.config["hidden_size"])
    assert mx.array_equal(logits, rt.trunk(tokens)).item()
    last, hidden_all = rt.forward(tokens, last_logits_only=True)
    # Different matmul shapes may round differently: compare with a tolerance.
    np.testing.assert_allclose(_np64(last), _np64(logits[:, -1:]), rtol=1e-5, atol=1e-5)
    assert mx.array_equal(hidden_all, hidden).item()
    # Same with batch caches over a prefill and one decode step.
    pads = [0] * 3
    c_rt, c_ref = rt.make_cache(pads), rt.make_cache(pads)
    step = _tokens(rng, (3, 1), rt.vocab_size)
    for chunk in (tokens, step):
        got, _ = rt.forward(chunk, c_rt)
        assert mx.array_equal(got, rt.trunk(chunk, cache=c_ref)).item()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_head_hidden_is_taken_before_or_after_final_norm_per_layout(runtimes, seed, case):
    rt = runtimes[case]
    rng = np.random.default_rng(seed + 1)
    tokens = _tokens(rng, (2, 5), rt.vocab_size)
    _, hidden = rt.forward(tokens)
    post = rt.trunk.model(tokens)
    expected = {"qwen3_next": "post_norm", "deepseek": "post_norm", "mimo": "pre_norm"}[case[1]]
    assert rt.hidden_source == expected
    if expected == "post_norm":
        assert mx.array_equal(hidden, post).item()
    else:
        norm = rt.trunk.model.norm
        ref = _rms64(_np64(hidden), _np64(norm.weight), norm.eps)
        np.testing.assert_allclose(ref, _np64(post), rtol=1e-4, atol=1e-5)
        assert not np.allclose(_np64(hidden), _np64(post), atol=1e-3)


# Independently written combine rule of each layout: (norm on the first
# half, norm on the second half, projection, which input goes first).
_COMBINE = {
    "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "embed"),
    "deepseek": ("enorm", "hnorm", "eh_proj", "embed"),
    "mimo": ("hidden_layernorm", "token_layernorm", "input_proj", "hidden"),
}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_head_combine_matches_float64_reference(runtimes, seed, case):
    rt = runtimes[case]
    head = rt.head
    rng = np.random.default_rng(seed + 2)
    first_norm, second_norm, proj, first = _COMBINE[case[1]]
    n1, n2 = getattr(head, first_norm), getattr(head, second_norm)
    H = rt.config["hidden_size"]
    old = (n1.weight, n2.weight)
    # Distinct norm weights so a swapped order or norm cannot pass.
    n1.weight = mx.array(rng.uniform(0.5, 1.5, H), dtype=mx.float32)
    n2.weight = mx.array(rng.uniform(-1.5, -0.5, H), dtype=mx.float32)
    try:
        hidden = mx.array(rng.normal(size=(2, 3, H)), dtype=mx.float32)
        embeds = mx.array(rng.normal(size=(2, 3, H)), dtype=mx.float32)
        got = _np64(head.combine(hidden, embeds))
        a, b = (embeds, hidden) if first == "embed" else (hidden, embeds)
        eps = head.args.rms_norm_eps
        # Qwen3-Next head norms hold zero-centred weights and scale by 1 + w.
        off = 1.0 if case[1] == "qwen3_next" else 0.0
        cat = np.concatenate(
            [
                _rms64(_np64(a), off + _np64(n1.weight), eps),
                _rms64(_np64(b), off + _np64(n2.weight), eps),
            ],
            -1,
        )
        ref = cat @ _np64(getattr(head, proj).weight).T
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    finally:
        n1.weight, n2.weight = old


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_head_output_projection_is_shared_lm_head_or_own_head(runtimes, seed, case):
    rt = runtimes[case]
    rng = np.random.default_rng(seed + 3)
    x = mx.array(rng.normal(size=(1, 2, rt.config["hidden_size"])), dtype=mx.float32)
    lm = rt.trunk.language_model if "language_model" in rt.trunk else rt.trunk
    W = rt.head.shared_head.head.weight if case[1] == "deepseek" else lm.lm_head.weight
    np.testing.assert_allclose(
        _np64(rt.head.logits(x, rt.trunk)), _np64(x) @ _np64(W).T, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_head_cache_stepwise_and_left_padded_equal_each_row_run_alone(runtimes, seed, case):
    rt = runtimes[case]
    rng = np.random.default_rng(seed + 4)
    H, V = rt.config["hidden_size"], rt.vocab_size
    T = int(rng.integers(5, 8))
    pads = [0, int(rng.integers(1, 3)), int(rng.integers(3, 5))]
    hidden = mx.array(rng.normal(size=(3, T, H)), dtype=mx.float32)
    nxt = _tokens(rng, (3, T), V)
    # Reference: each row alone, no padding, no cache, whole sequence.
    alone = [rt.head_forward(hidden[i : i + 1, p:], nxt[i : i + 1, p:]) for i, p in enumerate(pads)]
    # Whole sequence through a head cache, then a prefill + single steps.
    whole = rt.head_forward(hidden, nxt, rt.make_head_cache(pads))
    cache = rt.make_head_cache(pads)
    k = T - 3
    parts = [rt.head_forward(hidden[:, :k], nxt[:, :k], cache)]
    parts += [rt.head_forward(hidden[:, t : t + 1], nxt[:, t : t + 1], cache) for t in range(k, T)]
    stepped = mx.concatenate(parts, axis=1)
    for i, p in enumerate(pads):
        ref = _np64(alone[i][0])
        np.testing.assert_allclose(_np64(whole[i, p:]), ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(_np64(stepped[i, p:]), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_trunk_batch_cache_with_left_padding_equals_each_row_alone(runtimes, seed, case):
    rt = runtimes[case]
    rng = np.random.default_rng(seed + 5)
    lengths = [int(rng.integers(2, 7)) for _ in range(3)]
    L = max(lengths)
    pads = [L - n for n in lengths]
    rows = [rng.integers(0, rt.vocab_size, size=n + 2) for n in lengths]
    prompt = np.zeros((3, L), dtype=np.int32)  # pad id 0: masked, so any id works
    for i, r in enumerate(rows):
        prompt[i, pads[i] :] = r[: lengths[i]]
    cache = rt.make_cache(pads)
    outs = [rt.forward(mx.array(prompt), cache)]
    for s in range(2):
        step = np.array([[r[lengths[i] + s]] for i, r in enumerate(rows)], dtype=np.int32)
        outs.append(rt.forward(mx.array(step), cache))
    logits = mx.concatenate([o[0] for o in outs], axis=1)
    hidden = mx.concatenate([o[1] for o in outs], axis=1)
    for i, r in enumerate(rows):
        ref_l, ref_h = rt.forward(mx.array(r[None].astype(np.int32)))
        np.testing.assert_allclose(_np64(logits[i, pads[i] :]), _np64(ref_l[0]), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(_np64(hidden[i, pads[i] :]), _np64(ref_h[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_random_init_greedy_decoding_does_not_collapse(seed, family):
    # One stream of a random model can fall into a short cycle by chance;
    # eight streams from distinct start tokens cannot all do so.
    rt = mtplx_ext.init_random(family, seed=seed)
    rng = np.random.default_rng(seed + 8)
    B = 8
    cache = rt.make_cache([0] * B)
    x = mx.array(rng.choice(rt.vocab_size, size=(B, 1), replace=False), dtype=mx.int32)
    seen = []
    for _ in range(16):
        logits, _ = rt.forward(x, cache)
        x = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        seen += np.array(x).ravel().tolist()
    assert len(set(seen)) >= 40, seen
    spread = float(mx.std(logits, axis=-1).min().item())
    assert spread > 0.5, spread


def test_out_of_vocabulary_token_poisons_only_its_row(runtimes, seed):
    rt = runtimes[("qwen3_next", "qwen3_next")]
    rng = np.random.default_rng(seed + 6)
    V = rt.vocab_size
    good = rng.integers(0, V, size=(3, 4)).astype(np.int64)
    bad = good.copy()
    bad[1, 2] = V + int(rng.integers(0, 10**6))
    logits, hidden = rt.forward(mx.array(bad))
    ref, _ = rt.forward(mx.array(good))
    nan_rows = np.isnan(_np64(logits)).any(axis=(1, 2))
    assert nan_rows.tolist() == [False, True, False]
    keep = [0, 2]
    assert mx.array_equal(logits[mx.array(keep)], ref[mx.array(keep)]).item()
    head = rt.head_forward(hidden[mx.array(keep)], mx.array(bad[[1, 0]]))
    assert np.isnan(_np64(head[0])).all() and not np.isnan(_np64(head[1])).any()
    with pytest.raises(ValueError, match="tokens.*outside the vocabulary"):
        rt.check_tokens(mx.array(bad))
    rt.check_tokens(mx.array(good))


def test_bad_arguments_raise_errors_naming_them(runtimes):
    rt = runtimes[("qwen3", "qwen3_next")]
    with pytest.raises(ValueError, match="tokens"):
        rt.forward(mx.array([1, 2, 3]))
    with pytest.raises(TypeError, match="tokens"):
        rt.forward(mx.array([[0.5, 1.0]]))
    with pytest.raises(TypeError, match="tokens"):
        rt.forward([[1, 2]])
    with pytest.raises(ValueError, match="next_tokens"):
        rt.head_forward(mx.zeros((1, 2, 64)), mx.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="left_padding"):
        rt.make_cache([0, -1])
    with pytest.raises(ValueError, match="left_padding"):
        rt.make_head_cache([])


def test_model_without_head_has_no_mtp_and_refuses_head_calls(seed):
    rt = mtplx_ext.init_random("qwen3", seed=seed, head_layout=None)
    assert not rt.has_mtp and rt.head is None and rt.head_layout is None
    assert not any(k.startswith("head.") for k, _ in tree_flatten(rt.parameters()))
    logits, hidden = rt.forward(mx.array([[1, 2]]))
    with pytest.raises(ValueError, match="no MTP head"):
        rt.head_forward(hidden, mx.array([[2, 3]]))
    with pytest.raises(ValueError, match="no MTP head"):
        rt.make_head_cache([0])


def test_init_random_applies_overrides_and_seed(seed):
    a = mtplx_ext.init_random("qwen3", seed=seed, hidden_size=32, num_hidden_layers=3, vocab_size=300)
    b = mtplx_ext.init_random("qwen3", seed=seed, hidden_size=32, num_hidden_layers=3, vocab_size=300)
    c = mtplx_ext.init_random("qwen3", seed=seed + 1, hidden_size=32, num_hidden_layers=3, vocab_size=300)
    assert len(a.trunk.layers) == 3 and a.vocab_size == 300 and a.config["hidden_size"] == 32
    logits, hidden = a.forward(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 300) and hidden.shape == (1, 3, 32)
    pa, pb, pc = (dict(tree_flatten(r.parameters())) for r in (a, b, c))
    assert all(mx.array_equal(pa[k], pb[k]).item() for k in pa)
    assert not mx.array_equal(pa["trunk.model.embed_tokens.weight"], pc["trunk.model.embed_tokens.weight"]).item()
    with pytest.raises(ValueError, match="model_type"):
        mtplx_ext.init_random("no_such_family")
    with pytest.raises(ValueError, match="head_layout"):
        mtplx_ext.init_random("qwen3", head_layout="medusa")


def test_joint_loss_gradients_reach_trunk_and_head(runtimes, seed):
    rt = runtimes[("qwen3", "qwen3_next")]
    rng = np.random.default_rng(seed + 7)
    tokens = _tokens(rng, (2, 6), rt.vocab_size)

    def loss_fn(model, toks):
        logits, hidden = model(toks[:, :-1])
        main = nn.losses.cross_entropy(logits, toks[:, 1:]).mean()
        head = model.head_forward(hidden[:, :-1], toks[:, 1:-1])
        return main + nn.losses.cross_entropy(head, toks[:, 2:]).mean()

    loss, grads = nn.value_and_grad(rt, loss_fn)(rt, tokens)
    g = dict(tree_flatten(grads))
    assert np.isfinite(loss.item())
    for k in ("trunk.model.embed_tokens.weight", "trunk.lm_head.weight", "head.fc.weight", "head.norm.weight"):
        assert float(mx.abs(g[k]).max().item()) > 0, k
