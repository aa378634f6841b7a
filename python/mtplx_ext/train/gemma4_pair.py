"""A tiny Gemma 4 pair: a `gemma4_text` target and a `gemma4_assistant` drafter, their objectives.

The target is mlx-lm's `gemma4_text` (sliding and full attention layers, the
last `kv_shared` layers reusing the K/V of the last earlier layer of their
type, soft-capped tied logits), trained with next-token cross-entropy.

The assistant is the package's `Gemma4Assistant` (pre_projection, q-only
layers over the target's K/V, norm, tied LM head, post_projection), trained
against the frozen target with every position of a window in parallel. For
a [B, T] window x_0 .. x_{T-1} the target runs once (no gradient) and gives
its final-normed hidden states h_t, its logits and the K/V of its source
layers (`gemma4_trunk.kv_sources`). The engine's first draft step at
position p (x_p just committed, not yet forwarded) reads
concat(scaled_embed(x_p), h_{p-1}), queries at RoPE position p over the
target's K/V of positions < p (sliding layers: the last window + 1 of them,
`gemma4_assistant.frozen_kv`'s rule) and predicts x_{p+1}; step 2 reads
post_projection of step 1's normed state and the next token's embedding at
the same position over the same K/V. `assistant_logits` computes exactly
that for p = 1 .. T-1 in one call of `Gemma4Assistant.step` (L queries per
row, a [L, T] mask, RoPE offset 1), so the trained computation is the
drafted one; tests/train compare it with the engine's step-by-step drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from mtplx_ext.checkpoints import assistant as assistant_ckpt
from mtplx_ext.checkpoints import build_runtime
from mtplx_ext.models import gemma4_trunk
from mtplx_ext.models.gemma4_assistant import LAYOUT, FrozenKV, Gemma4Assistant, visible_keys
from mtplx_ext.models.runtime import MTPRuntime

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class TargetShape:
    """The target's architecture (written to its config.json)."""

    vocab_size: int = 2048
    hidden: int = 160
    layers: int = 6
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 32
    global_head_dim: int = 64
    intermediate: int = 480
    #: Keys a sliding layer sees; smaller than the prompts, so decoding goes past it.
    sliding_window: int = 48
    #: Every `full_every`-th layer is full attention, the others sliding.
    full_every: int = 3
    #: The last layers that reuse an earlier layer's K/V (as Gemma 4 does).
    kv_shared: int = 2
    softcap: float = 30.0


def layer_types(layers: int, full_every: int) -> list[str]:
    """[sliding] * (full_every - 1) + [full], repeated over `layers` (Gemma's pattern)."""
    return [FULL if (i + 1) % full_every == 0 else SLIDING for i in range(layers)]


def check_target_shape(s: TargetShape) -> None:
    """Refuses a shape mlx-lm cannot build or an assistant cannot draft for, naming the field.

    Raises:
        ValueError: naming the field.
    """
    for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "global_head_dim",
                 "intermediate", "sliding_window", "full_every"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(s, name)}")
    if s.heads % s.kv_heads:
        raise ValueError(f"heads = {s.heads} must be a multiple of kv_heads = {s.kv_heads}")
    if s.head_dim % 2 or s.global_head_dim % 8:
        raise ValueError("head_dim must be even and global_head_dim a multiple of 8 (RoPE over a quarter of it)")
    types = layer_types(s.layers, s.full_every)
    stored = types[: s.layers - s.kv_shared]
    if not 0 <= s.kv_shared < s.layers or set(types) != {SLIDING, FULL} or set(stored) != {SLIDING, FULL}:
        raise ValueError(
            f"layers = {s.layers}, full_every = {s.full_every}, kv_shared = {s.kv_shared}: the layers that store "
            "K/V must include both a sliding and a full attention layer (an assistant reads one of each)"
        )


def target_config(s: TargetShape) -> dict:
    """config.json of the target (mlx-lm `gemma4_text`, no per-layer inputs, no MTP head)."""
    check_target_shape(s)
    config = {
        "model_type": "gemma4_text",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "global_head_dim": s.global_head_dim,
        "num_kv_shared_layers": s.kv_shared,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "sliding_window": s.sliding_window,
        "layer_types": layer_types(s.layers, s.full_every),
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "final_logit_softcapping": s.softcap,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "mtp_head_layout": None,
    }
    # mlx-lm's per-layer-type RoPE defaults, written out so the folder states them.
    config["rope_parameters"] = gemma4_text.ModelArgs.from_dict(config).rope_parameters
    return config


def build_target(s: TargetShape, tokenizer: Any = None) -> MTPRuntime:
    """A randomly initialised target runtime (float32, no head), through the package's loader.

    The embedding rows get norm ~1 (std 1 / sqrt(hidden)): the input is
    scaled by sqrt(hidden), so it starts at unit RMS, and the tied logits of
    RMS-normed states start at unit scale.
    """
    rt = build_runtime(target_config(s), tokenizer=tokenizer)
    emb = rt.trunk.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape, scale=1.0 / math.sqrt(s.hidden))
    mx.eval(rt.parameters())
    return rt


@dataclass
class AssistantShape:
    """The assistant's decoder (its `text_config`); the rest follows from the target."""

    hidden: int = 160
    #: Layer types, comma-separated: each must have a K/V-storing layer in the target.
    types: str = "sliding_attention,full_attention"
    heads: int = 4
    intermediate: int = 320


def assistant_config(target: MTPRuntime, s: AssistantShape) -> dict:
    """config.json of an assistant drafting for `target` (head sizes and window are the target's)."""
    t = target.trunk.args
    kinds = [k.strip() for k in s.types.split(",") if k.strip()]
    sources = gemma4_trunk.kv_sources(target.trunk)
    for k in kinds:
        if k not in sources:
            raise ValueError(f"assistant layer type {k!r}: the target has no {k} layer storing K/V")
    text = {
        "model_type": "gemma4_text",
        "vocab_size": t.vocab_size,
        "hidden_size": s.hidden,
        "num_hidden_layers": len(kinds),
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "global_head_dim": t.global_head_dim,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "sliding_window": t.sliding_window,
        "layer_types": kinds,
        "use_double_wide_mlp": False,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": t.rope_parameters,
    }
    return {"model_type": LAYOUT, "backbone_hidden_size": t.hidden_size, "tie_word_embeddings": True,
            "text_config": text}


def build_assistant(target: MTPRuntime, s: AssistantShape) -> tuple[Gemma4Assistant, dict]:
    """A random assistant for `target` and its config (checked against the target).

    With the target's width its embedding (the tied LM head) starts as the
    target's: both map the same tokens, so the head starts where the
    target's is.
    """
    config = assistant_config(target, s)
    a = assistant_ckpt.build_assistant(config, None, "assistant config", target.trunk)
    if s.hidden == target.trunk.args.hidden_size:
        a.model.embed_tokens.weight = mx.array(target.trunk.model.embed_tokens.weight)
    mx.eval(a.parameters())
    return a, config


# -- the frozen target's states ------------------------------------------------


@dataclass
class TargetStates:
    """One forward of the target over [B, T] tokens.

    Attributes:
        logits: [B, T, V] soft-capped logits (position t predicts token t + 1).
        hidden: [B, T, H] final-normed hidden states (what the engine hands a draft step).
        kv: layer type -> (keys, values) [B, H_kv, T, D] of its source layer, RoPE applied.
    """

    logits: mx.array
    hidden: mx.array
    kv: dict[str, tuple[mx.array, mx.array]]


def target_states(trunk: nn.Module, tokens: mx.array) -> TargetStates:
    """mlx-lm's `gemma4_text` forward (same modules, same order, no cache), keeping K/V and hidden.

    Raises:
        ValueError: a trunk with per-layer inputs (E2B / E4B), which this does not feed.
    """
    inner = trunk.model
    if inner.hidden_size_per_layer_input:
        raise ValueError("targets with per-layer inputs are not supported here")
    h, inter = gemma4_trunk.hidden_and_kv(trunk, tokens, None, inner.embed_tokens(tokens))
    normed = inner.norm(h)
    logits = gemma4_trunk.softcap(trunk, inner.embed_tokens.as_linear(normed))
    kv = {kind: inter[i][0] for kind, i in gemma4_trunk.kv_sources(trunk).items()}
    return TargetStates(logits, normed, kv)


def window_masks(T: int, kinds: list[str], window: int) -> dict[str, mx.array]:
    """Layer type -> [T - 1, T] bool: query row p - 1 (position p = 1 .. T-1) sees keys s < p;
    sliding layers only s >= p - (window + 1), as `gemma4_assistant.frozen_kv` masks a draft step."""
    s = mx.arange(T)[None]
    p = mx.arange(1, T)[:, None]
    return {kind: visible_keys(s, p, kind, window) for kind in dict.fromkeys(kinds)}


def frozen_window(states: TargetStates, kinds: list[str], window: int) -> FrozenKV:
    """The target's K/V seen by draft steps at every position p = 1 .. T-1 at once (RoPE offset 1)."""
    T = states.hidden.shape[1]
    kv = {k: states.kv[k] for k in dict.fromkeys(kinds)}
    return FrozenKV(kv, window_masks(T, kinds, window), 1)


def draft_steps(
    assistant: Gemma4Assistant, embeds: mx.array, hidden: mx.array, frozen: FrozenKV, depth: int
) -> list[mx.array]:
    """Logits of chained draft steps 1..depth, all positions at once.

    Args:
        embeds: [B, L, H] scaled target embeddings of the tokens at the L query
            positions; step k at row j reads row j + k - 1 (the token after
            step k - 1's draft).
        hidden: [B, L, H] the state step 1 reads at each of the L query positions.
        frozen: K/V and [L, S] masks of the L positions.

    Returns:
        depth arrays [B, L - k + 1, V] (step k has no next token for its last k - 1 rows).
    """
    L = hidden.shape[1]
    out, h = [], hidden
    for k in range(1, depth + 1):
        n = L - k + 1
        f = frozen if k == 1 else FrozenKV(frozen.kv, {t: m[:n] for t, m in frozen.masks.items()}, frozen.offset)
        logits, h = assistant.step(embeds[:, k - 1 : k - 1 + n], h[:, :n], f)
        out.append(logits)
    return out


def assistant_logits(
    assistant: Gemma4Assistant, trunk: nn.Module, tokens: mx.array, states: TargetStates, depth: int
) -> list[mx.array]:
    """The engine's draft steps 1..depth at every position p = 1 .. T-1 of [B, T] tokens.

    Step 1 at p reads (x_p, h_{p-1}); step k at p reads step k - 1's state and
    x_{p+k-1}. Row j of step k's logits is position p = j + 1, predicting
    x_{p+k}; its teacher is the target's logits at position p + k - 1.
    """
    a = assistant.args.text
    embeds = gemma4_trunk.scaled_embed(trunk, trunk.model.embed_tokens(tokens))
    frozen = frozen_window(states, assistant.layer_types, a.sliding_window)
    return draft_steps(assistant, embeds[:, 1:], states.hidden[:, :-1], frozen, depth)


# -- losses --------------------------------------------------------------------


def target_loss(trunk: nn.Module, seq: mx.array) -> tuple[mx.array, tuple[mx.array]]:
    """Next-token cross-entropy of the target on [B, T + 1] windows: (loss, (loss,))."""
    logits = trunk(seq[:, :-1]).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, seq[:, 1:], reduction="mean")
    return ce, (ce,)


def step_losses(steps: list[mx.array], seq: mx.array, teacher: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Per draft step k: (cross-entropy against the data's x_{p+k}, cross-entropy against the
    target's distribution at p + k - 1), means over rows.

    Args:
        steps: `assistant_logits` of [B, T] tokens.
        seq: the [B, T + 1] window the tokens are the first T of.
        teacher: [B, T, V] the target's logits over the tokens.
    """
    out = []
    for k, logits in enumerate(steps, start=1):
        n = logits.shape[1]
        logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
        data = seq[:, 1 + k : 1 + k + n]
        ce = -mx.take_along_axis(logp, data[..., None], axis=-1).mean()
        q = mx.softmax(teacher[:, k : k + n].astype(mx.float32), axis=-1)
        out.append((ce, -(q * logp).sum(axis=-1).mean()))
    return out


def frozen_states(trunk: nn.Module, tokens: mx.array) -> TargetStates:
    """`target_states` with every output cut from the gradient (the target stays as it is)."""
    st = target_states(trunk, tokens)
    kv = {k: (mx.stop_gradient(kk), mx.stop_gradient(vv)) for k, (kk, vv) in st.kv.items()}
    return TargetStates(mx.stop_gradient(st.logits), mx.stop_gradient(st.hidden), kv)


def assistant_loss(
    assistant: Gemma4Assistant, trunk: nn.Module, seq: mx.array, depth: int, distill: float
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """The assistant's loss on [B, T + 1] windows, the target frozen (no gradient reaches it).

    Step k at position p (k = 1..depth) predicts x_{p+k}: its target is
    `distill` x the target's distribution at p + k - 1 (drafts are accepted
    when they match the target, not the data) + (1 - distill) x the data's
    token. The loss is the mean over steps.

    Returns:
        (loss, (step-1 cross-entropy against the data, step-1 cross-entropy against the target)).
    """
    tokens = seq[:, :-1]
    states = frozen_states(trunk, tokens)
    parts = step_losses(assistant_logits(assistant, trunk, tokens, states, depth), seq, states.logits)
    loss = sum((1.0 - distill) * ce + distill * soft for ce, soft in parts) / len(parts)
    return loss, parts[0]


__all__ = [
    "AssistantShape", "TargetShape", "TargetStates", "assistant_config", "assistant_logits", "assistant_loss",
    "build_assistant", "build_target", "check_target_shape", "draft_steps", "frozen_states", "frozen_window",
    "layer_types", "step_losses", "target_config", "target_loss", "target_states", "window_masks",
]
