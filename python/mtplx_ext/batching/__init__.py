"""Continuous batching: `Engine` admits requests into one running MTP batch as they arrive.

The engine decides and executes on its own thread; the modules beside it
hold what is not the loop itself: `options` (EngineOptions, its settings),
`requests` (the client's Request handle, its RowSettings, Event), `rows`
(RowRecord, the engine's own record of a request), `rules` and `admission`
(what a request may ask, what it needs, what fits), `scheduler` (the typed
plans), `batch` (a batch shape's caches, policy and compiled cycle; rows
moved between batches), `detok` (text and stop strings of a request),
`steps` (StepResult, what a step did), `metrics` (what `Engine.metrics()`
reports).

Each engine step:

1. new requests and cancellations are taken from the inbox (any thread may
   submit; only the engine's own thread touches MLX);
2. waiting requests are prefilled alone (B = 1, `Cycle.prefill_steps`), one
   chunk of `prefill_chunk` tokens per step while other streams decode, so a
   long prompt never stalls them for its whole prefill (requests that start
   together prefill in one left-padded forward: `prefill`);
3. the running batch is recomposed when a stream finished, was cancelled or
   a prefill completed: the rows that go on and the new ones are gathered
   into one compact batch (finished rows cost nothing afterwards), each at
   its own positions (per-stream end slots of `RaggedKVCache`); on hybrid
   trunks each row's recurrent and conv state (`ArraysCache`) moves with it.
   A new row's first token goes out when its prefill ends (time to first
   token); where no one reads it sooner (fixed batches:
   `EngineOptions.first_token_at_prefill`), it is read only once the batch
   is built and its first cycle launched, so the device does not wait for
   the host between the two (`PrefillPhase._defers`);
4. one MTP cycle (`Cycle`'s compiled per-stream step: K drafts, one
   [B, K + 1] verification, per-stream commit) runs for all live streams,
   its bundle is read once, and each stream's committed tokens go out;
5. `step` returns a `StepResult` of what it did, falsy once the engine is
   idle (`while engine.step(): ...`).

Hybrid trunks (`qwen3_next`, `qwen3_5`: GatedDeltaNet layers and attention
layers) commit per stream too: the verification runs through
`gated_delta.capture`, and each stream takes the recurrent state captured at
its own accepted length (no repair forward). The routing of mlx-lm's
GatedDeltaNet through the capture op is on, process-wide, while the engine
runs (`Engine.session`).

A batch of a given (rows, capacity, policy kind) is traced once and replayed
whenever the batch has that shape again: its arrays are loaded, not rebuilt
(`batch.Batch`).

Streams do not depend on each other: greedy rows are argmax decoding of
their own prompt, sampled rows draw from their own seed's key with their own
cycle count (`SampledPolicy.step_base`), so a request's tokens equal those
of decoding it alone.

Memory: at most `max_batch` live streams and `max_kv_slots` KV slots (rows
times the batch's slot capacity, the KV memory actually held). A request
that does not fit now waits; one that never could is refused at `submit`.
A recurrent layer holds a fixed-size state per row, so hybrids add memory
per row (bounded by `max_batch`), not per slot.
"""

from mtplx_ext.batching.admission import KV_BLOCK
from mtplx_ext.batching.detok import Detokenizer
from mtplx_ext.batching.engine import Engine
from mtplx_ext.batching.fixed import generate_batched, generate_greedy_batched
from mtplx_ext.batching.options import EngineOptions
from mtplx_ext.batching.requests import Event, Request, RowSettings
from mtplx_ext.batching.steps import CycleRun, Recomposition, StepResult

__all__ = ["KV_BLOCK", "CycleRun", "Detokenizer", "Engine", "EngineOptions", "Event", "Recomposition", "Request",
           "RowSettings", "StepResult", "generate_batched", "generate_greedy_batched"]
