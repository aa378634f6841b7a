"""RoPE settings of configs written by transformers 5, mapped onto the fields mlx-lm reads.

transformers 5 keeps every RoPE setting in one `rope_parameters` dict
(`rope_type`, `rope_theta`, the scaling fields, `partial_rotary_factor`);
mlx-lm 0.32's model classes mostly read the older top-level `rope_theta`,
`rope_scaling` and `partial_rotary_factor`. A folder saved by transformers 5
then loads with mlx-lm's defaults, silently wrong (DeepSeek-V3), or not at
all (GLM-4.5). `map_rope_parameters` fills the top-level fields from
`rope_parameters` (the config itself and its `text_config`); a RoPE type
mlx-lm does not implement, or top-level fields that contradict
`rope_parameters`, are refused in one line instead.
"""

from __future__ import annotations

from typing import Any

from mtplx_ext._checks import CheckpointError

#: RoPE types mlx-lm implements (`mlx_lm.models.rope_utils.initialize_rope`
#: and DeepSeek's own YaRN path).
SUPPORTED_ROPE_TYPES = (
    "default", "linear", "dynamic", "llama3", "yarn", "deepseek_yarn", "longrope", "proportional", "mrope",
)
#: Fields of `rope_parameters` that are top-level fields of their own in mlx-lm's configs.
_OWN_FIELDS = ("rope_theta", "partial_rotary_factor")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _map_scope(scope: dict, where: str) -> None:
    rp = scope.get("rope_parameters")
    if rp is None:
        return
    if not isinstance(rp, dict):
        raise CheckpointError(f"{where}: rope_parameters must be an object, got {type(rp).__name__}")
    if rp and all(isinstance(v, dict) for v in rp.values()):
        # Per attention type (sliding / full): the families that use it read it themselves.
        return
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope_parameters.rope_type {rope_type!r} is not supported by mlx-lm "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    for name in _OWN_FIELDS:
        if name not in rp:
            continue
        if scope.get(name) is not None and not _same(scope[name], rp[name]):
            raise CheckpointError(
                f"{where}: {name} = {scope[name]!r} contradicts rope_parameters.{name} = {rp[name]!r}"
            )
        scope[name] = rp[name]
    scaling = {k: v for k, v in rp.items() if k not in _OWN_FIELDS}
    if rope_type == "default":
        scope.setdefault("rope_scaling", None)  # a required field of some families (glm4_moe)
        return
    scaling.setdefault("rope_type", rope_type)
    scaling.setdefault("type", rope_type)
    old = scope.get("rope_scaling")
    if old is not None:
        for k, v in old.items() if isinstance(old, dict) else ():
            if k in scaling and not _same(scaling[k], v):
                raise CheckpointError(
                    f"{where}: rope_scaling.{k} = {v!r} contradicts rope_parameters.{k} = {scaling[k]!r}"
                )
    scope["rope_scaling"] = {**(old if isinstance(old, dict) else {}), **scaling}


def map_rope_parameters(config: dict, where: str = "config") -> dict:
    """`config` (changed in place, and returned) with `rope_parameters` mapped onto mlx-lm's fields.

    Raises:
        CheckpointError: an unsupported RoPE type, or top-level fields that
            contradict `rope_parameters` (naming both).
    """
    _map_scope(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _map_scope(text, f"{where}: text_config")
    return config


__all__ = ["SUPPORTED_ROPE_TYPES", "map_rope_parameters"]
