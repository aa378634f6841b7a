"""Checkpoint I/O: model folders in and out, conversion, quantization, random models.

* `loading`: `load(folder)` -> `MTPRuntime` (trunk through mlx-lm, head by layout);
* `assistant`: `load(folder, drafter=assistant_folder)`: a Gemma 4 assistant as the drafter, its conversion;
* `gemma4`: Gemma 4 `per_layer_config` mapped onto mlx-lm's fields;
* `saving`: `save_runtime(runtime, folder)` (mlx-lm's trunk files, `mtp.safetensors`);
* `convert`: Hugging Face checkpoints (sharded, quantized on request) to MLX folders;
* `quantize`: mlx-lm's quantization applied to trunk and head;
* `random`: `init_random(model_type)`, small random models for tests.

Every problem with a folder is a one-line `CheckpointError` (a `ValueError`)
or `FileNotFoundError` naming the file, field or tensor.
"""

from mtplx_ext._checks import CheckpointError
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
from mtplx_ext.checkpoints.assistant import convert_assistant, is_assistant_folder, load
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
    "is_assistant_folder",
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
