"""A move of depth="auto" to a new K, checked against the running K in alternating blocks of cycles.

`BatchDepths` predicts each K's speed from a calibration, the running
acceptance and the host work it timed. Its step timings come from different
stretches of time, and on a shared machine one stretch can run 2x slower than
the next (other processes, the server's threads): a K timed in a slow
stretch looks dear for good, one timed in a fast stretch cheap, and K
wandered between near-equal depths, or went where it lost.

So a predicted move is a `DepthTrial` first: the batch runs the challenger
and the running K (the incumbent) in turns, `TRIAL_BLOCK` cycles each, for
`TRIAL_BLOCKS` blocks. Each pair of neighbouring blocks gives the ratio of the
two K's tokens per second (the running acceptance's tokens per cycle over
the median of the block's timed steps), and the challenger wins where the
median of those ratios is above 1 + `TRIAL_MARGIN`. Neighbouring blocks run a few cycles
apart, so a machine that slows down or speeds up between stretches of time
moves both alike; a change inside a trial spoils the one pair that straddles
it, which the median outvotes. A trial whose steps were not timed (a caller
that never calls `BatchDepths.time`) lets the prediction decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mtplx_ext.decode.autodepth import expected_tokens

#: Cycles per block of a trial (the engine does not time its first step at a new K).
TRIAL_BLOCK = 4
#: Blocks per trial, challenger first: half at each K.
TRIAL_BLOCKS = 10
#: Neighbouring pairs of timed blocks the timings need to decide.
MIN_PAIRS = 3
#: The challenger must measure this much faster: the move costs a recomposition, and a near tie is more
#: often the acceptance estimate's noise (both rates read it) than a real gain.
TRIAL_MARGIN = 0.03
#: ... and a challenger nothing predicted faster (a neighbour explored, a beaten K tried again) this much.
UNPREDICTED_MARGIN = 0.06


@dataclass
class DepthTrial:
    """The incumbent K against a challenger at one calibrated batch size.

    Attributes:
        size: the calibrated batch size whose K is tried.
        incumbent: the K running before the trial.
        challenger: the K to try: predicted faster, or not (`predicted` False: a K tried again, a neighbour
            explored).
        cycles: cycles run at the trial's K so far.
        seen: cycles observed since the trial began (at any K: the engine may lag a switch by a cycle).
        samples: per block, the wall times of its timed steps.
    """

    size: int
    incumbent: int
    challenger: int
    predicted: bool = True
    cycles: int = 0
    seen: int = 0
    samples: dict[int, list[float]] = field(default_factory=dict)

    def _k_of(self, block: int) -> int:
        return self.challenger if block % 2 == 0 else self.incumbent

    def _block(self) -> int:
        return min(self.cycles // TRIAL_BLOCK, TRIAL_BLOCKS - 1)

    def k(self) -> int:
        """The K of the current block."""
        return self._k_of(self._block())

    def cycle(self, k: int) -> bool:
        """Counts a cycle run at K = `k`; True when the block ends here (the batch switches K)."""
        self.seen += 1
        if k != self.k():
            return False
        self.cycles += 1
        return self.cycles % TRIAL_BLOCK == 0

    def done(self) -> bool:
        return self.cycles >= TRIAL_BLOCK * TRIAL_BLOCKS

    def stuck(self) -> bool:
        """The batch has not run the trial's K for a trial's length of cycles (requests' caps, a constraint)."""
        return self.seen > 3 * TRIAL_BLOCK * TRIAL_BLOCKS

    def record(self, k: int, seconds: float) -> None:
        """A timed step at K = `k`: the current block's, or the one before where the engine timed the last
        step of a block after the switch was decided."""
        block = self._block()
        if self._k_of(block) != k:
            block -= 1
        if block >= 0 and self._k_of(block) == k:
            self.samples.setdefault(block, []).append(float(seconds))

    def _ratios(self, acceptance: Sequence[float]) -> list[float]:
        """Challenger over incumbent tokens per second, per neighbouring pair of timed blocks."""
        def rate(block: int) -> float:
            k = self._k_of(block)
            per_cycle = 1.0 if k == 0 else expected_tokens(acceptance, k)
            return per_cycle / float(np.median(self.samples[block]))

        return [rate(b) / rate(b + 1) if b % 2 == 0 else rate(b + 1) / rate(b) for b in self._pairs()]

    def _pairs(self) -> list[int]:
        """The first blocks of the neighbouring pairs whose blocks both have timed steps."""
        return [b for b in range(TRIAL_BLOCKS - 1) if b in self.samples and b + 1 in self.samples]

    def timed(self) -> bool:
        """Whether the timed blocks can decide (`MIN_PAIRS`)."""
        return len(self._pairs()) >= MIN_PAIRS

    def winner(self, acceptance: Sequence[float]) -> int:
        """The challenger where the median ratio of the timed pairs is above 1 + `TRIAL_MARGIN` (+
        `UNPREDICTED_MARGIN` where it was not predicted faster), else the incumbent; where the steps were not
        timed, the challenger if it was predicted faster."""
        if not self.timed():
            return self.challenger if self.predicted else self.incumbent
        margin = TRIAL_MARGIN if self.predicted else UNPREDICTED_MARGIN
        return self.challenger if float(np.median(self._ratios(acceptance))) > 1.0 + margin else self.incumbent


__all__ = ["MIN_PAIRS", "TRIAL_BLOCK", "TRIAL_BLOCKS", "TRIAL_MARGIN", "UNPREDICTED_MARGIN", "DepthTrial"]
