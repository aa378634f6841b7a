"""One-token decode forward of the shipped tiny model, before and after fusion.

Times trunk(x, cache) + mx.eval for batch 1 (mlx-lm KVCache per layer) and
batch 8 (the runtime's BatchKVCache) after a 64-token prefill, trimming the
cache back by one token after each step, for three set-ups: plain mlx-lm,
`fuse_cpu_ops(trunk)`, and fused with `patch_mlx_lm_attention()`. Rounds of
the set-ups are interleaved so that load on a shared machine hits them alike.
Also counts the nodes of one step's graph (labels in mx.export_to_dot).

Run: python bench/scripts/fused_decode_step.py [--rounds 5] [--steps 100]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mtplx_ext.models import fused_modules

MODEL = Path(mtplx_ext.__file__).parent / "assets" / "tiny-qwen3-mtp"
PREFILL = 64


def graph_nodes(y: mx.array) -> int:
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, y)
        return len(re.findall(r"label", Path(path).read_text()))
    finally:
        os.remove(path)


class Setup:
    def __init__(self, name: str, fuse: bool, attention: bool, batch: int, seed: int):
        self.name, self.attention = name, attention
        rt = mtplx_ext.load(MODEL)
        self.trunk = rt.trunk
        self.replaced = fused_modules.fuse_cpu_ops(self.trunk) if fuse else 0
        if batch == 1:
            self.cache = [KVCache() for _ in self.trunk.layers]
        else:
            self.cache = rt.make_cache([0] * batch)
        mx.random.seed(seed)
        prompt = mx.random.randint(0, rt.vocab_size, (batch, PREFILL))
        self.token = mx.random.randint(0, rt.vocab_size, (batch, 1))
        with self.routing():
            mx.eval(self.trunk(prompt, cache=self.cache))
        self.times: list[float] = []

    def routing(self):
        if self.attention:
            return mtplx_ext.patch_mlx_lm_attention()
        return _Null()

    def run(self, steps: int) -> None:
        with self.routing():
            for _ in range(steps):
                t0 = time.perf_counter()
                mx.eval(self.trunk(self.token, cache=self.cache))
                self.times.append(time.perf_counter() - t0)
                for c in self.cache:
                    c.trim(1)

    def nodes(self) -> int:
        with self.routing():
            y = self.trunk(self.token, cache=self.cache)
            n = graph_nodes(y)
            mx.eval(y)
        for c in self.cache:
            c.trim(1)
        return n


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    for batch in (1, 8):
        setups = [
            Setup("mlx-lm", False, False, batch, 0),
            Setup("fused norm+rope", True, False, batch, 0),
            Setup("fused norm+rope+attention", True, True, batch, 0),
        ]
        for s in setups:
            s.run(10)  # warm-up
            s.times.clear()
        for _ in range(args.rounds):
            for s in setups:
                s.run(args.steps)
        base = statistics.median(setups[0].times)
        for s in setups:
            med = statistics.median(s.times)
            print(
                f"B={batch}  {s.name:27s} median {med * 1e3:6.3f} ms  "
                f"({base / med:4.2f}x)  graph nodes {s.nodes():5d}  "
                f"modules fused {s.replaced}"
            )


if __name__ == "__main__":
    main()
