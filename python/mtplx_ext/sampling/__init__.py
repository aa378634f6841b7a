"""Sampled decoding's one definition: the sampler settings and the exact acceptance rule.

* `config`: `SamplerConfig` (every field checked once, in float32's range)
  and `pack_params`, the [B, 7] rows the kernels read (`pack_logit_bias`:
  the padded [B, M] logit bias);
* `reference`: the rule itself (transforms, inverse-CDF draws, the min(1, p/q)
  acceptance and the residual resample, depth-K chains) as NumPy float64
  functions, the reference the fused primitives are tested against.
"""

from mtplx_ext.sampling.config import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    PARAM_COLUMNS,
    TOP_K_LIMIT,
    SamplerConfig,
    check_field,
    check_logit_bias,
    pack_logit_bias,
    pack_params,
)
from mtplx_ext.sampling.reference import (
    MAX_COUNT,
    RowCycle,
    RowTransform,
    biased_logits,
    clamp_uniform,
    counts_with,
    distribution_from_logits,
    greedy_chain_row,
    penalised_logits,
    row_is_valid,
    sample_from,
    sample_mtp_chain_row,
    sample_mtp_row_cycle,
    transform_row,
    verify_one_token,
)

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_COUNT",
    "MAX_LOGIT_BIAS",
    "PARAM_COLUMNS",
    "TOP_K_LIMIT",
    "RowCycle",
    "RowTransform",
    "SamplerConfig",
    "biased_logits",
    "check_field",
    "check_logit_bias",
    "clamp_uniform",
    "counts_with",
    "distribution_from_logits",
    "greedy_chain_row",
    "pack_logit_bias",
    "pack_params",
    "penalised_logits",
    "row_is_valid",
    "sample_from",
    "sample_mtp_chain_row",
    "sample_mtp_row_cycle",
    "transform_row",
    "verify_one_token",
]
