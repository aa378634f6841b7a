"""mtplx_ext: fast, exact batched MTP speculative decoding on MLX."""

# Must run before mlx.core is first imported: on Linux it routes MLX's CPU
# matmuls to OpenBLAS. If mlx.core is already loaded it warns and leaves MLX's
# reference BLAS in place; `mtplx_ext.BLAS` says which BLAS is in use.
from mtplx_ext import _blas

BLAS: _blas.BlasStatus = _blas.load()

from mtplx_ext._abi import check_extension as _check_extension  # noqa: E402

_check_extension()

from mtplx_ext.state import restore_state, snapshot_state  # noqa: E402
from mtplx_ext.verify import verify_greedy, verify_greedy_chain  # noqa: E402
from mtplx_ext.sampling import SamplerConfig  # noqa: E402
from mtplx_ext.sampled import sample_tokens, verify_sampled, verify_sampled_chain  # noqa: E402
from mtplx_ext.ragged_cache import RaggedKVCache  # noqa: E402
from mtplx_ext.gated_delta import gated_delta_capture, route_gated_delta  # noqa: E402
from mtplx_ext.compiled_step import CompiledStep  # noqa: E402
from mtplx_ext.runtime import MTPRuntime  # noqa: E402
from mtplx_ext.checkpoint import CheckpointError, init_random, load  # noqa: E402
from mtplx_ext.fused import (  # noqa: E402
    AttentionPatch,
    MlxLmPatch,
    FusedRMSNorm,
    FusedRoPE,
    FusedZeroCentredRMSNorm,
    fuse_cpu_ops,
    patch_mlx_lm_attention,
    patch_mlx_lm_ops,
    patch_mlx_lm_swiglu,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    swiglu,
)
from mtplx_ext.engine import (  # noqa: E402
    BatchedDecodeResult,
    StreamResult,
    generate_batched,
    generate_greedy_batched,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionPatch",
    "MlxLmPatch",
    "FusedRMSNorm",
    "FusedRoPE",
    "FusedZeroCentredRMSNorm",
    "fuse_cpu_ops",
    "patch_mlx_lm_attention",
    "patch_mlx_lm_ops",
    "patch_mlx_lm_swiglu",
    "rms_norm",
    "rope",
    "scaled_dot_product_attention",
    "swiglu",
    "BatchedDecodeResult",
    "StreamResult",
    "generate_batched",
    "generate_greedy_batched",
    "BLAS",
    "CheckpointError",
    "CompiledStep",
    "MTPRuntime",
    "RaggedKVCache",
    "gated_delta_capture",
    "route_gated_delta",
    "init_random",
    "load",
    "SamplerConfig",
    "sample_tokens",
    "verify_sampled",
    "verify_sampled_chain",
    "restore_state",
    "snapshot_state",
    "verify_greedy",
    "verify_greedy_chain",
]
