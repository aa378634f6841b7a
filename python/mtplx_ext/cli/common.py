"""What every `mtplx-ext` verb shares: one-line user errors, model loading, prompts, output, flags."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtplx_ext import sampling
from mtplx_ext._checks import MAX_DRAFTS, SEED_LIMIT, as_int
from mtplx_ext.benchmark import encode_prompts
from mtplx_ext.cache.compiled_step import mlx_kernel_cache_dir
from mtplx_ext.cache.ragged import KV_BITS, KV_GROUP_SIZES
from mtplx_ext.checkpoints import load
from mtplx_ext.decode import autodepth
from mtplx_ext.shipped import SHIPPED_MODEL, eos_ids


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def add_kv_flags(p: Any) -> None:
    """`--kv-bits` / `--kv-group-size`, as mlx-lm's."""
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None, metavar="BITS",
                   help=f"store keys and values quantized, {'/'.join(map(str, KV_BITS))} bits (default: float)")
    p.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=64, metavar="N",
                   help="values per scale and bias of quantized KV: 32, 64 or 128 (default 64)")


def load_model(path: str | None, need_mtp: bool, drafter: str | None = None, group: Any = None,
               parallel: str = "tensor", kv_bits: int | None = None, kv_group_size: int = 64) -> Any:
    """Loads a model folder (default: the shipped one) with one-line errors.

    `drafter`: a Gemma 4 assistant folder drafting for the model (`--drafter`).
    With a distributed `group`, this rank's part of it (`checkpoints.sharded`,
    split as `parallel` says). `kv_bits` / `kv_group_size`: its caches
    store keys and values quantized (`--kv-bits`).
    """
    if drafter is not None and not Path(drafter).is_dir():
        raise CLIError(f"--drafter {drafter!r} is not a folder (give a gemma4_assistant model folder)")
    if drafter is not None and group is not None:
        raise CLIError("--drafter cannot be combined with --tensor-parallel / --pipeline-parallel")
    folder = Path(path) if path else SHIPPED_MODEL
    if not folder.exists():
        if path is None:
            raise CLIError(f"the shipped model is missing from this install ({folder}); reinstall mtplx-ext")
        raise CLIError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise CLIError(f"--model {str(folder)!r} is not a folder (give a Hugging Face-style model folder)")
    if not (folder / "config.json").is_file():
        raise CLIError(f"model folder {str(folder)!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise CLIError(f"model folder {str(folder)!r} has no *.safetensors weights")
    try:
        kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
        rt = load(folder, drafter=drafter, **kv) if group is None else load(folder, group=group, parallel=parallel, **kv)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # corrupt files: one line, never a traceback
        raise CLIError(f"cannot load model folder {str(folder)!r}: {e}") from e
    if need_mtp and not rt.has_mtp:
        raise CLIError(
            f"model folder {str(folder)!r} has no MTP head weights; use --no-mtp for plain decoding with it, "
            "add the head with `mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT`, "
            "or give a Gemma 4 target its assistant with --drafter ASSISTANT_FOLDER"
        )
    return rt


def tokenizer(rt: Any, folder: str | None) -> Any:
    if rt.tokenizer is None:
        raise CLIError(f"model folder {folder or str(SHIPPED_MODEL)!r} has no tokenizer.json to encode text prompts")
    return rt.tokenizer


def stop_ids(tok: Any) -> list[int]:
    """The tokenizer's end-of-text ids: decoding stops there."""
    return list(eos_ids(tok))


def encode(tok: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (CLIError for one that encodes to none)."""
    try:
        return encode_prompts(tok, prompts)
    except ValueError as e:
        raise CLIError(str(e)) from None


def check_prompt_text(texts: list[str]) -> None:
    """Rejects prompts that are not UTF-8 (the tokenizer takes only valid text)."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            # Undecodable argv bytes arrive as lone surrogates (U+DC80..U+DCFF = byte 0x80..0xFF).
            c = ord(t[e.start])
            what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character U+{c:04X}"
            raise CLIError(f"prompt {i} is not UTF-8 text: {what} at position {e.start}") from None


class StdoutError(CLIError):
    """Standard output cannot be written (closed, full, an I/O error)."""


class Stdout:
    """sys.stdout whose write errors become one-line CLI errors.

    A broken pipe (the reader went away, as in `| head`) passes through as
    BrokenPipeError: `main` then exits quietly, as other Unix tools do.
    """

    def __init__(self) -> None:
        if sys.stdout is None:
            raise StdoutError("standard output is closed")
        self._out = sys.stdout

    def _guard(self, fn, *args) -> Any:
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to standard output: {e.strerror or e}") from None

    def write(self, text: str) -> int:
        return self._guard(self._out.write, text)

    def flush(self) -> None:
        self._guard(self._out.flush)


def drop_stdout() -> None:
    """Points fd 1 at the null device after a failed write to it.

    The interpreter flushes stdout once more at exit; that flush would fail
    again and print "Exception ignored" to stderr.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


class TextStreamer:
    """Prints committed tokens as text while decoding runs.

    One stream prints raw text; several streams print whole lines prefixed
    with the stream index, so their output does not interleave mid-line.
    """

    def __init__(self, tok: Any, n: int, out=None, header: str = ""):
        self.tok = tok
        self.header = header  # shown with the first committed tokens
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.printed = [0] * n  # characters of decoded text already shown
        self.out = out or sys.stdout
        self.multi = n > 1

    def _text(self, i: int) -> str:
        text = self.tok.decode(self.ids[i])
        # A byte-level token can end inside a UTF-8 character: hold it back.
        return text[:-1] if text.endswith("\ufffd") else text

    def _start(self) -> None:
        if self.header:
            self.out.write(self.header)
            self.header = ""

    def __call__(self, i: int, new: list[int]) -> None:
        self._start()
        self.ids[i].extend(new)
        text = self._text(i)
        if not self.multi:
            self.out.write(text[self.printed[i] :])
            self.printed[i] = len(text)
        else:
            end = text.rfind("\n") + 1
            if end > self.printed[i]:
                for line in text[self.printed[i] : end].splitlines():
                    self.out.write(f"[{i}] {line}\n")
                self.printed[i] = end
        self.out.flush()

    def finish(self) -> None:
        self._start()
        for i in range(len(self.ids)):
            rest = self.tok.decode(self.ids[i])[self.printed[i] :]
            if self.multi:
                for line in rest.splitlines():
                    self.out.write(f"[{i}] {line}\n")
            else:
                self.out.write(rest + "\n")
        self.out.flush()


def mlx_kernel_cache_is_cold() -> bool:
    """Whether MLX has no compiled CPU kernels cached here yet (first compiled decode on this machine).

    MLX's CPU backend compiles the fused kernels of `mx.compile`d graphs with
    the system C++ compiler and keeps them under the temp directory.
    """
    return mx.default_device() == mx.cpu and not any(mlx_kernel_cache_dir().glob("*.so"))


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated positive ints, got {text!r}") from None
    if not batches or any(b < 1 for b in batches):
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated positive ints, got {text!r}")
    return batches


def positive(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def check_writable(flag: str, path: str) -> None:
    """Fails now, not after the whole run, when `path` cannot be written."""
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        p.unlink()  # a run that fails later leaves no empty file behind


def sampler_flag(flag: str, field: str, kind: type = float):
    """A SamplerConfig field as a flag: the config's own check, the flag named."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}") from None
        try:
            return sampling.check_field(field, v)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e).replace(f"SamplerConfig.{field}", flag, 1)) from None

    return parse


def depth_flag(text: str) -> int | str:
    """--depth: an int in 1..MAX_DRAFTS, or "auto" (the fastest depth here, 0 meaning plain decoding)."""
    if text.strip() == "auto":
        return "auto"
    try:
        d = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depth must be auto or an integer in 1..{MAX_DRAFTS}, got {text!r}") from None
    if not 1 <= d <= MAX_DRAFTS:
        raise argparse.ArgumentTypeError(f"--depth must be in 1..{MAX_DRAFTS}, got {d}")
    return d


def add_recalibrate_flag(p: Any) -> None:
    """`--recalibrate`: with --depth auto, measure the depth calibration anew (as MTPLX_RECALIBRATE=1)."""
    p.add_argument("--recalibrate", action="store_true",
                   help="with --depth auto: measure the depth calibration anew instead of reading the cached one "
                        "(as MTPLX_RECALIBRATE=1)")


def apply_recalibrate(args: argparse.Namespace) -> None:
    """Honours `--recalibrate` for this process (before any "auto" depth is chosen)."""
    if getattr(args, "recalibrate", False):
        autodepth.request_recalibration()


def calibration_note(rt: Any) -> str:
    """Where "auto" depth's calibration of `rt` lives: its key, and its folder unless it is measured anew."""
    key = autodepth.calibration_key(rt)
    how = "measured anew" if autodepth.recalibration_requested() else f"kept in {autodepth.cache_dir() / 'depth'}"
    return f"calibration key {key} ({how})"


def depths_flag(text: str) -> list[int | str]:
    """--depth for bench: depths to sweep, ints ascending, then "auto" if given."""
    given = {depth_flag(t) for t in text.split(",") if t.strip()}
    return sorted(d for d in given if d != "auto") + (["auto"] if "auto" in given else []) or ["auto"]


def seed_flag(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an int, got {text!r}") from None
    try:
        return as_int("--seed", v, 0, SEED_LIMIT)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
