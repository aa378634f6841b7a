#include "linear_ops.h"

#include <string>

#include "arg_checks.h"
#include "cpu/packed_gemm.h"
#include "cpu/qgemm.h"
#include "linear_primitives.h"
#include "mlx/ops.h"

namespace mtplx {

namespace {

// n, the weight's rows, must fill the P panels of `panel` columns, the last
// one at least partly.
void check_n(int n, int64_t P, int panel) {
  if (n <= (P - 1) * panel || n > P * panel) {
    bad_arg(
        "n must be in (" + std::to_string((P - 1) * panel) + ", " +
        std::to_string(P * panel) + "] for " + std::to_string(P) +
        " panels, got " + std::to_string(n));
  }
}

void check_packed(const mx::array& w_packed, int n) {
  if (w_packed.dtype() != mx::float32) {
    bad_arg("w_packed must be float32");
  }
  if (w_packed.ndim() != 3 || w_packed.shape(2) != kPackedPanel ||
      w_packed.shape(0) < 1 || w_packed.shape(1) < 1) {
    bad_arg(
        "w_packed must have shape [P, K, " + std::to_string(kPackedPanel) +
        "] with P, K >= 1, got " + shape_str(w_packed.shape()));
  }
  check_n(n, w_packed.shape(0), kPackedPanel);
}

} // namespace

mx::array pack_linear_weight(const mx::array& weight, mx::StreamOrDevice s) {
  if (weight.dtype() != mx::float32) {
    bad_arg("weight must be float32");
  }
  if (weight.ndim() != 2 || weight.shape(0) < 1 || weight.shape(1) < 1) {
    bad_arg(
        "weight must have shape [N, K] with N, K >= 1, got " +
        shape_str(weight.shape()));
  }
  const int N = weight.shape(0), K = weight.shape(1);
  const int P = (N + kPackedPanel - 1) / kPackedPanel;
  mx::array w = weight;
  if (P * kPackedPanel != N) {
    w = mx::pad(
        w,
        {{0, P * kPackedPanel - N}, {0, 0}},
        mx::array(0.0f),
        "constant",
        s);
  }
  w = mx::reshape(w, {P, kPackedPanel, K}, s);
  return mx::contiguous(mx::transpose(w, {0, 2, 1}, s), false, s);
}

mx::array unpack_linear_weight(
    const mx::array& w_packed,
    int n,
    mx::StreamOrDevice s) {
  check_packed(w_packed, n);
  const int P = w_packed.shape(0), K = w_packed.shape(1);
  auto w = mx::reshape(
      mx::transpose(w_packed, {0, 2, 1}, s), {P * kPackedPanel, K}, s);
  return mx::contiguous(mx::slice(w, {0, 0}, {n, K}, s), false, s);
}

mx::array packed_linear(
    const mx::array& x,
    const mx::array& w_packed,
    int n,
    mx::StreamOrDevice s) {
  check_packed(w_packed, n);
  if (x.dtype() != mx::float32) {
    bad_arg("x must be float32");
  }
  if (x.ndim() < 1 || x.shape(-1) != w_packed.shape(1)) {
    bad_arg(
        "x must have shape [..., K] with K = w_packed.shape[1] = " +
        std::to_string(w_packed.shape(1)) + ", got " + shape_str(x.shape()));
  }
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    bad_arg("packed_linear runs on the CPU only (stream is a GPU stream)");
  }
  auto shape = x.shape();
  shape.back() = n;
  return mx::array(
      shape,
      mx::float32,
      std::make_shared<PackedLinear>(st, n),
      {x, w_packed});
}

const char* packed_linear_isa() {
  return cpu::packed_gemm_isa();
}

std::string set_packed_linear_isa(const std::string& isa) {
  return cpu::set_packed_gemm_isa(isa);
}

namespace {

// `a` for a kernel that reads it as a dense array: packed weights already
// are (a Contiguous node only for a lazy or strided argument).
mx::array dense(const mx::array& a, mx::Stream st) {
  return a.is_available() && a.flags().row_contiguous
      ? a
      : mx::contiguous(a, false, st);
}

// The packed weight's checks shared by the quantized ops; returns (P, G).
std::pair<int, int> check_packed_quantized(
    const mx::array& wq,
    const mx::array& sb,
    int group_size,
    int bits) {
  if (bits < 2 || bits > 8 || bits == 7) {
    bad_arg("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    bad_arg(
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (wq.dtype() != mx::uint8) {
    bad_arg("wq must be uint8");
  }
  const int block = group_size / cpu::q_step_k(bits) * 256;
  if (wq.ndim() != 3 || wq.shape(0) < 1 || wq.shape(1) < 1 ||
      wq.shape(2) != block) {
    bad_arg(
        "wq must have shape [P, G, " + std::to_string(block) +
        "] with P, G >= 1 for group_size " + std::to_string(group_size) +
        " and bits " + std::to_string(bits) + ", got " +
        shape_str(wq.shape()));
  }
  const int P = wq.shape(0), G = wq.shape(1);
  if (sb.dtype() != mx::float32 && sb.dtype() != mx::float16 &&
      sb.dtype() != mx::bfloat16) {
    bad_arg("sb must be float32, float16 or bfloat16");
  }
  if (sb.ndim() != 4 || sb.shape(0) != P || sb.shape(1) != G ||
      sb.shape(2) != 2 || sb.shape(3) != kQPanel) {
    bad_arg(
        "sb must have shape [" + std::to_string(P) + ", " + std::to_string(G) +
        ", 2, " + std::to_string(kQPanel) + "] to match wq, got " +
        shape_str(sb.shape()));
  }
  return {P, G};
}

} // namespace

mx::array packed_quantized_linear(
    const mx::array& x,
    const mx::array& wq,
    const mx::array& sb,
    int n,
    int group_size,
    int bits,
    const std::vector<mx::array>& prefetch,
    mx::StreamOrDevice s) {
  const auto [P, G] = check_packed_quantized(wq, sb, group_size, bits);
  check_n(n, P, kQPanel);
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 &&
      x.dtype() != mx::bfloat16) {
    bad_arg("x must be float32, float16 or bfloat16");
  }
  const int K = G * group_size;
  if (x.ndim() < 1 || x.shape(-1) != K) {
    bad_arg(
        "x must have shape [..., K] with K = G * group_size = " +
        std::to_string(K) + ", got " + shape_str(x.shape()));
  }
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    bad_arg(
        "packed_quantized_linear runs on the CPU only (stream is a GPU "
        "stream)");
  }
  std::vector<mx::array> inputs = {x, dense(wq, st), dense(sb, st)};
  if (!prefetch.empty()) {
    const bool pair = prefetch.size() == 2;
    if (!pair || prefetch[0].dtype() != mx::uint8 || prefetch[0].ndim() != 3 ||
        prefetch[0].shape(0) < 1 || prefetch[0].size() == 0 ||
        prefetch[1].ndim() != 4 ||
        prefetch[1].shape(0) != prefetch[0].shape(0)) {
      bad_arg(
          "prefetch must be empty or the (wq, sb) pair of a packed weight: "
          "uint8 [P, G, block] and [P, G, 2, 64]");
    }
    inputs.push_back(dense(prefetch[0], st));
    inputs.push_back(dense(prefetch[1], st));
  }
  auto shape = x.shape();
  shape.back() = n;
  return mx::array(
      shape,
      mx::promote_types(x.dtype(), sb.dtype()),
      std::make_shared<PackedQuantizedLinear>(st, n, group_size, bits),
      std::move(inputs));
}

namespace {

std::vector<mx::array> quantized_rows(
    const mx::array& wq,
    const mx::array& sb,
    const mx::array& ids,
    int n,
    int group_size,
    int bits,
    bool dequantize,
    mx::StreamOrDevice s) {
  const auto [P, G] = check_packed_quantized(wq, sb, group_size, bits);
  check_n(n, P, kQPanel);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) {
    bad_arg("ids must be an integer array");
  }
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    bad_arg(
        "packed_quantized_rows runs on the CPU only (stream is a GPU stream)");
  }
  const mx::array rows = ids.dtype() == mx::int32
      ? dense(ids, st)
      : mx::contiguous(mx::astype(ids, mx::int32, st), false, st);
  auto prim =
      std::make_shared<PackedQuantizedRows>(st, n, group_size, bits, dequantize);
  std::vector<mx::array> in = {dense(wq, st), dense(sb, st), rows};
  auto shapes = prim->output_shapes(in);
  if (dequantize) {
    return mx::array::make_arrays(shapes, {sb.dtype()}, prim, in);
  }
  return mx::array::make_arrays(
      shapes, {mx::uint32, sb.dtype(), sb.dtype()}, prim, in);
}

} // namespace

std::vector<mx::array> packed_quantized_rows(
    const mx::array& wq,
    const mx::array& sb,
    const mx::array& ids,
    int n,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  return quantized_rows(wq, sb, ids, n, group_size, bits, false, s);
}

mx::array packed_quantized_embedding(
    const mx::array& wq,
    const mx::array& sb,
    const mx::array& ids,
    int n,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  return quantized_rows(wq, sb, ids, n, group_size, bits, true, s)[0];
}

std::vector<mx::Shape> PackedQuantizedRows::output_shapes(
    const std::vector<mx::array>& inputs) {
  const int G = inputs[0].shape(1);
  auto shape = inputs[2].shape();
  if (dequantize_) {
    shape.push_back(G * group_size_);
    return {shape};
  }
  auto gshape = shape;
  shape.push_back(G * group_size_ * bits_ / 32);
  gshape.push_back(G);
  return {shape, gshape, gshape};
}

void PackedQuantizedRows::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error("PackedQuantizedRows has no GPU kernel");
}

const char* packed_quantized_linear_isa() {
  return cpu::qgemm_isa();
}

std::string set_packed_quantized_linear_isa(const std::string& isa) {
  return cpu::set_qgemm_isa(isa);
}

void PackedQuantizedLinear::eval_gpu(
    const std::vector<mx::array>&,
    mx::array&) {
  throw std::runtime_error("PackedQuantizedLinear has no GPU kernel");
}

void PackedLinear::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("PackedLinear has no GPU kernel");
}

} // namespace mtplx
