"""Checkpoint I/O: model folders in and out, conversion, quantization, random models.

* `loading`: `load(folder)` -> `MTPRuntime` (trunk through mlx-lm, head by layout);
* `assistant`: `load(folder, drafter=assistant_folder)`: a Gemma 4 assistant as the drafter, its conversion;
* `gemma4`: Gemma 4 `per_layer_config` mapped onto mlx-lm's fields;

* `sharded`: `load(folder, group=mx.distributed.init(), parallel="tensor" | "pipeline")`,
  this rank's part of the model (mlx-lm's `shard()` / `pipeline()`);
* `saving`: `save_runtime(runtime, folder)` (mlx-lm's trunk files, `mtp.safetensors`);
* `convert`: Hugging Face checkpoints (sharded, quantized on request) to MLX folders;
* `quantize`: mlx-lm's quantization applied to trunk and head;
* `random`: `init_random(model_type)`, small random models for tests.

Every problem with a folder is a one-line `CheckpointError` (a `ValueError`)
or `FileNotFoundError` naming the file, field or tensor.
"""

from mtplx_ext._checks import CheckpointError
from mtplx_ext.cache.ragged import check_kv_quantization
from pathlib import Path
from typing import Any

from mtplx_ext.checkpoints import loading, sharded
from mtplx_ext.checkpoints.loading import (
    HEAD_FILE,
    INDEX_FILE,
    build_runtime,
    check_config,
    head_checkpoint_name,
    load_strict,
    read_config,
    read_index,
    read_safetensors,
    read_tokenizer,
    read_weights,
    weight_files,
)
from mtplx_ext.checkpoints import assistant
from mtplx_ext.checkpoints.assistant import convert_assistant
from mtplx_ext.checkpoints.random import SMALL_CONFIGS, init_random
from mtplx_ext.checkpoints.saving import (
    add_mtp_modules,
    head_checkpoint_weights,
    save_runtime,
    trunk_shards,
    write_config,
    write_weights,
)
from mtplx_ext.models.runtime import MTPRuntime


def load(
    path: str | Path,
    *,
    fuse_cpu_ops: bool = True,
    drafter: str | Path | None = None,
    group: Any = None,
    parallel: str = "tensor",
    head: str | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> MTPRuntime:
    """Loads a model folder into an MTP runtime; with a distributed `group`, this rank's part of it.

    Args:
        path, fuse_cpu_ops: as `loading.load`.
        drafter: a Gemma 4 assistant folder drafting for the model
            (`assistant.load`); not with a `group`.
        group: an `mx.distributed.Group` (e.g. `mx.distributed.init()` in a
            process started by `mlx.launch`): the model is split across it
            (`sharded.load`); None loads the whole model.
        parallel: "tensor" (every layer split, mlx-lm's `shard()`) or
            "pipeline" (one stage of layers per rank, mlx-lm's `pipeline()`).
        head: "shard" (default in tensor parallel: the MTP head split like a
            trunk layer) or "replicate" (every rank runs the whole head; the
            default, and the only mode, pipelined).
        kv_bits, kv_group_size: the runtime's caches store keys and values
            quantized (`MTPRuntime.set_kv_quantization`: 2-8 bits, groups of
            32/64/128, mlx-lm's `--kv-bits` layout); None: float KV.

    Raises:
        as `loading.load`; ValueError naming `parallel` / `head` for an
        unknown mode; CheckpointError for a family or width that cannot be
        split that way.
    """
    kv = None if kv_bits is None else check_kv_quantization(kv_bits, kv_group_size)
    if group is None:
        sharded.check_parallel(parallel, head)
        runtime = assistant.load(path, fuse_cpu_ops=fuse_cpu_ops, drafter=drafter)
    elif drafter is not None:
        raise ValueError("drafter cannot be combined with a distributed group (not supported yet)")
    else:
        runtime = sharded.load(path, group=group, parallel=parallel, head=head, fuse_cpu_ops=fuse_cpu_ops)
    if kv is not None:
        runtime.set_kv_quantization(*kv)
    return runtime


# The models layer does not know file formats: this layer installs the writer
# behind `MTPRuntime.save`.
MTPRuntime.writer = staticmethod(save_runtime)

__all__ = [
    "HEAD_FILE",
    "INDEX_FILE",
    "SMALL_CONFIGS",
    "CheckpointError",
    "add_mtp_modules",
    "build_runtime",
    "check_config",
    "convert_assistant",
    "head_checkpoint_name",
    "head_checkpoint_weights",
    "init_random",
    "load",
    "load_strict",
    "read_config",
    "read_index",
    "read_safetensors",
    "read_tokenizer",
    "read_weights",
    "save_runtime",
    "trunk_shards",
    "weight_files",
    "write_config",
    "write_weights",
]
