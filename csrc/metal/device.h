// Access to mtplx_ext's own Metal kernels (macOS builds only).
#pragma once

#include <string>

#include "mlx/backend/metal/device.h"

namespace mtplx::metal {

namespace mx = mlx::core;

// Directory of the loaded extension module, where mtplx_ext.metallib is
// installed next to it.
const std::string& module_dir();

// Pipeline state of the kernel with this host name, from mtplx_ext.metallib
// or, in builds that embed the kernel source, from that source.
MTL::ComputePipelineState* get_kernel(
    mx::metal::Device& d,
    const std::string& name);

} // namespace mtplx::metal
