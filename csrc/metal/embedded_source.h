// The Metal kernels as one source string, for macOS builds without
// mtplx_ext.metallib (no Xcode metal compiler). Defined by the C++ file that
// cmake/embed_metal.py generates from metal/*.metal.
#pragma once

#include <string_view>

namespace mtplx::metal {

std::string_view embedded_source();

} // namespace mtplx::metal
