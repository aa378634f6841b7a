"""depth="auto" in the Engine: a K per batch size (0 included) that follows the acceptance the engine sees.

Calibration (`engine.autodepth`) measures, per batch size 1, 2, 4, ... and
`max_batch`, what a cycle costs at every K and how often the calibration's
drafts were accepted. A batch of B rows runs the K of the smallest
calibrated size that holds it; a verification of B x (K + 1) rows costs
more the larger B is, so one stream runs deeper than a full batch, and a
size where drafting does not pay runs K = 0: one token per cycle, the head
idle (`Cycle.zero_draft_step`). Rows move between batches of any K exactly:
a row keeps its uncommitted x0 whatever its batch's K.

The acceptance of the text actually served, and what its steps take,
decide too: the engine feeds the wall time of each step that only decoded
to `BatchDepths.time` (a K's served cost replaces its calibration while
fresh) and its running draft totals to `BatchDepths.observe`, which re-picks
the running size's K against the running estimate
(`autodepth.RunningAcceptance`) every `CHECK_EVERY` cycles. A K predicted at
least `HYSTERESIS` faster than the running one, and at most one K past both
the deepest it has timed at that size and the draft positions decoding has
reached (beyond them cost and acceptance are guesses), is tried before it is
made (`depth_trials`): the two run in alternating blocks and the timed
steps decide. The engine recomposes its batch at each new K (rows keep or
pad their drafts: `batch.fit_drafts`).
Greedy tokens never depend on K, and sampled decoding is exact at every K.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from mtplx_ext._checks import MAX_DRAFTS, as_int
from mtplx_ext.batching.admission import decode_mode
from mtplx_ext.batching.depth_trials import DepthTrial
from mtplx_ext.decode.autodepth import AUTO, DepthCosts, RunningAcceptance, choose_depth, cycle_cost, tokens_per_s
from mtplx_ext.decode.generate import auto_costs

#: depth="auto" runs the K of the largest of this many recent batch sizes,
RECENT_BATCHES = 8
#: recorded in the last this many cycles (a load that fell from many streams to one gets its deep K within
#: a request, not after eight of them).
RECENT_CYCLES = 32
#: Cycles between two re-picks of K from the running acceptance.
CHECK_EVERY = 16
#: A re-picked K replaces the current one only when predicted this much faster (no flapping on noise).
HYSTERESIS = 0.1
#: Steps the running estimate of a cycle's host overhead averages over (`BatchDepths.time`).
OVERHEAD_CYCLES = 32
#: A step timed over this many times its K's running step time counts as this many times it: a stall (a
#: collection, the machine's other work) moves the estimate by at most OUTLIER / OVERHEAD_CYCLES of itself.
OUTLIER = 1.5
#: A K's served step time older than this many cycles no longer counts: its cost is again the calibration's
#: plus the running host work. A K timed while the machine was slow (the first steps after start, other
#: work) would otherwise keep the engine off it for good.
STALE_CYCLES = 512
#: Explorations of a size whose neighbours keep losing space out to this many times `STALE_CYCLES`.
EXPLORE_MAX = 8


def depth_for(depths: dict[int, int], rows: int) -> int:
    """The K of the smallest size in `depths` that holds `rows` rows (the largest size's K beyond it)."""
    fits = [b for b in depths if b >= rows]
    return depths[min(fits)] if fits else depths[max(depths)]


def pick_depth(costs: DepthCosts, acceptance: Sequence[float] | None, current: int | None,
               cap: int | None = None, exclude: Collection[int] = ()) -> int:
    """A batch size's K >= 0 for `acceptance` (None: the calibration's), at most `cap` (or `current`, if
    deeper) and none of `exclude` (but `current`), moving from `current` only for a predicted gain of at
    least `HYSTERESIS`."""
    among = [k for k in costs.depths() if k == current or ((cap is None or k <= cap) and k not in exclude)]
    best = choose_depth(costs, acceptance, among)
    if current is None or current == best or str(current) not in costs.cycle_s:
        return best
    gain = tokens_per_s(costs, best, acceptance) / tokens_per_s(costs, current, acceptance)
    return best if gain >= 1 + HYSTERESIS else current


class BatchDepths:
    """depth="auto" per batch size: `depths(rows)` is the K for a batch of `rows` rows.

    The K of the largest of the last `recent` batch sizes recorded in the
    last `RECENT_CYCLES` cycles (`depth_for`): under steady load streams come
    and go every few cycles, and a K that followed each recomposition would
    flap between a small batch's deep K and a full batch's shallow one, each
    change costing the drafts cut or padded. Once the load stays low the
    deeper K takes over.

    Args:
        depths: {batch size: K} to start from.
        recent: the window of batch sizes.
        costs: {batch size: its calibration}: with them, K follows the
            acceptance `observe` sees; without, `depths` stay as given.
    """

    def __init__(self, depths: dict[int, int], recent: int = RECENT_BATCHES,
                 costs: dict[int, DepthCosts] | None = None):
        self.depths = dict(depths)
        self.recent: deque[tuple[int, int]] = deque(maxlen=recent)  # (cycle it was recorded at, rows)
        self._ticks = 0  # cycles observed
        self.costs = costs
        # The prior: the calibrations' acceptance per draft position, averaged over the sizes that saw it.
        lengths = {len(c.acceptance) for c in (costs or {}).values()}
        self.running: RunningAcceptance | None = None
        if len(lengths) == 1 and 0 not in lengths:
            self.running = RunningAcceptance(np.mean([c.acceptance for c in costs.values()], axis=0))
        self._cycles = 0
        self._last_k: int | None = None  # the K of the last cycle observed
        #: Per calibrated size, the running estimate of each cycle's host work beyond its measured cost.
        self.overhead_s: dict[int, float] = {}
        #: Per (calibrated size, K), the running wall time of a step that only decoded at that K,
        self.step_s: dict[tuple[int, int], float] = {}
        #: and the cycle it was last updated at.
        self.timed_at: dict[tuple[int, int], int] = {}
        #: The move being tried (`depth_trials`), and per (size, K) the cycle a K lost a trial at.
        self.trial: DepthTrial | None = None
        self.lost: dict[tuple[int, int], int] = {}
        #: Per size, the K a challenger beat and the cycle it did: tried again once `STALE_CYCLES` have passed,
        #: should the prediction never propose it (a trial the noise decided would otherwise stand for good).
        self.recheck: dict[int, tuple[int, int]] = {}
        #: Per size, the cycle its last trial began at; per (size, K), the cycle an exploration last tried K;
        #: per size, explorations lost in a row (`_unpredicted`).
        self.tried_at: dict[int, int] = {}
        self.explored: dict[tuple[int, int], int] = {}
        self.explore_losses: dict[int, int] = {}

    def freeze(self) -> None:
        """Keeps the calibration's K per batch size from now on (side-by-side measurements)."""
        self.running = None

    def _sizes(self) -> list[int]:
        """The window's sizes: the last `recent` batches, those of the last `RECENT_CYCLES` cycles only."""
        while self.recent and self._ticks - self.recent[0][0] > RECENT_CYCLES:
            self.recent.popleft()
        return [rows for _, rows in self.recent]

    def __call__(self, rows: int) -> int:
        self.recent.append((self._ticks, rows))
        return depth_for(self.depths, max(self._sizes()))

    def expected(self, rows: int) -> int:
        """The K a batch of `rows` rows would run now (as `__call__`, without recording the size): what a
        prefill drafts, so that a row bound for a K = 0 batch skips the head's drafting (it still runs the head
        over its prompt); a row that then lands in a deeper batch pads its drafts for one cycle."""
        return depth_for(self.depths, max([rows, *self._sizes()]))

    def observe(self, reached: Sequence[int], accepted: Sequence[int], rows: int, k: int) -> bool:
        """Takes the engine's running draft totals after a cycle of `rows` rows at K = `k`.

        Every `CHECK_EVERY` cycles that drafted (or ran at K = 0) it predicts
        the running size's best K; a move is tried first (`depth_trials`)
        and made only where the trial's timed steps confirm it. Sizes not
        running keep their K until they run.

        Returns:
            True when the running batch should change K now (the engine recomposes it).
        """
        self._ticks += 1
        if self.running is None:
            return False
        # The first cycle after K went up verified padded drafts past the old K (`batch.fit_drafts`): only the
        # old K's positions count (a trial's switches would otherwise read as rejections of the deeper K).
        upto = self._last_k if self._last_k is not None and k > self._last_k else None
        self._last_k = k
        drafted = self.running.observe(reached, accepted, upto)
        load = max(self._sizes(), default=rows)  # the rows whose size's K the batch runs
        size = self._size(load)
        if self.trial is not None:
            self._trial_cycle(size, k)
            return depth_for(self.depths, load) != k
        # A cycle at K = 0 drafts nothing to learn from, but its host work (`time`) may still move K off 0.
        if not drafted and k != 0:
            return False
        self._cycles += 1
        if self._cycles % CHECK_EVERY:
            return False
        est = self.running.estimate()
        # K climbs one draft past what the decoding has seen and one past the deepest K the size has run:
        # deeper drafts' acceptance is extrapolated from the shallow ones, and a deeper K's cost is the
        # calibration's until its steps are timed (`served_costs`); a jump on either (K = 1 to 4 at 8 streams on
        # the grown model, 0.74x plain) would need the hysteresis' gain to come back.
        cap = min(self.running.observed() + 1, self.deepest_run(size) + 1)
        current = self.depths.get(size)
        if current is None:
            return False
        lost = [kk for (b, kk), at in self.lost.items() if b == size and self._ticks - at <= STALE_CYCLES]
        best = pick_depth(self.served_costs(size), est, current, cap, lost)
        predicted = best != current
        if not predicted:
            best = self._unpredicted(size, current, cap, lost, est)
        if best is None or best == current:
            return False
        self.trial, self.tried_at[size] = DepthTrial(size, current, best, predicted), self._ticks
        self.depths[size] = best
        return depth_for(self.depths, load) != k

    def _unpredicted(self, size: int, current: int, cap: int, lost: Sequence[int], est: Sequence[float]
                     ) -> int | None:
        """A K to try that the prediction does not propose, or None: the K a won trial beat, once
        `STALE_CYCLES` have passed (a trial the noise decided would otherwise stand for good); else, when the
        size has tried nothing for `STALE_CYCLES` cycles, a neighbour of `current`, the two in turns (a
        calibration measured in a slow moment would otherwise keep the size off its best K for good). Each
        time both neighbours have lost, explorations come half as often, down to one per `EXPLORE_MAX` x
        `STALE_CYCLES` cycles."""
        beaten, at = self.recheck.get(size, (None, 0))
        if beaten is not None and self._ticks - at > STALE_CYCLES:
            del self.recheck[size]
            return beaten
        every = STALE_CYCLES * min(2 ** (self.explore_losses.get(size, 0) // 2), EXPLORE_MAX)
        if self._ticks - self.tried_at.get(size, 0) <= every:
            return None
        costs = self.served_costs(size)
        near = [kk for kk in (current - 1, current + 1) if 0 <= kk <= cap and str(kk) in costs.cycle_s and kk not in lost]
        if not near:
            return None
        # The neighbour explored least lately (never first), the one predicted faster on a tie.
        pick = min(near, key=lambda kk: (self.explored.get((size, kk), -1), -tokens_per_s(costs, kk, est)))
        self.explored[(size, pick)] = self._ticks
        return pick

    def _size(self, rows: int) -> int:
        """The calibrated size whose K a batch of `rows` rows runs."""
        fits = [b for b in self.depths if b >= rows]
        return min(fits) if fits else max(self.depths)

    def _trial_cycle(self, size: int, k: int) -> None:
        """One cycle of the trial: the next block's K, the verdict at its end, or the trial dropped where the
        load moved to another size or the batch does not run the trial's K."""
        t = self.trial
        assert t is not None and self.running is not None
        if size != t.size or t.stuck():
            self.depths[t.size], self.trial = t.incumbent, None
            return
        switched = t.cycle(k)
        if t.done():
            win = t.winner(self.running.estimate())
            if t.timed():
                self.lost[(t.size, t.incumbent if win == t.challenger else t.challenger)] = self._ticks
                if win == t.challenger:
                    self.recheck[t.size], self.explore_losses[t.size] = (t.incumbent, self._ticks), 0
                elif not t.predicted:
                    self.explore_losses[t.size] = self.explore_losses.get(t.size, 0) + 1
            self.depths[t.size], self.trial = win, None
        elif switched:
            self.depths[t.size] = t.k()

    def time(self, rows: int, k: int, seconds: float) -> None:
        """Takes the wall time of one engine step that only decoded (a cycle of `rows` rows at K = `k`).

        What it took beyond the calibrated cycle is host work the calibration
        does not see (streaming each cycle's tokens to clients, detokenizing,
        the server's threads): it costs every K the same per cycle, so it
        favours deeper K, which commit more tokens a cycle. The step time itself
        replaces the calibration for the K it ran (`served_costs`). Both are
        averages over the last `OVERHEAD_CYCLES` steps or so, per calibrated size.
        """
        if self.costs is None or self.running is None:
            return
        b = self._size(rows)
        if str(k) not in self.costs[b].cycle_s:
            return
        if self.trial is not None and self.trial.size == b:
            self.trial.record(k, seconds)
        old = self.step_s.get((b, k))
        seconds = float(seconds) if old is None else min(float(seconds), OUTLIER * old)
        sample = max(seconds - cycle_cost(self.costs[b], k), 0.0)
        prev = self.overhead_s.get(b)
        self.overhead_s[b] = sample if prev is None else prev + (sample - prev) / OVERHEAD_CYCLES
        self.step_s[(b, k)] = seconds if old is None else old + (seconds - old) / OVERHEAD_CYCLES
        self.timed_at[(b, k)] = self._ticks

    def deepest_run(self, b: int) -> int:
        """The deepest K whose steps size `b` has timed (its current K where none is)."""
        return max([k for (size, k) in self.step_s if size == b] + [self.depths.get(b, 0)])

    def served_costs(self, b: int) -> DepthCosts:
        """Size `b`'s cycle costs as served: a K's running step time where the engine has run it lately
        (`STALE_CYCLES`), else its calibrated cost plus the running host work (`time`). The calibration of a
        deep K on a compute-bound batch can be short of what the engine's steps take (the grown model at 8
        streams: K = 4 calibrated 189 ms, served 222 ms), and a K picked on it would keep running."""
        c, h = self.costs[b], self.overhead_s.get(b, 0.0)
        def cost(k: int, calibrated: float) -> float:
            fresh = (b, k) in self.step_s and self._ticks - self.timed_at[(b, k)] <= STALE_CYCLES
            return self.step_s[(b, k)] if fresh else calibrated + h

        served = {k: cost(int(k), t) for k, t in c.cycle_s.items()}
        return DepthCosts(batch=c.batch, cycle_s=served, acceptance=c.acceptance)


def auto_costs_by_size(runtime: Any, max_batch: int) -> dict[int, DepthCosts] | None:
    """The calibrations of 1, 2, 4, ... and max_batch streams, or None where K cannot vary.

    None for runtimes whose head caches depend on K (several MTP modules):
    their rows cannot change K.
    """
    if len(getattr(runtime, "mtp_modules", [])) > 1:
        return None
    sizes = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})
    costs = {b: auto_costs(runtime, b) for b in sizes}
    return None if any(c is None for c in costs.values()) else costs  # type: ignore[misc]


def engine_depths(runtime: Any, mtp: bool, depth: int | str, max_batch: int, per_batch: bool
                  ) -> tuple[bool, int, bool, BatchDepths | None]:
    """`admission.decode_mode` plus, for depth="auto" with `per_batch`, the K per batch size.

    MTP stays on when some batch size's K is above 0 (sizes at 0 decode one
    token per cycle); it is off only when every size runs plain. The depth
    returned is then the deepest K any size may pick (the calibration's
    deepest): the prefills draft that many, and requests may cap theirs up to it.
    """
    if isinstance(depth, dict):
        return _given_depths(runtime, mtp, depth, max_batch, per_batch)
    costs = None
    if depth == AUTO and mtp and per_batch and getattr(runtime, "has_mtp", False):
        costs = auto_costs_by_size(runtime, max_batch)
    if not costs:
        mtp, k, route = decode_mode(runtime, mtp, depth, max_batch)
        return mtp, k, route, None
    picks = {b: pick_depth(c, None, None) for b, c in costs.items()}
    if not any(picks.values()):  # drafting pays at no size: a plain engine, the head never runs
        mtp, k, route = decode_mode(runtime, False, 1, max_batch)
        return mtp, k, route, None
    mtp, _, route = decode_mode(runtime, True, 1, max_batch)
    return mtp, max(max(c.depths()) for c in costs.values()), route, BatchDepths(picks, costs=costs)


def _given_depths(runtime: Any, mtp: bool, depth: dict, max_batch: int, per_batch: bool
                  ) -> tuple[bool, int, bool, BatchDepths | None]:
    """depth={batch size: K}: each size's K as given (0: no drafts), fixed (no running acceptance)."""
    if not per_batch:
        raise ValueError("depth as {batch size: K} is not supported by this engine (one K for every batch)")
    if not depth:
        raise ValueError("depth as {batch size: K} needs at least one entry")
    given = {}
    for b, k in depth.items():
        size = as_int("depth (a batch size key)", b, lo=1, hi=max_batch + 1)
        given[size] = as_int(f"depth[{size}]", k, lo=0, hi=MAX_DRAFTS + 1)
    if max_batch not in given and max(given) < max_batch:
        given[max_batch] = given[max(given)]  # sizes past the largest given take its K
    if not mtp or not any(given.values()):
        mtp, k, route = decode_mode(runtime, False, 1, max_batch)
        return mtp, k, route, None
    mtp, _, route = decode_mode(runtime, True, 1, max_batch)
    if len(getattr(runtime, "mtp_modules", [])) > 1 and len(set(given.values())) > 1:
        raise ValueError("depth: a head of several MTP modules keeps caches per K, so every batch size needs the same K")
    return mtp, max(given.values()), route, BatchDepths(given)


__all__ = ["CHECK_EVERY", "HYSTERESIS", "RECENT_BATCHES", "RECENT_CYCLES", "BatchDepths", "auto_costs_by_size", "depth_for", "pick_depth",
           "engine_depths"]
