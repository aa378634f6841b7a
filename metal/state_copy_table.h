// Layout shared by the state copy kernel (metal/state_copy.h) and its host
// code (csrc/metal/state_copy_plan.h): one table row per leaf of a launch.
#pragma once

#ifndef __METAL_VERSION__
#include <cstdint>
#endif

#include "mtplx_rules.h"

namespace mtplx {

#ifndef __METAL_VERSION__
using ulong = uint64_t;
#endif

// Leaves bound per launch: three buffers per leaf (snapshot, live, out) plus
// the table and the row mask stay under Metal's 31 buffer slots.
MTPLX_CONST int kMaxCopyLeaves = 8;
// Copy units handled by each thread of a threadgroup.
MTPLX_CONST int kCopyUnitsPerThread = 4;

struct LeafCopy {
  ulong n_units; // units (1 << unit_log2 bytes) in the leaf
  uint row_units; // units per batch row: the row mask's granularity
  uint unit_log2; // 0..4: copy as uchar, ushort, uint, uint2 or uint4
};

} // namespace mtplx
