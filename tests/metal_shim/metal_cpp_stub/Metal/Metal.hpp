// Declarations-only stand-in for Apple's metal-cpp, just enough for MLX's
// Metal backend headers: lets the test suite compile the eval_gpu glue in
// csrc/metal/ with -fsyntax-only on Linux against MLX's real headers.
#pragma once

#include <cstddef>

namespace NS {
using UInteger = unsigned long;
class Error;
class String;
class AutoreleasePool;
template <class T>
class SharedPtr {
 public:
  T* get() const;
  T* operator->() const;
};
} // namespace NS

namespace MTL {
enum DataType : NS::UInteger {};
struct Size {
  Size(NS::UInteger width, NS::UInteger height, NS::UInteger depth);
  NS::UInteger width, height, depth;
};
class Allocation;
class Resource;
class Buffer;
class Fence;
class Function;
class LinkedFunctions;
class Library;
class Device;
class CommandQueue;
class CommandBuffer;
class ResidencySet;
class ComputePipelineState {
 public:
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
};
class ComputeCommandEncoder {
 public:
  void setComputePipelineState(const ComputePipelineState* state);
  void setBytes(const void* bytes, NS::UInteger length, NS::UInteger index);
  void setThreadgroupMemoryLength(NS::UInteger length, NS::UInteger index);
};
} // namespace MTL
