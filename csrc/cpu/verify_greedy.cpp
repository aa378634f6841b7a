#include <cstdint>

#include "cpu/row_argmax.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/dtype.h"
#include "primitives.h"

namespace mtplx {

namespace {

template <typename TokT>
void verify_rows(
    const void* logits,
    mx::Dtype dtype,
    const TokT* tokens,
    int32_t* out,
    int B,
    int V) {
  for (int b = 0; b < B; ++b) {
    cpu::RowArgmax r[2];
    for (int p = 0; p < 2; ++p) {
      size_t off = (size_t(b) * 2 + p) * size_t(V);
      if (dtype == mx::float32) {
        r[p] = cpu::row_argmax_f32(
            static_cast<const uint32_t*>(logits) + off, V);
      } else if (dtype == mx::float16) {
        r[p] = cpu::row_argmax_f16(
            static_cast<const uint16_t*>(logits) + off, V);
      } else {
        r[p] = cpu::row_argmax_bf16(
            static_cast<const uint16_t*>(logits) + off, V);
      }
    }
    int64_t x0 = tokens[2 * b];
    int64_t draft = tokens[2 * b + 1];
    bool x0_ok = x0 >= 0 && x0 < V;
    bool draft_ok = draft >= 0 && draft < V;
    int32_t* row = out + size_t(b) * kBundleCols;
    row[kColX0] = x0_ok ? int32_t(x0) : kInvalid;
    row[kColDraft] = draft_ok ? int32_t(draft) : kInvalid;
    row[kColSecond] = r[0].index;
    row[kColBonus] = r[1].index;
    bool usable = x0_ok && draft_ok && r[0].valid && r[1].valid;
    row[kColAccept] = usable ? int32_t(draft == r[0].index) : kInvalid;
  }
}

} // namespace

void VerifyGreedy::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0];
  auto& tokens = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(logits);
  enc.set_input_array(tokens);
  enc.set_output_array(out);
  enc.dispatch([logits = mx::array::unsafe_weak_copy(logits),
                tokens = mx::array::unsafe_weak_copy(tokens),
                out = mx::array::unsafe_weak_copy(out)]() mutable {
    const int B = logits.shape(0);
    const int V = logits.shape(2);
    const void* lp = logits.data<void>();
    int32_t* op = out.data<int32_t>();
    if (tokens.dtype() == mx::int32) {
      verify_rows(lp, logits.dtype(), tokens.data<int32_t>(), op, B, V);
    } else {
      verify_rows(lp, logits.dtype(), tokens.data<int64_t>(), op, B, V);
    }
  });
}

} // namespace mtplx
