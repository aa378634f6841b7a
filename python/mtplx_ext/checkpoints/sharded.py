"""One model across several processes: mlx-lm's tensor and pipeline sharding of an MTP runtime.

`load(path, group=mx.distributed.init(), parallel="tensor")` (or
"pipeline") builds the runtime from lazily loaded weights, shards it with
the family's own mlx-lm code, and only then evaluates the parameters, so a
rank keeps only its shard:

* tensor parallel: the trunk family's `shard()` (attention heads and MLP
  columns split, one all-reduce after each attention and each MLP); every
  rank reads every tensor once and keeps its slice, as mlx-lm's
  `sharded_load` does;
* pipeline parallel: the family's `pipeline()` (rank 0 runs the last
  layers, the highest rank the first ones); a rank never reads the tensors
  of the layers it does not run. Each stage sends its output on with
  `mx.distributed.send` and the last stage's output reaches every rank
  through one `all_gather` (`models.trunk.trunk_hidden`).

The MTP head is split like a trunk layer by default in tensor parallel
(`head="shard"`, with the trunk family's own `shard()`): a draft step then
reads only the rank's part of the head block, for two all-reduces, and a
memory-bound head step is the rank's bytes, not the whole block's (measured
faster than a replicated head on the grown benchmark model, see
bench/RESULTS.md; DeepSeek-V3's MTP block is a full MoE layer, gigabytes at
full size). `head="replicate"` keeps the whole head on every rank (no
collective per draft); pipeline parallel always replicates it. The
embedding, the final norm and the LM head are replicated (mlx-lm does not
shard them), so every rank computes the same logits and, with the same
sampling keys, the same tokens.
"""

from __future__ import annotations

import os
import socket
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from mtplx_ext._checks import CheckpointError
from mtplx_ext.checkpoints import loading
from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.runtime import MTPRuntime
from mtplx_ext.ops.threads import cpu_threads, set_cpu_threads

#: The ways a runtime can be split across a group.
PARALLEL_MODES = ("tensor", "pipeline")
HEAD_MODES = ("replicate", "shard")  # None picks by parallel mode: `resolve_head`


def check_parallel(parallel: object, head: object = None) -> None:
    """Raises ValueError naming the argument when `parallel` / `head` is not a known mode (None: the default)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    if head is not None and head not in HEAD_MODES:
        raise ValueError(f"head must be one of {', '.join(HEAD_MODES)} or None, got {head!r}")


def resolve_head(parallel: str, head: str | None) -> str:
    """The head mode a load uses: `head`, or by default "shard" in tensor parallel and "replicate" pipelined."""
    check_parallel(parallel, head)
    if head is None:
        return "shard" if parallel == "tensor" else "replicate"
    return head


def _check_tensor_split(config: dict, n: int, where: str) -> None:
    """mlx-lm's `shard()` divides head counts and widths without checking: a remainder would be garbage."""
    text = trunk_lib.text_config(config)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"):
        v = text.get(name)
        if isinstance(v, int) and v % n:
            raise CheckpointError(f"{where}: {name} = {v} does not split over {n} tensor-parallel ranks")


def _shard_head(runtime: MTPRuntime, group: Any) -> None:
    """Shards each MTP block with the trunk family's own `shard()` (it only walks `model.layers`)."""
    layers = [l for m in runtime.mtp_modules for l in m.layer_list()]
    shim = SimpleNamespace(model=SimpleNamespace(layers=layers))
    type(runtime.trunk).shard(shim, group)


def shard_runtime(runtime: MTPRuntime, group: Any, parallel: str, head: str | None = None, where: str = "model") -> None:
    """Splits a runtime's trunk (and optionally its head) across `group`, in place, before evaluation.

    Call it on a runtime whose parameters are still lazy (as `load` does) so
    that each rank reads only its part; on an evaluated runtime (a random
    model) it gives the same split.

    Raises:
        ValueError / CheckpointError: an unknown mode, a family mlx-lm
            cannot split that way (naming it and the other mode), widths
            that do not divide by the group size.
    """
    head = resolve_head(parallel, head)
    n = group.size()
    if n == 1:
        return
    family = trunk_lib.family_of(runtime.trunk)
    lm = trunk_lib.text_model(runtime.trunk)
    runtime.group = group  # (its ranks must run every forward in lockstep)
    if parallel == "tensor":
        if not hasattr(runtime.trunk, "shard"):
            raise CheckpointError(f"{where}: mlx-lm's {family} has no tensor-parallel shard(); try pipeline parallel")
        _check_tensor_split(runtime.config, n, where)
        runtime.trunk.shard(group)
        if head == "shard" and runtime.has_mtp:
            _shard_head(runtime, group)
        return
    if head == "shard":
        raise ValueError("head='shard' needs tensor parallel: in pipeline parallel every rank runs the whole head")
    if not hasattr(lm.model, "pipeline"):
        raise CheckpointError(f"{where}: mlx-lm's {family} has no pipeline(); try tensor parallel")
    layers = len(lm.model.layers)
    if layers < n:
        raise CheckpointError(f"{where}: {layers} trunk layers cannot make {n} pipeline stages")
    lm.model.pipeline(group)


def load(
    path: str | Path,
    *,
    group: Any,
    parallel: str = "tensor",
    head: str | None = None,
    fuse_cpu_ops: bool = True,
) -> MTPRuntime:
    """`checkpoints.load` across the ranks of `group`: each rank keeps (and, pipelined, reads) only its part.

    Args:
        path: a model folder, as for `checkpoints.load`.
        group: an `mx.distributed.Group` (`mx.distributed.init()`); a group
            of one loads the whole model.
        parallel: "tensor" or "pipeline".
        head: "shard" (the default in tensor parallel: the head block split
            like a trunk layer) or "replicate" (the default pipelined, and
            the only mode there).
        fuse_cpu_ops: as for `checkpoints.load`.

    Raises:
        as `checkpoints.load` and `shard_runtime`.
    """
    head = resolve_head(parallel, head)
    path = Path(path)
    config = loading.read_config(path)
    where = str(path / "config.json")
    loading.check_config(config, where)
    weights = loading.read_weights(path)  # lazy: nothing is read before the shard is chosen
    tokenizer = loading.read_tokenizer(path)
    runtime = loading.build_runtime(
        config, weights, tokenizer, where=where,
        prepare=lambda rt: shard_runtime(rt, group, parallel, head, where), consume=True,
    )
    mx.clear_cache()  # the full tensors the slices were cut from
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    share_cpus(group)
    # Ranks that finished loading wait here for the slower ones (as mlx-lm's sharded_load).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return runtime


def share_cpus(group: Any) -> int:
    """Divides this host's CPUs between the ranks of `group` running on it; returns this rank's kernel threads.

    Ranks on one host each run their CPU kernels (the packed GEMM splits a
    product over the pool) on the same cores; two ranks with a pool of every
    core each would time-slice four busy threads on two cores, and every
    collective would wait for the rank that was descheduled. Each rank gets
    its share of the cores instead (at least one). `MTPLX_CPU_THREADS`, when
    set, wins. One collective (an all_sum of host ids), so every rank must
    call it.
    """
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    ids = mx.zeros((group.size(),), dtype=mx.int64)
    ids[group.rank()] = host
    local = int((mx.distributed.all_sum(ids, group=group, stream=mx.cpu) == host).sum().item())
    if os.environ.get("MTPLX_CPU_THREADS", "").strip() or local <= 1:
        return cpu_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    set_cpu_threads(max(1, cpus // local))
    return cpu_threads()


__all__ = ["HEAD_MODES", "PARALLEL_MODES", "check_parallel", "load", "share_cpus", "shard_runtime"]
