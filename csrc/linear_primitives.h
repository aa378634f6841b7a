// PackedLinear: y = x W^T over a weight packed once into panels
// (cpu/packed_gemm.h), the decode-time Linear product on MLX's CPU backend.
// CPU only: the op refuses GPU streams (MLX's Metal matmul needs no packing).
// Inference only: there is no vjp / jvp (training uses nn.Linear).
#pragma once

#include <vector>

#include "mlx/primitives.h"

namespace mtplx {

namespace mx = mlx::core;

// Inputs: x [..., K] float32, w_packed [P, K, kPackedPanel] float32, any
// strides (eval_cpu gathers an input that is not row contiguous). Output: [..., N]
// float32, row contiguous.
class PackedLinear : public mx::UnaryPrimitive {
 public:
  PackedLinear(mx::Stream stream, int n) : mx::UnaryPrimitive(stream), n_(n) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PackedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return n_ == static_cast<const PackedLinear&>(other).n_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = n_;
    return {shape};
  }
  int n() const {
    return n_;
  }

 private:
  int n_;
};

// PackedQuantizedLinear: y = x W^T over an affine-quantized weight repacked
// for the CPU's integer dot products (cpu/qgemm.h). CPU only, inference only.
// Inputs: x [..., K] float32 / float16 / bfloat16, wq [P, G, S * 256] uint8,
// sb [P, G, 2, 64] (scales, biases) float32 / float16 / bfloat16. Output:
// [..., n] in the promoted dtype of x and sb (as mx.quantized_matmul).
class PackedQuantizedLinear : public mx::UnaryPrimitive {
 public:
  PackedQuantizedLinear(mx::Stream stream, int n, int group_size, int bits)
      : mx::UnaryPrimitive(stream), n_(n), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PackedQuantizedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedQuantizedLinear&>(other);
    return n_ == o.n_ && group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = n_;
    return {shape};
  }

 private:
  int n_, group_size_, bits_;
};

// PackedQuantizedRows: rows `ids` of a weight packed by cpu/qgemm.h's layout
// (an embedding lookup: only those rows are read). Inputs: wq [P, G, S *
// 256] uint8, sb [P, G, 2, 64], ids (int32, any shape). Outputs: the rows in
// MLX's affine format, words uint32 [..., K * bits / 32], scales and biases
// [..., G] in sb's dtype, bit for bit what mx.quantize stored; or, with
// `dequantize`, the rows' values [..., K] in sb's dtype, bit for bit what
// mx.dequantize gives (q * s, rounded to the dtype, + b, rounded). An id
// outside [0, n) reads row 0 or n - 1 (clamped, never out of bounds).
class PackedQuantizedRows : public mx::Primitive {
 public:
  PackedQuantizedRows(
      mx::Stream stream,
      int n,
      int group_size,
      int bits,
      bool dequantize)
      : mx::Primitive(stream),
        n_(n),
        group_size_(group_size),
        bits_(bits),
        dequantize_(dequantize) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "PackedQuantizedRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedQuantizedRows&>(other);
    return n_ == o.n_ && group_size_ == o.group_size_ && bits_ == o.bits_ &&
        dequantize_ == o.dequantize_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int n_, group_size_, bits_;
  bool dequantize_;
};

} // namespace mtplx
