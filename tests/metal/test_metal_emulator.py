"""The Metal kernels of metal/, executed on the CPU by the threadgroup emulator.

Every kernel runs from its real Metal source (translated to C++ against
tests/tools/metal_shim/metal_shim.h) with 32-lane simdgroups, shared threadgroup
memory and barriers, and must equal both the CPU primitive and a float64 /
numpy reference. Deliberately broken copies of the kernels (fixtures in
tests/tools/metal_shim/broken/) must each be caught.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from metal_shim import emulator
from metal_shim.emulator import EmulatorError
import _seed

pytestmark = pytest.mark.skipif(
    emulator.clang() is None,
    reason="clang++ not installed: the Metal emulator tests need it "
    "(Debian: apt-get install clang)",
)

THREADS = [32, 64, 256, 1024]
LOGIT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOKEN_DTYPES = {"int32": np.int32, "int64": np.int64}
# Kernels of metal/ that the tests below run; a new kernel must join them.
COVERED = {
    "verify_greedy_" + d + "_" + t for d in LOGIT_DTYPES for t in TOKEN_DTYPES
} | {"state_copy", "state_copy_masked"}
# Kernels whose emulator tests live with their CPU tests (host-name patterns).
COVERED_ELSEWHERE = {
    "sample_tokens_*": "ops/test_sampling_fused.py",
    "verify_sampled_*": "ops/test_sampling_fused.py",
    "verify_greedy_chain_*": "ops/test_chain_verify.py",
    "verify_sampled_chain_*": "ops/test_chain_verify.py",
    "gated_delta_capture_*": "ops/test_gated_delta.py",
}


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def test_every_kernel_in_metal_dir_is_emulated_and_covered(emu):
    real = {n for n in emu.kernel_names() if "/" not in n}
    elsewhere = {
        n for n in real if any(fnmatch.fnmatch(n, p) for p in COVERED_ELSEWHERE)
    }
    missing = real - COVERED - elsewhere
    assert not missing, f"kernels without emulator tests: {sorted(missing)}"
    assert COVERED <= real, f"expected kernels not built: {sorted(COVERED - real)}"
    for pattern, test_file in COVERED_ELSEWHERE.items():
        if any(fnmatch.fnmatch(n, pattern) for n in real):
            text = (Path(__file__).parents[1] / test_file).read_text()
            assert "emu.launch(" in text and pattern.rstrip("*") in text, (
                f"{test_file} does not run the {pattern} kernels on the emulator"
            )


# ---------------------------------------------------------------------------
# verify_greedy


def reference_bundle(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float64 reference: first max, invalid rows and tokens give -1."""
    B, _, V = logits.shape
    out = np.empty((B, 5), np.int64)
    for b in range(B):
        picks, valid = [], True
        for p in range(2):
            row = logits[b, p]
            bad = np.isnan(row).any() or np.isposinf(row).any() or np.isneginf(row).all()
            valid &= not bad
            picks.append(-1 if bad else int(np.argmax(row)))
        x0, draft = int(tokens[b, 0]), int(tokens[b, 1])
        x0_ok, draft_ok = 0 <= x0 < V, 0 <= draft < V
        out[b] = [
            x0 if x0_ok else -1,
            draft if draft_ok else -1,
            picks[0],
            (int(draft == picks[0]) if (valid and x0_ok and draft_ok) else -1),
            picks[1],
        ]
    return out


def make_case(rng, B: int, V: int, dtype: str, tok_dtype):
    """Random logits with planted ties, edge maxima, bad rows and tokens.

    Returns (raw logits for the kernel, float64 logits as the dtype holds
    them, mx logits, tokens).
    """
    x = rng.standard_normal((B, 2, V)) * rng.uniform(0.5, 4.0)
    for b in range(B):
        for p in range(2):
            kind = rng.integers(0, 8)
            row = x[b, p]
            if kind == 0:  # exact tie of the max at a random other index
                j, k = rng.choice(V, size=2, replace=V < 2)
                row[j] = row[k] = row.max() + 1.0
            elif kind == 1:  # max at the last index (tail of the scan)
                row[V - 1] = row.max() + 1.0
            elif kind == 2:  # max at index 0
                row[0] = row.max() + 1.0
            elif kind == 3 and B > 1:  # one bad row kind
                bad = rng.integers(0, 4)
                if bad == 0:
                    row[rng.integers(0, V)] = np.nan
                elif bad == 1:
                    row[rng.integers(0, V)] = np.inf
                elif bad == 2:
                    row[:] = -np.inf
                else:  # -inf entries are fine while a finite one remains
                    row[rng.random(V) < 0.5] = -np.inf
                    row[rng.integers(0, V)] = 0.0
    xm = mx.array(x.astype(np.float32)).astype(LOGIT_DTYPES[dtype])
    held = np.array(xm.astype(mx.float32)).astype(np.float64)
    if dtype == "bfloat16":
        raw = np.array(xm.view(mx.uint16))
    else:
        raw = np.array(xm)
    tokens = rng.integers(0, V, (B, 2))
    hit = rng.random(B) < 0.5
    tokens[hit, 1] = np.nanargmax(np.where(np.isnan(held[hit, 0]), -np.inf, held[hit, 0]), -1)
    edge = rng.random((B, 2))
    tokens[edge < 0.1] = V  # one past the vocabulary
    tokens[(edge >= 0.1) & (edge < 0.15)] = -1
    tokens[(edge >= 0.15) & (edge < 0.2)] = V - 1
    tokens[(edge >= 0.2) & (edge < 0.25)] = 0
    if tok_dtype == np.int64:
        tokens[edge > 0.97] = 2**40  # only representable in int64
    return np.ascontiguousarray(raw), held, xm, tokens.astype(tok_dtype)


def run_verify(emu, raw, dtype, tokens, threads, prefix=""):
    B = raw.shape[0]
    bundle = np.full((B, 5), 0x5A5A5A5A, np.int32)  # poison
    emu.verify_greedy(raw, dtype, tokens, bundle, threads=threads, prefix=prefix)
    return bundle


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("tok", list(TOKEN_DTYPES))
@pytest.mark.parametrize("dtype", list(LOGIT_DTYPES))
def test_verify_greedy_kernel_equals_cpu_primitive_and_reference(
    emu, rng, dtype, tok, threads
):
    # V below, around and well above the threadgroup, never a multiple of it.
    for V in (int(rng.integers(1, threads)), threads + int(rng.integers(1, 31)), 5003):
        B = int(rng.integers(1, 5))
        raw, held, xm, tokens = make_case(rng, B, V, dtype, TOKEN_DTYPES[tok])
        got = run_verify(emu, raw, dtype, tokens, threads)
        ref = reference_bundle(held, tokens)
        cpu = np.array(mtplx_ext.verify_greedy(xm, mx.array(tokens), stream=mx.cpu))
        np.testing.assert_array_equal(got, ref, err_msg=f"V={V} vs reference")
        np.testing.assert_array_equal(got, cpu, err_msg=f"V={V} vs CPU primitive")


@pytest.mark.parametrize("dtype", list(LOGIT_DTYPES))
def test_verify_greedy_with_host_plan_threads_at_large_vocab(emu, rng, dtype):
    # The launch plan of eval_gpu picks the threadgroup size (1024 here).
    B, V = 2, 151936
    raw, held, xm, tokens = make_case(rng, B, V, dtype, np.int32)
    got = run_verify(emu, raw, dtype, tokens, threads=0)
    np.testing.assert_array_equal(got, reference_bundle(held, tokens))


def test_verify_greedy_ties_resolve_to_lowest_index_across_simdgroups(emu, rng):
    # All-equal rows: every lane and simdgroup holds the max; index 0 wins.
    V = 3000
    raw = np.full((2, 2, V), 1.5, np.float32)
    raw[1, 1, :] = -0.0
    raw[1, 1, rng.integers(1, V)] = 0.0  # +0 ties -0: still index 0
    tokens = np.zeros((2, 2), np.int32)
    got = run_verify(emu, raw, "float32", tokens, threads=256)
    np.testing.assert_array_equal(got[:, 2], [0, 0])
    np.testing.assert_array_equal(got[:, 4], [0, 0])


# ---------------------------------------------------------------------------
# snapshot / restore


def make_leaves(rng, B: int, n: int) -> list[np.ndarray]:
    """n random leaves [B, ...] of mixed dtypes and odd sizes (NaN payloads,
    an odd address) plus four fixed ones, one per copy unit width."""
    leaves = []
    for i in range(n):
        shape = (B, *rng.integers(1, 7, size=int(rng.integers(0, 3))))
        kind = i % 6
        if kind == 0:
            a = rng.standard_normal(shape).astype(np.float32)
            a.view(np.uint32).flat[0] = 0x7FC01234  # NaN with a payload
        elif kind == 1:
            a = rng.integers(0, 2**16, shape, dtype=np.uint16)  # f16 / bf16 bits
        elif kind == 2:
            a = rng.integers(-128, 128, shape, dtype=np.int8)
        elif kind == 3:
            a = rng.random(shape) < 0.5
        elif kind == 4:
            a = rng.integers(-(2**62), 2**62, shape, dtype=np.int64)
        else:
            # A view at an odd address: forces narrower copy units.
            raw = rng.integers(0, 256, int(np.prod(shape)) * 4 + 1, dtype=np.uint8)
            a = raw[1:].view(np.uint8).reshape(*shape[:1], -1)
        leaves.append(a)
    # Rows of 48, 24, 6 and 20 bytes: the uint4, uint2, ushort and uint paths.
    leaves += [
        rng.standard_normal((B, 12)).astype(np.float32),
        rng.integers(-(2**62), 2**62, (B, 3), dtype=np.int64),
        rng.integers(0, 2**16, (B, 3), dtype=np.uint16),
        rng.integers(-(2**31), 2**31, (B, 5), dtype=np.int32),
    ]
    return leaves


def random_like(rng, a: np.ndarray) -> np.ndarray:
    """Fresh random contents of a's shape and dtype (bools stay 0/1)."""
    if a.dtype == np.bool_:
        return rng.random(a.shape) < 0.5
    o = np.empty_like(a)
    o.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    return o


def poisoned_like(rng, leaves):
    outs = []
    for a in leaves:
        o = np.empty_like(a)
        o.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
        outs.append(o)
    return outs


def to_mx(a: np.ndarray) -> mx.array:
    return mx.array(a)


@pytest.mark.parametrize("threads", THREADS)
def test_snapshot_kernel_copies_every_leaf_bit_exactly(emu, rng, threads):
    B = int(rng.integers(1, 6))
    leaves = make_leaves(rng, B, int(rng.integers(5, 10)))  # > 8: two launches
    outs = poisoned_like(rng, leaves)
    emu.state_copy(leaves, outs, threads=threads)
    cpu = mtplx_ext.snapshot_state([to_mx(a) for a in leaves], stream=mx.cpu)
    for i, (a, o, c) in enumerate(zip(leaves, outs, cpu)):
        assert o.tobytes() == a.tobytes(), f"leaf {i} ({a.dtype}, {a.shape})"
        assert np.array(c).tobytes() == o.tobytes(), f"leaf {i} vs CPU primitive"


@pytest.mark.parametrize("threads", THREADS)
def test_restore_kernel_takes_snapshot_rows_where_masked(emu, rng, threads):
    B = int(rng.integers(2, 7))
    snap = make_leaves(rng, B, int(rng.integers(5, 10)))
    live = [random_like(rng, a) for a in snap]
    mask = rng.random(B) < 0.5
    mask[rng.integers(0, B)] = True
    mask[rng.integers(0, B)] = not mask[0]
    outs = poisoned_like(rng, snap)
    emu.state_copy(snap, outs, live=live, row_mask=mask, threads=threads)
    cpu = mtplx_ext.restore_state(
        [to_mx(a) for a in live], [to_mx(a) for a in snap], mx.array(mask), stream=mx.cpu
    )
    for i, (s, l, o, c) in enumerate(zip(snap, live, outs, cpu)):
        sel = mask.reshape((B,) + (1,) * (s.ndim - 1))
        ref = np.where(sel, s, l)
        assert o.tobytes() == ref.tobytes(), f"leaf {i} ({s.dtype}, {s.shape})"
        assert np.array(c).tobytes() == o.tobytes(), f"leaf {i} vs CPU primitive"


def test_restore_kernel_without_mask_copies_the_snapshot(emu, rng):
    snap = make_leaves(rng, 3, 5)
    outs = poisoned_like(rng, snap)
    emu.state_copy(snap, outs, threads=64)
    for s, o in zip(snap, outs):
        assert o.tobytes() == s.tobytes()


# ---------------------------------------------------------------------------
# The emulator's own semantics (simd functions, threadgroup memory)


def test_simd_functions_follow_metal_semantics(emu, rng):
    n = 64  # two full simdgroups
    x = rng.integers(-50, 50, n).astype(np.int32)
    out = np.full((n, 14), -999999, np.int32)
    emu.launch("probe/simd_probe", (1,), n, [x, out])
    for g in range(2):
        v = x[32 * g : 32 * g + 32]
        o = out[32 * g : 32 * g + 32]
        lanes = np.arange(32)
        np.testing.assert_array_equal(o[:, 0], v.sum())
        np.testing.assert_array_equal(o[:, 1], v.max())
        np.testing.assert_array_equal(o[:, 2], v.min())
        np.testing.assert_array_equal(o[:, 3], np.cumsum(v))
        np.testing.assert_array_equal(o[:, 4], np.cumsum(v) - v)
        # shuffle_down/up leave the lanes without a source unchanged.
        np.testing.assert_array_equal(o[:, 5], np.where(lanes + 3 < 32, np.roll(v, -3), v))
        np.testing.assert_array_equal(o[:, 6], np.where(lanes >= 5, np.roll(v, 5), v))
        np.testing.assert_array_equal(o[:, 7], v[lanes ^ 6])
        np.testing.assert_array_equal(o[:, 8], v[7])
        np.testing.assert_array_equal(o[:, 9], v[(lanes * 7) % 32])
        ballot = sum(1 << i for i in range(32) if v[i] > 0)
        np.testing.assert_array_equal(o[:, 10].view(np.uint32), ballot)
        np.testing.assert_array_equal(o[:, 11], int((v > 40).any()) + 2 * int((v > -40).all()))
        np.testing.assert_array_equal(o[:16, 12], v[:16].sum())
        np.testing.assert_array_equal(o[16:, 12], 0)
        np.testing.assert_array_equal(o[:, 13], np.roll(v, -30))


def test_partial_simdgroup_reduces_over_existing_lanes(emu, rng):
    n = 48  # second simdgroup has 16 lanes
    x = rng.integers(-50, 50, n).astype(np.int32)
    out = np.zeros((n, 14), np.int32)
    emu.launch("probe/simd_probe", (1,), n, [x, out])
    np.testing.assert_array_equal(out[32:, 0], x[32:].sum())
    np.testing.assert_array_equal(out[32:, 3], np.cumsum(x[32:]))


def test_synchronised_threadgroup_exchange_runs_clean(emu, rng):
    n = 256
    x = rng.standard_normal(3 * n).astype(np.float32)
    out = np.full_like(x, np.nan)
    emu.launch("probe/tg_probe", (3,), n, [x, out])
    np.testing.assert_array_equal(out.reshape(3, n), np.roll(x.reshape(3, n), -1, axis=1))


def test_nonuniform_shuffle_offset_is_reported(emu):
    with pytest.raises(EmulatorError, match="differs across lanes"):
        emu.launch("probe/nonuniform_shuffle_probe", (1,), 32, [np.zeros(32, np.int32)])


def test_out_of_bounds_device_access_is_reported(emu, rng):
    x = rng.integers(-50, 50, 31).astype(np.int32)  # one element short
    with pytest.raises(EmulatorError, match=r"out-of-bounds access to buffer\(0\)"):
        emu.launch("probe/simd_probe", (1,), 32, [x, np.zeros((32, 14), np.int32)])


def test_unbound_buffer_is_reported(emu):
    with pytest.raises(EmulatorError, match="not bound"):
        emu.launch("probe/tg_probe", (1,), 32, [None, np.zeros(32, np.float32)])


# ---------------------------------------------------------------------------
# Teeth: broken copies of the kernels must be caught


def test_missing_barrier_is_reported_as_a_race(emu, rng):
    raw, held, _, tokens = make_case(rng, 2, 1000, "float32", np.int32)
    with pytest.raises(EmulatorError, match="race|uninitialised"):
        run_verify(emu, raw, "float32", tokens, 256, prefix="broken/missing_barrier/")


def test_barrier_without_threadgroup_memory_flag_is_reported(emu, rng):
    raw, held, _, tokens = make_case(rng, 2, 1000, "float32", np.int32)
    with pytest.raises(EmulatorError, match="race"):
        run_verify(
            emu, raw, "float32", tokens, 256, prefix="broken/barrier_without_memory_flag/"
        )


def test_skipped_barrier_is_reported_as_a_deadlock(emu, rng):
    raw, held, _, tokens = make_case(rng, 1, 40, "float32", np.int32)
    with pytest.raises(EmulatorError, match="verify_greedy_float32_int32.*deadlock") as e:
        run_verify(emu, raw, "float32", tokens, 64, prefix="broken/early_exit_skips_barrier/")
    assert re.search(r"threads 40-63 exited", str(e.value))


def test_wrong_shuffle_offset_gives_wrong_bundles(emu, rng):
    B = 24
    raw, held, _, tokens = make_case(rng, B, 64, "float32", np.int32)
    got = run_verify(emu, raw, "float32", tokens, 64, prefix="broken/wrong_shuffle_offset/")
    good = run_verify(emu, raw, "float32", tokens, 64)
    np.testing.assert_array_equal(good, reference_bundle(held, tokens))
    assert (got != good).any(), "a butterfly missing lanes 16-31 went unnoticed"


def test_tail_loop_one_short_misses_a_max_in_the_last_slot(emu, rng):
    B, V = 4, 777
    raw, held, _, tokens = make_case(rng, B, V, "float32", np.int32)
    raw = np.ascontiguousarray(np.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0))
    raw[:, :, V - 1] = raw.max() + 1.0  # every row's max sits in the tail
    got = run_verify(emu, raw, "float32", tokens, 256, prefix="broken/tail_one_short/")
    ref = reference_bundle(raw.astype(np.float64), tokens)
    assert (got[:, 2] != ref[:, 2]).all() and (got[:, 4] != ref[:, 4]).all()


def test_copy_overrun_is_reported_as_out_of_bounds(emu, rng):
    leaves = [rng.standard_normal((3, 37)).astype(np.float32)]
    outs = poisoned_like(rng, leaves)
    with pytest.raises(EmulatorError, match="out-of-bounds access to buffer"):
        emu.state_copy(leaves, outs, threads=32, prefix="broken/copy_overrun/")


def test_row_mask_off_by_one_is_caught(emu, rng):
    B = 6
    snap = [rng.standard_normal((B, 5)).astype(np.float32)]
    live = [rng.standard_normal((B, 5)).astype(np.float32)]
    mask = rng.random(B) < 0.5
    mask[:2] = [True, False]
    outs = poisoned_like(rng, snap)
    try:
        emu.state_copy(snap, outs, live=live, row_mask=mask, threads=32,
                       prefix="broken/mask_row_off_by_one/")
    except EmulatorError as e:
        assert "out-of-bounds" in str(e)
        return
    ref = np.where(mask[:, None], snap[0], live[0])
    assert outs[0].tobytes() != ref.tobytes()


def test_atomics_in_threadgroup_and_device_memory(emu, rng):
    groups, n = 3, 64
    x = rng.integers(0, 1000, groups * n).astype(np.uint32)
    total = np.zeros(1, np.uint32)
    hist = np.full((groups, 16), 0xDEADBEEF, np.uint32)
    emu.launch("probe/atomic_probe", (groups,), n, [x, total, hist])
    assert total[0] == x.sum()
    for g in range(groups):
        np.testing.assert_array_equal(
            hist[g], np.bincount(x[g * n : (g + 1) * n] % 16, minlength=16)
        )


def test_runaway_kernel_is_stopped_by_the_time_out_naming_it(emu):
    code = (
        "import sys, numpy as np; sys.path.insert(0, sys.argv[1]);"
        "from metal_shim.emulator import Emulator;"
        "Emulator(sys.argv[2]).launch('probe/spin_probe', (1,), 32,"
        " [np.zeros(1, np.int32)], timeout=1.0)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parents[1] / "tools"), str(emu.path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "probe/spin_probe did not finish within 1 s" in res.stderr


def test_half_and_bfloat_conversions_are_exact(emu, rng):
    n = 65536
    bits = np.arange(n, dtype=np.uint16)
    f = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -30, 20, n
    ).astype(np.float32)
    f[:4] = [np.inf, -np.inf, 0.0, -0.0]
    outs = [np.empty(n, np.float32), np.empty(n, np.float32)]
    outs += [np.empty(n, np.uint16), np.empty(n, np.uint16)]
    emu.launch("probe/convert_probe", (n // 1024,), 1024, [bits, bits, f, *outs])
    h = bits.view(np.float16)
    np.testing.assert_array_equal(outs[0], h.astype(np.float32))
    bf = np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(outs[1], bf)
    with np.errstate(over="ignore"):  # large floats round to half's inf
        np.testing.assert_array_equal(outs[2], f.astype(np.float16).view(np.uint16))
    to_bf = np.array(mx.array(f).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(outs[3], to_bf)


def test_host_sized_threadgroup_memory(emu, rng):
    n = 128
    x = rng.standard_normal(2 * n).astype(np.float32)
    data = x.copy()
    emu.launch("probe/tg_param_probe", (2,), n, [data], threadgroup_lengths=[4 * n])
    np.testing.assert_array_equal(data.reshape(2, n), x.reshape(2, n)[:, ::-1])


def test_threads_at_different_barriers_are_reported(emu):
    with pytest.raises(EmulatorError, match="different threadgroup barriers"):
        emu.launch("probe/split_barrier_probe", (1,), 32, [np.zeros(32, np.int32)])


def test_sampling_kernel_missing_barrier_is_reported_as_a_race(emu, rng):
    from mtplx_ext.sampling import SamplerConfig, pack_params

    B, V = 2, 500
    logits = rng.standard_normal((B, V)).astype(np.float32)
    params = pack_params(SamplerConfig(temperature=0.8, top_p=0.9), B)
    u = rng.random(B).astype(np.float32)
    out = np.full(B, -7, np.int32)
    scalar = lambda x: np.array([x], np.int32)  # noqa: E731
    args = [logits, u, params, None, None, out, scalar(V), scalar(0), scalar(0)]
    emu.launch("sample_tokens_float32_int32", (B,), 256, args)  # the real one runs clean
    with pytest.raises(EmulatorError, match="race|uninitialised"):
        emu.launch("broken/sampling_missing_barrier/sample_tokens_float32_int32", (B,), 256, args)
