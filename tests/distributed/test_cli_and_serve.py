"""`mtplx-ext generate` / `serve` on 2 ranks (127.0.0.1, ring backend), launch checks and a rank that dies.

The model is a random qwen3 with 4 attention heads (the shipped model's 3
do not split over 2 ranks) and the shipped tokenizer, so text goes in and
out. Oracles: the one-process CLI (run in this process) and the offline
`Engine`.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import signal
import threading
import time

import httpx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.cli import main as cli_main
from mtplx_ext.shipped import SHIPPED_MODEL, eos_ids

from _dist import free_ports, run, spawn, wait
import _seed

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = _seed.rng()
    path = tmp_path_factory.mktemp("tp") / "model"
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(0, 2**31)), vocab_size=2048)
    rt.save(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, path / name)
    return path


def test_generate_on_two_ranks_prints_what_one_process_prints(folder, tmp_path, capsys):
    flags = ["generate", "--model", str(folder), "--max-tokens", "16", "--depth", "2", "def parse(", "import os"]
    assert cli_main(flags) == 0
    want = capsys.readouterr().out
    ranks = run(["-m", "mtplx_ext.cli", *flags, "--tensor-parallel", "--dist-check-every", "2"], tmp_path, timeout=90)
    assert [r.rc for r in ranks] == [0, 0], ranks[0].err[-2000:] + ranks[1].err[-2000:]
    assert ranks[0].out == want and want.strip()
    assert "tokens/s" in ranks[0].err
    assert ranks[1].out == "" and ranks[1].err == ""  # rank 1 prints nothing


def test_ranks_launched_with_different_flags_are_refused_naming_the_flag(folder, tmp_path):
    base = ["-m", "mtplx_ext.cli", "generate", "--model", str(folder), "--max-tokens", "4", "--tensor-parallel"]
    ranks = run(base, tmp_path, timeout=60, per_rank=[["--depth", "1"], ["--depth", "2"]])
    assert [r.rc for r in ranks] == [2, 2]
    assert "disagree on --depth" in ranks[0].err and "model config" not in ranks[0].err


def test_server_on_two_ranks_answers_the_openai_client_like_the_offline_engine(folder, tmp_path):
    port = free_ports(1)[0]
    procs = spawn(["-m", "mtplx_ext.cli", "serve", "--model", str(folder), "--port", str(port), "--depth", "2",
                   "--max-batch", "4", "--tensor-parallel", "--dist-timeout", "60"], tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            assert all(p.poll() is None for p in procs), wait(procs, 5)[0].err[-3000:]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("the 2-rank server did not come up in 90 s")
        rng = _seed.rng()
        jobs = [dict(prompt=p, max_tokens=int(rng.integers(4, 20)), temperature=0.0 if i % 2 == 0 else 0.8,
                     seed=int(rng.integers(0, 2**31)))
                for i, p in enumerate(["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(3):"])]
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)

        def ask(job):
            r = client.completions.create(model="model", prompt=job["prompt"], max_tokens=job["max_tokens"],
                                          temperature=job["temperature"], seed=job["seed"])
            return r.choices[0].text

        with cf.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, jobs))
        # A client that drops mid-stream: its cancellation reaches both ranks at one step.
        body = {"prompt": "def main():", "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(4)]
        after = client.completions.create(model="model", prompt="x = ", max_tokens=6, temperature=0).choices[0].text
    finally:
        procs[0].send_signal(signal.SIGINT)
        ranks = wait(procs, 30)
    assert [r.rc for r in ranks] == [0, 0], ranks[0].err[-2000:] + ranks[1].err[-2000:]
    rt = mtplx_ext.load(folder)

    def offline(prompt, max_tokens, temperature, seed):
        eng = Engine(rt, max_batch=1, depth=2)
        r = eng.submit(rt.tokenizer.encode(prompt).ids, max_tokens=max_tokens, seed=seed,
                       sampler=SamplerConfig(temperature=temperature), stop_token_ids=eos_ids(rt.tokenizer))
        eng.run_until_idle()
        return r.text

    for job, text in zip(jobs, texts):
        assert text == offline(job["prompt"], job["max_tokens"], job["temperature"], job["seed"]), job
    assert after == offline("x = ", 6, 0.0, None)


def test_a_rank_killed_mid_decode_makes_the_survivor_exit_with_one_clear_error(folder, tmp_path):
    # --ignore-eos: a random model may end its text before the kill, leaving nothing to interrupt.
    procs = spawn(["-m", "mtplx_ext.cli", "generate", "--model", str(folder), "--max-tokens", "3000", "--ignore-eos",
                   "--depth", "2",
                   "--tensor-parallel", "--dist-timeout", "20", "def main():"], tmp_path)
    started = threading.Event()

    def read_first():  # rank 0 streams text once decoding runs
        if procs[0].stdout.read(1):
            started.set()

    threading.Thread(target=read_first, daemon=True).start()
    try:
        assert started.wait(90), "rank 0 never started decoding"
        time.sleep(0.5)
        procs[1].kill()  # mid-decode
        killed = time.monotonic()
        rc0 = procs[0].wait(timeout=30)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = procs[0].stderr.read()
    assert rc0 != 0 and took < 30, (rc0, took)
    lines = [l for l in err.splitlines() if l.startswith("mtplx-ext: error:")]
    assert len(lines) == 1 and ("lost the connection to another rank" in lines[0]
                                or "no answer from the other ranks" in lines[0]), err[-2000:]
    assert "Traceback" not in err
