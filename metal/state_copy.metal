// Instantiations of the state copy kernel, as csrc/metal/state_copy.cpp
// names them.
#include "state_copy.h"

#define instantiate_state_copy(name, masked)              \
  template [[host_name(name)]] [[kernel]]                  \
  decltype(mtplx::state_copy<masked>) mtplx::state_copy<masked>;

instantiate_state_copy("state_copy", false)
instantiate_state_copy("state_copy_masked", true)
