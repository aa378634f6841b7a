"""`SamplerConfig`: one request's sampler settings, checked once, packed for the kernels.

Every sampler field is validated here, in one place (`check_field`), before
any kernel sees it: the device reads the parameters as float32, so each
float must be 0 or, rounded to float32, a normal number (magnitude
1.1754944e-38 to 3.4028235e+38); past that range a value would round to Inf
or 0 (or a subnormal, which Metal flushes) and silently mean something else.
`pack_params` gives the [B, 7] float32 rows the fused primitives read
(`PARAM_COLUMNS`); `pack_logit_bias` the padded [B, M] (ids, values) pair of
the per-request `logit_bias`. What the fields mean is the rule in
`mtplx_ext.sampling.reference`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Column order of the packed per-row parameter array ([B, 7] float32).
PARAM_COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

#: float32's largest finite and smallest normal magnitudes: every float
#: parameter must be 0 or lie in between once rounded to float32.
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
#: top_k travels as float32 too, exact for ints below 2**24.
TOP_K_LIMIT = 2**24

_TINY, _MAX = "1.1754944e-38", "3.4028235e+38"
_NORMAL = "float32's normal range: the kernels read float32"


def _in_f32_range(v: float) -> bool:
    """Whether `v` keeps its meaning as the float32 the kernels read.

    A value past float32's largest rounds to Inf (which the kernels treat as
    "off"); a nonzero one below its smallest normal rounds to 0 or to a
    subnormal (which Metal flushes to 0): both would silently change what
    the setting does. In this range the CPU kernels' float64 transforms can
    neither overflow nor underflow.
    """
    if v == 0:
        return True
    with np.errstate(over="ignore", under="ignore"):
        f = abs(float(np.float32(v)))
    return F32_TINY <= f <= F32_MAX


#: Per field: (test of the float value, besides the float32 range; what the
#: error says the field must be).
_FLOAT_RULES = {
    "temperature": (lambda v: v >= 0, f"0 (greedy) or in [{_TINY}, {_MAX}] ({_NORMAL})"),
    "top_p": (lambda v: 0 < v <= 1, f"in [{_TINY}, 1] ({_NORMAL}; 1 is off)"),
    "min_p": (lambda v: 0 <= v <= 1, f"0 (off) or in [{_TINY}, 1] ({_NORMAL})"),
    "presence_penalty": (lambda v: True, f"0 or of magnitude in [{_TINY}, {_MAX}] ({_NORMAL})"),
    "frequency_penalty": (lambda v: True, f"0 or of magnitude in [{_TINY}, {_MAX}] ({_NORMAL})"),
    "repetition_penalty": (lambda v: v > 0, f"in [{_TINY}, {_MAX}] ({_NORMAL}; 1 is off)"),
}


#: Most logit_bias entries one request may carry (OpenAI's limit), and the
#: largest magnitude of a bias.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0


def check_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """Checks a logit bias ({token id: bias} or (id, bias) pairs); returns sorted (id, bias) pairs.

    Ids are ints >= 0 (the vocabulary bound is checked where the model is
    known), biases numbers in [-100, 100]; at most `MAX_LOGIT_BIAS` entries,
    each id once.

    Raises:
        TypeError / ValueError: naming `SamplerConfig.logit_bias` and the entry.
    """
    name = "SamplerConfig.logit_bias"
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(f"{name} must be a mapping {{token id: bias}}, got {type(value).__name__}")
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"{name} may hold at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(f"{name} entries must be (token id, bias) pairs, got {item!r}")
        t, b = item
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < 2**31:
            raise ValueError(f"{name} keys must be token ids (ints >= 0), got {t!r}")
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name}[{int(t)}] must be a number, got {type(b).__name__} {b!r}")
        if not -LOGIT_BIAS_LIMIT <= float(b) <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"{name}[{int(t)}] must be in [-100, 100], got {b!r}")
        if int(t) in out:
            raise ValueError(f"{name} holds token id {int(t)} twice")
        out[int(t)] = float(b)
    return tuple(sorted(out.items()))


def check_field(name: str, value: object) -> float | int:
    """Checks one SamplerConfig field; returns it as a Python float (int for top_k).

    The one place that says which values each field takes: SamplerConfig
    and the command line both call it.

    Raises:
        TypeError: not a number (bools included), naming the field.
        ValueError: outside the field's range (NaN and Inf included), or a
            top_k that is not an int, naming the field.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"SamplerConfig.{name} must be a number, got {type(value).__name__} {value!r}")
    if name == "top_k":
        if not isinstance(value, (int, np.integer)) or not 0 <= value < TOP_K_LIMIT:
            raise ValueError(f"SamplerConfig.top_k must be an int in [0, 2**24) (0 is off), got {value!r}")
        return int(value)
    ok, want = _FLOAT_RULES[name]
    v = float(value)
    # NaN fails every comparison, Inf the float32 range.
    if not (ok(v) and _in_f32_range(v)):
        raise ValueError(f"SamplerConfig.{name} must be {want}, got {value!r}")
    return v


@dataclass(frozen=True)
class SamplerConfig:
    """Per-stream sampler settings.

    The kernels read every value as float32, so each float field must be 0
    or lie within float32's normal range (magnitude 1.1754944e-38 to
    3.4028235e+38 after rounding): values past it would round to Inf or 0
    and silently change meaning, so they raise ValueError naming the field.
    Fields are stored as Python floats (top_k as an int); NumPy scalars are
    accepted.

    Attributes:
        temperature: 0 for greedy, else > 0.
        top_k: keep the k most likely tokens; 0 turns it off. An int in
            [0, 2**24).
        top_p: keep the smallest most-likely set of mass >= top_p; 1 is off.
            In (0, 1].
        min_p: keep tokens with probability >= min_p * the largest; 0 is off.
            In [0, 1].
        presence_penalty: subtracted once from the logit of a seen token.
        frequency_penalty: subtracted per occurrence of a seen token.
        repetition_penalty: divides positive / multiplies negative logits of
            seen tokens; 1 is off. > 0.
        logit_bias: {token id: bias in [-100, 100]} (or (id, bias) pairs),
            added to the raw logits in float32 before the penalties, in the
            target and the draft distributions alike (so MTP stays exact);
            stored as sorted (id, bias) pairs. +100 all but forces a token,
            -100 all but bans it.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in PARAM_COLUMNS:
            # Frozen: normalised values (Python numbers) go in by object.__setattr__.
            object.__setattr__(self, name, check_field(name, getattr(self, name)))
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """True when this config picks the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when token counts change the logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def has_bias(self) -> bool:
        """True when a logit bias changes the logits."""
        return bool(self.logit_bias)

    def as_row(self) -> np.ndarray:
        """The parameters as one float32 row in `PARAM_COLUMNS` order."""
        return np.array([getattr(self, n) for n in PARAM_COLUMNS], dtype=np.float32)


def pack_params(samplers: SamplerConfig | Sequence[SamplerConfig], batch: int) -> np.ndarray:
    """Packs one config (shared) or one per row into a [B, 7] float32 array.

    Raises:
        ValueError: a sequence whose length is not `batch`.
        TypeError: an entry that is not a SamplerConfig.
    """
    if isinstance(samplers, SamplerConfig):
        samplers = [samplers] * batch
    samplers = list(samplers)
    if len(samplers) != batch:
        raise ValueError(f"sampler has {len(samplers)} entries for a batch of {batch}")
    for i, s in enumerate(samplers):
        if not isinstance(s, SamplerConfig):
            raise TypeError(f"sampler[{i}] must be a SamplerConfig, got {type(s).__name__}")
    return np.stack([s.as_row() for s in samplers]).reshape(batch, len(PARAM_COLUMNS))


def pack_logit_bias(
    samplers: Sequence[SamplerConfig], width: int | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The padded [B, M] (ids int32, values float32) bias of one config per row, or None when none has one.

    M is `width` (a batch's fixed shape: compiled steps keep it) or the
    longest bias rounded up to a multiple of 8; rows pad with id -1, which
    the kernels skip.

    Raises:
        ValueError: a bias longer than `width`.
    """
    if width is None and not any(s.logit_bias for s in samplers):
        return None
    longest = max((len(s.logit_bias) for s in samplers), default=0)
    M = width if width is not None else max(8, -(-longest // 8) * 8)
    if longest > M:
        raise ValueError(f"a logit_bias of {longest} entries does not fit a batch's {M}")
    ids = np.full((len(samplers), M), -1, np.int32)
    values = np.zeros((len(samplers), M), np.float32)
    for b, s in enumerate(samplers):
        for e, (t, v) in enumerate(s.logit_bias):
            ids[b, e], values[b, e] = t, v
    return ids, values
