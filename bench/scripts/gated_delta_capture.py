"""gated_delta_capture vs mlx-lm's own gated-delta path on the CPU.

For one GatedDeltaNet layer of Qwen3-Next-80B-A3B's shape (16 key heads, 32
value heads, Dk = Dv = 128, float32 state) and a [B, T] verification chunk,
times `mtplx_ext.gated_delta_capture` (which also writes the T states) and
`mlx_lm.models.gated_delta.gated_delta_update` on an MLX CPU stream (there
it runs `gated_delta_ops`, a compiled step per position), plus the per-stream
selection of one state per stream from the capture. Medians of interleaved
rounds; the inputs are evaluated beforehand.

Run: python bench/scripts/gated_delta_capture.py [--rounds 7] [--shapes 1x2,8x2,8x4]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(B: int, T: int, rng: np.random.Generator) -> tuple[mx.array, ...]:
    def unit(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return mx.array(x / np.linalg.norm(x, axis=-1, keepdims=True))

    q, k = unit((B, T, HK, DK)) * DK**-0.5, unit((B, T, HK, DK))
    v = mx.array(rng.standard_normal((B, T, HV, DV)).astype(np.float32))
    a = mx.array(rng.standard_normal((B, T, HV)).astype(np.float32))
    b = mx.array(rng.standard_normal((B, T, HV)).astype(np.float32))
    A_log = mx.array(np.log(rng.uniform(1, 16, HV)).astype(np.float32))
    dt_bias = mx.ones(HV)
    state = mx.array(rng.standard_normal((B, HV, DV, DK)).astype(np.float32) * 0.1)
    out = (q, k, v, a, b, A_log, dt_bias, state)
    mx.eval(*out)
    return out


def timed(f) -> float:
    t0 = time.perf_counter()
    mx.eval(f())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default="1x2,1x4,8x2,8x4")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    mx.set_default_device(mx.cpu)
    print(f"one layer, Hk={HK} Hv={HV} Dk={DK} Dv={DV}, float32; ms per call (median of {args.rounds})")
    print(f"{'B x T':>6} {'mlx-lm':>9} {'capture':>9} {'capture+select':>15} {'ratio':>7}")
    for spec in args.shapes.split(","):
        B, T = map(int, spec.split("x"))
        q, k, v, a, b, A_log, dt_bias, state = inputs(B, T, rng)
        n = mx.array(rng.integers(0, T, B).astype(np.int32))

        def ref():
            return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)

        def cap():
            g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
            return mtplx_ext.gated_delta_capture(q, k, v, g, beta, state)

        def cap_select():
            y, states = cap()
            flat = states.reshape((B * T, HV, DV, DK))  # as cache_state.commit_streams selects
            return y, mx.take(flat, mx.arange(B, dtype=mx.int32) * T + n, axis=0)

        runs = {"ref": [], "cap": [], "sel": []}
        for f in (ref, cap, cap_select):
            timed(f)  # warm-up (compiles mlx-lm's step)
        for _ in range(args.rounds):
            runs["ref"].append(timed(ref))
            runs["cap"].append(timed(cap))
            runs["sel"].append(timed(cap_select))
        med = {key: statistics.median(v) * 1e3 for key, v in runs.items()}
        print(f"{spec:>6} {med['ref']:9.2f} {med['cap']:9.2f} {med['sel']:15.2f} {med['ref'] / med['cap']:6.2f}x")


if __name__ == "__main__":
    main()
