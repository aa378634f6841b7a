"""The decode loop: cycles run serially or pipelined, one bundle read per cycle."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mtplx_ext.cache import rollback
from mtplx_ext.decode.compaction import Compactor
from mtplx_ext.decode.constraint import RowConstraints, forced_drafts
from mtplx_ext.decode.cycle import Cycle, Pending
from mtplx_ext.decode.streams import Streams

#: Weight of the newest cycle in the pipelined loop's estimate of how often
#: cycles repair (it builds the likelier path ahead).
_REPAIR_EMA = 0.25


def read_bundle(
    p: Pending, streams: Streams, with_next: bool = False, rows: Compactor | None = None
) -> np.ndarray:
    """The cycle's one blocking host read (with the next cycle's tokens evaluated alongside: `read_next`).

    With `rows` (a compacted batch) the bundle comes back as one row per stream.
    """
    t = time.perf_counter()
    if with_next and p.next_tokens is not None:
        mx.eval(p.bundle, p.next_tokens)
    b = np.array(p.bundle)
    streams.result.sync_wait_s += time.perf_counter() - t
    streams.result.host_syncs += 1
    return b if rows is None else rows.expand(b, len(streams.done))


def _decide(st: Streams, b: np.ndarray, mtp: bool):
    return st.decide(b) if mtp else (st.decide_plain(b), None)


def _constrain(cyc: Cycle, st: Streams, guide: RowConstraints, p: Pending, b: np.ndarray, mtp: bool) -> None:
    """Moves the rows' constraints along what the cycle committed and masks the next step."""
    live = ~st.done
    if mtp:
        guide.commit_bundle(b, live)
        cyc.policy.mask, toks, forced = guide.probe(np.array(p.next_tokens), live)
        if forced is not None:
            p.next_tokens, p.next_info = forced_drafts(p.next_tokens, p.next_info, toks, forced)
    else:
        for i in range(b.shape[0]):
            if live[i]:
                guide.commit(i, [int(b[i, 0])])
        cyc.policy.mask = guide.current()


def run_cycles(
    cyc: Cycle,
    st: Streams,
    first: Pending,
    mtp: bool,
    serial: bool,
    guide: RowConstraints | None = None,
    rows: Compactor | None = None,
) -> None:
    """The decode cycles, serial or pipelined (same graphs, same forwards).

    Pipelined, the host builds the next cycle's graph while the device runs
    the current one. With per-stream commit (and plain decoding) the next
    cycle depends only on device arrays. With uniform repair it is built
    along the likelier path (every stream accepts, or the one repair a
    depth-1 cycle can need) and dropped unevaluated when the bundle says
    otherwise: tokens and forwards equal the serial loop's.

    With constraints (`guide`) the loop is serial: the next step's mask
    needs this cycle's commits and the next x0 and drafts on the host (read
    with the bundle, one blocking read per cycle).

    With `rows` (pipelined per-stream or plain decoding) the batch drops
    its finished rows whenever at most half are live (`engine.compaction`):
    that cycle is read before the next is launched, the live rows move to
    a smaller batch, and `rows.cyc` is the cycle from then on.
    """
    res = st.result
    p = first
    repair_rate = 0.0
    uniform = mtp and not cyc.per_stream
    while True:
        res.cycles += 1
        res.row_cycles += len(rows.rows) if rows is not None else len(st.done)
        if serial:
            b = read_bundle(p, st, with_next=guide is not None)
            commits, r = _decide(st, b, mtp)
            st.apply(commits)
            if not st.any_live():
                return
            if guide is not None:
                _constrain(cyc, st, guide, p, b, mtp)
        elif not uniform:
            if rows is not None and rows.due(st.done):
                # Nothing in flight while rows move: this cycle is read first.
                commits, r = _decide(st, read_bundle(p, st, rows=rows), mtp)
                st.apply(commits)
                if not st.any_live():
                    return
                p = rows.compact(p, st.done)
                cyc = rows.cyc
                res.forwards += 1
                p = cyc.next_step(p, mtp, None, res.cycles + 1, st.slots_needed())
                mx.async_eval(p.bundle)
                continue
            # Launch the next cycle before reading this one, so the device
            # never waits for the host; unless this cycle may end every
            # stream at its cap.
            spec = cyc.next_step(p, mtp, None, res.cycles + 1, st.slots_needed())
            early = not st.may_all_finish()
            if early:
                mx.async_eval(spec.bundle)
            commits, r = _decide(st, read_bundle(p, st, rows=rows), mtp)
            if not st.any_live():
                st.apply(commits)
                if early:
                    # A stop token ended them early: the launched cycle is
                    # wasted work, and the decode time includes it.
                    mx.eval(spec.bundle)
                return
            if not early:
                mx.async_eval(spec.bundle)
        else:
            # A repair's width is known before the bundle only at depth 1.
            guess = 1 if repair_rate > 0.5 and cyc.depth == 1 else None
            slots = st.slots_needed()
            if cyc.compiled is not None:
                # Grow first: a restored state must fit the caches' shapes.
                cyc.reserve(slots)
                saved, ckpt = cyc.save_compiled(), None
            else:
                saved, ckpt = None, rollback.checkpoint_caches(*cyc.caches(), [cyc.policy])
            spec = cyc.next_step(p, mtp, guess, res.cycles + 1, slots)
            commits, r = _decide(st, read_bundle(p, st), mtp)
            if r != guess or not st.any_live():
                if ckpt is None:
                    cyc.load_compiled(saved)
                else:
                    rollback.rollback_caches(ckpt)
            if not st.any_live():
                st.apply(commits)
                return
            if r != guess:
                spec = cyc.next_step(p, mtp, r, res.cycles + 1, slots)
            # No stale handles on the caches' arrays: MLX may update them in place.
            del ckpt
            saved = None
            mx.async_eval(spec.bundle)
            repair_rate += _REPAIR_EMA * (float(r is not None) - repair_rate)
        res.forwards += 1 + int(r is not None)
        res.repair_cycles += int(r is not None)
        if serial:
            p = cyc.next_step(p, mtp, r, res.cycles + 1, st.slots_needed())
        else:
            # Late commit: host bookkeeping and callbacks overlap the device.
            st.apply(commits)
            p = spec
