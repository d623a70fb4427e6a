"""Continuous batching with chunked prefill over the device and host KV pools.

Each step every running request gets its next chunk of not-yet-computed tokens (one token when decoding, up
to the token budget when prefilling), oldest first. When a request's pool has no block left for its chunk,
the newest running request of that pool is evicted: moved to the other pool when that pool also runs
requests (offload fraction) and has room, else parked in the other pool (swap preemption), else its blocks
are freed and it is prefilled again later (recompute preemption). With overlapped moves
(`KVManager.overlaps_moves`) the device pool parks ahead: once its free blocks fall short of its requests' next
tokens, the newest is parked after its step is queued, so the copy runs beside the next step (`park_launched`).
Parked requests resume before waiting requests are admitted (with the staggered plan, waiting requests may
meanwhile start in its pipeline, and parked ones join it while it takes them: `PipelineRules`); waiting
requests are admitted in arrival order while their first chunk fits in the pool the offload policy picks for
them. With `ApexConfig.growth_reserve` the device pool admits or resumes a request only while its free blocks
also cover that share of every device request's remaining tokens (SGLang's new-token ratio): a pool filled to
its last block parks a request each time one grows. A parked request resumes in a step scheduled on the host,
which waits for its copy. The staggered pipeline's members take host blocks as they grow, a share of their
remaining tokens kept free (`PipelineRules.unstall` where growth runs dry).
"""
import collections
import dataclasses
import math
import warnings
from typing import Callable, Deque, Dict, Iterable, List, Optional, Tuple

from apex_compile.config import ApexConfig
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, POOL_NAMES, KVManager
from apex_compile.runtime.request import Request, RequestStatus

# overlapped moves (`KVManager.overlaps_moves`): the device pool's running requests keep blocks for this many tokens
# beyond the step's own; a shortfall parks the newest ahead, its copy beside the next step. While the copy lands
# (its blocks held) the free blocks still cover the steps queued ahead meanwhile (2 tokens left none: each park
# cost a step scheduled on the host waiting for that copy)
LOOKAHEAD_TOKENS = 8


@dataclasses.dataclass
class ScheduledChunk:
    """Tokens start..start+num_tokens-1 of a request, computed this step in pool `pool`."""

    request: Request
    start: int
    num_tokens: int
    pool: int

    @property
    def decodes(self) -> bool:
        """Whether the chunk is one token after the first (a decode row), not a prompt chunk."""
        return self.num_tokens == 1 and self.start > 0

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last token, so its logits give the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes, and the evictions decided on the way."""

    chunks: List[ScheduledChunk] = dataclasses.field(default_factory=list)
    moved: List[Tuple[Request, int]] = dataclasses.field(default_factory=list)  # (request, destination pool)
    parked: List[Request] = dataclasses.field(default_factory=list)
    resumed: List[Request] = dataclasses.field(default_factory=list)
    recomputed: List[Request] = dataclasses.field(default_factory=list)


class WaitingQueue(collections.deque):
    """The waiting requests, first in line first, and `rest_tokens`: the sum of the tokens they may still
    generate, kept as requests come and go (each one's share recorded as it enters), so that the staggered
    plan's admission rule (`PipelineRules.pays`) reads a long queue's backlog in O(1)."""

    def __init__(self, rest: Callable[[Request], int], requests: Iterable[Request] = ()):
        super().__init__()
        self._rest = rest
        self._shares: Dict[int, int] = {}  # id(request) -> its remaining tokens when it entered
        self.rest_tokens = 0
        self.extend(requests)

    def _enter(self, request: Request) -> Request:
        share = self._rest(request)
        self._shares[id(request)] = share
        self.rest_tokens += share
        return request

    def _leave(self, request: Request) -> Request:
        self.rest_tokens -= self._shares.pop(id(request))
        return request

    def append(self, request: Request) -> None:
        super().append(self._enter(request))

    def appendleft(self, request: Request) -> None:
        super().appendleft(self._enter(request))

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.appendleft(request)

    def insert(self, index: int, request: Request) -> None:
        super().insert(index, self._enter(request))

    def pop(self) -> Request:
        return self._leave(super().pop())

    def popleft(self) -> Request:
        return self._leave(super().popleft())

    def remove(self, request: Request) -> None:
        index = next(i for i, r in enumerate(self) if r is request)
        del self[index]

    def __delitem__(self, index: int) -> None:
        self._leave(self[index])
        super().__delitem__(index)

    def __setitem__(self, index: int, request: Request) -> None:
        self._leave(self[index])
        super().__setitem__(index, self._enter(request))

    def __iadd__(self, requests: Iterable[Request]) -> "WaitingQueue":
        self.extend(requests)
        return self

    def clear(self) -> None:
        super().clear()
        self._shares.clear()
        self.rest_tokens = 0

    def copy(self) -> "WaitingQueue":
        return WaitingQueue(self._rest, self)


class Scheduler:
    """Decides, step by step, which tokens of which requests run and where their KV lives."""

    def __init__(self, config: ApexConfig, kv: KVManager, max_model_len: Optional[int] = None, host_policy=None,
                 stagger=None):
        """host_policy: offload="auto"'s `AutoOffload` when it runs requests in the host pool (None: the config's
        fixed share decides). stagger: the staggered plan's `StaggerPipeline`: requests the device pool cannot
        take are prefilled in the host pool (their whole length reserved) and then decode in the pipeline."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len or config.max_model_len
        self.host_fraction = config.host_fraction()
        self.host_policy = host_policy
        self.stagger = stagger
        if host_policy is not None or stagger is not None:
            self.run_pools: Tuple[int, ...] = (DEVICE_POOL, HOST_POOL)
        elif self.host_fraction == 0.0:
            self.run_pools = (DEVICE_POOL,)
        elif self.host_fraction == 1.0:
            self.run_pools = (HOST_POOL,)
        else:
            self.run_pools = (DEVICE_POOL, HOST_POOL)
        for pool in self.run_pools:
            if kv.pools[pool].num_blocks == 0:
                size = "gpu_cache_size" if pool == DEVICE_POOL else "cpu_cache_size"
                raise ValueError(
                    f"offload={config.offload!r} runs requests in the {POOL_NAMES[pool]} pool, but it holds no KV "
                    f"block: raise ApexConfig.{size} (one block takes {kv.shape.block_bytes} bytes)")
        self.park_pool: Optional[int] = None
        if (host_policy is not None or stagger is not None) and config.preemption == "swap":
            self.park_pool = HOST_POOL  # evicted when the host pool does not pay: parked there, resumed on the device
        elif len(self.run_pools) == 1 and config.preemption == "swap":
            other = 1 - self.run_pools[0]
            if kv.pools[other].num_blocks > 0:
                self.park_pool = other
        # the staggered plan's rules where its pipeline is involved (None without one); imported here, as the
        # plans package imports this module's chunks
        from apex_compile.runtime.plans.pipeline_rules import PipelineRules

        self.pipeline_rules = PipelineRules(self, stagger) if stagger is not None else None
        if stagger is not None:
            stagger.keep_free = self.pipeline_rules.park_room()  # members grow around the room kept to park into
        self.waiting = WaitingQueue(self._rest_tokens)
        self.running: List[Request] = []
        self.parked: Deque[Request] = collections.deque()
        self._park_after: List[Request] = []  # parks ahead chosen by `schedule`, issued by `park_launched`
        self._warned_split = False  # `_warn_split` once
        # what the staggered pipeline serves: "makespan" (a batch: requests the device pool would reach last) or
        # "latency" (online arrivals: none; `ApexConfig.objective`, "auto" resolved by the engine's front)
        self.objective = "latency" if config.objective == "latency" else "makespan"
        self.to_device: set = set()  # ids of parked pipeline members bound for the device pool (not to rejoin)

    def capacity_tokens(self) -> int:
        """Tokens the largest pool that runs requests can hold (the longest request that can ever run). Under
        offload="auto" the device pool's: auto puts a request in the host pool only where its model says it pays
        (the staggered pipeline: the queue's tail, under the makespan objective), so one that only the host pool
        could hold might wait for the device pool forever."""
        pools = (DEVICE_POOL,) if self.config.offload == "auto" else self.run_pools
        return max(self.kv.pools[p].num_blocks for p in pools) * self.kv.block_size

    def max_tokens(self, request: Request) -> int:
        """The most tokens (prompt + generated) the request can reach: max_new_tokens capped by max_model_len."""
        total = len(request.prompt_token_ids) + request.sampling.max_new_tokens
        return total if self.max_model_len is None else min(total, self.max_model_len)

    def _rest_tokens(self, request: Request) -> int:
        """The tokens `request` may still generate."""
        return max(self.max_tokens(request) - request.num_tokens, 0)

    def add(self, request: Request) -> None:
        """Queues a request; raises if it could never fit in a pool, so no work starts for it."""
        self.check_fits(request)
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raises ValueError if the request could never fit in a pool that runs requests."""
        total = self.max_tokens(request)
        if total > self.capacity_tokens():
            auto = self.config.offload == "auto" and HOST_POOL in self.run_pools  # (else GPU-only: no choice)
            where = ("the device pool (offload='auto' runs every request there unless its model finds the host "
                     "pool pays)" if auto else f"the largest pool that runs requests under offload="
                     f"{self.config.offload!r}")
            raise ValueError(
                f"request {request.request_id} needs KV for {total} tokens (prompt {len(request.prompt_token_ids)}"
                f" + max_new_tokens {request.sampling.max_new_tokens}) but {where} holds {self.capacity_tokens()} "
                f"tokens: raise ApexConfig.gpu_cache_size / cpu_cache_size or lower max_new_tokens"
                + ("; offload='staggered' runs a request the device pool cannot hold from the host pool"
                   if auto else ""))

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, parked or in the staggered pipeline."""
        return bool(self.waiting or self.running or self.parked or (self.stagger and self.stagger.num_members))

    def admits_nothing(self) -> bool:
        """Whether the next step would start no parked or waiting request, with every running request decoding
        one token (conservative: True only where that is certain). Lets the engine queue that step ahead."""
        if not (self.waiting or self.parked) or len(self.running) >= self.config.max_num_seqs:
            return True
        budget = self.config.max_num_batched_tokens - len(self.running)
        if budget <= 0:
            return True
        if self.parked and self._resumes(self.parked[0], budget) is not None:
            return False  # the first parked request resumes first
        if not self.waiting:
            return True
        if self.parked and self.stagger is None:
            return True  # nothing waiting starts before a parked request
        request = self.waiting[0]
        rest = request.num_tokens - request.num_computed
        end = request.num_computed + min(rest, budget)
        room = self._prefill_room()  # every running request decodes: the whole room is the first chunk's

        def full(pool: int) -> bool:
            last = end if pool == HOST_POOL or room is None else request.num_computed + min(rest, budget, room)
            return (self.kv.extra_blocks(request.request_id, last) > self.kv.num_free(pool)
                    or pool == DEVICE_POOL and not self._keeps_reserve(request, last))

        if self.stagger is not None:  # the device pool, unless the parked wait for it; the pipeline from the tail
            if self.config.offload == "staggered":
                return (bool(self.parked) or full(DEVICE_POOL)) and not self.pipeline_rules.takes(request)
            return ((bool(self.parked or self.stagger.leaving) or full(DEVICE_POOL))
                    and self.pipeline_rules.candidate(budget) is None)
        if len(self.run_pools) > 1:
            return False  # a policy picks the pool: leave it to the step
        return full(self.run_pools[0])

    def _resumes(self, request: Request, budget: int) -> Optional[int]:
        """The tokens of parked `request`'s next chunk if its pool-to-be (the first that runs requests) has room
        for its blocks and that chunk; None if not."""
        num_tokens = min(request.num_tokens - request.num_computed, budget)
        blocks = len(self.kv.tables[request.request_id].block_ids)
        end = request.num_computed + num_tokens
        if self.config.growth_reserve and self.run_pools[0] == DEVICE_POOL:  # its own reserve and the others'
            end = max(end, self._reserve_target(request))
        need = blocks + self.kv.extra_blocks(request.request_id, end)
        # the running requests' look-ahead (else it would be parked again at once) and growth reserve
        need += self._running_need(lookahead=self.parks_ahead, reserve=True)
        return num_tokens if self.kv.num_free(self.run_pools[0]) >= need else None

    def _reserve_target(self, request: Request) -> int:
        """The tokens the device pool keeps blocks for, for `request`: its tokens and `growth_reserve` of those it
        may still generate."""
        rest = max(self.max_tokens(request) - request.num_tokens, 0)
        return request.num_tokens + math.ceil(self.config.growth_reserve * rest)

    def _running_need(self, lookahead: bool, reserve: bool, step_tokens: Optional[dict] = None) -> int:
        """Blocks the device pool's running requests need beyond their tables: for LOOKAHEAD_TOKENS tokens past
        their computed ones and those of `step_tokens` (request id -> tokens this step computes), and (reserve)
        for their growth reserve (`_reserve_target`)."""
        reserve = reserve and bool(self.config.growth_reserve)
        if not (lookahead or reserve):
            return 0
        step_tokens = step_tokens or {}
        need = 0
        for r in self.running:
            if self.kv.pool_of(r.request_id) != DEVICE_POOL:
                continue
            target = r.num_computed + step_tokens.get(r.request_id, 0) + LOOKAHEAD_TOKENS if lookahead else 0
            if reserve:
                target = max(target, self._reserve_target(r))
            need += self.kv.extra_blocks(r.request_id, target)
        return need

    def _keeps_reserve(self, request: Request, end: int) -> bool:
        """Whether the device pool, giving `request` blocks up to token `end`, keeps its growth reserve: that of its
        running requests and of `request` (blocks of moves landing count as free). True without one."""
        if not self.config.growth_reserve:
            return True
        need = self.kv.extra_blocks(request.request_id, max(end, self._reserve_target(request)))
        need += self._running_need(lookahead=False, reserve=True)
        return need <= self.kv.num_free(DEVICE_POOL) + self.kv.num_held(DEVICE_POOL)

    @property
    def parks_ahead(self) -> bool:
        """Whether the device pool's evictions are parks ahead (overlapped moves, parked in the host pool, which
        runs no request beside the device pool's except in the staggered pipeline)."""
        return (self.kv.overlaps_moves and self.park_pool == HOST_POOL and self.run_pools[0] == DEVICE_POOL
                and (HOST_POOL not in self.run_pools or self.stagger is not None))

    def _device_shortfall(self, step_tokens: dict) -> int:
        """The running requests' look-ahead need (`_running_need`) less the device pool's free blocks and those of
        moves landing."""
        return (self._running_need(lookahead=True, reserve=False, step_tokens=step_tokens)
                - self.kv.num_free(DEVICE_POOL) - self.kv.num_held(DEVICE_POOL))

    def plan_parks_ahead(self, step_tokens: dict) -> None:
        """A step queued ahead computing `step_tokens` (request id -> tokens): the parks that step leaves due
        (`_plan_parks`), issued by `park_launched` once it is queued."""
        self._park_after = []
        if self.parks_ahead:
            self._plan_parks(step_tokens)

    def _plan_parks(self, step_tokens: dict) -> None:
        """Overlapped moves: while the device pool's free blocks (and those of moves landing) fall short of its
        running requests' look-ahead, the newest of them are parked once this step (computing `step_tokens`:
        request id -> tokens) is queued (`park_launched`), so each park's copy runs beside the next step,
        instead of a park at the step that needs its blocks, which waits for the copy. Not a request that stops
        by length within the look-ahead (its blocks come back anyway), nor the last one."""
        short = self._device_shortfall(step_tokens)
        device = [r for r in self.running if self.kv.pool_of(r.request_id) == DEVICE_POOL]
        room = self.kv.num_free(HOST_POOL)
        for request in reversed(device):
            if short <= 0 or len(device) - len(self._park_after) <= 1:
                break
            end = request.num_computed + step_tokens.get(request.request_id, 0)
            blocks = len(self.kv.tables[request.request_id].block_ids)
            if end + LOOKAHEAD_TOKENS >= self.max_tokens(request) or blocks > room:
                continue
            self._park_after.append(request)
            room -= blocks
            short -= blocks + self.kv.extra_blocks(request.request_id, end + LOOKAHEAD_TOKENS)

    def park_launched(self) -> List[Request]:
        """Parks the requests `schedule` chose to park ahead, now that this step is queued (their copy follows it
        on the device; their device blocks return once it has landed: `KVManager.move(hold=True)`)."""
        parked = []
        for request in self._park_after:
            if request.status is not RequestStatus.RUNNING or not self.kv.can_move(request.request_id, HOST_POOL):
                continue
            self.running.remove(request)
            request.num_preemptions += 1
            self.kv.move(request.request_id, HOST_POOL, hold=True)
            request.status = RequestStatus.PARKED
            self.parked.append(request)
            parked.append(request)
        self._park_after = []
        return parked

    def _prefill_room(self) -> Optional[int]:
        """Prompt tokens the device pool may take this step (`prefill_tokens_while_decoding`) while a running
        request or the staggered pipeline decodes; None: no cap (nothing decodes, or no cap set)."""
        cap = self.config.prefill_tokens_while_decoding
        if cap is None:
            return None
        decoding = any(r.num_tokens - r.num_computed == 1 for r in self.running)
        if decoding or (self.stagger is not None and self.stagger.num_members):
            return cap
        return None

    def finish(self, request: Request, reason: str) -> None:
        """Marks a running request finished and returns its blocks (one parked ahead after its last step was
        queued is parked by then)."""
        if request.status is RequestStatus.PARKED:
            self.parked.remove(request)
        else:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)

    def abort_all(self) -> None:
        """Drops every unfinished request and returns all their blocks (after an error mid-run)."""
        self.abort(None)

    def abort(self, request_ids=None) -> List[Request]:
        """Drops the unfinished requests with these ids (all when None), returns their blocks, and returns them."""
        ids = None if request_ids is None else set(request_ids)
        dropped = [r for r in list(self.waiting) + self.running + list(self.parked)
                   if ids is None or r.request_id in ids]
        if self.stagger is not None:  # its CPU jobs are drained before the blocks are freed
            members = [r.request_id for r in self.stagger.members() if ids is None or r.request_id in ids]
            dropped += self.stagger.remove(members)
        for request in dropped:
            self.kv.free(request.request_id)
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
        keep = [r for r in self.waiting if r.status is not RequestStatus.FINISHED]
        self.waiting = WaitingQueue(self._rest_tokens, keep)
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]
        self.parked = collections.deque(r for r in self.parked if r.status is not RequestStatus.FINISHED)
        return dropped

    def schedule(self) -> SchedulerOutput:
        """Picks this step's chunks, evicting requests where pools are full."""
        out = SchedulerOutput()
        self._park_after = []
        budget = self.config.max_num_batched_tokens
        room = self._prefill_room()  # None: no cap on the device pool's prompt tokens this step
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            rest = request.num_tokens - request.num_computed
            num_tokens = min(rest, budget)
            capped = room is not None and rest > 1 and self.kv.pool_of(request.request_id) == DEVICE_POOL
            if capped:
                num_tokens = min(num_tokens, room)
                if num_tokens == 0:  # its next chunk waits for a step with room
                    index += 1
                    continue
            if not self._grow_evicting(request, index, num_tokens, out):
                continue  # the request itself was evicted; the list shifted left
            pool = self.kv.pool_of(request.request_id)
            out.chunks.append(ScheduledChunk(request, request.num_computed, num_tokens, pool))
            budget -= num_tokens
            if capped and pool == DEVICE_POOL:
                room -= num_tokens
            index += 1
        while self.parked and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.parked[0]
            pool = self.run_pools[0]
            num_tokens = self._resumes(request, budget)
            if num_tokens is None:
                break
            self.kv.move(request.request_id, pool)
            self.kv.grow(request.request_id, pool, request.num_computed + num_tokens)
            self.parked.popleft()
            self.to_device.discard(request.request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.resumed.append(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed, num_tokens, pool))
            budget -= num_tokens
        if room is None:
            room = self._prefill_room()  # a resumed request decodes now
        # waiting requests start after the parked ones; with the staggered plan they may start in its pipeline
        # meanwhile (the parked wait for the device pool only)
        while (self.waiting and (not self.parked or self.stagger is not None)
               and len(self.running) < self.config.max_num_seqs and budget > 0 and (room is None or room > 0)):
            request = self.waiting[0]
            num_tokens = min(request.num_tokens - request.num_computed, budget)
            device_tokens = num_tokens if room is None else min(num_tokens, room)
            pool = self._admit_pool(request, num_tokens, device_tokens)
            if pool is None:
                break
            if pool == DEVICE_POOL:
                num_tokens = device_tokens
                if room is not None:
                    room -= num_tokens
            else:
                self._warn_split(request, num_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed, num_tokens, pool))
            budget -= num_tokens
        while self.stagger is not None and len(self.running) < self.config.max_num_seqs and budget > 0:
            rules = self.pipeline_rules
            request = rules.candidate(budget)
            if request is None or not self.kv.grow(request.request_id, HOST_POOL, rules.host_target(request)):
                break
            num_tokens = request.num_tokens - request.num_computed  # past `budget` ends the loop: one a step
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed, num_tokens, HOST_POOL))
            budget -= num_tokens
        for chunk in out.chunks:
            chunk.request.steps_per_pool[chunk.pool] += 1
        if self.parks_ahead:
            self._plan_parks({c.request.request_id: c.num_tokens for c in out.chunks})
        return out

    def _grow_evicting(self, request: Request, index: int, num_tokens: int, out: SchedulerOutput) -> bool:
        """Gets blocks for the request's chunk, evicting newer requests of its pool; False if it was evicted."""
        while True:
            pool = self.kv.pool_of(request.request_id)
            if self.kv.grow(request.request_id, pool, request.num_computed + num_tokens):
                return True
            victim = next((r for r in reversed(self.running[index + 1:])
                           if self.kv.pool_of(r.request_id) == pool), None)
            if victim is None:
                if self._evict(request, out):
                    continue  # moved to the other running pool: try again there
                return False
            self._evict(victim, out)

    def _evict(self, request: Request, out: SchedulerOutput) -> bool:
        """Frees the request's blocks in its pool; True if it stays running (moved to the other running pool)."""
        pool = self.kv.pool_of(request.request_id)
        other = 1 - pool
        total = self.max_tokens(request)
        room_needed = self.kv.blocks_for(request.num_tokens)  # every chunk it may run this step
        if (other in self.run_pools and not (self.stagger is not None and other == HOST_POOL)
                and self.kv.num_free(other) >= room_needed
                and self.kv.pools[other].num_blocks * self.kv.block_size >= total
                and (self.host_policy is None or other != HOST_POOL or self._host_pays(request))):
            self.kv.move(request.request_id, other)
            if other == HOST_POOL:
                self.kv.host_ready(request.request_id)  # its rows attend on the CPU this step
            out.moved.append((request, other))
            return True
        request.num_preemptions += 1
        self.running.remove(request)
        if other == self.park_pool and self.kv.can_move(request.request_id, other):
            self.kv.move(request.request_id, other)
            request.status = RequestStatus.PARKED
            self.parked.append(request)
            out.parked.append(request)
            return False
        self._requeue(request)
        out.recomputed.append(request)
        return False

    def _requeue(self, request: Request) -> None:
        """Recompute preemption: frees the request's blocks; it waits first in line to be prefilled again."""
        self.kv.free(request.request_id)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _admit_pool(self, request: Request, num_tokens: int, device_tokens: int) -> Optional[int]:
        """Allocates the first chunk of a waiting request in the pool the offload policy picks (`num_tokens` in
        the host pool, `device_tokens` in the device pool: its prompt cap); None if full.

        With a fraction, the pick keeps the host share of running requests at the fraction; when that pool is
        full the request waits rather than tipping the share (a pool too small for the whole request is never
        picked).
        """
        total = self.max_tokens(request)
        fitting = [p for p in self.run_pools if self.kv.pools[p].num_blocks * self.kv.block_size >= total]
        if self.stagger is not None:
            return self.pipeline_rules.admit_head(request, num_tokens, device_tokens, fitting)
        if self.host_policy is not None:
            return self._admit_auto(request, num_tokens, device_tokens, fitting)
        pool = fitting[0]
        if len(fitting) == 2:
            on_host = sum(1 for r in self.running if self.kv.pool_of(r.request_id) == HOST_POOL)
            pool = HOST_POOL if on_host < self.host_fraction * (len(self.running) + 1) else DEVICE_POOL
        if pool == HOST_POOL and self._splits_host_prompt(request, num_tokens):
            return None
        chunk = device_tokens if pool == DEVICE_POOL else num_tokens
        return pool if self._grow(request, pool, request.num_computed + chunk) else None

    def _grow(self, request: Request, pool: int, end: int) -> bool:
        """Gives `request` blocks in `pool` up to token `end` if they fit, in the device pool only while it keeps
        its growth reserve (`_keeps_reserve`)."""
        if pool == DEVICE_POOL and not self._keeps_reserve(request, end):
            return False
        return self.kv.grow(request.request_id, pool, end)

    def _admit_auto(self, request: Request, num_tokens: int, device_tokens: int,
                    fitting: List[int]) -> Optional[int]:
        """offload="auto": the device pool when it has room, else the host pool if the model says it pays."""
        end = request.num_computed + num_tokens
        if DEVICE_POOL in fitting and self._grow(request, DEVICE_POOL, request.num_computed + device_tokens):
            return DEVICE_POOL
        if HOST_POOL not in fitting or self._splits_host_prompt(request, num_tokens):
            return None
        if self._host_pays(request) and self.kv.grow(request.request_id, HOST_POOL, end):
            return HOST_POOL
        return None

    def _warn_split(self, request: Request, num_tokens: int) -> None:
        """Warns (once per scheduler) when a request admitted to the host pool starts with a chunk shorter than its
        rest: no step of this budget can take it whole beside the running rows, and its continued chunks attend
        on the CPU."""
        rest = request.num_tokens - request.num_computed
        if num_tokens >= rest or self._warned_split:
            return
        self._warned_split = True
        warnings.warn(f"a {rest}-token prompt starts in the host pool split across steps (step budget "
                      f"{self.config.max_num_batched_tokens}, {len(self.running)} running rows): its continued "
                      f"chunks attend on the CPU, many times slower than a whole prompt's; set "
                      f"ApexConfig.max_num_batched_tokens to at least the longest prompt + max_num_seqs",
                      RuntimeWarning, stacklevel=2)

    def _splits_host_prompt(self, request: Request, num_tokens: int) -> bool:
        """Whether starting `request` in the host pool with `num_tokens` tokens would split a prompt that a later
        step can take whole (its running requests' rows aside). A continued host-pool chunk attends its cached
        part on the CPU, every layer waiting for it (about ten times a fresh chunk's time), so
        the request waits for that step instead."""
        rest = request.num_tokens - request.num_computed
        return num_tokens < rest <= self.config.max_num_batched_tokens - len(self.running)

    def _host_pays(self, request: Request) -> bool:
        """Whether the auto policy predicts more tokens/s with `request` (not yet counted) in the host pool."""
        others = [r for r in self.running if r is not request]
        on_host = sum(1 for r in others if self.kv.pool_of(r.request_id) == HOST_POOL)
        context = sum(r.num_tokens for r in others + [request]) / (len(others) + 1)
        return self.host_policy.admit_host(len(others) - on_host, on_host, context)
