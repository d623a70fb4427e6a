"""`PipelineRules`: the staggered plan's rules that the scheduler asks where its pipeline is involved: who enters
the pipeline (the head of the queue under offload="staggered"; under auto, the tail where a request is predicted to
finish sooner there, and parked requests likewise), what the host pool keeps free beside it (room to park the
device pool's requests, a reserve for the members' growth), and how members leave it (finished, parked for the
device pool, recomputed when growth runs dry). The scheduler owns the queues and pools; these rules read them.
"""
import math
from typing import List, Optional

from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
from apex_compile.runtime.request import Request, RequestStatus


class PipelineRules:
    """The staggered pipeline's admission and release rules over one scheduler's queues and pools."""

    def __init__(self, scheduler, pipeline):
        self.scheduler = scheduler
        self.pipeline = pipeline  # its `StaggerPipeline`
        self._host_rest = (None, 0)  # (when, the host requests' remaining tokens then): `reserve`
        self._members = (None, 0)  # (when, the members' remaining tokens then): `_members_rest`
        # offload="auto": whether the batch as it stands ends sooner with the pipeline than GPU-only (set by the
        # staggered plan: `StaggeredPlan.batch_pays`); None: no such check (offload="staggered", tests)
        self.batch_gate = None

    def takes(self, request: Request) -> bool:
        """Whether the staggered pipeline has a row for `request` and the host pool room for its blocks
        (`host_target`) beside the room kept to park the device pool's requests (`park_room`; else they would be
        recomputed from their prompts) and that kept for the host requests' growth (`reserve`)."""
        s = self.scheduler
        if self.full():
            return False
        need = s.kv.extra_blocks(request.request_id, self.host_target(request))
        return s.kv.num_free(HOST_POOL) >= need + self.park_room() + self.reserve(request)

    def host_target(self, request: Request) -> int:
        """The tokens a request entering the staggered pipeline takes host blocks for: its tokens and the next one
        (more as it grows: `StaggerPipeline.begin_step`)."""
        s = self.scheduler
        return min(request.num_tokens + 1, s.max_tokens(request))

    def reserve(self, request: Request) -> int:
        """Host blocks kept free for the growth of the host requests (the pipeline's members, those prefilling in
        the host pool) and of `request`: `TuningConfig.pipeline_reserve` of their remaining tokens. The members'
        sum is taken once per pipeline turn and membership (it moves by a token per member and turn)."""
        s = self.scheduler
        when = (self.pipeline.steps, self.pipeline.num_members, len(s.running))
        if self._host_rest[0] != when:
            hosted = self.pipeline.members() + [r for r in s.running if s.kv.pool_of(r.request_id) == HOST_POOL]
            self._host_rest = (when, sum(self._rest(r) for r in hosted))
        rest = self._host_rest[1] + self._rest(request)
        return math.ceil(s.config.tuning.pipeline_reserve * rest / s.kv.block_size)

    def unstall(self) -> List[Request]:
        """Before a step: when no member is in the staggered pipeline's groups and the first
        waiting to rejoin has no host block for its next token (growth outran the reserve), the newest waiting
        members whose last token is on the host are recomputed (blocks freed, first in line to start again) until
        it has one; returns them."""
        s = self.scheduler
        recomputed: List[Request] = []
        stagger = self.pipeline
        if stagger.inside or not stagger.joining:
            return recomputed
        first = stagger.joining[0]
        while not stagger.can_grow(first):
            victim = next((r for r in reversed(stagger.joining) if r.num_tokens - r.num_computed == 1), None)
            if victim is None:
                break
            stagger.remove([victim.request_id])
            victim.num_preemptions += 1
            s._requeue(victim)
            recomputed.append(victim)
            if victim is first:
                break
        return recomputed

    def park_room(self) -> int:
        """Host blocks the staggered pipeline leaves free to park the device pool's requests (swap preemption):
        the device pool's blocks, at most half the host pool; 0 without parking there."""
        s = self.scheduler
        if s.park_pool != HOST_POOL:
            return 0
        return min(s.kv.pools[DEVICE_POOL].num_blocks, s.kv.pools[HOST_POOL].num_blocks // 2)

    def full(self) -> bool:
        """Whether the staggered pipeline has no row left for another host request (members, and host-pool
        requests still prefilling, which join it next), or is closed to new ones (auto: its members finishing)."""
        s = self.scheduler
        if self.pipeline.closed:
            return True
        prefilling = sum(1 for r in s.running if s.kv.pool_of(r.request_id) == HOST_POOL)
        return self.pipeline.num_members + prefilling >= self.pipeline.capacity

    def join_parked(self) -> List[Request]:
        """The staggered plan, before a step: parked requests (their KV in the host pool, their last token
        sampled) join its pipeline while it takes them, the latest parked first (the earliest resume first in the
        device pool); returns them. Else the parked wait for the device pool while the pipeline starves once the
        waiting queue is empty (a pipeline emptied by auto's ceiling would refill only from new arrivals)."""
        s = self.scheduler
        joined: List[Request] = []
        index = len(s.parked) - 1
        while index >= 0 and not self.full():
            request = s.parked[index]
            index -= 1
            if request.num_tokens - request.num_computed != 1 or request.request_id in s.to_device:
                continue  # parked mid-prompt (its prefill resumes in the device pool), or migrating there
            if s.config.offload == "auto" and not (s.objective == "makespan" and self.pays(request, 0)
                                                   and self._batch_pays()):
                continue  # first in line for the device pool: sooner there (`pays`, `batch_gate`)
            if not s.kv.landed(request.request_id):
                # its park's copy (queued behind the step in flight) has not landed: it joins at a later step;
                # waiting here would hold the launching thread for that whole step and the copy, the GPU idle after
                continue
            if not (self.takes(request)
                    and s.kv.grow(request.request_id, HOST_POOL, self.host_target(request))):
                break  # the host pool has no room for it (nor, mostly, for the earlier parked)
            del s.parked[index + 1]
            request.status = RequestStatus.RUNNING
            self.pipeline.join(request)
            joined.append(request)
        return joined

    def join(self, request: Request) -> None:
        """A host-pool request finished its prefill: it decodes in the staggered pipeline from now on."""
        s = self.scheduler
        s.running.remove(request)
        self.pipeline.join(request)

    def park(self, request: Request) -> None:
        """A request the staggered pipeline let go (auto's model stopped its host rows): parked with its host KV
        (the blocks past its computed tokens returned), it resumes in the device pool like a swapped-out one."""
        s = self.scheduler
        s.kv.shrink(request.request_id, request.num_computed)
        request.status = RequestStatus.PARKED
        request.num_preemptions += 1
        s.parked.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Marks a pipeline request finished and returns its blocks."""
        s = self.scheduler
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.pipeline.finish(request)
        s.kv.free(request.request_id)

    def admit_head(self, request: Request, num_tokens: int, device_tokens: int, fitting: List[int]) -> Optional[int]:
        """The pool of the queue's first request: the device pool when it has room and no parked or migrating
        request waits for it. Else, with offload="staggered" (throughput asked for), the pipeline while it has a
        row and the host pool room, with blocks for its prompt and first token; under offload="auto" the pipeline
        takes requests from the queue's tail instead, where they pay (`candidate`)."""
        s = self.scheduler
        if (not (s.parked or self.pipeline.leaving) and DEVICE_POOL in fitting
                and s._grow(request, DEVICE_POOL, request.num_computed + device_tokens)):
            return DEVICE_POOL
        if s.config.offload != "staggered":
            return None
        if HOST_POOL not in fitting or s._splits_host_prompt(request, num_tokens):
            return None
        if not self.takes(request):
            return None
        if s.kv.grow(request.request_id, HOST_POOL, max(self.host_target(request), request.num_computed + num_tokens)):
            return HOST_POOL
        return None

    def candidate(self, budget: int) -> Optional[Request]:
        """The waiting request the staggered pipeline takes now, or None: the queue's last, whose whole prompt fits
        the step's `budget` or `TuningConfig.pipeline_prompt_tokens`, the pipeline a row and the host pool its
        blocks (`takes`), and which is predicted to finish sooner there than by waiting for the device pool
        (`pays`), while the batch as a whole ends sooner so (`batch_gate`). Only under the makespan objective: a
        pipeline member gains a token per lanes x (layers + 1) steps, a per-token latency no online SLO allows."""
        s = self.scheduler
        if s.config.offload != "auto" or s.objective != "makespan" or not s.waiting:
            return None
        request = s.waiting[-1]
        # its whole prompt, up to `TuningConfig.pipeline_prompt_tokens` past the budget (the step buffers hold it)
        if request.num_tokens - request.num_computed > max(budget, s.config.tuning.pipeline_prompt_tokens):
            return None
        if s.kv.pools[HOST_POOL].num_blocks * s.kv.block_size < s.max_tokens(request):
            return None
        if not (self.takes(request) and self.pays(request, len(s.waiting) - 1) and self._batch_pays()):
            return None
        return request

    def _batch_pays(self) -> bool:
        """The batch-level check beside `pays`: a member's staggered steps slow every device row a little and
        its prompt takes a step of its own, so a pipeline that takes only a few requests can lengthen the batch
        that each of them alone finishes sooner in (`StaggeredPlan.batch_pays`)."""
        return self.batch_gate is None or self.batch_gate()

    def pays(self, request: Request, position: int) -> bool:
        """Whether `request`, `position` places back in the queue (a waiting or parked request), is predicted to
        finish sooner in the staggered pipeline than by waiting for the device pool, counted in steps: in the
        pipeline it gains a token per `pipeline.cycle` steps; waiting, it starts once the device rows have worked
        off the tokens of every request ahead of it (running in the device pool, parked, in the pipeline, and
        waiting before it) at a token per row and step, then gains a token per step. A batch's last requests are
        the ones that gain: the pipeline serves what the device pool would reach last."""
        s = self.scheduler
        if position == len(s.waiting) - 1:
            ahead = s.waiting.rest_tokens - self._rest(s.waiting[-1])
        else:
            ahead = sum(self._rest(s.waiting[i]) for i in range(position))
        return self._sooner_in_pipeline(request, self._members_rest() + ahead)

    def _sooner_in_pipeline(self, request: Request, others: int) -> bool:
        """own x cycle <= backlog / device rows + own, where the backlog is the device rows' and parked requests'
        remaining tokens plus `others` (the remaining tokens of the members and waiting requests counted ahead)."""
        s = self.scheduler
        rest = self._rest
        device = [r for r in s.running if s.kv.pool_of(r.request_id) == DEVICE_POOL]
        backlog = sum(rest(r) for r in device) + sum(rest(r) for r in s.parked if r is not request) + others
        own = max(rest(request), 1)
        return own * self.pipeline.cycle <= backlog / max(len(device), 1) + own

    def _rest(self, request: Request) -> int:
        """Tokens `request` may still generate."""
        return self.scheduler._rest_tokens(request)

    def _members_rest(self) -> int:
        """The pipeline members' remaining tokens, summed once per pipeline turn and membership."""
        when = (self.pipeline.steps, self.pipeline.num_members)
        if self._members[0] != when:
            self._members = (when, sum(self._rest(r) for r in self.pipeline.members()))
        return self._members[1]
