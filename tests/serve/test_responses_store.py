"""The Responses API's response store: least recently used first out, bounded in entries and bytes."""

from __future__ import annotations

import pytest
import _seed

pytest.importorskip("starlette")

from mtplx_ext.serve.responses_store import NotFound, ResponseStore  # noqa: E402


def test_the_store_evicts_the_least_recently_used_and_bounds_its_bytes():
    rng = _seed.rng()
    cap = int(rng.integers(2, 6))
    s = ResponseStore(max_entries=cap)
    ids = [f"resp_{i}" for i in range(cap)]
    for i in ids:
        assert s.put(i, {"id": i}, [{"role": "user", "content": i}])
    touched, evicted = ids[0], ids[1]
    s.get(touched)  # the oldest, now the most recently used: the next oldest goes first
    s.put("resp_new", {"id": "resp_new"}, [])
    with pytest.raises(NotFound):
        s.get(evicted)
    assert len(s) == cap and s.get(touched)[1] == [{"role": "user", "content": touched}]
    small = ResponseStore(max_entries=100, max_bytes=200)
    big = [{"role": "user", "content": "x" * 80}]
    assert small.put("a", {}, big) and small.put("b", {}, big)
    assert small.bytes <= 200 and len(small) == 1 and "b" in small.entries
    assert not small.put("c", {}, [{"role": "user", "content": "x" * 300}]) and "c" not in small.entries
    assert small.delete("b") and not small.delete("b") and small.bytes == 0
