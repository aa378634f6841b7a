"""mtplx_ext: fast, exact batched MTP speculative decoding on MLX.

The package is layered; each layer imports only the layers below it:

    _blas, _abi, _ext, _checks, shipped   the extension, its ABI check, argument checks
    sampling                             the sampler settings and the exact acceptance rule
    ops                                  typed wrappers of the fused primitives
    cache                                ragged KV, rollback / commit, row state, compiled steps
    models                               trunk helpers, MTP head layouts, MTPRuntime, mlx-lm patches
    checkpoints                          load / save / convert / quantize / random models
    decode                               policies, drafter, cycle, streams, statistics, the reference loop
    batching                             continuous batching: requests, admission, the Engine
    serve                                the OpenAI-compatible HTTP server
    train, benchmark, cli                tools: training, the bench harness, `mtplx-ext`

`__all__` is what a user calls: `load`, the generate functions, `Engine`,
`SamplerConfig` and the fused primitives; the runtime's building blocks
(fused and packed modules, ragged caches, compiled steps) are imported from
their modules.

Import `mtplx_ext` before `mlx.core` on Linux: it routes MLX's CPU matmuls to
OpenBLAS first (`mtplx_ext.BLAS` says which BLAS is in use).
"""

# Must run before mlx.core is first imported: on Linux it routes MLX's CPU
# matmuls to OpenBLAS. If mlx.core is already loaded it warns and leaves MLX's
# reference BLAS in place; `mtplx_ext.BLAS` says which BLAS is in use.
from mtplx_ext import _blas

BLAS: _blas.BlasStatus = _blas.load()

from mtplx_ext._abi import check_extension as _check_extension  # noqa: E402

_check_extension()

import warnings as _warnings  # noqa: E402

from mtplx_ext.sampling import SamplerConfig  # noqa: E402
from mtplx_ext.ops import (  # noqa: E402
    gated_delta_capture,
    pack_linear_weight,
    pack_quantized_weight,
    packed_linear,
    packed_quantized_linear,
    quantized_scaled_dot_product_attention,
    restore_state,
    rms_norm,
    rope,
    route_gated_delta,
    sample_tokens,
    scaled_dot_product_attention,
    snapshot_state,
    swiglu,
    unpack_linear_weight,
    verify_greedy,
    verify_greedy_chain,
    verify_sampled,
    verify_sampled_chain,
)
import importlib as _importlib  # noqa: E402

from mtplx_ext.models.runtime import MTPRuntime  # noqa: E402
from mtplx_ext.checkpoints import CheckpointError, init_random, load, save_runtime as save  # noqa: E402
from mtplx_ext.decode import BatchedDecodeResult, StreamResult  # noqa: E402
from mtplx_ext.batching import (  # noqa: E402
    Engine, EngineOptions, Event, Request, StepResult, generate_batched, generate_greedy_batched)

__version__ = "0.1.0"

__all__ = [
    "BLAS",
    "BatchedDecodeResult",
    "CheckpointError",
    "Engine",
    "EngineOptions",
    "Event",
    "MTPRuntime",
    "Request",
    "SamplerConfig",
    "StepResult",
    "StreamResult",
    "gated_delta_capture",
    "generate_batched",
    "generate_greedy_batched",
    "init_random",
    "load",
    "pack_quantized_weight",
    "pack_linear_weight",
    "packed_linear",
    "packed_quantized_linear",
    "restore_state",
    "quantized_scaled_dot_product_attention",
    "rms_norm",
    "rope",
    "route_gated_delta",
    "sample_tokens",
    "save",
    "scaled_dot_product_attention",
    "snapshot_state",
    "swiglu",
    "unpack_linear_weight",
    "verify_greedy",
    "verify_greedy_chain",
    "verify_sampled",
    "verify_sampled_chain",
]

#: Names that moved off the top level: still importable here, with a warning naming their module.
#: (The runtime's building blocks: `load` applies them; users who assemble a model by hand import them there.)
_MOVED = {
    "AttentionPatch": "mtplx_ext.models.mlx_lm_patches",
    "MlxLmPatch": "mtplx_ext.models.mlx_lm_patches",
    "patch_mlx_lm_attention": "mtplx_ext.models.mlx_lm_patches",
    "patch_mlx_lm_ops": "mtplx_ext.models.mlx_lm_patches",
    "patch_mlx_lm_swiglu": "mtplx_ext.models.mlx_lm_patches",
    "CompiledStep": "mtplx_ext.cache",
    "RaggedKVCache": "mtplx_ext.cache",
    "QuantizedRaggedKVCache": "mtplx_ext.cache",
    "FusedRMSNorm": "mtplx_ext.models.fused_modules",
    "FusedRoPE": "mtplx_ext.models.fused_modules",
    "FusedZeroCentredRMSNorm": "mtplx_ext.models.fused_modules",
    "fuse_cpu_ops": "mtplx_ext.models.fused_modules",
    "PackedLinear": "mtplx_ext.models.packed_linear",
    "pack_cpu_linears": "mtplx_ext.models.packed_linear",
    "unpack_cpu_linears": "mtplx_ext.models.packed_linear",
    "PackedQuantizedEmbedding": "mtplx_ext.models.packed_quantized",
    "PackedQuantizedLinear": "mtplx_ext.models.packed_quantized",
    "pack_cpu_quantized": "mtplx_ext.models.packed_quantized",
    "unpack_cpu_quantized": "mtplx_ext.models.packed_quantized",
}


def __getattr__(name: str):
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module 'mtplx_ext' has no attribute {name!r}")
    _warnings.warn(f"mtplx_ext.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(where), name)
