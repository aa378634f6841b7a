"""Admission rules of the continuous-batching engine: what a request needs, what fits.

A request needs KV slots for its prompt, its generated tokens and what a
cycle may write past them (K + 1 verified slots, the cycle launched ahead's
K + 1 more, the head's K - 1 chained drafts). Capacities are rounded up to
`KV_BLOCK` slots so that few distinct batch shapes (each traced once) occur.
A running batch holds rows x its largest row's capacity slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplx_ext._checks import as_depth, as_int
from mtplx_ext.decode import session
from mtplx_ext.decode.autodepth import AUTO
from mtplx_ext.decode.generate import auto_depth
from mtplx_ext.sampling import SamplerConfig

#: KV capacities are rounded up to this many slots (fewer distinct traces).
KV_BLOCK = 128


def capacity(need: int) -> int:
    """KV slots a row needing `need` slots is given (a multiple of `KV_BLOCK`)."""
    return KV_BLOCK * -(-need // KV_BLOCK)


def request_need(prompt_len: int, max_tokens: int, depth: int, mtp: bool) -> int:
    """KV slots a request may use: prompt, generated tokens, and a cycle's writes past them."""
    k = depth + 1 if mtp else 1
    return prompt_len + max_tokens + 2 * k + depth


def fits(needs: Sequence[int], max_batch: int, max_kv_slots: int) -> bool:
    """Whether rows with these needs fit one batch: at most max_batch rows and max_kv_slots slots."""
    if len(needs) > max_batch:
        return False
    return len(needs) * capacity(max(needs)) <= max_kv_slots


def model_context(runtime: object) -> int:
    """The most prompt + generated tokens one request may have: the model's max_position_embeddings."""
    cfg = getattr(runtime, "config", {}) or {}
    return int(cfg.get("max_position_embeddings", 4096))


def check_context(prompt_len: int, max_tokens: int, context: int) -> None:
    """Refuses a request whose prompt plus max_tokens exceeds the model's context (ValueError)."""
    total = prompt_len + max_tokens
    if total > context:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context of "
            f"{context} tokens"
        )


def check_stops(stop: Sequence[str] | str, has_tokenizer: bool) -> tuple[str, ...]:
    """Stop strings as a tuple: each a non-empty str, and a tokenizer to find them (ValueError)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    if stops and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer (this engine has none)")
    return stops


def check_logit_bias(sampler: object, vocab: int) -> None:
    """A logit bias may only name tokens of the vocabulary (the rest is checked by `SamplerConfig`).

    Raises:
        ValueError: naming `sampler.logit_bias` and the first id outside [0, vocab).
    """
    for t, _ in getattr(sampler, "logit_bias", ()):
        if not 0 <= t < vocab:
            raise ValueError(f"sampler.logit_bias names token id {t}, outside the vocabulary [0, {vocab})")


def check_sampler(sampler: object, vocab: int) -> SamplerConfig:
    """A request's sampler (None: greedy), its logit bias checked against the vocabulary."""
    if sampler is None:
        sampler = SamplerConfig(temperature=0.0)
    if not isinstance(sampler, SamplerConfig):
        raise TypeError(f"sampler must be a SamplerConfig or None, got {type(sampler).__name__}")
    check_logit_bias(sampler, vocab)
    return sampler


def check_callback(on_event: object) -> None:
    """`on_event` is callable or None."""
    if on_event is not None and not callable(on_event):
        raise TypeError("on_event must be callable or None")


def decode_mode(runtime: Any, mtp: bool, depth: int | str, max_batch: int) -> tuple[bool, int, bool]:
    """(MTP on, depth, route the recurrent capture) for an engine over `runtime`.

    `depth="auto"` is the fastest depth for a full batch here (0 turns MTP
    off). The capture routes as fixed-batch decoding decides: for per-stream
    commit, else only for runtimes that opted into fused CPU ops.

    Raises:
        ValueError: MTP asked of a runtime without head weights; recurrent
            layers whose state cannot be captured per position.
    """
    if depth == AUTO:
        chosen = auto_depth(runtime, max_batch) if mtp else 1
        mtp, depth = mtp and chosen > 0, max(chosen, 1)
    depth = as_depth(depth)
    if mtp and not runtime.has_mtp:
        raise ValueError("use_mtp=True needs a runtime with MTP head weights (this one has none)")
    recurrent = session.has_recurrent_layers(runtime)
    if recurrent and not session.gated_delta_trunk(runtime):
        raise ValueError(f"Engine: {session.NOT_CAPTURABLE.format(getattr(runtime, 'model_type', '?'))}")
    return mtp, depth, recurrent and (mtp or bool(getattr(runtime, "cpu_ops_fused", False)))


def request_depth(depth: object, engine_depth: int, mtp: bool) -> int:
    """A request's most drafts per cycle: None gives the engine's K (0 without MTP); else an int in [0, K]."""
    k = engine_depth if mtp else 0
    return k if depth is None else as_int("depth", depth, lo=0, hi=k + 1)


__all__ = ["KV_BLOCK", "capacity", "check_callback", "check_context", "check_logit_bias", "check_sampler",
           "check_stops", "decode_mode", "fits", "model_context", "request_depth", "request_need"]
