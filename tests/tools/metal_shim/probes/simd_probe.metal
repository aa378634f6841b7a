// Emulator self-test kernels: each lane records what the simd-group functions
// return, so the tests can compare the emulator with Metal's documented
// semantics computed in numpy. Never built into the metallib.
#include <metal_stdlib>

using namespace metal;

constant int kProbeCols = 14;

[[kernel]] void simd_probe(
    const device int* in [[buffer(0)]],
    device int* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  int x = in[gid];
  device int* o = out + gid * kProbeCols;
  o[0] = simd_sum(x);
  o[1] = simd_max(x);
  o[2] = simd_min(x);
  o[3] = simd_prefix_inclusive_sum(x);
  o[4] = simd_prefix_exclusive_sum(x);
  o[5] = simd_shuffle_down(x, 3);
  o[6] = simd_shuffle_up(x, 5);
  o[7] = simd_shuffle_xor(x, 6);
  o[8] = simd_broadcast(x, 7);
  o[9] = simd_shuffle(x, ushort((lane * 7) % 32));
  o[10] = int(uint(ulong(simd_ballot(x > 0)) & 0xFFFFFFFFul));
  o[11] = int(simd_any(x > 40)) + 2 * int(simd_all(x > -40));
  o[12] = 0;
  if (lane < 16) {
    o[12] = simd_sum(x); // divergent: only the lower half is active
  }
  o[13] = simd_shuffle_rotate_down(x, 30);
}

// Reads the per-thread values back through threadgroup memory, correctly
// synchronised: must run clean.
[[kernel]] void tg_probe(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[1024];
  shared[tid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = shared[(tid + 1) % n];
}

// Shuffle with a lane-dependent offset: Metal requires it uniform.
[[kernel]] void nonuniform_shuffle_probe(
    device int* out [[buffer(0)]],
    uint gid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  out[gid] = simd_shuffle_down(int(gid), ushort(lane & 1));
}

// Histogram in threadgroup atomics plus a device-wide atomic total.
[[kernel]] void atomic_probe(
    const device uint* in [[buffer(0)]],
    volatile device atomic_uint* total [[buffer(1)]],
    device uint* hist_out [[buffer(2)]],
    uint gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint group [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint hist[16];
  if (tid < 16) {
    atomic_store_explicit(&hist[tid], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint v = in[gid];
  atomic_fetch_add_explicit(&hist[v % 16], 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, v, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) {
    hist_out[group * 16 + tid] =
        atomic_load_explicit(&hist[tid], memory_order_relaxed);
  }
}

// Never finishes while flag[0] == 0: the launch time-out must fire.
[[kernel]] void spin_probe(
    const device int* flag [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]]) {
  int x = int(lane);
  while (flag[0] == 0) {
    x = simd_sum(x) & 1;
  }
}

// The shim's half and bfloat conversions, element by element.
[[kernel]] void convert_probe(
    const device half* h [[buffer(0)]],
    const device bfloat* b [[buffer(1)]],
    const device float* f [[buffer(2)]],
    device float* h_to_f [[buffer(3)]],
    device float* b_to_f [[buffer(4)]],
    device half* f_to_h [[buffer(5)]],
    device bfloat* f_to_b [[buffer(6)]],
    uint i [[thread_position_in_grid]]) {
  h_to_f[i] = float(h[i]);
  b_to_f[i] = float(b[i]);
  f_to_h[i] = half(f[i]);
  f_to_b[i] = bfloat(f[i]);
}

// Threadgroup memory sized by the host ([[threadgroup(0)]]): reversal.
[[kernel]] void tg_param_probe(
    device float* data [[buffer(0)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint n [[threads_per_threadgroup]]) {
  scratch[tid] = data[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[gid] = scratch[n - 1 - tid];
}

// Half the threads wait at one barrier, half at another.
[[kernel]] void split_barrier_probe(
    device int* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1;
}
