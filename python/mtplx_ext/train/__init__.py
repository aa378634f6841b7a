"""Training the shipped model (and others like it) on this machine.

* `corpus`: the standard library's source files, split by a hash of their
  path, and the tokenizer trained on them;
* `trainer`: the joint objective (next token through the trunk, later tokens
  through the MTP head), evaluation and the run (`train(TrainConfig)`);
* `report`: the reproducing command and the model folder's README;
* `cli`: `python -m mtplx_ext.train` / `mtplx-ext train`;
* `loop`: the run loop both trainers share (budget, schedule, batches, log);
* `gemma4_pair`, `gemma4`, `gemma4_report`: a tiny Gemma 4 pair, a
  `gemma4_text` target and then its `gemma4_assistant` trained against it
  frozen (`python -m mtplx_ext.train.gemma4 target|assistant`; not imported
  here, so that `-m` runs it once).
"""

from mtplx_ext.train.cli import main, parse_args
from mtplx_ext.train.corpus import (
    encode_files,
    is_heldout,
    read_text,
    split_files,
    stdlib_files,
    stdlib_root,
    train_tokenizer,
)
from mtplx_ext.train.report import command_line, write_model_readme
from mtplx_ext.train.trainer import (
    TrainConfig,
    build_runtime,
    evaluate,
    heldout_decode_acceptance,
    joint_loss,
    lr_at,
    train,
)

__all__ = [
    "TrainConfig",
    "build_runtime",
    "command_line",
    "encode_files",
    "evaluate",
    "heldout_decode_acceptance",
    "is_heldout",
    "joint_loss",
    "lr_at",
    "main",
    "parse_args",
    "read_text",
    "split_files",
    "stdlib_files",
    "stdlib_root",
    "train",
    "train_tokenizer",
    "write_model_readme",
]
