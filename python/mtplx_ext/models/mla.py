"""DeepSeek-V3's multi-head latent attention with one formula for every decode-sized query block.

mlx-lm's `DeepseekV3Attention` computes attention two ways: a single query
(L == 1) attends in the latent space (the query goes through `embed_q`, the
output through `unembed_out`: the weights absorbed), a longer block expands
the cached latents into keys and values first. The two are equal in exact
arithmetic only. A verification forward of K + 1 tokens would take the
second way while plain decoding takes the first, so MTP would commit what
plain decoding commits only up to rounding: at 4 bits with half-precision
activations the logits differ by about 1e-2 and near-ties flip. Decoding
runs with `patch_mla_one_formula()`: blocks of up to `ABSORBED_MAX_L`
queries (every verification and plain step) take the absorbed way, longer
ones (prompt chunks) mlx-lm's own code. A single query computes exactly what
mlx-lm computes.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

from mtplx_ext._checks import MAX_DRAFTS
from mtplx_ext.models.mlx_lm_patches import MlxLmPatch

#: Longest query block computed the absorbed way: a verification of the most drafts, x0 included.
ABSORBED_MAX_L = MAX_DRAFTS + 1

_MODULE, _CLASS = "mlx_lm.models.deepseek_v3", "DeepseekV3Attention"
#: Trunk families (`MTPRuntime.model_type`) whose attention this routes.
MLA_FAMILIES = frozenset({"deepseek_v3"})


def _absorbed(attn: Any, x: mx.array, mask: mx.array | None, cache: Any, sdpa: Any) -> mx.array:
    """MLA of the queries of `x` against the cached latents, the projections absorbed (mlx-lm's L == 1 way)."""
    B, L, _ = x.shape
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)
    offset = cache.offset if cache is not None else 0
    q_pe, k_pe = attn.rope(q_pe, offset), attn.rope(k_pe, offset)
    if cache is not None:
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
    # The rotary part of the scores rides in as the additive mask of the latent attention.
    scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = sdpa(attn.embed_q(q_nope), latent, latent, cache=cache, scale=attn.scale, mask=scores)
    out = attn.unembed_out(out)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def patch_mla_one_formula() -> MlxLmPatch:
    """Routes mlx-lm's DeepSeek-V3 attention: up to `ABSORBED_MAX_L` queries the absorbed way, longer blocks
    mlx-lm's own code; undone by the handle's `undo()` (a `with` block). Inactive where mlx-lm has no such
    model or a patch is already in place."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        return MlxLmPatch([])
    cls = getattr(module, _CLASS, None)
    original = getattr(cls, "__call__", None)
    if original is None or getattr(original, "mtplx_router", False):
        return MlxLmPatch([])

    def one_formula(self: Any, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] > ABSORBED_MAX_L:
            return original(self, x, mask=mask, cache=cache)
        return _absorbed(self, x, mask, cache, module.scaled_dot_product_attention)

    one_formula.mtplx_router = True  # type: ignore[attr-defined]
    cls.__call__ = one_formula
    return MlxLmPatch([("__call__", original, one_formula, [cls])])


__all__ = ["ABSORBED_MAX_L", "MLA_FAMILIES", "patch_mla_one_formula"]
