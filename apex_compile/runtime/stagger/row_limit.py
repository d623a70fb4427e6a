"""The staggered pipeline's row limit: how many rows of a lane's turn take requests, adapted to the measured
CPU job (a running fit of its seconds), the guard (the GPU's waits for it) and auto's ceiling."""
import math
from typing import List, Optional, Tuple

from apex_compile.config import TuningConfig

EMA = 0.2  # weight of the newest measurement in the adaptive pipeline's running averages
FIT_EMA = 0.05  # decay per job of the weighted sums the job-time fit (fixed + rate x work) uses: ~20 jobs of memory
FIT_SPREAD = 0.1  # the fit's slope is taken only from jobs whose work spreads by this share of its mean (a ramp)
WAIT_SHARE = 0.05  # above this running share of a step spent waiting for the CPU job, rows are taken away
REGROW_STEPS = 16  # steps without waiting for the CPU before a row taken away comes back
# The job fit's rate stays within this factor of the performance model's CPU rate (profiled at bandwidth, when
# there is a profile): a draining pipeline's small jobs, mostly per-call costs, once read as a CPU 3-6x slower
# and the rows collapsed for good; a flat noisy fit read as a nearly free CPU whose fixed part took the step.
# A CPU really slower than the profile's (another process) is caught by the waits (the guard).
PRIOR_SPREAD = 1.5
# (The adaptive rows fit the one-lane layered job's work, its team's thread-seconds inside work items over the
# team's threads, not its running time: that also counts threads waiting for a layer's flag while the GPU paces
# the job, so a job with slack would read as costly as a full one. The guard still cuts rows that make the GPU wait.)
# Steps an empty pipeline waits before it drops its measured rows' evidence (a probe: one row more, auto's model
# decides); the wait doubles after each probe, up to MAX_IDLE_HOLD. Without jobs nothing else moves the
# limits, so one bad stretch (a fill's contention) would otherwise stop the host rows for good.
IDLE_HOLD = 256
MAX_IDLE_HOLD = 16384


def fitting_rows(step_s: float, fixed_s: float, row_s: float, width: int, job_share: float) -> float:
    """Rows (unrounded, 1..width) whose CPU job, `fixed_s` plus `row_s` a row, fits `job_share` of a `step_s` step."""
    return max(1.0, min(float(width), (job_share * step_s - fixed_s) / max(row_s, 1e-12)))


class RowLimit:
    """How many rows of a lane's turn hold requests (beyond it, requests wait to rejoin), where the pipeline adapts
    it: the most whose CPU job fits in `job_share` of a step, from a running fit of the job's seconds as a fixed part
    plus a rate per (layer, context token) (the slope from jobs of different work, as a filling pipeline runs; the
    fixed part keeps the job's per-call costs from reading as per-row ones) and a running average of the step
    (measured without the launching thread's wait for the job, so a CPU that falls behind does not loosen its own
    limit). A guard against a fit that flatters the CPU (a slower host than the fit's jobs showed): each step in
    which the launching thread waits for the job more than WAIT_SHARE of the step, as it has on average lately,
    takes a row away, then lets the waits of one `cycle` pass (a row taken away shortens the job only as the
    lanes' groups re-enter under the new limit, `cycle` steps; one per waiting step would take every row before
    the first cut acts); one comes back after REGROW_STEPS steps without such a wait. With the performance
    model's CPU rate (`prior_rate`) the fit's rate is kept within PRIOR_SPREAD of it. The step average takes
    decode steps only (a step with prompt chunks, hundreds of them while a pipeline fills, would widen the budget
    of the decode steps that follow). An empty pipeline drops that evidence after `IDLE_HOLD` steps
    (`idle_step`). A fixed pipeline keeps every row. The fitted rows need not be whole: the groups of a cycle
    take the floor or the ceiling of them in turn (`turn_rows`), each step's job covering every group."""

    def __init__(self, width: int, num_layers: int, adaptive: bool, prior_rate: Optional[float] = None,
                 cycle: Optional[int] = None, job_share: float = TuningConfig.job_share):
        """prior_rate: the profiled seconds per (layer, context token) of the CPU attention, or None. cycle: steps
        until every group re-entered under a new limit (lanes x (num_layers + 1); default one lane's). job_share:
        the share of a step the CPU job keeps within (`TuningConfig.job_share`)."""
        self.width = width
        self.job_share = job_share
        self.cycle = num_layers + 1 if cycle is None else cycle
        self.prior_rate = prior_rate
        self.num_layers = num_layers
        self.adaptive = adaptive
        self.measured = width  # rows whose CPU job fits a step (adaptive; else the width)
        self.ceiling = width  # rows the performance model says pay (offload="auto"; else the width)
        self.limit = width  # min(measured, ceiling): the whole rows every turn takes (`turn_rows` adds the rest)
        # the measured rows before rounding down (the budget over a row's seconds, within the guard): the groups
        # share them out (`turn_rows`), so a job that fits 4.6 rows runs 4.6 a step on average, not 4
        self.fraction = float(width)
        self.rate: Optional[float] = None  # seconds per (layer, context token) of the CPU job beyond its fixed part
        self.fixed = 0.0  # seconds of a job that do not grow with its work
        self.step: Optional[float] = None  # seconds per step
        self.wait_share: Optional[float] = None  # running share of a step the launching thread waited for the job
        self.guard = width  # rows allowed by the waits for the CPU job (the guard in the class docstring)
        self._calm_steps = 0  # steps since the last one that waited too long
        self._cooldown = 0  # steps left before the guard may take another row (its last cut is taking effect)
        self._moments: Optional[List[float]] = None  # weighted sums of 1, work, seconds, work^2, work x seconds
        self._context = 0.0  # the last mean context `update` saw (an empty pipeline keeps it)
        self.idle_steps = 0  # steps with an empty pipeline since it emptied or last probed
        self.idle_hold = IDLE_HOLD  # idle steps before the next probe (doubles after each)
        self.probes = 0

    @staticmethod
    def _average(old: Optional[float], new: float) -> float:
        return new if old is None else (1 - EMA) * old + EMA * new

    def observe_job(self, seconds: float, work: int, decode: bool = True) -> None:
        """A job's run time and its work: the context tokens it attended, summed over its rows (one layer each).
        decode: False for a job of a turn with prompt chunks, left out like its step (`observe_step`): it ran
        beside the prompts' K/V export into the host cache, so its time tells nothing of its rows' cost."""
        if work <= 0 or not decode:
            return
        x = float(work)
        values = (1.0, x, seconds, x * x, x * seconds)  # exponentially weighted sums (the first: the weights)
        if self._moments is None:
            self._moments = list(values)
        else:
            self._moments = [(1 - FIT_EMA) * m + v for m, v in zip(self._moments, values)]
        weight = self._moments[0]
        mean_x, mean_y, mean_xx, mean_xy = (m / weight for m in self._moments[1:])
        proportional = mean_y / mean_x
        variance = mean_xx - mean_x * mean_x
        if variance > (FIT_SPREAD * mean_x) ** 2:
            # a slope above the per-work average would mean a negative fixed part (noise, contention): capped
            self.rate = min(max((mean_xy - mean_x * mean_y) / variance, 0.1 * proportional), proportional)
        elif self.rate is None:
            self.rate = proportional
        if self.prior_rate:
            self.rate = min(max(self.rate, self.prior_rate / PRIOR_SPREAD), self.prior_rate * PRIOR_SPREAD)
        self.fixed = min(max(mean_y - self.rate * mean_x, 0.0), mean_y)

    def observe_step(self, seconds: float, waited: float = 0.0, decode: bool = True,
                     in_use: Optional[float] = None) -> None:
        """A step's seconds without the launching thread's wait for the CPU job, and that wait; decode: False for
        a step with prompt chunks or just after one, which neither its length nor its wait tells about: the CPU job
        then also waits for the prompts' K/V on their way into the host cache, and that wait, not the job's rows,
        holds the GPU. in_use: the rows the job's groups held on average (None: unknown); a step without a wait
        counts towards a row back only if they reached the guard: a pipeline draining under a ceiling of 0 shows
        nothing about the rows that made the GPU wait (regrown, they would refill it at those rows)."""
        self.idle_steps = 0
        if seconds > 0 and decode:
            self.step = self._average(self.step, seconds)
            share = waited / (seconds + waited)
            self.wait_share = self._average(self.wait_share, share)
            self._cooldown = max(self._cooldown - 1, 0)
            if share > WAIT_SHARE and self.wait_share > WAIT_SHARE:  # this step waited, and it is no one-off
                if not self._cooldown:
                    self.guard = max(1, min(self.guard, math.ceil(self.share())) - 1)
                    self._cooldown = self.cycle
                self._calm_steps = 0
            elif in_use is None or in_use + 0.5 >= self.guard:
                self._calm_steps += 1
                if self._calm_steps >= REGROW_STEPS and self.guard < self.width:
                    self.guard += 1
                    self._calm_steps = 0

    def row_seconds(self, context: Optional[float] = None) -> Optional[float]:
        """The fitted job's seconds per row of a full lane (each row at every layer once) of `context`-token
        requests (None: the last mean context); None before a fit."""
        context = self._context if context is None else context
        if self.rate is None or context <= 0:
            return None
        return self.rate * self.num_layers * context

    @property
    def context(self) -> float:
        """The mean context of the job's rows at the last turn that had any (0 before one): a host request gains a
        token per lanes x (num_layers + 1) steps, so it lags the device rows' context."""
        return self._context

    def job_fit(self) -> Optional[Tuple[float, float]]:
        """The fitted job as (fixed seconds, seconds per context token of a row over every layer); None before a
        fit."""
        return None if self.rate is None else (self.fixed, self.rate * self.num_layers)

    def job_seconds(self, rows: float) -> Optional[float]:
        """The fitted CPU job of a full lane with `rows` rows per layer at the last mean context (None before
        a fit)."""
        per_row = self.row_seconds()
        return None if per_row is None else self.fixed + rows * per_row

    def set_ceiling(self, rows: int) -> None:
        """The performance model's rows (0..width; 0: no request enters the pipeline)."""
        self.ceiling = max(0, min(self.width, rows))
        self.limit = min(self.measured, self.ceiling)

    def idle_step(self) -> None:
        """A step with no request in the pipeline: after `idle_hold` of them, if the measured rows are below the
        width, the evidence behind them (the job fit, the guard) is dropped as stale and one row more than measured
        is allowed (the guard; auto's model decides whether they pay). One row a probe bounds what a failed probe
        costs: the host prompts of the requests it admits, parked again. Measured rows at the width are no
        probe."""
        if not self.adaptive or self.measured >= self.width:
            return
        self.idle_steps += 1
        if self.idle_steps >= self.idle_hold:
            self.idle_steps = 0
            self.idle_hold = min(2 * self.idle_hold, MAX_IDLE_HOLD)
            self.probes += 1
            self.guard = self.measured = min(self.width, self.measured + 1)
            self.rate, self.fixed, self._moments = None, 0.0, None
            self._calm_steps = self._cooldown = 0
            self.update(0.0)

    def update(self, mean_context: float) -> int:
        """The limit for requests of `mean_context` tokens (0: the last seen; the measured part unchanged until
        both averages exist)."""
        if mean_context > 0:
            self._context = mean_context
        per_row = self.row_seconds()
        if self.adaptive and per_row is not None and self.step is not None:
            self.fraction = min(fitting_rows(self.step, self.fixed, per_row, self.width, self.job_share),
                                float(self.guard))
            self.measured = int(self.fraction)
        else:
            self.fraction = float(self.measured)
        self.limit = min(self.measured, self.ceiling)
        return self.limit

    def share(self) -> float:
        """Rows a turn holds on average: the measured rows unrounded, or the model's ceiling where it is below
        them (a ceiling at the measured whole rows is the model taking every row it was offered: `fits`)."""
        return self.fraction if self.ceiling >= self.measured else float(self.ceiling)

    def turn_rows(self, slot: int) -> int:
        """The rows of the group at `slot` (0 .. groups - 1) of a lane's cycle: `share` spread over the groups
        (floor or ceiling of it), so that any `groups` consecutive slots hold `capacity_rows(groups)` rows. A
        group keeps its size while the share holds, and the job's work per step (every group, one layer each)
        stays even."""
        x = self.share()
        return math.floor((slot + 1) * x + 1e-9) - math.floor(slot * x + 1e-9)

    def capacity_rows(self, groups: int) -> int:
        """Rows of `groups` groups of one lane (`turn_rows` summed over a cycle)."""
        return math.floor(groups * self.share() + 1e-9)
