#include "metal/device.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#ifdef MTPLX_METAL_EMBEDDED
#include "metal/embedded_source.h"
#endif

namespace mtplx::metal {

const std::string& module_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<const void*>(&module_dir), &info) ||
        info.dli_fname == nullptr) {
      throw std::runtime_error(
          "mtplx_ext: cannot locate the extension module to load "
          "mtplx_ext.metallib");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

MTL::ComputePipelineState* get_kernel(
    mx::metal::Device& d,
    const std::string& name) {
#ifdef MTPLX_METAL_EMBEDDED
  // Built without the metallib: MLX compiles the embedded source once, on
  // first use, and caches the library by name.
  auto* lib = d.get_library(
      "mtplx_ext", [] { return std::string(embedded_source()); });
#else
  // A path ending in .metallib is loaded as is (MLX caches it by name).
  auto* lib = d.get_library("mtplx_ext", module_dir() + "/mtplx_ext.metallib");
#endif
  return d.get_kernel(name, lib);
}

} // namespace mtplx::metal
