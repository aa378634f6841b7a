// Test fixture, deliberately broken: the row mask is read one row late.
// A copy of metal/state_copy.h with one change; the emulator tests must
// catch it. Never built into the metallib.
#include <metal_stdlib>

#include "state_copy_table.h"

using namespace metal;

namespace mtplx {

template <typename P>
inline P pick_leaf(uint slot, P p0, P p1, P p2, P p3, P p4, P p5, P p6, P p7) {
  switch (slot) {
    case 0:
      return p0;
    case 1:
      return p1;
    case 2:
      return p2;
    case 3:
      return p3;
    case 4:
      return p4;
    case 5:
      return p5;
    case 6:
      return p6;
    default:
      return p7;
  }
}

// Copies units [begin, end) of one leaf; with Masked, row r takes the
// snapshot where row_mask[r] is set and the live value elsewhere.
template <typename U, bool Masked>
inline void copy_units(
    const device uchar* snap,
    const device uchar* live,
    device uchar* out,
    const device bool* row_mask,
    ulong begin,
    ulong end,
    uint row_units,
    uint tid,
    uint tg_size) {
  const device U* s = (const device U*)snap;
  const device U* l = (const device U*)live;
  device U* d = (device U*)out;
  for (ulong j = begin + tid; j < end; j += tg_size) {
    if (Masked) {
      d[j] = row_mask[j / row_units + 1] ? s[j] : l[j];
    } else {
      d[j] = s[j];
    }
  }
}

// Unmasked: out = snap for every leaf (snapshot_state, restore_state without
// a mask; `live` and `row_mask` are not read). Masked: per-row select.
template <bool Masked>
[[kernel]] void state_copy(
    const device uchar* snap0 [[buffer(0)]],
    const device uchar* snap1 [[buffer(1)]],
    const device uchar* snap2 [[buffer(2)]],
    const device uchar* snap3 [[buffer(3)]],
    const device uchar* snap4 [[buffer(4)]],
    const device uchar* snap5 [[buffer(5)]],
    const device uchar* snap6 [[buffer(6)]],
    const device uchar* snap7 [[buffer(7)]],
    const device uchar* live0 [[buffer(8)]],
    const device uchar* live1 [[buffer(9)]],
    const device uchar* live2 [[buffer(10)]],
    const device uchar* live3 [[buffer(11)]],
    const device uchar* live4 [[buffer(12)]],
    const device uchar* live5 [[buffer(13)]],
    const device uchar* live6 [[buffer(14)]],
    const device uchar* live7 [[buffer(15)]],
    device uchar* out0 [[buffer(16)]],
    device uchar* out1 [[buffer(17)]],
    device uchar* out2 [[buffer(18)]],
    device uchar* out3 [[buffer(19)]],
    device uchar* out4 [[buffer(20)]],
    device uchar* out5 [[buffer(21)]],
    device uchar* out6 [[buffer(22)]],
    device uchar* out7 [[buffer(23)]],
    constant LeafCopy* table [[buffer(24)]],
    const device bool* row_mask [[buffer(25)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint tg_size [[threads_per_threadgroup]]) {
  const uint slot = group.y;
  const LeafCopy leaf = table[slot];
  const ulong per_group = ulong(tg_size) * kCopyUnitsPerThread;
  const ulong begin = ulong(group.x) * per_group;
  if (begin >= leaf.n_units) {
    return; // a shorter leaf than the grid's longest
  }
  const ulong end =
      begin + per_group < leaf.n_units ? begin + per_group : leaf.n_units;

  auto snap = pick_leaf(
      slot, snap0, snap1, snap2, snap3, snap4, snap5, snap6, snap7);
  auto live = pick_leaf(
      slot, live0, live1, live2, live3, live4, live5, live6, live7);
  auto out =
      pick_leaf(slot, out0, out1, out2, out3, out4, out5, out6, out7);
  const uint rows = leaf.row_units;
  switch (leaf.unit_log2) {
    case 0:
      copy_units<uchar, Masked>(
          snap, live, out, row_mask, begin, end, rows, tid, tg_size);
      break;
    case 1:
      copy_units<ushort, Masked>(
          snap, live, out, row_mask, begin, end, rows, tid, tg_size);
      break;
    case 2:
      copy_units<uint, Masked>(
          snap, live, out, row_mask, begin, end, rows, tid, tg_size);
      break;
    case 3:
      copy_units<uint2, Masked>(
          snap, live, out, row_mask, begin, end, rows, tid, tg_size);
      break;
    default:
      copy_units<uint4, Masked>(
          snap, live, out, row_mask, begin, end, rows, tid, tg_size);
      break;
  }
}

} // namespace mtplx

template [[host_name("state_copy")]] [[kernel]]
decltype(mtplx::state_copy<false>) mtplx::state_copy<false>;
template [[host_name("state_copy_masked")]] [[kernel]]
decltype(mtplx::state_copy<true>) mtplx::state_copy<true>;
