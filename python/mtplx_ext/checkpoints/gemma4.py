"""Gemma 4 configs: transformers 5's per-layer settings mapped onto mlx-lm's fields; the multimodal wrapper.

transformers 5.2x writes the full-attention layers' head size (and K/V head
count) of a Gemma 4 text config as `per_layer_config` entries ({"5":
{"head_dim": 512}}); mlx-lm's `gemma4_text` reads `global_head_dim` and
`num_global_key_value_heads`. Without the mapping the full layers would be
built with mlx-lm's defaults and the weights would not fit (or, for a
matching default, load silently wrong). `map_per_layer_config` fills the
two fields, and refuses in one line an entry mlx-lm cannot express (a
per-layer setting of a sliding layer that differs from the global one, two
full layers that differ, a key it does not know).

Gemma 4 targets as published are multimodal (`model_type` `gemma4`,
`Gemma4ForConditionalGeneration`: a vision / audio tower and a
`language_model`). Text decoding runs the language model alone, so
`wrapper_config` / `text_only` build mlx-lm's wrapper (whose sanitize drops
the towers and renames the language model's weights), load it, and hand on
its `gemma4_text` model with a text config: from there a wrapped target is
the same runtime as a `gemma4_text` one, drafter included.
"""

from __future__ import annotations

from typing import Any

from mtplx_ext._checks import CheckpointError

#: Model types whose text config may carry `per_layer_config`.
GEMMA4_TYPES = ("gemma4", "gemma4_text", "gemma4_assistant")
_FULL_FIELD = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


def _map_scope(scope: dict, where: str) -> None:
    plc = scope.get("per_layer_config")
    if not plc:
        return
    if not isinstance(plc, dict):
        raise CheckpointError(f"{where}: per_layer_config must be an object, got {type(plc).__name__}")
    types = scope.get("layer_types")
    if not isinstance(types, list):
        raise CheckpointError(f"{where}: per_layer_config needs layer_types (a list of layer types)")
    full: dict[str, Any] = {}
    for key, entry in plc.items():
        if not str(key).isdigit() or not 0 <= int(key) < len(types) or not isinstance(entry, dict):
            raise CheckpointError(f"{where}: per_layer_config.{key} is not an entry of a layer in layer_types")
        kind = types[int(key)]
        for name, v in entry.items():
            field = f"per_layer_config.{key}.{name}"
            if name not in _FULL_FIELD:
                raise CheckpointError(f"{where}: {field} is not supported (supported: {', '.join(_FULL_FIELD)})")
            if kind != "full_attention":
                if v != scope.get(name):
                    raise CheckpointError(f"{where}: {field} = {v!r} differs from {name} = {scope.get(name)!r} on a {kind} layer")
                continue
            if full.setdefault(name, v) != v:
                raise CheckpointError(f"{where}: {field} = {v!r} differs from another full_attention layer's {full[name]!r}")
    kv = full.get("num_key_value_heads")
    if kv is not None and not scope.get("attention_k_eq_v") and kv != scope.get("num_key_value_heads"):
        # mlx-lm gives full layers their own K/V head count only with attention_k_eq_v.
        raise CheckpointError(
            f"{where}: per_layer_config num_key_value_heads = {kv!r} on full_attention layers needs attention_k_eq_v"
        )
    for name, v in full.items():
        own = _FULL_FIELD[name]
        if scope.get(own) not in (None, v):
            raise CheckpointError(f"{where}: {own} = {scope[own]!r} contradicts per_layer_config {name} = {v!r}")
        scope[own] = v


#: The multimodal wrapper's model_type (its language model is a `gemma4_text`).
WRAPPER_TYPE = "gemma4"


def is_wrapper(config: dict) -> bool:
    return config.get("model_type") == WRAPPER_TYPE


def wrapper_config(config: dict, where: str = "config") -> dict:
    """A `gemma4` wrapper config with the top-level `vocab_size` mlx-lm's wrapper reads.

    transformers keeps the vocabulary size in `text_config` only; mlx-lm's
    wrapper copies its own top-level field (default 262144, the released
    models') over it, which would build a wrong-sized table for any other
    vocabulary. Raises CheckpointError for a wrapper without a text config.
    """
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: a gemma4 config needs text_config (an object)")
    if "vocab_size" not in config and "vocab_size" in text:
        config = {**config, "vocab_size": text["vocab_size"]}
    return config


def _strip_prefix(quantization: Any) -> Any:
    if not isinstance(quantization, dict):
        return quantization
    out = {}
    for k, v in quantization.items():
        out[k.removeprefix("language_model.") if isinstance(v, dict) else k] = v
    return out


def text_only(trunk: Any, config: dict) -> tuple[Any, dict]:
    """(the wrapper's `gemma4_text` model, its config as a `gemma4_text` config), weights loaded.

    The config keeps the wrapper's `quantization` with per-layer entries
    renamed to the language model's paths.
    """
    text = {**trunk.args.text_config, "model_type": "gemma4_text"}
    if "quantization" in config:
        text["quantization"] = _strip_prefix(config["quantization"])
    return trunk.language_model, text


def map_per_layer_config(config: dict, where: str = "config") -> dict:
    """`config` (changed in place, and returned) with Gemma 4 `per_layer_config` mapped.

    Configs of other families are returned unchanged.
    """
    if config.get("model_type") not in GEMMA4_TYPES:
        return config
    _map_scope(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _map_scope(text, f"{where}: text_config")
    return config


__all__ = ["GEMMA4_TYPES", "WRAPPER_TYPE", "is_wrapper", "map_per_layer_config", "text_only", "wrapper_config"]
