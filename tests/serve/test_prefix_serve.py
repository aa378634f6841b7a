"""The prefix cache behind `mtplx-ext serve` on the hybrid bench model: a multi-turn conversation hits it (its
/metrics.json counts the lookups and hits, /metrics exports the disk tier's), the warm-up leaves no files in --prefix-cache-dir, and a restarted server
resumes the conversation from the files."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _serve import LiveServer

import mtplx_ext
from mtplx_ext.batching import Engine

HYBRID = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-qwen3-next-mtp"


def _turn(base: str, prompt: list[int], n: int) -> str:
    body = {"model": HYBRID.name, "prompt": prompt, "max_tokens": n, "temperature": 0.0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.skipif(not (HYBRID / "config.json").is_file(), reason="the trained hybrid model folder is not here")
def test_a_conversation_hits_the_cache_and_a_restarted_server_resumes_it_from_disk(tmp_path):
    import _seed

    rng = _seed.rng()
    rt = mtplx_ext.load(HYBRID)
    V, flags = rt.vocab_size, ("--model", str(HYBRID), "--max-batch", "1", "--depth", "2",
                               "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-bytes", "64M")
    history, texts = rng.integers(0, V, 80).tolist(), []
    with LiveServer(*flags) as served:
        m = httpx.get(served.base + "/metrics.json").json()
        assert m["prefix_lookups"] == 0 and m["prefix_disk_writes"] == 0 and not list(tmp_path.iterdir())
        for _ in range(3):
            prompt = history + rng.integers(0, V, 12).tolist()
            texts.append((prompt, _turn(served.base, prompt, 8)))
            history = prompt + rt.tokenizer.encode(texts[-1][1]).ids
        m = httpx.get(served.base + "/metrics.json").json()
    assert m["prefix_lookups"] == 3 and m["prefix_hits"] >= 1 and m["prefix_disk_writes"] > 0, m
    nxt = history + rng.integers(0, V, 12).tolist()
    with LiveServer(*flags) as served:  # a restart
        texts.append((nxt, _turn(served.base, nxt, 8)))
        m = httpx.get(served.base + "/metrics.json").json()
        prom = httpx.get(served.base + "/metrics").text  # the Prometheus export: the disk tier as tier="disk"
    disk_hits = [float(line.split()[-1]) for line in prom.splitlines()
                 if line.startswith('mtplx_prefix_cache_hits_total{tier="disk"}')]
    assert disk_hits == [m["prefix_disk_hits"]], prom
    assert m["prefix_hits"] == 1 and m["prefix_disk_hits"] > 0 and m["prefill_tokens"] < len(nxt) - 80, m
    cold = Engine(rt, max_batch=1, depth=2)  # each reply is the cold engine's
    for prompt, text in texts:
        r = cold.submit(prompt, max_tokens=8)
        cold.run_until_idle()
        assert text == rt.tokenizer.decode(r.tokens)
