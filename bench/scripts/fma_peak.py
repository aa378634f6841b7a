"""This CPU's float32 FMA peak: the compute roof of any GEMM here, beside the memory floor.

Compiles (with the system C compiler, into a temporary folder) and runs a loop
of independent AVX-512 (else AVX2) fused multiply-adds on registers only, on 1
and on every core at once, and prints GFLOP/s. A product of M rows over P
float32 weights needs 2 M P flops, so no kernel can run it in less than
2 M P / peak seconds; `decode_gemm.py` prints the memory floor of the same
products.

Run: python bench/scripts/fma_peak.py [--seconds 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef __AVX512F__
typedef __m512 V;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define LANES 16
#else
typedef __m256 V;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define LANES 8
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static volatile float sink;
static void* run(void* arg) {
  long n = (long)arg;
  V x = SET1(1.0000001f), y = SET1(0.999999f);
  /* 12 independent chains (in registers, written out so no compiler keeps them in memory) hide the latency */
  V a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
  V a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
  for (long it = 0; it < n; it++) {
    a0 = FMA(a0, x, y); a1 = FMA(a1, x, y); a2 = FMA(a2, x, y); a3 = FMA(a3, x, y);
    a4 = FMA(a4, x, y); a5 = FMA(a5, x, y); a6 = FMA(a6, x, y); a7 = FMA(a7, x, y);
    a8 = FMA(a8, x, y); a9 = FMA(a9, x, y); a10 = FMA(a10, x, y); a11 = FMA(a11, x, y);
  }
  a0 = FMA(a0, a1, FMA(a2, a3, FMA(a4, a5, FMA(a6, a7, FMA(a8, a9, FMA(a10, a11, a0))))));
  float s[LANES];
  memcpy(s, &a0, sizeof(s));
  sink = s[0];
  return 0;
}
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  int cores = atoi(argv[2]);
  for (int th = 1; th <= cores; th = th == cores ? cores + 1 : cores) {
    pthread_t t[256];
    double t0 = now();
    for (int i = 0; i < th; i++) pthread_create(&t[i], 0, run, (void*)n);
    for (int i = 0; i < th; i++) pthread_join(t[i], 0);
    printf("%d %.3f\n", th, th * (double)n * 12 * LANES * 2 / (now() - t0) / 1e9);
  }
  return 0;
}
"""


def measure(iterations: int = 200_000_000) -> dict[int, float]:
    """FLOP/s of the FMA loop on 1 thread and on every core at once: {threads: FLOP/s}.

    Raises:
        SystemExit: no C compiler (cc, gcc or clang) on PATH.
    """
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("no C compiler found (cc, gcc or clang)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma.c", Path(tmp) / "fma"
        src.write_text("#include <string.h>\n" + SOURCE)
        subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe), "-lpthread"], check=True)
        out = subprocess.run([str(exe), str(iterations), str(cores)], check=True, capture_output=True,
                             text=True).stdout
    rates = {}
    for line in out.split("\n"):
        if line.strip():
            th, gflops = line.split()
            rates[int(th)] = float(gflops) * 1e9
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200_000_000, help="FMA rounds per thread")
    args = ap.parse_args()
    for th, rate in measure(args.iterations).items():
        print(f"{th} thread(s): {rate / 1e9:.0f} GFLOP/s float32 FMA peak")


if __name__ == "__main__":
    main()
