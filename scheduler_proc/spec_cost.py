"""What a verification position costs, measured from the steps' own clock, and what a
sequence's proposals are worth against it.

A proposal pays only when the tokens it is expected to add outweigh the rows it adds to the
step. Neither is known up front: how much a row costs depends on the model, the device, the
batch and on what speculation switches off (a step holding proposals is not overlapped,
Scheduler.can_schedule_ahead), and how often a sequence's proposals are right depends on the sequence. So both
are measured as the engine runs:

- **Cost:** the time between one step's clock (``SchedulerOutput.now_s``) and the next is
  that step's whole cycle (scheduling, the forward, the update, and the overlap lost or won).
  Over pure-decode steps, an average of that gap per sequence for steps without proposals
  gives what one sequence's plain decode costs; for steps with proposals, the gap beyond the
  plain steps' cost, per proposed row, gives a row's cost. ``rho`` is their ratio: the price
  of one verification position in units of one plain decode of one sequence.
- **Worth:** per sequence, the chance that a proposal is accepted given the ones before it
  were (``alpha``: accepted proposals over accepted plus rejections, from an even prior).
  Proposing m tokens is then expected to add alpha + alpha^2 + ... + alpha^m tokens for
  ``rho * m``: the best m is the number of terms with alpha^j > rho, and 0 when alpha <= rho.

Only the recorded clock enters (never a clock read here), so a replay hands the same numbers
and decides the same proposals bit for bit. Until both averages have a few samples, rho is a
prior (``PRIOR_RHO``), so the first proposals of a run are an exploration, not a verdict; and
when every sequence speculates, a step without proposals is scheduled now and then (every other
step at first, then one in ``RECALIBRATE_EVERY``) so the plain cost stays measured.
"""

from __future__ import annotations

import math

PRIOR_RHO = 0.05  # a position's cost before steps measured it: with the even prior on alpha, k = 4 proposals
MIN_SAMPLES = 4  # steps of each kind before the measured rho replaces the prior
EMA = 0.1  # weight of the newest step in each running average
RECALIBRATE_EVERY = 64  # steps with proposals between two plain ones that keep the plain cost current
IDLE_FACTOR = 8.0  # a gap this many times the expected one held idle time (no requests): not a cost


class StepCost:
    """Running averages of the step cycle, split into the plain decode and the proposed rows."""

    __slots__ = ("per_seq", "per_row", "plain_samples", "row_samples", "rows_since_plain", "batch", "_last",
                 "_forward")

    def __init__(self):
        self.per_seq = 0.0  # seconds per sequence of a pure-decode step without proposals
        self.per_row = 0.0  # seconds per proposed row, beyond the plain cost of its step
        self.plain_samples = 0
        self.row_samples = 0
        self.rows_since_plain = 0  # steps with proposals measured since the last plain one
        self.batch = 0  # the sequences a step held when the averages started
        self._last = None  # (step, now_s, sequences, rows, overlapped) of the step before, if pure decode
        self._forward = (0, 0.0)  # (step, the worker's forward seconds) of the latest result

    def note_forward(self, step: int, seconds: float) -> None:
        """A result's ``forward_time_s`` (recorded with it, so a replay reads the same)."""
        self._forward = (step, seconds)

    def observe(self, step: int, now_s: float, num_seqs: int, num_rows: int, pure_decode: bool,
                overlapped: bool) -> None:
        """Step ``step`` was built at ``now_s``; the gap since the one before is that one's cycle.
        ``overlapped``: every sequence of it is in the decode lane (it may be scheduled ahead)."""
        last = self._last
        self._last = (step, now_s, num_seqs, num_rows, overlapped) if pure_decode and num_seqs else None
        if last is None:
            return
        then_step, then, seqs, rows, was_overlapped = last
        gap = now_s - then
        if gap <= 0.0:
            return
        if not self.batch or seqs > 2 * self.batch or 2 * seqs < self.batch:
            # A sequence's share of a step depends on how many share it (the weights are read
            # once for all): at a batch of another size, measure afresh.
            self.batch, self.plain_samples, self.row_samples, self.rows_since_plain = seqs, 0, 0, 0
        if rows == 0 and not was_overlapped and self._forward[0] == then_step:
            # A plain step held back by a speculating sequence: in the lane its host work would
            # overlap the forward, so what it would have cost there is the larger of the two.
            # The rest is speculation's, and is charged to the rows below (it is per_seq's gap).
            forward = self._forward[1]
            gap = max(forward, gap - forward)
        # A gap far beyond what the step should cost held idle time (no requests, or the
        # engine between two generate() calls): not a cost. Until the averages settle, the
        # plain cost is the least seen, so one idle gap among the first cannot inflate it.
        expected = self.per_seq * seqs + max(self.per_row, self.per_seq) * rows
        if self.plain_samples and gap > IDLE_FACTOR * expected:
            return
        if rows == 0:
            value = gap / seqs
            self.per_seq = (min(self.per_seq, value) if 0 < self.plain_samples < MIN_SAMPLES
                            else _average(self.per_seq, value, self.plain_samples))
            self.plain_samples += 1
            self.rows_since_plain = 0
        else:
            self.rows_since_plain += 1
            if self.plain_samples:
                extra = max(0.0, gap - self.per_seq * seqs) / rows
                self.per_row = _average(self.per_row, extra, self.row_samples)
                self.row_samples += 1

    @property
    def wants_plain_step(self) -> bool:
        """A step without proposals is due: while every sequence speculates no step is plain,
        and without plain steps a row has nothing to be priced against."""
        return self.rows_since_plain >= (1 if self.plain_samples < MIN_SAMPLES else RECALIBRATE_EVERY)

    @property
    def rho(self) -> float:
        """One verification position's cost, in plain decodes of one sequence."""
        if self.plain_samples < MIN_SAMPLES or self.row_samples < MIN_SAMPLES or self.per_seq <= 0.0:
            return PRIOR_RHO
        return self.per_row / self.per_seq


def _average(mean: float, value: float, samples: int) -> float:
    if samples == 0:
        return value
    weight = max(EMA, 1.0 / (samples + 1))  # a plain mean until the EMA's window is full
    return mean + weight * (value - mean)


def worth_proposing(accepted: int, rejections: int, rho: float, most: int) -> int:
    """Proposals (up to ``most``) whose expected tokens outweigh their rows; 0: none pay."""
    alpha = (accepted + 1) / (accepted + rejections + 2)
    if alpha <= rho or most <= 0:
        return 0
    if rho <= 0.0:
        return most
    # alpha^j > rho exactly for j < log(rho) / log(alpha)
    return min(most, math.ceil(math.log(rho) / math.log(alpha)) - 1)
