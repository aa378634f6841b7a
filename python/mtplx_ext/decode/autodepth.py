"""`depth="auto"`: the drafts per cycle (K, or 0 for plain decoding) that decode fastest here.

A cycle at depth K costs `cycle_s[K]` (K head steps, one [B, K + 1]
verification, the commit; K = 0 is one plain step) and commits on average
`1 + sum_j prod_{i <= j} a_i` tokens per stream, with a_i the acceptance of
draft i given draft i - 1 was accepted. Both depend on the model and the
machine far more than on anything else: on a model that lives in the CPU's
caches a verification of K + 1 tokens costs several plain steps, on a
memory-bound one about one. So the choice is measured, not guessed:
`calibrate` times short greedy decodes of the running model at every depth
0..K_max for a batch size (and reads their acceptance), `depth_costs` keeps
the result per model, machine and batch size (in memory and under the user's
cache folder, as MTPLX's `tune` does), and `choose_depth` picks the K with
the most tokens per second for a given acceptance (the calibration's, or one
observed since). K = 0 wins wherever MTP would lose, so `auto` never decodes
slower than MTP off by more than the measurement's noise.

A calibration is cached under `calibration_key`: a hash of what it depends
on (the model's config and a fingerprint of its weights, the CPU model and
core count, the BLAS, the library versions), so another head, another
machine or another MLX measures anew. MTPLX_RECALIBRATE=1 (the CLI's
`--recalibrate`) measures anew regardless.

Greedy tokens never depend on K (every depth is lossless), and sampled
decoding is exact at every K, so the choice changes speed only.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtplx_ext.shipped import BENCH_PROMPTS

AUTO = "auto"
#: Deepest K the calibration tries (deeper chains rarely pay: acceptance compounds).
MAX_AUTO_DEPTH = 5
#: Tokens per stream of each calibration decode.
CALIBRATION_TOKENS = 24
#: Format of the cached calibration files.
_CACHE_VERSION = 2

#: (prompts, max_new_tokens, depth or 0 for plain) -> (decode seconds, cycles, accepted_at, reached).
Decode = Callable[[list[list[int]], int, int], tuple[float, int, list[int], list[int]]]


@dataclass
class DepthCosts:
    """Measured cycle costs of one model at one batch size on this machine.

    Attributes:
        batch: streams per cycle.
        cycle_s: seconds per cycle by depth ("0" is a plain step); JSON keys are strings.
        acceptance: per draft position, the acceptance seen by the calibration.
    """

    batch: int
    cycle_s: dict[str, float]
    acceptance: list[float]

    def depths(self) -> list[int]:
        return sorted(int(k) for k in self.cycle_s)


def expected_tokens(acceptance: Sequence[float], depth: int) -> float:
    """Tokens a stream commits per cycle at `depth`: 1 + sum over j <= K of prod_{i <= j} a_i."""
    total, run = 1.0, 1.0
    for j in range(depth):
        a = float(acceptance[j]) if j < len(acceptance) else 0.0
        run *= min(max(a, 0.0), 1.0)
        total += run
    return total


def cycle_cost(costs: DepthCosts, depth: int) -> float:
    """Seconds of a cycle at `depth`: the measured cost, raised to the dearest shallower depth's.

    A cycle at K does what one at K - 1 does and more (a head step, a wider
    verification), so a measured cost below a shallower depth's is timing
    noise; taken at face value it would make a deep K look cheap (seen:
    K = 4 and 5 measured below K = 3 at batch 8, and auto ran K = 5 where
    plain decoding was faster).
    """
    return max(t for k, t in costs.cycle_s.items() if int(k) <= depth)


def tokens_per_s(costs: DepthCosts, depth: int, acceptance: Sequence[float] | None = None) -> float:
    """Predicted tokens per second of all streams at `depth`."""
    acc = costs.acceptance if acceptance is None else acceptance
    per_cycle = 1.0 if depth == 0 else expected_tokens(acc, depth)
    return costs.batch * per_cycle / cycle_cost(costs, depth)


def choose_depth(costs: DepthCosts, acceptance: Sequence[float] | None = None,
                 among: Sequence[int] | None = None) -> int:
    """The depth (0 = plain decoding) with the most predicted tokens per second, of `among` (default: every
    depth `costs` has)."""
    return max(costs.depths() if among is None else among, key=lambda k: (tokens_per_s(costs, k, acceptance), -k))


#: Pseudo-observations of the calibration's acceptance at each draft position: the running estimate's prior.
PRIOR_WEIGHT = 8.0
#: Stream-cycles after which an observation counts half: the estimate follows a workload that changes.
HALF_LIFE = 512.0


class RunningAcceptance:
    """Acceptance per draft position as decoding sees it, the calibration's as the prior.

    The calibration decodes a few code openings; served text may be
    accepted far more (repetitive agent output) or far less (prose) often,
    and the best K moves with it. Draft j's estimate is (accepted_j + w p_j)
    / (reached_j + w), p_j the calibration's (scaled: `estimate`), w =
    `PRIOR_WEIGHT`, over counts that decay by half every `HALF_LIFE`
    stream-cycles.

    Args:
        prior: the calibration's acceptance per draft position.
    """

    def __init__(self, prior: Sequence[float], weight: float = PRIOR_WEIGHT, half_life: float = HALF_LIFE):
        self.prior = np.clip(np.asarray(prior, dtype=np.float64), 0.0, 1.0)
        self.weight, self.half_life = float(weight), float(half_life)
        self.accepted = np.zeros_like(self.prior)
        self.reached = np.zeros_like(self.prior)
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def _fit(self, counts: Sequence[int]) -> np.ndarray:
        out = np.zeros_like(self.prior)
        n = min(len(out), len(counts))
        out[:n] = np.asarray(counts[:n], dtype=np.float64)
        return out

    def observe(self, reached: Sequence[int], accepted: Sequence[int], upto: int | None = None) -> bool:
        """Takes running totals (a `DraftStats`'s `reached`, `accepted_at`); True when they moved.

        `upto`: only the first `upto` draft positions' counts since the last call are taken (the cycle after
        a batch's K went up verifies padded drafts past its old K, which say nothing of the head).
        """
        r, a = self._fit(reached), self._fit(accepted)
        dr, da = (r, a) if self._last is None else (r - self._last[0], a - self._last[1])
        self._last = (r, a)
        if upto is not None:
            dr[upto:], da[upto:] = 0.0, 0.0
        if dr[0] <= 0:
            return False
        decay = 0.5 ** (dr[0] / self.half_life)
        self.reached = self.reached * decay + dr
        self.accepted = self.accepted * decay + da
        return True

    def estimate(self) -> list[float]:
        """The acceptance per draft position now.

        A deep position is reached only after every earlier draft was
        accepted, so where the shallow ones are rarely accepted it is seen
        seldom: its prior is the calibration's scaled as the position before
        it moved from its own (text the head guesses worse at draft 1 it
        guesses worse deeper too), not the calibration's value unchanged.
        """
        out, ratio = [], 1.0
        for a, r, p in zip(self.accepted, self.reached, self.prior):
            e = (a + self.weight * min(1.0, p * ratio)) / (r + self.weight)
            ratio = e / p if p > 0 else 1.0
            out.append(float(e))
        return out


    def observed(self) -> int:
        """How many leading draft positions the decoding itself has reached at least `weight` times lately:
        beyond them the estimate is the prior extrapolated, not something seen."""
        n = 0
        for r in self.reached:
            if r < self.weight:
                break
            n += 1
        return n


def calibration_prompts(runtime: Any, batch: int, length: int = 16) -> list[list[int]]:
    """The same prompts every run: code openings through the model's tokenizer, else fixed random tokens.

    Acceptance depends on the text: the continuation of real text, not of
    random tokens (which decoding often turns into loops that any drafter
    guesses), is what a user's prompts get.
    """
    tok = getattr(runtime, "tokenizer", None)
    vocab = int(runtime.vocab_size)
    if tok is not None:
        ids = [[t for t in tok.encode(BENCH_PROMPTS[i % len(BENCH_PROMPTS)]).ids if 0 <= t < vocab] for i in range(batch)]
        if all(ids):
            return ids
    rng = np.random.default_rng(20261202)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(batch)]


def calibrate(runtime: Any, batch: int, decode: Decode, max_depth: int = MAX_AUTO_DEPTH,
              tokens: int = CALIBRATION_TOKENS) -> DepthCosts:
    """Times greedy decodes at depths 0..max_depth (each warmed up once) and reads their acceptance.

    Depths interleave over two timed rounds (medians), so a load change on
    the machine hits them alike; the acceptance per position pools every MTP
    decode of the calibration.
    """
    prompts = calibration_prompts(runtime, batch)
    depths = [0] + (list(range(1, max_depth + 1)) if getattr(runtime, "has_mtp", False) else [])
    for k in depths:
        decode(prompts, tokens, k)  # traces and compiles the steps of exactly this shape
    times: dict[int, list[float]] = {k: [] for k in depths}
    accepted, reached = [0] * max_depth, [0] * max_depth
    for _ in range(2):
        for k in depths:
            seconds, cycles, acc_at, reach = decode(prompts, tokens, k)
            times[k].append(seconds / max(cycles, 1))
            for j in range(min(len(acc_at), max_depth)):
                accepted[j] += acc_at[j]
                reached[j] += reach[j]
    # Acceptance per position over every MTP decode (position j is reached at
    # depths > j), Laplace-smoothed: a position seen a few times only is not
    # taken as certain.
    acceptance = [(a + 1) / (r + 2) for a, r in zip(accepted, reached)] if len(depths) > 1 else []
    return DepthCosts(batch=batch, cycle_s={str(k): statistics.median(v) for k, v in times.items()},
                      acceptance=acceptance)


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo on Linux, `sysctl machdep.cpu.brand_string` on macOS,
    `platform.processor()` elsewhere (or where those fail); "" when nothing names it."""
    system = platform.system()
    if system == "Linux":
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name.strip() in ("model name", "Processor", "cpu model", "Hardware"):
                        return value.strip()
        except OSError:
            pass
    elif system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5, check=False)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or ""


#: Elements sampled per array by `weights_fingerprint`.
FINGERPRINT_SAMPLES = 256


def weights_fingerprint(runtime: Any, samples: int = FINGERPRINT_SAMPLES) -> str:
    """A short hash of the weights the runtime decodes with (16 hex digits).

    It hashes every parameter's name, shape and dtype and the bytes of
    `samples` elements taken at an even stride through the array (all of
    them for a small one), so two checkpoints of one architecture (another
    head after self-distillation, another fine-tune) get different
    fingerprints while the cost stays about a millisecond however large the
    model. The runtime does not record the folder it came from, and its
    weights need not be that folder's (a head added with `--mtp-from`, a
    `--drafter`, a distributed rank's shard, weights trained in this process),
    so the parameters themselves are hashed, not files. A change confined to
    elements the stride skips goes unseen: `MTPLX_RECALIBRATE=1` (or
    `--recalibrate`) measures anew whatever the key says.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    items = sorted(tree_flatten(runtime.parameters()), key=lambda kv: kv[0])
    picked = []
    for _, v in items:
        flat = v.reshape(-1)
        stride = max(1, flat.size // max(int(samples), 1))
        picked.append(flat[::stride][:samples].view(mx.uint8))
    mx.eval(picked)
    h = hashlib.sha256()
    for (name, v), s in zip(items, picked):
        h.update(f"{name}:{tuple(v.shape)}:{v.dtype};".encode())
        h.update(np.array(s).tobytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def calibration_key(runtime: Any) -> str:
    """What a calibration depends on, hashed (24 hex digits): it names the cache file.

    The model: its config, size in bytes, weights (`weights_fingerprint`)
    and whether its CPU ops are fused and its linears packed. The machine:
    architecture, system, CPU model (`cpu_model`), core count,
    `MTPLX_CPU_THREADS` and the BLAS in use. The libraries: mlx, mlx-lm and
    mtplx-ext versions. A change in any of them measures anew; so does
    `MTPLX_RECALIBRATE=1` (`recalibration_requested`).
    """
    from mlx.utils import tree_flatten

    from mtplx_ext import _blas

    size = sum(v.nbytes for _, v in tree_flatten(runtime.parameters()))
    facts = {
        "config": getattr(runtime, "config", {}), "bytes": size, "weights": weights_fingerprint(runtime),
        "fused": bool(getattr(runtime, "cpu_ops_fused", False)), "packed": bool(getattr(runtime, "linears_packed", False)),
        "machine": platform.machine(), "system": platform.system(), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "threads": os.environ.get("MTPLX_CPU_THREADS", ""), "blas": _blas.describe(),
        "mlx": _version("mlx"), "mlx-lm": _version("mlx-lm"), "mtplx-ext": _version("mtplx-ext"), "version": _CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


_machine_key = calibration_key  # the name earlier code used

#: Set by `request_recalibration` (the CLI's --recalibrate).
_FORCE = False
#: Calibrations measured in this process since recalibration was asked for (each is measured once).
_REMEASURED: set[tuple[str, int, int]] = set()


def request_recalibration(on: bool = True) -> None:
    """Makes this process measure every calibration anew once, ignoring cached files (the CLI's --recalibrate)."""
    global _FORCE
    _FORCE = bool(on)


def recalibration_requested() -> bool:
    """True under `request_recalibration()` or with MTPLX_RECALIBRATE set to anything but "" or "0"."""
    return _FORCE or os.environ.get("MTPLX_RECALIBRATE", "").strip() not in ("", "0")


def cache_dir() -> Path:
    """Where calibrations are kept: $MTPLX_CACHE_DIR, else $XDG_CACHE_HOME/mtplx_ext, else ~/.cache/mtplx_ext."""
    if os.environ.get("MTPLX_CACHE_DIR"):
        return Path(os.environ["MTPLX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtplx_ext"


_MEMORY: dict[tuple[str, int, int], DepthCosts] = {}


def calibration_file(key: str, batch: int, max_depth: int = MAX_AUTO_DEPTH) -> Path:
    """The cached calibration of `key` (a `calibration_key`) at `batch`, under `cache_dir()`."""
    return cache_dir() / "depth" / f"{key}-b{int(batch)}-k{int(max_depth)}.json"


def depth_costs(runtime: Any, batch: int, decode: Decode, max_depth: int = MAX_AUTO_DEPTH) -> DepthCosts:
    """The calibration of this model at `batch` on this machine: from memory, the cache folder, or measured now.

    Under `recalibration_requested()` the first call per key in this process
    measures anew (and overwrites the cached file); later calls reuse it.
    """
    key = (calibration_key(runtime), int(batch), int(max_depth))
    fresh = recalibration_requested() and key not in _REMEASURED
    if key in _MEMORY and not fresh:
        return _MEMORY[key]
    file = calibration_file(key[0], batch, max_depth)
    costs = None
    if not fresh:
        try:
            costs = DepthCosts(**json.loads(file.read_text()))
        except (OSError, ValueError, TypeError):
            costs = None
    if costs is None:
        costs = calibrate(runtime, batch, decode, max_depth)
        if fresh:
            _REMEASURED.add(key)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")  # concurrent writers never share one
            tmp.write_text(json.dumps(asdict(costs)))
            tmp.replace(file)
        except OSError:
            pass  # a read-only home only costs a calibration next time
    _MEMORY[key] = costs
    return costs


def remember(runtime: Any, batch: int, costs: DepthCosts, max_depth: int = MAX_AUTO_DEPTH) -> None:
    """Makes `costs` this process's calibration of `runtime` at `batch` (memory only, no file).

    A distributed run measures on every rank and shares rank 0's costs, so
    that every later `depth_costs` (and so every "auto") of every rank
    picks the same depth.
    """
    key = (calibration_key(runtime), int(batch), int(max_depth))
    _MEMORY[key] = costs
    _REMEASURED.add(key)  # measured now: a requested recalibration must not measure (and disagree) again


__all__ = [
    "AUTO", "FINGERPRINT_SAMPLES", "HALF_LIFE", "MAX_AUTO_DEPTH", "PRIOR_WEIGHT", "DepthCosts", "RunningAcceptance", "cache_dir",
    "calibrate", "calibration_file", "calibration_key", "calibration_prompts", "choose_depth", "cpu_model", "cycle_cost",
    "depth_costs",
    "expected_tokens", "recalibration_requested", "remember", "request_recalibration", "tokens_per_s", "weights_fingerprint",
]
