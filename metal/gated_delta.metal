// Instantiations of the gated delta capture kernel. Host names:
// gated_delta_capture_<input dtype>_<state dtype>, as
// csrc/metal/gated_delta.cpp builds them.
#include "gated_delta.h"

#define instantiate_gated_delta(iname, itype, sname, stype)              \
  template [[host_name("gated_delta_capture_" #iname "_" #sname)]]       \
  [[kernel]] decltype(mtplx::gated_delta_capture<itype, stype>)          \
      mtplx::gated_delta_capture<itype, stype>;

#define instantiate_gated_delta_states(iname, itype)           \
  instantiate_gated_delta(iname, itype, float32, float)        \
  instantiate_gated_delta(iname, itype, float16, half)         \
  instantiate_gated_delta(iname, itype, bfloat16, bfloat)

instantiate_gated_delta_states(float32, float)
instantiate_gated_delta_states(float16, half)
instantiate_gated_delta_states(bfloat16, bfloat)
