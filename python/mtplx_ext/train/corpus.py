"""The training data: the Python standard library's own source files, split by a hash of their path.

Every machine with Python has this corpus, so a training run is reproducible
for a given Python version. Some files are held out (`is_heldout`, a hash of
the relative path) for evaluation and for held-out benchmark prompts. A
byte-level BPE tokenizer is trained on the training files first.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from mtplx_ext.shipped import EOS_TOKEN

# Parts of the stdlib tree that are not ordinary Python source: installed
# packages, test suites, generated encoding tables and doc data.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "encodings", "pydoc_data", "__pycache__"}


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Python source files of the standard library, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    # os.walk with pruning: site-packages alone can hold far more files than the stdlib.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            # _sysconfigdata*: machine-specific build settings, not library code.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel_path: str, heldout_per_mille: int = 50) -> bool:
    """Deterministic split: a file is held out when crc32 of its path falls low."""
    return zlib.crc32(rel_path.encode()) % 1000 < heldout_per_mille


def split_files(files: list[Path], root: Path, heldout_per_mille: int = 50) -> tuple[list[Path], list[Path]]:
    """(train, heldout) by :func:`is_heldout` on each file's relative path."""
    train, held = [], []
    for p in files:
        (held if is_heldout(p.relative_to(root).as_posix(), heldout_per_mille) else train).append(p)
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE tokenizer trained on `files` with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """All files' tokens, each followed by EOS_TOKEN, as one int32 stream."""
    eos = tok.token_to_id(EOS_TOKEN)
    out = []
    # Batches keep memory flat while using the tokenizer's own threads.
    for i in range(0, len(files), 64):
        chunk = files[i : i + 64]
        for enc in tok.encode_batch([read_text(p) for p in chunk]):
            out.append(np.asarray(enc.ids, dtype=np.int32))
            out.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros((0,), np.int32)
