"""Typed wrappers of the extension's primitives: argument checks, then one kernel each.

* `greedy_verify`: greedy verification of one draft or a depth-K chain, and the bundle;
* `sampled_verify`: the fused sampler and exact sampled verification (one draft or a chain);
* `state_copy`: device snapshot / masked restore of state leaves in one launch;
* `gated_delta`: the gated-delta rule over a chunk plus the state after every position,
  and the routing of mlx-lm's GatedDeltaNet through it;
* `fused`: single-node CPU RMSNorm, RoPE, attention (float or quantized KV) and SwiGLU;
* `linear`: Linear weights packed once and the CPU decode GEMM over them;
* `qlinear`: affine-quantized weights repacked once and the CPU's quantized GEMM (int8 dot products);
* `threads`: the CPU kernels' thread count.

Every wrapper raises TypeError / ValueError naming the bad argument before a
kernel touches memory.
"""

from mtplx_ext.ops.fused import (
    quantized_scaled_dot_product_attention,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    swiglu,
)
from mtplx_ext.ops.linear import pack_linear_weight, packed_linear, unpack_linear_weight
from mtplx_ext.ops.qlinear import pack_quantized_weight, packed_quantized_linear, unpack_quantized_weight
from mtplx_ext.ops.gated_delta import gated_delta_capture, route_gated_delta
from mtplx_ext.ops.state_copy import restore_state, snapshot_state
from mtplx_ext.ops.greedy_verify import verify_greedy, verify_greedy_chain
from mtplx_ext.ops.sampled_verify import row_uniforms, sample_tokens, sampler_params, verify_sampled, verify_sampled_chain

__all__ = [
    "gated_delta_capture",
    "pack_linear_weight",
    "pack_quantized_weight",
    "packed_linear",
    "packed_quantized_linear",
    "quantized_scaled_dot_product_attention",
    "restore_state",
    "rms_norm",
    "rope",
    "route_gated_delta",
    "row_uniforms",
    "sample_tokens",
    "sampler_params",
    "scaled_dot_product_attention",
    "snapshot_state",
    "swiglu",
    "unpack_linear_weight",
    "unpack_quantized_weight",
    "verify_greedy",
    "verify_greedy_chain",
    "verify_sampled",
    "verify_sampled_chain",
]
