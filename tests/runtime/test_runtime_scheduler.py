"""Scheduler: continuous batching, chunked prefill, placement by offload mode, evictions under full pools.

The model is simulated (every sampled token is 0), so these tests check bookkeeping: budgets, block tables,
invariants after every step, and that every request finishes with all its blocks returned.
"""
import random
import warnings

import pytest
import torch

from apex_compile.config import ApexConfig
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
from apex_compile.runtime.request import Request, RequestStatus, SamplingParams
from apex_compile.runtime.scheduler import Scheduler

BLOCK = 16


def make(device_blocks, host_blocks, **config):
    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BLOCK, dtype=torch.float32)
    kv = KVManager(shape, device_blocks, host_blocks, torch.device("cpu"))
    return Scheduler(ApexConfig(**config), kv), kv


def add(sched, request_id, prompt_len, max_new):
    request = Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new))
    sched.add(request)
    return request


def check_invariants(sched, kv, plan):
    config = sched.config
    assert sum(c.num_tokens for c in plan.chunks) <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    assert len({c.request.request_id for c in plan.chunks}) == len(plan.chunks)
    for chunk in plan.chunks:
        request = chunk.request
        assert request.status is RequestStatus.RUNNING
        assert chunk.start == request.num_computed and chunk.num_tokens >= 1
        assert chunk.pool == kv.pool_of(request.request_id) and chunk.pool in sched.run_pools
        assert len(kv.tables[request.request_id].block_ids) * BLOCK >= chunk.start + chunk.num_tokens
    for request in sched.waiting:
        assert request.request_id not in kv.tables
    for request in sched.parked:
        assert kv.pool_of(request.request_id) == sched.park_pool
    for pool in (DEVICE_POOL, HOST_POOL):
        held = sum(len(t.block_ids) for t in kv.tables.values() if t.pool == pool)
        assert held == kv.num_used(pool)


def drive(sched, kv, max_steps=2000):
    """Runs the simulated engine to the end; returns the plans and, per step, [(num_tokens, samples)]."""
    plans, shapes = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return plans, shapes
        plan = sched.schedule()
        assert plan.chunks, "no progress"
        check_invariants(sched, kv, plan)
        plans.append(plan)
        shapes.append([(c.num_tokens, c.samples) for c in plan.chunks])
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
        for chunk in plan.chunks:
            if chunk.samples:
                request = chunk.request
                request.output_token_ids.append(0)
                if len(request.output_token_ids) == request.sampling.max_new_tokens:
                    sched.finish(request, "length")
    raise AssertionError("requests did not finish")


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    sched, kv = make(20, 0, offload="never", max_num_batched_tokens=32)
    request = add(sched, 0, 100, 3)
    _, shapes = drive(sched, kv)
    assert shapes == [[(32, False)], [(32, False)], [(32, False)], [(4, True)], [(1, True)], [(1, True)]]
    assert request.finish_reason == "length" and len(request.output_token_ids) == 3
    assert kv.num_used(DEVICE_POOL) == 0


def test_decode_tokens_go_first_and_new_prompts_share_the_budget():
    sched, kv = make(40, 0, offload="never", max_num_batched_tokens=20)
    first = add(sched, 0, 10, 5)
    plan = sched.schedule()
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 10)]
    first.num_computed = 10
    first.output_token_ids.append(0)
    second = add(sched, 1, 30, 5)
    plan = sched.schedule()
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 19)]


def advance(sched, plan):
    """What the engine does after a step: tokens computed, a token sampled where the chunk samples."""
    for chunk in plan.chunks:
        chunk.request.num_computed += chunk.num_tokens
        if chunk.samples:
            chunk.request.output_token_ids.append(0)
            if len(chunk.request.output_token_ids) == chunk.request.sampling.max_new_tokens:
                sched.finish(chunk.request, "length")


def test_prompt_tokens_are_capped_while_requests_decode():
    """prefill_tokens_while_decoding: a step with decoding rows takes at most that many prompt tokens into the
    device pool (a running prompt's next chunk and new admissions share it); a step where nothing decodes
    takes the whole budget; every request still finishes."""
    sched, kv = make(60, 0, offload="never", max_num_batched_tokens=64, prefill_tokens_while_decoding=12)
    first = add(sched, 0, 40, 6)
    plan = sched.schedule()
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 40)]  # nothing decodes: no cap
    advance(sched, plan)
    second, third = add(sched, 1, 30, 3), add(sched, 2, 30, 3)
    plan = sched.schedule()
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 12)]
    advance(sched, plan)
    plan = sched.schedule()  # the running prompt's chunk uses the room first; nothing left to admit the third
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 12)]
    advance(sched, plan)
    plan = sched.schedule()  # 6 left of the second prompt, 6 tokens of room for the third
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 6), (third, 6)]
    advance(sched, plan)
    _, shapes = drive(sched, kv)
    assert all(sum(n for n, _ in step if n > 1) <= 12 for step in shapes if any(n == 1 for n, _ in step))
    assert all(r.is_finished for r in (first, second, third)) and kv.num_used(DEVICE_POOL) == 0
    uncapped, kv = make(60, 0, offload="never", max_num_batched_tokens=64)
    runs = add(uncapped, 0, 40, 4)
    advance(uncapped, uncapped.schedule())
    add(uncapped, 1, 30, 3)
    assert [c.num_tokens for c in uncapped.schedule().chunks] == [1, 30]


def test_admits_nothing_knows_the_capped_first_chunk():
    """A step queued ahead must not skip an admission: with the cap the first chunk of a prompt too long for
    the device pool's free blocks fits them, so the next step admits it (no growth reserve to hold it back)."""
    sched, kv = make(5, 0, offload="never", max_num_batched_tokens=64, prefill_tokens_while_decoding=12,
                     growth_reserve=0.0)
    first = add(sched, 0, 40, 6)
    advance(sched, sched.schedule())  # 3 of 5 blocks held: 32 tokens free
    waiting = add(sched, 1, 60, 2)
    assert not sched.admits_nothing()
    assert [(c.request, c.num_tokens) for c in sched.schedule().chunks] == [(first, 1), (waiting, 12)]


def test_a_host_pool_prompt_is_taken_whole_past_the_prompt_cap():
    """The cap is the device pool's: a host-pool prompt (a continued host chunk attends on the CPU) still runs
    whole in a step that decodes, as long as the step's budget holds it."""
    sched, kv = make(40, 40, offload="all", max_num_batched_tokens=32, prefill_tokens_while_decoding=4)
    first = add(sched, 0, 20, 3)
    second = add(sched, 1, 20, 3)
    advance(sched, sched.schedule())
    plan = sched.schedule()
    assert [(c.request, c.num_tokens, c.pool) for c in plan.chunks] == [(first, 1, HOST_POOL),
                                                                        (second, 20, HOST_POOL)]


def test_the_prompt_cap_is_validated():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_tokens_while_decoding"):
            ApexConfig(prefill_tokens_while_decoding=bad)


@pytest.mark.parametrize("offload,expected", [("never", (4, 0)), ("auto", (4, 0)), ("all", (0, 4)),
                                              (0.5, (2, 2)), (0.25, (3, 1))])
def test_placement_follows_the_offload_mode(offload, expected):
    sched, kv = make(50, 50, offload=offload)
    for i in range(4):
        add(sched, i, 20, 4)
    plan = sched.schedule()
    pools = [c.pool for c in plan.chunks]
    assert (pools.count(DEVICE_POOL), pools.count(HOST_POOL)) == expected
    drive(sched, kv)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


@pytest.mark.filterwarnings("ignore:.*split across steps")  # small budgets split host prompts here on purpose
@pytest.mark.parametrize("offload,preemption", [("never", "swap"), ("never", "recompute"), ("all", "swap"),
                                                (0.5, "swap")])
def test_full_pools_evict_and_every_request_finishes_with_all_blocks_back(offload, preemption):
    rng = random.Random(f"{offload}/{preemption}")  # a str seed is stable across processes; hash() of a str is not
    sched, kv = make(9, 6, offload=offload, preemption=preemption, max_num_batched_tokens=48, max_num_seqs=6)
    # at most 40 + 56 = 96 tokens: every request fits the 6-block host pool alone, so none is refused at add
    requests = [add(sched, i, rng.randint(1, 40), rng.randint(1, 56)) for i in range(12)]
    plans, _ = drive(sched, kv)
    assert all(r.is_finished and len(r.output_token_ids) == r.sampling.max_new_tokens for r in requests)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0 and not kv.tables
    evictions = sum(len(p.parked) + len(p.recomputed) + len(p.moved) for p in plans)
    assert evictions > 0
    if preemption == "recompute":
        assert sum(len(p.parked) for p in plans) == 0
    if offload == "never" and preemption == "swap":
        assert sum(len(p.parked) for p in plans) > 0 and sum(len(p.resumed) for p in plans) > 0


def test_a_host_pool_prompt_that_fits_a_step_is_not_split():
    """A host-pool prompt waits for a step with room for all of it rather than starting with the budget's
    rest (its continuation would attend on the CPU, layer by layer); one longer than any step is chunked."""
    sched, kv = make(40, 40, offload="all", max_num_batched_tokens=32)
    first = add(sched, 0, 20, 3)
    second = add(sched, 1, 20, 3)  # 12 tokens left in the first step: it waits for the next one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing split: no warning
        plan = sched.schedule()
        assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 20)]
        assert plan.chunks[0].pool == HOST_POOL
        first.num_computed = 20
        first.output_token_ids.append(0)
        plan = sched.schedule()
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 1), (second, 20)]
    sched, kv = make(40, 40, offload="all", max_num_batched_tokens=32)
    add(sched, 0, 100, 3)
    add(sched, 1, 100, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, shapes = drive(sched, kv)
    assert shapes[:3] == [[(32, False)]] * 3 and shapes[3][0] == (4, True)  # then the second prompt's chunks
    # the user is told once (not per prompt) how to keep host prompts whole
    split = [w for w in caught if "split across steps" in str(w.message)]
    assert len(split) == 1 and "max_num_batched_tokens" in str(split[0].message)


def test_fraction_mode_moves_a_request_to_the_other_pool_when_its_pool_is_full():
    sched, kv = make(8, 6, offload=0.5)
    a = add(sched, 0, 20, 40)  # host (the first placement goes to the host pool)
    b = add(sched, 1, 20, 40)  # device
    c = add(sched, 2, 20, 40)  # host, until a and c outgrow its 6 blocks
    plans, _ = drive(sched, kv)
    assert [(r, pool) for p in plans for r, pool in p.moved] == [(c, DEVICE_POOL)]
    assert all(r.is_finished for r in (a, b, c)) and kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


def test_max_num_seqs_limits_the_running_set():
    sched, kv = make(100, 0, offload="never", max_num_seqs=3)
    for i in range(7):
        add(sched, i, 5, 2)
    plan = sched.schedule()
    assert len(plan.chunks) == 3 and len(sched.waiting) == 4
    drive(sched, kv)


def test_request_larger_than_every_running_pool_is_refused_at_add():
    sched, kv = make(4, 100, offload="never")
    with pytest.raises(ValueError, match="holds 64 tokens"):
        add(sched, 0, 40, 30)
    assert not sched.has_unfinished()


def test_under_auto_a_request_only_the_host_pool_could_hold_is_refused_at_add():
    """offload="auto" puts a request in the host pool only where its model says it pays (the staggered pipeline:
    the queue's tail, under the makespan objective), so one that only the host pool could hold could wait for
    the device pool forever (the engine stopped with "nothing to run" once the others were done): it is refused
    at add, the message naming the mode that runs it."""
    kv_shape = make(4, 100)[1]
    sched = Scheduler(ApexConfig(offload="auto"), kv_shape, host_policy=object())
    assert sched.run_pools == (DEVICE_POOL, HOST_POOL)
    with pytest.raises(ValueError, match=r"device pool \(offload='auto'.*holds 64 tokens.*offload='staggered'"):
        add(sched, 0, 40, 30)
    assert not sched.has_unfinished()
    add(sched, 1, 40, 24)  # 64 tokens: the device pool holds it


def test_offload_mode_needs_blocks_in_the_pools_it_runs():
    with pytest.raises(ValueError, match="cpu_cache_size"):
        make(10, 0, offload="all")
    with pytest.raises(ValueError, match="gpu_cache_size"):
        make(0, 10, offload=0.5)


def test_abort_all_returns_every_block():
    sched, kv = make(6, 6, offload=0.5)
    for i in range(4):
        add(sched, i, 30, 10)
    sched.schedule()
    assert kv.num_used(DEVICE_POOL) + kv.num_used(HOST_POOL) > 0
    sched.abort_all()
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0 and not sched.has_unfinished()


def test_the_growth_reserve_holds_back_an_admission_the_first_chunk_would_fit():
    """growth_reserve: a waiting request enters the device pool only while the free blocks also cover that share
    of every device request's remaining tokens (its own too); without the reserve its first chunk is enough.
    admits_nothing agrees, so a step queued ahead skips no admission and none is refused needlessly."""
    for reserve, admitted in ((0.0, True), (0.5, False)):
        sched, kv = make(8, 0, offload="never", max_num_batched_tokens=64, growth_reserve=reserve)
        first = add(sched, 0, 4 * BLOCK, 4 * BLOCK)  # 8 blocks at its end; with 0.5 it keeps 7 (97 tokens)
        advance(sched, sched.schedule())
        waiting = add(sched, 1, BLOCK, 2 * BLOCK)  # its first chunk: 1 block; with 0.5 it keeps 2 (32 tokens)
        assert sched.admits_nothing() is not admitted
        plan = sched.schedule()
        assert [c.request for c in plan.chunks] == ([first, waiting] if admitted else [first])
        drive(sched, kv)  # held back, it starts once the first request's growth leaves room
        assert waiting.is_finished and first.is_finished and kv.num_used(DEVICE_POOL) == 0


def test_the_growth_reserve_parks_less_and_every_request_finishes():
    """A steady stream of requests into a small device pool: with a growth reserve fewer requests are parked and
    resumed, and every request still finishes with all blocks back (no request waits for a reserve forever)."""
    counts = {}
    for reserve in (0.0, 0.25):
        rng = random.Random("reserve")
        sched, kv = make(24, 64, offload="never", max_num_batched_tokens=64, max_num_seqs=16,
                         prefill_tokens_while_decoding=16, growth_reserve=reserve)
        requests = [add(sched, i, rng.randint(8, 48), rng.randint(16, 80)) for i in range(40)]
        plans, _ = drive(sched, kv, max_steps=5000)
        assert all(r.is_finished and len(r.output_token_ids) == r.sampling.max_new_tokens for r in requests)
        assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0 and not kv.tables
        counts[reserve] = sum(len(p.parked) for p in plans), sum(len(p.resumed) for p in plans)
    assert counts[0.0][0] > 0 and counts[0.25][0] < counts[0.0][0] / 2, counts


def test_a_parked_request_resumes_only_with_room_for_the_growth_reserve():
    """_resumes: a parked request's blocks and next token fit, but not the running requests' reserve: it stays
    parked; without the reserve it resumes."""
    for reserve, resumes in ((0.0, True), (0.5, False)):
        sched, kv = make(8, 8, offload="never", max_num_batched_tokens=64, growth_reserve=reserve)
        running = add(sched, 0, 4 * BLOCK, 4 * BLOCK)
        advance(sched, sched.schedule())  # its prompt: 4 of the 8 blocks
        parked = Request(1, list(range(1, 2 * BLOCK + 1)), SamplingParams(max_new_tokens=2 * BLOCK))
        kv.grow(parked.request_id, HOST_POOL, 2 * BLOCK)  # as if parked after its prompt and first token
        parked.num_computed, parked.status = 2 * BLOCK, RequestStatus.PARKED
        parked.output_token_ids.append(0)
        sched.parked.append(parked)
        # the running request's next token takes a 5th block; the parked one needs its 2 and a 3rd for its
        # next token: the 3 free blocks. With the reserve: the running request's 2 more and the parked one's 1
        plan = sched.schedule()
        assert (parked in plan.resumed) is resumes
        drive(sched, kv)
        assert running.is_finished and parked.is_finished and kv.num_used(DEVICE_POOL) == 0


def test_the_growth_reserve_is_validated():
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="growth_reserve"):
            ApexConfig(growth_reserve=bad)


def test_the_waiting_queue_keeps_its_remaining_tokens_through_every_change():
    """`WaitingQueue.rest_tokens` (the backlog behind the staggered plan's admission rule) equals the sum over the
    queue through a random run of arrivals, admissions from the head, takes from the tail, requeues, removals,
    replacements and abort's rebuild, looked at after one change or several. Requests with equal fields stay
    distinct."""
    from apex_compile.runtime.scheduler import WaitingQueue

    sched, _ = make(4, 64)
    rng = random.Random(0)
    next_id = 0

    def request():
        nonlocal next_id
        r = Request(next_id, [1, 2, 3], SamplingParams(max_new_tokens=rng.choice([4, 8])))
        r.output_token_ids = [5] * rng.randrange(0, 3)  # a requeued one carries its tokens
        next_id += 1
        return r

    for _ in range(6):
        sched.add(request())
    for _ in range(3000):
        op, waiting = rng.random(), sched.waiting
        if op < 0.3:
            sched.add(request())
        elif op < 0.45 and waiting:
            waiting.popleft()
        elif op < 0.55 and waiting:
            waiting.pop()
        elif op < 0.65:
            waiting.appendleft(request())
        elif op < 0.75 and waiting:
            del waiting[rng.randrange(len(waiting))]
        elif op < 0.8 and waiting:
            waiting[rng.randrange(len(waiting))] = request()
        elif op < 0.85 and waiting:
            waiting.remove(waiting[rng.randrange(len(waiting))])
        elif op < 0.88:
            waiting += [request(), request()]
        elif op < 0.9 and waiting:
            sched.abort([waiting[0].request_id])
        if rng.random() < 0.5:
            assert isinstance(sched.waiting, WaitingQueue)
            assert sched.waiting.rest_tokens == sum(sched._rest_tokens(r) for r in sched.waiting)
    sched.waiting.clear()
    assert sched.waiting.rest_tokens == 0
