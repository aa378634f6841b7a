"""The process-wide context a decode runs in: wired memory, fused attention, gated-delta routing.

mlx-lm's model modules call module-level functions (attention, the gated
delta rule), so routing them through this package's fused ops is a
process-wide patch, undone when the decode ends. Fixed-batch generation and
the continuous-batching engine both decode inside `decode_session`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mtplx_ext.models.mla import MLA_FAMILIES, patch_mla_one_formula
from mtplx_ext.models.mlx_lm_patches import patch_mlx_lm_ops
from mtplx_ext.ops import gated_delta


def fused_attention(runtime: Any) -> Any:
    """mlx-lm's attention and SwiGLU through the fused ops, for runtimes that opted into fused CPU ops."""
    if getattr(runtime, "cpu_ops_fused", False):
        return patch_mlx_lm_ops()
    return contextlib.nullcontext()


def one_mla_formula(runtime: Any) -> Any:
    """DeepSeek-V3 trunks' attention in one formula for plain steps and verifications (`models.mla`)."""
    if getattr(runtime, "model_type", None) in MLA_FAMILIES:
        return patch_mla_one_formula()
    return contextlib.nullcontext()


def route_recurrent(route: bool) -> Any:
    """GatedDeltaNet layers through the capture op (or nothing)."""
    return gated_delta.route_gated_delta() if route else contextlib.nullcontext()


def gated_delta_trunk(runtime: Any) -> bool:
    """Whether every recurrent layer is a GatedDeltaNet the capture routes."""
    trunk = getattr(runtime, "trunk", None)
    layers = getattr(getattr(trunk, "model", None), "layers", None)
    if layers is None:
        return False
    rec = [l for l in layers if getattr(l, "is_linear", False)]
    return bool(rec) and all(
        hasattr(getattr(l, "linear_attn", None), "conv1d") and hasattr(l.linear_attn, "A_log") for l in rec
    )


#: Why a trunk whose recurrent layers the capture cannot route cannot commit per stream.
NOT_CAPTURABLE = (
    "the {} trunk has recurrent layers that are not GatedDeltaNet layers; continuous batching of a hybrid "
    "needs the gated-delta capture (qwen3_next / qwen3_5 trunks) to commit and move each stream's recurrent state"
)


def has_recurrent_layers(runtime: Any) -> bool:
    """Whether the runtime's trunk has recurrent layers (True when it cannot say)."""
    flag = getattr(runtime, "has_recurrent_layers", None)
    return True if flag is None else bool(flag)


def kv_setting(runtime: Any, kv: tuple[int, int] | None) -> Any:
    """The runtime's caches made with keys and values quantized as kv = (bits, group size) (or as set)."""
    return contextlib.nullcontext() if kv is None else runtime.kv_quantization(*kv)


@contextlib.contextmanager
def decode_session(runtime: Any, route: bool, kv: tuple[int, int] | None = None) -> Iterator[None]:
    """Wired memory (mlx-lm's `wired_limit`), fused attention, with `route` gated-delta routing, with `kv` the
    caches' KV quantization (`kv_setting`), and DeepSeek-V3's attention in one formula for a plain step and a
    verification alike (`models.mla`: else MTP would equal plain decoding only up to rounding)."""
    from mlx_lm.generate import wired_limit  # noqa: PLC0415  (mlx_lm.generate imports much)

    with wired_limit(runtime), fused_attention(runtime), route_recurrent(route), kv_setting(runtime, kv), \
            one_mla_formula(runtime):
        yield


__all__ = [
    "decode_session",
    "one_mla_formula",
    "fused_attention",
    "gated_delta_trunk",
    "has_recurrent_layers",
    "kv_setting",
    "route_recurrent",
]
