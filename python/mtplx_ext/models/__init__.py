"""MTP head layouts (one module each) and the trunk helpers they share.

Each layout module exposes `LAYOUT`, `DEFAULT_HIDDEN_SOURCE`,
`ModelArgs.from_config(config)`, `detect(weights, config)`,
`layer_prefix(config, i)` (where MTP layer i's tensors sit), `is_head_key(config,
key)` (a tensor of any MTP layer) and `Model(args, trunk, module=0, first=None)`
(an `MTPHead` with `sanitize` / `checkpoint_weights`; module i > 0 of a
checkpoint with several MTP layers is built with the first as `first`).
"""

from __future__ import annotations

from types import ModuleType

from mtplx_ext.models import deepseek_head, mimo_head, qwen3_next_head

_LAYOUTS: dict[str, ModuleType] = {
    qwen3_next_head.LAYOUT: qwen3_next_head,
    deepseek_head.LAYOUT: deepseek_head,
    mimo_head.LAYOUT: mimo_head,
}

# Head layout a family's own checkpoints use; anything else gets qwen3_next.
FAMILY_DEFAULT_LAYOUT = {
    "qwen3": "qwen3_next",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "deepseek_v3": "deepseek",
    "glm4_moe": "deepseek",
    "mimo": "mimo",
}


def layout_module(layout: str) -> ModuleType:
    """The module implementing a head layout.

    Raises:
        ValueError: naming the unknown layout and the supported ones.
    """
    try:
        return _LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown head_layout {layout!r}; supported: {', '.join(_LAYOUTS)} or None"
        ) from None


def detect_layout(weights: dict, config: dict) -> str | None:
    """The head layout whose weights a checkpoint holds, or None."""
    for name, mod in _LAYOUTS.items():
        if mod.detect(weights, config):
            return name
    return None

