"""cache_state: recurrent snapshots, KV trim and graph checkpoints on real caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache

import mtplx_ext
from mtplx_ext.cache import rollback as cache_state
from _ragged import fresh_seed, ragged_batch
import _seed


def _host_leaves(cache: list) -> list[np.ndarray]:
    return [np.array(a) for a in cache_state.recurrent_leaves(cache)]


def _prefilled(rt, toks: mx.array, pads: list[int]) -> list:
    cache = rt.make_cache(pads)
    rt.forward(toks, cache)
    cache_state.finish_prefill(cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.fixture(scope="module")
def hybrid():
    return mtplx_ext.init_random("qwen3_next", seed=fresh_seed())


def test_snapshot_restore_roll_back_a_forward_bit_exactly(hybrid):
    rng = _seed.rng()
    V = hybrid.vocab_size
    toks, pads = ragged_batch(rng, V, 3)
    cache = _prefilled(hybrid, toks, pads)
    before = _host_leaves(cache)
    snap = cache_state.snapshot_recurrent(cache)
    hybrid.forward(mx.array(rng.integers(0, V, (3, 2)).astype(np.int32)), cache)
    mx.eval([c.state for c in cache])
    moved = _host_leaves(cache)
    # Teeth: the forward did change the state.
    assert any(not np.array_equal(a, b) for a, b in zip(before, moved))
    cache_state.restore_recurrent(cache, snap)
    after = _host_leaves(cache)
    assert len(after) == len(before) > 0
    for a, b in zip(after, before):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_repair_after_restore_and_trim_equals_a_run_that_never_drafted(hybrid):
    rng = _seed.rng()
    V = hybrid.vocab_size
    toks, pads = ragged_batch(rng, V, 4)
    pair = mx.array(rng.integers(0, V, (4, 2)).astype(np.int32))
    draft_pair = mx.array(rng.integers(0, V, (4, 2)).astype(np.int32))

    cache = _prefilled(hybrid, toks, pads)
    snap = cache_state.snapshot_recurrent(cache)
    hybrid.forward(draft_pair, cache)
    mx.eval([c.state for c in cache])
    cache_state.restore_recurrent(cache, snap)
    cache_state.trim_kv(cache, 2)
    logits, hidden = hybrid.forward(pair, cache)

    clean = _prefilled(hybrid, toks, pads)
    ref_logits, ref_hidden = hybrid.forward(pair, clean)
    assert np.array_equal(np.array(logits), np.array(ref_logits))
    assert np.array_equal(np.array(hidden), np.array(ref_hidden))
    for a, b in zip(_host_leaves(cache), _host_leaves(clean)):
        assert np.array_equal(a, b)
    for c, r in zip(cache, clean):
        if isinstance(c, BatchKVCache):
            k, v = c.keys_and_values()
            rk, rv = r.keys_and_values()
            assert np.array_equal(np.array(k), np.array(rk))
            assert np.array_equal(np.array(c.offset), np.array(r.offset))


def test_snapshot_and_restore_each_use_one_primitive_call_for_all_layers(hybrid, monkeypatch):
    calls = {"snapshot": 0, "restore": 0}
    real_snap, real_restore = cache_state.snapshot_state, cache_state.restore_state

    def snap(leaves):
        calls["snapshot"] += 1
        return real_snap(leaves)

    def restore(live, snapshot):
        calls["restore"] += 1
        return real_restore(live, snapshot)

    monkeypatch.setattr(cache_state, "snapshot_state", snap)
    monkeypatch.setattr(cache_state, "restore_state", restore)
    rng = _seed.rng()
    toks, pads = ragged_batch(rng, hybrid.vocab_size, 2)
    cache = _prefilled(hybrid, toks, pads)
    n_recurrent = sum(isinstance(c, ArraysCache) for c in cache)
    assert n_recurrent >= 2
    s = cache_state.snapshot_recurrent(cache)
    assert len(s.arrays) == 2 * n_recurrent
    cache_state.restore_recurrent(cache, s)
    assert calls == {"snapshot": 1, "restore": 1}


def test_trim_kv_drops_tokens_and_rejects_trimming_more_than_held():
    B, n = 2, int(_seed.rng().integers(3, 7))
    c = BatchKVCache([0, 1])
    kv = mx.random.normal((B, 2, n, 4))
    c.update_and_fetch(kv, kv)
    offset = np.array(c.offset)
    cache_state.trim_kv([c], 2)
    assert c.size() == n - 2
    assert np.array_equal(np.array(c.offset), offset - 2)
    with pytest.raises(ValueError, match=r"caches\[0\]"):
        cache_state.trim_kv([c], n)


def test_rollback_drops_an_unevaluated_forward_without_a_trace(hybrid):
    rng = _seed.rng()
    V = hybrid.vocab_size
    toks, pads = ragged_batch(rng, V, 3)
    a = mx.array(rng.integers(0, V, (3, 2)).astype(np.int32))
    b = mx.array(rng.integers(0, V, (3, 2)).astype(np.int32))
    head_cache = hybrid.make_head_cache(pads)

    cache = _prefilled(hybrid, toks, pads)
    ckpt = cache_state.checkpoint_caches(cache, head_cache)
    spec_logits, _ = hybrid.forward(a, cache)  # built, never evaluated
    cache_state.rollback_caches(ckpt)
    logits, _ = hybrid.forward(b, cache)

    clean = _prefilled(hybrid, toks, pads)
    ref, _ = hybrid.forward(b, clean)
    assert np.array_equal(np.array(logits), np.array(ref))
    for x, y in zip(_host_leaves(cache), _host_leaves(clean)):
        assert np.array_equal(x, y)
    # Teeth: without the rollback the second forward sees the first one.
    stale = _prefilled(hybrid, toks, pads)
    hybrid.forward(a, stale)
    bad, _ = hybrid.forward(b, stale)
    assert not np.array_equal(np.array(bad), np.array(ref))


def test_finish_prefill_drops_recurrent_padding_but_keeps_kv_padding(hybrid):
    rng = _seed.rng()
    toks, pads = ragged_batch(rng, hybrid.vocab_size, 3)
    cache = hybrid.make_cache(pads)
    hybrid.forward(toks, cache)
    cache_state.finish_prefill(cache)
    for c in cache:
        if isinstance(c, ArraysCache):
            assert c.left_padding is None and c.make_mask(2) is None
        else:
            assert np.array(c.left_padding).tolist() == pads


def test_cache_list_type_errors_name_the_argument():
    with pytest.raises(TypeError, match="caches"):
        cache_state.trim_kv("not a list", 2)
    with pytest.raises(TypeError, match="caches"):
        cache_state.snapshot_recurrent(None)


def test_runtime_snapshot_restore_trim_undo_a_forward_bit_exactly(hybrid):
    rng = _seed.rng()
    V = hybrid.vocab_size
    toks, pads = ragged_batch(rng, V, 2)
    cache = _prefilled(hybrid, toks, pads)
    before = _host_leaves(cache)
    sizes = [c.size() for c in cache if isinstance(c, BatchKVCache)]
    snap = hybrid.snapshot(cache)
    hybrid.forward(mx.array(rng.integers(0, V, (2, 3)).astype(np.int32)), cache)
    hybrid.restore(cache, snap)
    hybrid.trim(cache, 3)
    assert [c.size() for c in cache if isinstance(c, BatchKVCache)] == sizes
    for a, b in zip(_host_leaves(cache), before):
        assert np.array_equal(a, b)


def test_ragged_cache_after_random_per_stream_rollbacks_equals_a_fresh_forward_of_each_stream():
    # Streams write [B, 2] pairs and drop 0, 1 or 2 of them at random; the
    # logits of a final forward must equal a forward of each stream's kept
    # tokens alone, from scratch.
    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    V, B = rt.vocab_size, 4
    toks, pads = ragged_batch(rng, V, B)
    kept = [toks[i, p:].tolist() for i, p in enumerate(pads)]
    cache = rt.make_cache(pads, ragged=True)
    rt.forward(toks, cache)
    for _ in range(int(rng.integers(3, 9))):
        pair = rng.integers(0, V, size=(B, 2))
        rt.forward(mx.array(pair.astype(np.int32)), cache)
        drop = rng.integers(0, 3, size=B)
        cache_state.rollback_streams(cache, mx.array(drop.astype(np.int32)))
        for i in range(B):
            kept[i] += pair[i, : 2 - drop[i]].tolist()
    assert len({len(k) for k in kept}) > 1  # the streams did end up ragged
    last = rng.integers(0, V, size=(B, 1))
    got = np.array(rt.forward(mx.array(last.astype(np.int32)), cache)[0][:, -1], np.float64)
    for i in range(B):
        want = np.array(rt.forward(mx.array([kept[i] + [int(last[i, 0])]]))[0][0, -1], np.float64)
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4, err_msg=f"stream {i}")


def test_rollback_streams_refuses_caches_that_cannot_roll_back_one_stream():
    cache = [BatchKVCache([0, 1])]
    with pytest.raises(ValueError, match=r"caches\[0\].*BatchKVCache"):
        cache_state.rollback_streams(cache, mx.array([1, 0]))


def test_ragged_layers_share_positions_so_trimming_every_layer_trims_once():
    from mlx_lm.models.cache import trim_prompt_cache

    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    toks, pads = ragged_batch(rng, rt.vocab_size, 3)
    cache = rt.make_cache(pads, ragged=True)
    rt.forward(toks, cache)
    width = toks.shape[1]
    assert trim_prompt_cache(cache, 2) == 2  # mlx-lm's helper trims layer by layer
    assert [c.size() for c in cache] == [width - 2] * len(cache)
    assert np.array_equal(np.array(cache[-1].offset), width - 2 - np.array(pads))


def test_a_ragged_layer_out_of_step_with_the_others_raises():
    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    toks, pads = ragged_batch(rng, rt.vocab_size, 2)
    cache = rt.make_cache(pads, ragged=True)
    rt.forward(toks, cache)
    cache[0].rollback(mx.array([1, 0]))  # only the first layer
    with pytest.raises(ValueError, match="out of step"):
        cache[1].trim(1)
