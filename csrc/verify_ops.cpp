#include "verify_ops.h"

#include <string>

#include "arg_checks.h"
#include "mtplx_rules.h"
#include "verify_primitives.h"

namespace mtplx {

mx::array verify_greedy(
    const mx::array& verify_logits,
    const mx::array& tokens,
    mx::StreamOrDevice s) {
  check_verify_logits(verify_logits);
  const int B = verify_logits.shape(0);
  const int V = verify_logits.shape(2);
  if (tokens.ndim() != 2 || tokens.shape(0) != B || tokens.shape(1) != 2) {
    bad_arg(
        "tokens must have shape [B, 2] = (" + std::to_string(B) +
        ", 2) to match verify_logits, got " + shape_str(tokens.shape()));
  }
  auto st = mx::to_stream(s);
  auto tok = token_ids("tokens", tokens, st);
  auto logits = mx::contiguous(verify_logits, false, st);
  return mx::array(
      {B, 5},
      mx::int32,
      std::make_shared<VerifyGreedy>(st),
      {logits, tok});
}

std::vector<mx::Shape> VerifyGreedy::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), 5}};
}

mx::array verify_greedy_chain(
    const mx::array& verify_logits,
    const mx::array& tokens,
    const std::optional<mx::array>& logit_bias_ids,
    const std::optional<mx::array>& logit_bias_values,
    mx::StreamOrDevice s) {
  const int K = check_chain_logits(verify_logits, kMaxChainDrafts);
  const int B = verify_logits.shape(0);
  if (tokens.ndim() != 2 || tokens.shape(0) != B ||
      tokens.shape(1) != K + 1) {
    bad_arg(
        "tokens must have shape [B, K + 1] = (" + std::to_string(B) + ", " +
        std::to_string(K + 1) + ") to match verify_logits, got " +
        shape_str(tokens.shape()));
  }
  auto st = mx::to_stream(s);
  auto tok = token_ids("tokens", tokens, st);
  auto logits = mx::contiguous(verify_logits, false, st);
  std::vector<mx::array> inputs = {logits, tok};
  const int V = verify_logits.shape(2);
  auto bias = logit_bias_inputs(logit_bias_ids, logit_bias_values, B, V, st);
  inputs.insert(inputs.end(), bias.begin(), bias.end());
  return mx::array(
      {B, K + 3},
      mx::int32,
      std::make_shared<VerifyGreedyChain>(st, !bias.empty()),
      std::move(inputs));
}

std::vector<mx::Shape> VerifyGreedyChain::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1) + 2}};
}

} // namespace mtplx
