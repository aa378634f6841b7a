"""`EngineOptions`: an `Engine`'s settings, in one frozen record (the engine checks the values when built)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EngineOptions:
    """How an `Engine` runs. `Engine(runtime, options)` takes one, `Engine(runtime, **settings)` builds one from
    keywords of the same names; `engine.options` is the one it runs with (the values as given: the engine's own
    attributes hold the resolved ones, e.g. `engine.context`).

    Attributes:
        max_batch: most streams decoding at once.
        depth: drafts per cycle (K); {batch size: K} (0: no drafts; a batch takes the K of the smallest size
            that holds it); or "auto" (the default): for each batch size the K (0 included) that decodes it
            fastest here (`batching.depths`: calibrated once, cached; K then follows the acceptance seen).
        use_mtp: False decodes plainly (one token per forward), the baseline.
        max_kv_slots: most KV slots held by the running batch (rows times its per-row capacity); None: max_batch
            times the context's.
        prefill_chunk: prompt tokens prefilled per engine step while other streams decode.
        context: most prompt + generated tokens of one request (None: the model's `max_position_embeddings`).
        prefix_cache_bytes: most bytes of prompt caches kept for later prompts that start alike
            (`prefix_cache.PrefixCache`; 0: off); prefix_cache_dir, prefix_cache_disk_bytes, prefix_block_tokens:
            its disk tier (kept across restarts; None: none), the tier's cap, the slots of its blocks.
        kv_bits, kv_group_size: KV stored quantized (as `generate_batched`'s); None: the runtime's setting.
        launch_ahead: launch each cycle before reading the one before it (False: one cycle at a time, for
            side-by-side measurements; the tokens are the same). The engine's `launch_ahead` attribute starts
            from it.
        detokenize: decode each request's text as it commits (`Request.text`, stop strings); False: tokens only
            (stop strings are refused), for callers that read token ids alone (fixed batches).
        compact_rows: drop finished rows once at most half of the batch decodes (False: only when every row has
            finished; `scheduler.needs_rebuild`). The engine's `compact_rows` attribute starts from it.
        first_token_at_prefill: a request's first token goes out as soon as its prefill gives it (time to first
            token: the prefill); False reads it only after the batch it joins is built and that batch's first
            cycle launched, so the device does not wait for the host in between, for callers that read no
            token early (fixed batches). Same tokens either way.
    """

    max_batch: int = 8
    depth: int | str | dict[int, int] = "auto"
    use_mtp: bool = True
    max_kv_slots: int | None = None
    prefill_chunk: int = 256
    context: int | None = None
    prefix_cache_bytes: int = 0
    prefix_cache_dir: Any = None
    prefix_cache_disk_bytes: int = 4 << 30
    prefix_block_tokens: int = 32
    kv_bits: int | None = None
    kv_group_size: int = 64
    launch_ahead: bool = True
    compact_rows: bool = True
    detokenize: bool = True
    first_token_at_prefill: bool = True

    @classmethod
    def given(cls, options: EngineOptions | None, settings: Mapping[str, Any]) -> EngineOptions:
        """The options of `Engine(runtime, options, **settings)`: `options`, or one built from `settings`.

        Raises:
            TypeError: both given (naming the keywords), an unknown keyword (naming it), or `options` not an
                `EngineOptions`.
        """
        if options is not None and not isinstance(options, EngineOptions):
            raise TypeError(f"options must be an EngineOptions or None, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"Engine got unknown setting(s) {', '.join(unknown)} (EngineOptions has: "
                            f"{', '.join(sorted(known))})")
        if options is not None and settings:
            raise TypeError(f"Engine takes options or keyword settings, not both (got options and "
                            f"{', '.join(sorted(settings))})")
        return options if options is not None else cls(**settings)


__all__ = ["EngineOptions"]
