"""Predicts a finite batch's makespan per plan: the batch's steps simulated with the performance model.

A batch is judged by its last token (DECISIONS 37), so the question a plan answers is when the batch ends. This
module replays the scheduler's rules over the batch's lengths and prices every step with the engine's
(calibrated) model:

- the device pool admits the queue's head while it has blocks for its prompt, its first token and its growth
  reserve beside those of the running requests (`ApexConfig.growth_reserve`), up to `max_num_seqs`;
- a step decodes every running request past its prompt and fills the rest of `max_num_batched_tokens` with
  prompt chunks, in admission order;
- where the running requests' blocks (their tokens, the look-ahead) outgrow the pool, the newest decoding one is
  swapped out and resumes first once there is room again (`Scheduler._evict`). GPU-only's steps follow from these
  rules alone (within 1% of the measured step counts: DECISIONS 45);
- with the staggered pipeline (offload="auto", the makespan objective), the queue's last request enters it when
  the pipeline has a row (the model's host rows for the step, `AutoOffload.stagger_rows`) and it is predicted to
  finish sooner there (`PipelineRules.pays`: own tokens x cycle <= the device requests' backlog per request +
  own); its whole prompt joins a step after the device pool's chunks, where they left some of the step budget
  (then the next tail request may follow while budget is left, as the scheduler takes them), then it gains a
  token per cycle steps while the pipeline's rows serve every member: a step serves at most the rows whose CPU
  job fits `job_share` of the step (the adaptive row limit, `RowLimit`, priced with the profile's CPU rate at
  the members' context), and members past rows x cycle wait their turn, so each gains its tokens that much
  slower. Once nothing waits, members move to the device pool as it has room (most tokens left first).

A step's price: a decode step is the model's GPU-only or staggered step plus its learned host gap; prompt tokens
add `PerfModel.prompt_s` (their linear layers, and per token what the warm-up's timed prompt-only step took
beyond that), a pipeline prompt its K/V's copy to the host and, the first time its padded row count comes,
the capture of its pieces (`StepCalibration.piece_capture_s`, which the warm-up measures). Prefill attention's
growth past the calibrated step's context, the swaps' copies and the host's time of the pipeline's steps are
left out: the benchmark's measured makespan beside the prediction (`benchmarks/offline.py`) tells how much they
weigh.

`StaggeredPlan.batch_pays` asks it, both ways, whether a batch ends sooner with the pipeline at all: `pays` judges
one request, but each member's staggered steps slow every device row while it lives.
"""
import collections
import dataclasses
import heapq
import math
from typing import Deque, Dict, List, Optional, Sequence, Set, Tuple

from apex_compile.runtime.cuda_graphs import PIECEWISE_MAX_TOKENS, padded_key
from apex_compile.runtime.scheduler import LOOKAHEAD_TOKENS
from apex_compile.runtime.stagger.row_limit import fitting_rows


@dataclasses.dataclass
class BatchLimits:
    """The engine's limits a batch runs under (pools in blocks)."""

    device_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    growth_reserve: float = 0.0
    # tokens past its own that a running request keeps blocks for: the scheduler's look-ahead where its parks are
    # issued ahead, beside the next step (`Scheduler.parks_ahead`: a CUDA engine's overlapped moves); 0 where a
    # shortfall evicts at the step that needs the blocks (a CPU-only engine)
    lookahead: int = LOOKAHEAD_TOKENS
    # the staggered pipeline (cycle 0: none): steps between two tokens of a member, the most host rows per step,
    # the longest prompt it takes, and the host pool's blocks
    cycle: int = 0
    max_rows: int = 0
    pipeline_prompt_tokens: int = 0
    host_blocks: int = 0
    job_share: float = 0.95  # the share of a step the CPU job keeps within (`TuningConfig.job_share`)
    # the padded row counts of the staggered plan's piecewise graphs past PIECEWISE_MAX_TOKENS: a pipeline prompt
    # step of a row count not yet captured pays `StepCalibration.piece_capture_s` (() : no such graphs)
    piece_sizes: Tuple[int, ...] = ()


@dataclasses.dataclass
class BatchState:
    """Where a batch stands when it is predicted mid-way (`predict_batch`'s `lengths` are the waiting requests):
    device-pool requests as (prompt tokens computed, prompt tokens, tokens still to generate), a request past its
    prompt with computed == prompt == its tokens now; pipeline members as (tokens, tokens still to generate)."""

    device: List[Tuple[int, int, int]] = dataclasses.field(default_factory=list)
    members: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    captured: Set[int] = dataclasses.field(default_factory=set)  # the piece sizes captured so far


@dataclasses.dataclass
class BatchPrediction:
    """A plan's simulated batch."""

    plan: str
    makespan_s: float
    steps: int
    output_tokens: int
    host_requests: int = 0  # requests that entered the pipeline
    migrated: int = 0  # members moved on to the device pool
    parks: int = 0  # device requests swapped out when the pool's blocks ran out
    last_entry_step: int = 0  # the step whose prompt was the last to enter the pipeline
    # per kind of step (the engine's `STEP_KINDS`): (steps, seconds)
    kinds: Dict[str, Tuple[int, float]] = dataclasses.field(default_factory=dict)
    captures: int = 0  # pipeline prompt steps priced with a capture of their pieces (`BatchLimits.piece_sizes`)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


class _Device:
    """A device-pool request of the simulation. Before its first token: `prompt` tokens to compute (`computed` so
    far). From step `first` on (its first token sampled there, or a member moved in decoding there) it has
    tokens0 + (step - first) tokens and rest - (step - first) to go, and ends after step first + rest - 1."""

    __slots__ = ("prompt", "rest", "computed", "first", "tokens0", "serial")
    made = 0  # serials: a key per request in the heap of ends (an object's id may be reused once it is freed)

    def __init__(self, prompt: int, rest: int):
        self.prompt, self.rest, self.computed, self.first, self.tokens0 = prompt, rest, 0, -1, prompt
        _Device.made += 1
        self.serial = _Device.made


class _Member:
    """A pipeline member: `tokens` tokens and `rest` to go at pipeline time `start`, a token per cycle of pipeline
    time from then (`_BatchSim.clock`: a step's worth where the rows serve every member, less where they wait)."""

    __slots__ = ("tokens", "rest", "start", "index")

    def __init__(self, tokens: int, rest: int, start: int, index: int):
        self.tokens, self.rest, self.start, self.index = tokens, rest, start, index


class _BatchSim:
    """One simulated batch (`predict_batch`)."""

    def __init__(self, policy, lengths: Sequence[Tuple[int, int]], limits: BatchLimits, pipeline: bool,
                 state: Optional[BatchState] = None, entries: bool = True):
        from apex_compile.runtime.perf_model import AutoOffload

        self.auto = policy if isinstance(policy, AutoOffload) else None
        self.model = self.auto.model if self.auto is not None else policy
        if pipeline and (self.auto is None or limits.cycle < 1 or limits.max_rows < 1):
            raise ValueError("predict_batch: the pipeline needs an AutoOffload policy and limits with a cycle and "
                             "max_rows")
        self.lengths, self.limits, self.pipeline = lengths, limits, pipeline
        self.entries = pipeline and entries  # whether requests enter the pipeline (else its members only finish)
        profile = self.model.profile
        self.copy_s_per_token = profile.kv_bytes_per_token / profile.copy_bytes_per_s
        room = limits.device_blocks * limits.block_size
        too_long = next(((p, o) for p, o in lengths if p + o > room), None)
        if too_long is not None:  # the engine refuses it (`Scheduler.check_fits`): it would wait forever here
            raise ValueError(f"predict_batch: a request of {too_long[0]} + {too_long[1]} tokens never fits the "
                             f"device pool's {room} tokens")
        self.waiting = collections.deque(range(len(lengths)))
        self.waiting_rest = sum(o for _, o in lengths)  # the waiting requests' output tokens
        self.running: List[_Device] = []
        self.prefilling: List[_Device] = []  # running requests before their first token, in admission order
        self.parked: Deque[Tuple[int, int]] = collections.deque()  # (tokens, rest) of swapped-out requests
        self.parked_rest = 0
        self.parks = 0
        self.ends: List[Tuple[int, int]] = []  # (last step, serial) of the decoding device requests
        self.by_serial: Dict[int, _Device] = {}  # the decoding device requests (a parked one's end stays behind)
        self.decode_rows = 0  # device requests decoding this step,
        self.ctx_sum = 0  # their tokens,
        self.device_rest = 0  # and their remaining tokens
        self.members: Dict[int, _Member] = {}
        self.member_ends: List[Tuple[float, int]] = []  # (last clock, index); a moved member's stays behind
        # sums over the members of tokens, rest and start: their current totals follow from the clock
        self.m_tokens = self.m_rest = self.m_start = 0
        # pipeline time: +1 a step while its rows serve every member, rows x cycle / members where they do not
        self.clock = 0.0
        self._fits: Dict[tuple, float] = {}
        self.step = 0
        self.seconds = 0.0
        self.host_requests = self.migrated = self.last_entry_step = 0
        self.dirty = True  # a request ended or joined since the device pool's last admission check
        self._prices: Dict[tuple, float] = {}
        self.kinds: Dict[str, Tuple[int, float]] = {}
        self._verdicts: Dict[tuple, int] = {}
        self.output_tokens = sum(o for _, o in lengths)
        self.captured = set(state.captured) if state else set()  # piece sizes whose capture is paid
        self.capture_s = self.model.calibration.piece_capture_s if limits.piece_sizes else 0.0
        self.captures = 0
        for computed, prompt, rest in (state.device if state else []):
            self.output_tokens += rest
            r = _Device(prompt, rest)
            r.computed = computed
            self.running.append(r)
            if computed < prompt:
                self.prefilling.append(r)
            elif rest > 0:
                self.decode_now(r, prompt)
        for index, (tokens, rest) in enumerate(state.members if state else []):
            self.output_tokens += rest
            if rest > 0:
                self.join(_Member(tokens, rest, 0, -1 - index))

    # ------------------------------------------------------------------------------------------------
    # accounting

    def need(self, tokens: int, rest: int) -> int:
        """Blocks of a device request of `tokens` tokens and `rest` to go, with its growth reserve."""
        bs = self.limits.block_size
        return -(-(tokens + math.ceil(self.limits.growth_reserve * rest)) // bs)

    def used_blocks(self) -> int:
        total = 0
        for r in self.running:
            if r.first >= 0:
                done = self.step - r.first
                total += self.need(r.tokens0 + done, r.rest - done)
            else:
                total += self.need(r.prompt + 1, r.rest)
        return total

    def members_now(self) -> Tuple[int, int]:
        """(tokens, rest) summed over the members now (each gains a token per cycle steps)."""
        if not self.members:
            return 0, 0
        gained = int((len(self.members) * self.clock - self.m_start) // self.limits.cycle)
        return self.m_tokens + gained, self.m_rest - gained

    def decode(self, r: _Device, tokens: int) -> None:
        """`r` decodes from the next step on, with `tokens` tokens then."""
        self.by_serial[r.serial] = r
        heapq.heappush(self.ends, (r.first + r.rest - 1, r.serial))
        self.decode_rows += 1
        self.ctx_sum += tokens
        self.device_rest += r.rest - (self.step + 1 - r.first)

    def decode_now(self, r: _Device, tokens: int) -> None:
        """`r`, of `tokens` tokens, decodes from this step on (a member moved in, a request already decoding)."""
        r.first, r.tokens0 = self.step, tokens
        self.by_serial[r.serial] = r
        heapq.heappush(self.ends, (r.first + r.rest - 1, r.serial))
        self.decode_rows += 1
        self.ctx_sum += tokens
        self.device_rest += r.rest

    def join(self, member: _Member) -> None:
        self.members[member.index] = member
        self.m_tokens += member.tokens
        self.m_rest += member.rest
        self.m_start += member.start
        heapq.heappush(self.member_ends, (self.end_clock(member), member.index))

    def end_clock(self, member: _Member) -> float:
        """The pipeline time at which `member` has its last token."""
        return member.start + member.rest * self.limits.cycle - 1

    def leave(self, member: _Member) -> None:
        del self.members[member.index]
        self.m_tokens -= member.tokens
        self.m_rest -= member.rest
        self.m_start -= member.start

    # ------------------------------------------------------------------------------------------------
    # prices

    def price(self, rows: int, context: float, prompt_tokens: int, host_rows: float, host_context: float) -> float:
        """A step's seconds: the model's decode step (GPU-only or staggered, with its learned host gap) and the
        prompt tokens' linear layers."""
        key = (rows, int(context) >> 4, prompt_tokens >> 4, round(host_rows * 4), int(host_context) >> 6)
        cached = self._prices.get(key)
        if cached is None:
            model, dense = self.model, max(rows, 1)
            if host_rows:  # the job covers every group at one layer each: the rows' average, unrounded
                cached = self.auto._staggered_step(dense, host_rows, context, host_context or None).step_s
                dense += math.ceil(host_rows)
            else:
                gap = self.auto.gap.seconds(False) if self.auto is not None else 0.0
                cached = model.predict("never", dense, 0, context).step_s + gap
            cached += model.prompt_s(dense, prompt_tokens)
            self._prices[key] = cached
        return cached

    def rows_ceiling(self, context: float, host_context: float) -> int:
        """The model's host rows per step beside the device rows (`AutoOffload.stagger_rows`; a running pipeline
        keeps them at the lower keep margin)."""
        key = (self.decode_rows, int(context) >> 5, int(host_context) >> 5, bool(self.members))
        if key not in self._verdicts:
            self._verdicts[key] = self.auto.stagger_rows(self.decode_rows, context, self.limits.max_rows,
                                                         keep=bool(self.members), host_context=host_context or None)
        return self._verdicts[key]

    def fit_rows(self, context: float, host_context: float) -> float:
        """Host rows a staggered step serves (unrounded, 1..max_rows): those whose CPU job fits `job_share` of the
        step's GPU work beside the device rows, priced with the learned job where there is one, else at the
        profile's CPU bandwidth (`RowLimit.update`'s rule, `fitting_rows`)."""
        key = (self.decode_rows, int(context) >> 5, int(host_context) >> 5)
        fit = self._fits.get(key)
        if fit is None:
            auto, limits = self.auto, self.limits
            step = auto.model.predict("staggered", max(self.decode_rows, 1), limits.max_rows, context,
                                      cpu_job=(0.0, 0.0), cpu_context=host_context).step_s + auto.gap.seconds(True)
            fixed, per_token = auto.cpu_job or (0.0, auto.model.cpu_seconds_per_token())
            fit = fitting_rows(step, fixed, per_token * host_context, limits.max_rows, limits.job_share)
            self._fits[key] = fit
        return fit

    # ------------------------------------------------------------------------------------------------
    # a step

    def admit(self) -> None:
        """The device pool takes the queue's head while it has the blocks; once nothing waits, members move in
        (most tokens left first)."""
        limits = self.limits
        used = self.used_blocks()
        while self.parked and len(self.running) < limits.max_num_seqs:  # swapped-out requests resume first
            tokens, rest = self.parked[0]
            if self.running and used + self.need(tokens + limits.lookahead, rest) > limits.device_blocks:
                return  # (into an empty pool it goes whatever its reserve: it fits, and nothing else can run)
            self.parked.popleft()
            self.parked_rest -= rest
            used += self.need(tokens, rest)
            r = _Device(0, rest)
            self.running.append(r)
            self.decode_now(r, tokens)  # its KV swapped back in (overlapped with the steps)
        while self.waiting and len(self.running) < limits.max_num_seqs:
            prompt, output = self.lengths[self.waiting[0]]
            if self.running and used + self.need(prompt + 1, output) > limits.device_blocks:
                return
            self.waiting.popleft()
            self.waiting_rest -= output
            used += self.need(prompt + 1, output)
            r = _Device(prompt, output)
            self.running.append(r)
            self.prefilling.append(r)
        if not (self.pipeline and self.members) or self.waiting:
            return
        cycle = limits.cycle
        for member in sorted(self.members.values(), key=lambda m: m.rest - (self.clock - m.start) // cycle,
                             reverse=True):
            gained = int(max(self.clock - member.start, 0) // cycle)
            tokens, rest = member.tokens + gained, member.rest - gained
            if rest <= 0:
                continue
            if len(self.running) >= limits.max_num_seqs or used + self.need(tokens, rest) > limits.device_blocks:
                return
            self.leave(member)
            used += self.need(tokens, rest)
            moved = _Device(0, rest)
            self.running.append(moved)
            self.decode_now(moved, tokens)  # from this step on (PCIe moves its KV in milliseconds)
            self.migrated += 1

    def park_overflow(self) -> None:
        """The device pool's blocks as the running requests hold them (their tokens and the look-ahead, half a
        block of rounding each; prompts whole): while beyond the pool, the newest decoding request is swapped out
        to the host pool (`Scheduler._evict`) and waits first in line to resume."""
        limits = self.limits
        bs = limits.block_size
        prefill = sum(r.prompt + 1 for r in self.prefilling) + len(self.prefilling) * bs // 2
        while self.decode_rows > 1:
            held = (self.ctx_sum + prefill + self.decode_rows * (limits.lookahead + bs // 2)) / bs
            if held <= limits.device_blocks:
                return
            victim = next(r for r in reversed(self.running) if r.serial in self.by_serial)
            done = self.step - victim.first
            tokens, rest = victim.tokens0 + done, victim.rest - done
            del self.by_serial[victim.serial]  # (its end stays in the heap, skipped)
            self.running.remove(victim)
            self.decode_rows -= 1
            self.ctx_sum -= tokens
            self.device_rest -= rest
            self.parked.append((tokens, rest))
            self.parked_rest += rest
            self.parks += 1

    def enter_pipeline(self) -> int:
        """The queue's last request enters the pipeline where it has a row, the host pool its blocks and it is
        predicted to finish sooner there; returns its prompt tokens (this step computes them) or 0."""
        limits = self.limits
        prompt, output = self.lengths[self.waiting[-1]]
        if prompt > max(limits.max_num_batched_tokens, limits.pipeline_prompt_tokens):
            return 0
        context = self.ctx_sum / self.decode_rows if self.decode_rows else float(prompt)
        tokens, rest = self.members_now()
        host_context = tokens / len(self.members) if self.members else float(prompt)
        if len(self.members) + 1 > self.rows_ceiling(context, host_context) * limits.cycle:
            return 0
        host_blocks = -(-(tokens + rest + prompt + output) // limits.block_size) + len(self.members)
        if host_blocks > limits.host_blocks:
            return 0
        backlog = (self.device_rest + sum(r.rest for r in self.prefilling) + self.parked_rest + self.waiting_rest
                   - output + rest)
        if output * limits.cycle > backlog / max(len(self.running), 1) + output:  # device rows, prefilling too
            return 0
        index = self.waiting.pop()
        self.waiting_rest -= output
        self.host_requests += 1
        self.last_entry_step = self.step
        if output > 1:  # its first token comes with its prompt's step
            self.join(_Member(prompt + 1, output - 1, self.clock + 1, index))
        return prompt

    def run_step(self) -> None:
        limits = self.limits
        if self.dirty:
            self.dirty = False
            self.admit()
        self.park_overflow()
        # prompt chunks in admission order, in the budget the decode rows leave
        chunk_tokens, left = 0, limits.max_num_batched_tokens - self.decode_rows
        sampled = []
        for r in self.prefilling:
            if left <= 0:
                break
            take = min(r.prompt - r.computed, left)
            r.computed += take
            left -= take
            chunk_tokens += take
            if r.computed == r.prompt:
                sampled.append(r)
        # pipeline prompts come last, from the queue's tail while the device pool's chunks and the prompts before
        # them left some of the budget (`Scheduler.schedule`: a prompt past what is left ends the step's entries)
        host_prompt = entered = 0
        while (self.entries and self.waiting and left > 0
               and len(self.running) + entered < limits.max_num_seqs):
            prompt = self.enter_pipeline()
            if not prompt:
                break
            host_prompt += prompt
            left -= prompt
            entered += 1
        context = self.ctx_sum / self.decode_rows if self.decode_rows else 0.0
        tokens, _ = self.members_now()
        host_context = tokens / len(self.members) if self.members else 0.0
        host_rows = len(self.members) / limits.cycle if self.pipeline else 0.0
        speed = 1.0
        if host_rows:  # members past the rows the CPU job fits wait their turn
            fit = self.fit_rows(context, host_context)
            if host_rows > fit:
                speed, host_rows = fit / host_rows, fit
        padding, capture = 0, 0.0
        if host_prompt:  # pieces of the step's padded size, captured the first time it comes
            rows = limits.max_rows + self.decode_rows + chunk_tokens + host_prompt
            size = self.piece_size(rows)
            if size is not None:
                padding = size - rows
                if size not in self.captured:
                    self.captured.add(size)
                    self.captures += bool(self.capture_s)
                    capture = self.capture_s
        seconds = self.price(self.decode_rows, context, chunk_tokens + host_prompt + padding, host_rows, host_context)
        seconds += host_prompt * self.copy_s_per_token + capture
        self.seconds += seconds
        kind = "pipeline prompt" if host_prompt else ("staggered " if host_rows else "") + (
            "prompt" if chunk_tokens else "decode")
        count, total = self.kinds.get(kind, (0, 0.0))
        self.kinds[kind] = (count + 1, total + seconds)
        # after the step: the decode rows gained a token, finished prompts sampled their first
        self.ctx_sum += self.decode_rows
        self.device_rest -= self.decode_rows
        for r in sampled:
            self.prefilling.remove(r)
            r.first = self.step
            if r.rest <= 1:
                self.running.remove(r)
                self.dirty = True
            else:
                self.decode(r, r.prompt + 1)
        while self.ends and self.ends[0][0] <= self.step:
            r = self.by_serial.pop(heapq.heappop(self.ends)[1], None)
            if r is None:  # parked since
                continue
            self.running.remove(r)
            self.decode_rows -= 1
            self.ctx_sum -= r.tokens0 + r.rest
            self.dirty = True
        self.clock += speed
        while self.member_ends and self.member_ends[0][0] < self.clock:
            member = self.members.get(self.member_ends[0][1])
            heapq.heappop(self.member_ends)
            if member is not None and self.end_clock(member) < self.clock:
                self.leave(member)
                self.dirty = True
        self.step += 1

    def piece_size(self, rows: int) -> Optional[int]:
        """The padded row count of the pieces a pipeline prompt step of `rows` rows replays; None at or below
        PIECEWISE_MAX_TOKENS (a whole mixed graph or small pieces, captured in ~0.1 s, padding a few rows) or past
        every size (uncaptured)."""
        key = padded_key(self.limits.piece_sizes, rows, 1) if rows > PIECEWISE_MAX_TOKENS else None
        return key[0] if key is not None else None

    def run(self, max_steps: int) -> BatchPrediction:
        while self.waiting or self.running or self.members or self.parked:
            if self.step >= max_steps:
                raise RuntimeError(f"predict_batch: the batch did not end within {max_steps} steps")
            self.run_step()
        return BatchPrediction("auto" if self.entries else "never", self.seconds, self.step, self.output_tokens,
                               self.host_requests, self.migrated, self.parks, self.last_entry_step, self.kinds,
                               self.captures)


def predict_batch(policy, lengths: Sequence[Tuple[int, int]], limits: BatchLimits, pipeline: bool = False,
                  state: Optional[BatchState] = None, entries: bool = True,
                  max_steps: int = 10_000_000) -> BatchPrediction:
    """The batch of `lengths` ((prompt, output) tokens per request, in submission order) simulated to its last
    token. policy: an `AutoOffload` (its model, learned host gaps and, with `pipeline`, its staggered verdicts)
    or a bare `PerfModel` (GPU-only). pipeline: the staggered pipeline takes the queue's tail where it pays.
    state: the requests already running (None: the batch starts now). entries=False: no request enters the
    pipeline (its members in `state` finish there or move to the device pool): GPU-only from now on."""
    return _BatchSim(policy, lengths, limits, pipeline, state, entries).run(max_steps)


# offload="auto", a batch (the makespan objective): the share by which the batch's predicted makespan must shrink
# with the pipeline taking its tail before any request enters it (`batch_verdict`). The simulation prices steps
# by the calibrated model and leaves out the host's launch time of the pipeline's prompt steps and swaps, which
# weigh against the pipeline.
BATCH_MARGIN = 0.05


def batch_verdict(policy, lengths: Sequence[Tuple[int, int]], limits: BatchLimits,
                  state: Optional[BatchState] = None) -> Tuple[BatchPrediction, BatchPrediction, bool]:
    """offload="auto"'s batch gate: (the batch without new pipeline members, with the pipeline taking the queue's
    tail where each request finishes sooner there, whether the second ends sooner by BATCH_MARGIN), both simulated
    from `state` (None: the batch starts now)."""
    without = predict_batch(policy, lengths, limits, pipeline=True, state=state, entries=False)
    with_pipeline = predict_batch(policy, lengths, limits, pipeline=True, state=state)
    return without, with_pipeline, with_pipeline.makespan_s < without.makespan_s * (1 - BATCH_MARGIN)


def engine_limits(engine) -> BatchLimits:
    """The limits of an `Engine`'s batches (its pools, batching limits and, with the staggered plan, pipeline)."""
    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL

    config, kv, pipeline = engine.config, engine.kv, engine.plan.pipeline
    pieces = getattr(engine.plan, "stagger_pieces", None)
    return BatchLimits(kv.pools[DEVICE_POOL].num_blocks, kv.block_size, config.max_num_seqs,
                       config.max_num_batched_tokens, config.growth_reserve,
                       lookahead=LOOKAHEAD_TOKENS if engine.scheduler.parks_ahead else 0,
                       cycle=pipeline.cycle if pipeline is not None else 0,
                       max_rows=pipeline.width if pipeline is not None else 0,
                       pipeline_prompt_tokens=config.tuning.pipeline_prompt_tokens,
                       host_blocks=kv.pools[HOST_POOL].num_blocks, job_share=config.tuning.job_share,
                       piece_sizes=tuple(s for s in pieces.sizes if s > PIECEWISE_MAX_TOKENS) if pieces else ())


def engine_state(engine) -> Tuple[List[Tuple[int, int]], BatchState]:
    """An engine's batch as it stands: the waiting requests' (prompt, output) lengths, parked ones first (they
    resume first; priced as prompts, their KV's move back is faster), and the running ones (`BatchState`)."""
    from apex_compile.runtime.kv_manager import DEVICE_POOL

    s = engine.scheduler
    rest = s._rest_tokens
    waiting = [(r.num_tokens, rest(r)) for r in list(s.parked) + list(s.waiting)]
    state = BatchState()
    for r in s.running:
        if engine.kv.pool_of(r.request_id) == DEVICE_POOL:
            decoding = r.num_computed >= r.num_tokens - 1  # (its last token sampled, not yet computed)
            state.device.append((r.num_tokens if decoding else r.num_computed, r.num_tokens, rest(r)))
        else:  # prefilling in the host pool: a member from its next token on
            state.members.append((r.num_tokens, rest(r)))
    if engine.plan.pipeline is not None:
        state.members += [(r.num_tokens, rest(r)) for r in engine.plan.pipeline.members()]
    pieces = getattr(engine.plan, "stagger_pieces", None)
    if pieces is not None:
        state.captured = {rows for rows, _ in pieces.pieces}
    return waiting, state
