"""The server's defaults, defined once for `serve()` and `mtplx-ext serve`.

This module imports nothing, and the `serve` package exposes its other names
lazily, so the CLI reads these without loading the HTTP stack (starlette and
uvicorn are the serve extra's; `generate` and `bench` run without them).
"""

#: Most streams decoding at once.
DEFAULT_MAX_BATCH = 8
#: Prompt tokens prefilled per engine step (long prompts are interleaved with decoding).
DEFAULT_PREFILL_CHUNK = 256
#: MiB of prompt KV the prefix cache keeps for later prompts that start alike.
DEFAULT_PREFIX_CACHE_MB = 256
#: Most bytes of prefix-cache files kept in `--prefix-cache-dir`.
DEFAULT_PREFIX_CACHE_DISK_BYTES = 4 << 30
#: Seconds requests in flight get to finish after SIGINT / SIGTERM.
DEFAULT_SHUTDOWN_GRACE_S = 5.0
#: Most bytes of a request body (a long prompt is well under a MiB).
DEFAULT_MAX_BODY_BYTES = 4 << 20

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_PREFILL_CHUNK", "DEFAULT_PREFIX_CACHE_DISK_BYTES",
           "DEFAULT_PREFIX_CACHE_MB",
           "DEFAULT_SHUTDOWN_GRACE_S"]
