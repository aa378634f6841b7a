"""Function-preserving growth of a qwen3 + MTP model folder into a bigger one.

`grow` turns a small trained model (by default the shipped tiny-qwen3-mtp)
into one that is `width` times wider and `depth` times deeper and computes
the same logits, trunk and head alike, up to float rounding. Its trained head
therefore keeps its real acceptance while a decode step has to stream
gigabytes of weights, as it does for real checkpoints, instead of running out
of the CPU caches.

Widening by w duplicates every width: a residual vector h becomes
[h, h, ..., h] (w copies), every attention head and KV head is repeated w
times (copy c of query head j reads copy c of its own KV head, so the GQA
grouping is kept), the MLP gets w copies of its units. A layer reading a
duplicated width takes 1/w of its weight per copy, so the sum over copies is
the original product; RMSNorm of [h, ..., h] equals RMSNorm of h (its weight
is tiled). The output projection reads the duplicated final hidden: the
embedding is tiled (not divided) and the untied lm_head is the tiled
embedding / w. The head's fc reads concat(norm_e(e), norm_h(h)), which the
grown model forms as [e]*w + [h]*w, so each half of fc is tiled on its own.

Deepening by d follows each original trunk layer with d - 1 copies of it
whose output projections (o_proj, down_proj) are zero: in a pre-norm residual
net such a block adds exactly 0, yet it costs a real layer's compute, weight
traffic and KV cache. The head is not deepened.

The result is an ordinary mlx-lm `qwen3` folder (`mlx_lm.load` reads the
trunk) plus the head in `mtp.safetensors`, written shard by shard (peak
memory about one shard), deterministically (same inputs, same bytes).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mtplx_ext._checks import CheckpointError, as_int
from mtplx_ext.checkpoints.loading import HEAD_FILE, INDEX_FILE, build_runtime, check_config, read_weights
from mtplx_ext.checkpoints.saving import head_checkpoint_weights, write_config
from mtplx_ext.shipped import SHIPPED_MODEL

#: The command that makes a grown folder (`mtplx_ext.cli.grow`); its README quotes it.
PROG = "mtplx-ext grow"

#: Storage dtypes of the grown weights (computed in float32, then cast).
DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

#: Trunk shard size; a shard is built in memory, then written.
DEFAULT_SHARD_BYTES = 512 * 2**20

#: Files besides the weights copied verbatim from the source folder.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)

# Per-head norms (their width is head_dim, which is not duplicated).
_HEAD_DIM_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Projections reading the residual width H (their input columns are split).
_READ_RESIDUAL = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight")
# Projections writing the residual (zero in an inserted block).
_WRITE_RESIDUAL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


# -- the per-tensor rules -----------------------------------------------------
# Each takes the source tensor (float32) and the width factor w.


def _tile_norm(a: np.ndarray, w: int) -> np.ndarray:
    """RMSNorm weight over a duplicated vector: tiled (the mean square is unchanged)."""
    return np.tile(a, w)


def _tile_embedding(a: np.ndarray, w: int) -> np.ndarray:
    """[V, H] -> [V, wH]: each token's vector becomes [e, ..., e]."""
    return np.tile(a, (1, w))


def _split_columns(a: np.ndarray, w: int) -> np.ndarray:
    """[O, I] -> [wO, wI]: outputs duplicated, each input copy weighted 1/w."""
    return np.tile(a / np.float32(w), (w, w))


def _lm_head(a: np.ndarray, w: int) -> np.ndarray:
    """[V, H] -> [V, wH]: reads w copies of the final hidden, 1/w each."""
    return np.tile(a / np.float32(w), (1, w))


def _fc(a: np.ndarray, w: int) -> np.ndarray:
    """[H, 2H] -> [wH, 2wH] over concat([e]*w, [h]*w): each half split on its own."""
    h = a.shape[1] // 2
    return np.concatenate([_split_columns(a[:, :h], w), _split_columns(a[:, h:], w)], axis=1)


def _keep(a: np.ndarray, w: int) -> np.ndarray:
    return a


def _zero_output(a: np.ndarray) -> np.ndarray:
    """An inserted block's output projection: zero, so the block adds nothing."""
    return np.zeros_like(a)


# -- the plan -----------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor of the grown folder: its name, shape and how to make it."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


@dataclass
class Plan:
    """Everything `grow` writes, checked and sized before anything is written."""

    config: dict
    trunk: list[Tensor]
    head: list[Tensor]
    itemsize: int

    def nbytes(self, tensors: list[Tensor]) -> int:
        return sum(int(np.prod(t.shape)) * self.itemsize for t in tensors)


def _rule(name: str, shape: tuple[int, ...], cfg: dict) -> tuple[Callable[[np.ndarray, int], np.ndarray], tuple]:
    """The rule for a source tensor and the shape it must have (errors name the tensor)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    hd, I = cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if name == "model.embed_tokens.weight":
        return _tile_embedding, (V, H)
    if name == "lm_head.weight":
        return _lm_head, (V, H)
    if name == "mtp.fc.weight":
        return _fc, (H, 2 * H)
    if name in ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                "mtp.pre_fc_norm_hidden.weight"):
        return _tile_norm, (H,)
    layer = name.split(".", 3)[-1] if name.startswith(("model.layers.", "mtp.layers.")) else None
    outs = {"self_attn.q_proj.weight": nq * hd, "self_attn.k_proj.weight": nkv * hd,
            "self_attn.v_proj.weight": nkv * hd, "mlp.gate_proj.weight": I, "mlp.up_proj.weight": I}
    if layer in _LAYER_NORMS:
        return _tile_norm, (H,)
    if layer in _HEAD_DIM_NORMS:
        return _keep, (hd,)
    if layer in _READ_RESIDUAL:
        return _split_columns, (outs[layer], H)
    if layer in _WRITE_RESIDUAL:
        return _split_columns, (H, nq * hd if layer.startswith("self_attn") else I)
    raise CheckpointError(f"grow has no width rule for tensor {name!r} (shape {shape}); only dense qwen3 layers grow")


def _source(path: Path) -> tuple[dict, dict[str, mx.array]]:
    """The source's config and tensors under checkpoint names, loaded and checked by the package's loader."""
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"src: model folder {str(path)!r} does not exist")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"src: model folder {str(path)!r} has no config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"src: {cfg_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"src: {cfg_file} is not a JSON object")
    if config.get("model_type") != "qwen3":
        raise CheckpointError(f"src: trunk family {config.get('model_type')!r} cannot grow; only 'qwen3' can")
    if "text_config" in config:
        raise CheckpointError("src: a nested text_config cannot grow; only a plain qwen3 config can")
    if "quantization" in config or config.get("quantization_config"):
        raise CheckpointError("src: a quantized model cannot grow; grow the float model, then quantize")
    layout = config.get("mtp_head_layout")
    if layout not in (None, "none", "qwen3_next"):
        raise CheckpointError(f"src: MTP head layout {layout!r} cannot grow; only 'qwen3_next' (or no head) can")
    check_config(config, f"src: {cfg_file}")
    for field in ("head_dim", "intermediate_size", "num_key_value_heads"):
        if not isinstance(config.get(field), int):
            raise CheckpointError(f"src: {cfg_file} needs an explicit integer {field!r} to grow")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise CheckpointError("src: num_attention_heads is not a multiple of num_key_value_heads")
    runtime = build_runtime(config, read_weights(path), where=f"src: {cfg_file}")
    if runtime.head_layout not in (None, "qwen3_next"):
        raise CheckpointError(f"src: MTP head layout {runtime.head_layout!r} cannot grow; only 'qwen3_next' can")
    weights = dict(tree_flatten(runtime.trunk.parameters()))
    weights.update(head_checkpoint_weights(runtime))
    config = {**config, "mtp_head_layout": runtime.head_layout}
    if runtime.head_layout is None:
        config.pop("mtp_hidden_source", None)
    else:
        config["mtp_hidden_source"] = runtime.hidden_source
    return config, weights


def _grown_shape(rule: Callable[[np.ndarray, int], np.ndarray], shape: tuple[int, ...], w: int) -> tuple[int, ...]:
    """The shape `rule` makes of a `shape` tensor (without making it)."""
    if rule is _keep:
        return shape
    if rule is _tile_norm:
        return (shape[0] * w,)
    if rule in (_tile_embedding, _lm_head):
        return (shape[0], shape[1] * w)
    return (shape[0] * w, shape[1] * w)


def _maker(src: mx.array, rule: Callable[[np.ndarray, int], np.ndarray], w: int, zero: bool) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        a = rule(np.array(src.astype(mx.float32)), w)
        return _zero_output(a) if zero else a

    return make


def _dtype(dtype: object) -> mx.Dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def plan(src: str | Path, *, width: int, depth: int, dtype: str | mx.Dtype = "float32") -> Plan:
    """Checks the arguments and the source and lays out the grown folder, writing nothing.

    Raises:
        TypeError / ValueError: a width or depth that is not an int >= 1, or
            an unknown dtype, naming the argument.
        CheckpointError (a ValueError) / FileNotFoundError: a source that
            cannot grow (not qwen3, quantized, another head layout, a tensor
            without a rule), naming `src`, the field or the tensor.
    """
    w = as_int("width", width, lo=1)
    d = as_int("depth", depth, lo=1)
    out_dtype = _dtype(dtype)
    config, weights = _source(Path(src))
    L = config["num_hidden_layers"]
    rules = {}
    for name, a in weights.items():
        rule, want = _rule(name, tuple(a.shape), config)
        if tuple(a.shape) != want:
            raise CheckpointError(f"src: tensor {name!r} has shape {tuple(a.shape)}, expected {want}")
        rules[name] = rule
    if "lm_head.weight" not in weights:  # tied: the untied lm_head is the embedding's
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        rules["lm_head.weight"] = _lm_head

    def tensor(out: str, name: str, zero: bool = False) -> Tensor:
        return Tensor(out, _grown_shape(rules[name], tuple(weights[name].shape), w),
                      _maker(weights[name], rules[name], w, zero))

    trunk = [tensor("model.embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(L):
        names = sorted(k for k in weights if k.startswith(f"model.layers.{i}."))
        for j in range(d):
            for name in names:
                out = f"model.layers.{i * d + j}." + name.split(".", 3)[-1]
                trunk.append(tensor(out, name, zero=j > 0 and name.split(".", 3)[-1] in _WRITE_RESIDUAL))
    trunk += [tensor("model.norm.weight", "model.norm.weight"), tensor("lm_head.weight", "lm_head.weight")]
    head = [tensor(k, k) for k in sorted(weights) if k.startswith("mtp.")]
    grown = dict(config)
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        grown[field] = config[field] * w
    grown["num_hidden_layers"] = L * d
    grown["tie_word_embeddings"] = False
    grown["grown"] = {"from": Path(src).name, "width": w, "depth": d, "dtype": str(out_dtype).split(".")[-1]}
    return Plan(grown, trunk, head, out_dtype.size)


def _shards(p: Plan, shard_bytes: int) -> list[tuple[str, list[Tensor]]]:
    """The trunk's tensors in order, cut into shards of at most `shard_bytes` (or one tensor)."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in p.trunk:
        n = p.nbytes([t])
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _save(file: Path, tensors: list[Tensor], dtype: mx.Dtype) -> None:
    arrays = {}
    for t in tensors:
        a = mx.array(t.make()).astype(dtype)
        if tuple(a.shape) != t.shape:
            raise RuntimeError(f"grown tensor {t.name} has shape {tuple(a.shape)}, planned {t.shape}")
        mx.eval(a)
        arrays[t.name] = a
    mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})


def _command(src: Path, dst: Path, w: int, d: int, dtype: str, shard_bytes: int) -> str:
    parts = [str(dst), "--width", str(w), "--depth", str(d)]
    if src.resolve() != SHIPPED_MODEL.resolve():
        parts += ["--from", str(src)]
    if dtype != "float32":
        parts += ["--dtype", dtype]
    if shard_bytes != DEFAULT_SHARD_BYTES:
        parts += ["--shard-mb", f"{shard_bytes / 2**20:g}"]
    return " ".join([PROG, *(shlex.quote(p) for p in parts)])


def _readme(p: Plan, src: Path, command: str, total: int) -> str:
    c, g = p.config, p.config["grown"]
    head = "its MTP head (layout qwen3_next) in `mtp.safetensors`" if c.get("mtp_head_layout") else "no MTP head"
    return f"""# {g['from']}, grown {g['width']}x wide and {g['depth']}x deep

A benchmark model: `{g['from']}` grown so that it computes the same logits (trunk
and head, up to float rounding) with many more weights, so a decode step has to
stream them from memory as real checkpoints do. It is no better a model than
`{g['from']}`; its MTP head keeps that model's acceptance.

- Trunk: mlx-lm `qwen3` (`mlx_lm.load` reads it): hidden {c['hidden_size']}, {c['num_hidden_layers']} layers,
  {c['num_attention_heads']} attention heads ({c['num_key_value_heads']} KV heads) of head_dim {c['head_dim']}, MLP {c['intermediate_size']},
  untied lm_head, vocabulary {c['vocab_size']}; {head}.
- {total:,} bytes of {g['dtype']} weights.
- Width x{g['width']}: every residual vector is w copies of the original's;
  heads, KV heads and MLP units are repeated w times; projections reading a
  duplicated width take 1/w of the weight per copy; lm_head = embedding / w, tiled.
- Depth x{g['depth']}: each original layer is followed by {g['depth'] - 1} cop{"y" if g['depth'] == 2 else "ies"} of
  it whose o_proj and down_proj are zero (identity blocks of full cost).

Made from `{src.name}` by:

    {command}
"""


def grow(
    src: str | Path,
    dst: str | Path,
    *,
    width: int,
    depth: int,
    dtype: str | mx.Dtype = "float32",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Writes a model folder computing `src`'s logits with `width` x wider, `depth` x deeper layers.

    Args:
        src: a float qwen3 model folder with a qwen3_next MTP head (or none).
        dst: the folder to create; it must not exist or be empty.
        width: w >= 1, the factor of the hidden, head and MLP widths.
        depth: d >= 1, the factor of the trunk's layer count.
        dtype: storage dtype ("float32", "float16", "bfloat16"); the grown
            weights are computed in float32, so below float32 the model is
            the source's function only up to that dtype's rounding.
        shard_bytes: the most bytes of one trunk shard (peak memory is about
            one shard); several shards come with mlx-lm's index and names.

    Returns:
        `dst`, holding config.json, model*.safetensors and the index,
        mtp.safetensors, the source's tokenizer files and README.md.

    Raises:
        TypeError / ValueError: bad width, depth, dtype or shard_bytes, naming it.
        CheckpointError / FileNotFoundError: a source that cannot grow (see `plan`).
        FileExistsError: `dst` exists and is not an empty folder.
        All before anything is written.
    """
    src, dst = Path(src), Path(dst)
    shard_bytes = as_int("shard_bytes", shard_bytes, lo=1)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"dst {str(dst)!r} exists and is not an empty folder")
    p = plan(src, width=width, depth=depth, dtype=dtype)
    out_dtype = _dtype(dtype)
    name = str(out_dtype).split(".")[-1]
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Written beside dst, then renamed: a failed run leaves no half folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        weight_map = {}
        for file, tensors in _shards(p, shard_bytes):
            _save(tmp / file, tensors, out_dtype)
            weight_map.update({t.name: file for t in tensors})
        if p.head:
            _save(tmp / HEAD_FILE, p.head, out_dtype)
            weight_map.update({t.name: HEAD_FILE for t in p.head})
        total = p.nbytes(p.trunk) + p.nbytes(p.head)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        write_config(tmp, p.config)
        for f in COPIED_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
        (tmp / "README.md").write_text(_readme(p, src, _command(src, dst, p.config["grown"]["width"],
                                                                  p.config["grown"]["depth"], name, shard_bytes), total))
        os.chmod(tmp, 0o755)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
