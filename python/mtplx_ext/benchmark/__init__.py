"""The benchmark harness `mtplx-ext bench` and the scripts in bench/ share.

* `harness`: timed decodes (`Run`, `engine_run`, `mlx_lm_run`), interleaved
  repeats with paired ratios (`run_bench`), held-out prompts;
* `bandwidth`: this machine's memory read rate and the weight-streaming floor
  of a decode step (bytes of weights / read rate).
"""

from mtplx_ext.benchmark.bandwidth import read_bandwidth, streaming_floor_s, weight_bytes
from mtplx_ext.benchmark.harness import (
    METHODS,
    Run,
    combined_runs,
    encode_prompts,
    engine_run,
    format_table,
    heldout_prompts,
    md_version,
    mlx_lm_model,
    mlx_lm_run,
    prompt_groups,
    run_bench,
    streaming_floor,
    versions,
    write_plot,
)

__all__ = [
    "METHODS",
    "Run",
    "combined_runs",
    "encode_prompts",
    "engine_run",
    "format_table",
    "heldout_prompts",
    "md_version",
    "mlx_lm_model",
    "mlx_lm_run",
    "prompt_groups",
    "read_bandwidth",
    "run_bench",
    "streaming_floor",
    "streaming_floor_s",
    "versions",
    "weight_bytes",
    "write_plot",
]
