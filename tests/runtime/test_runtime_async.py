"""Async scheduling (ApexConfig.async_scheduling, issue 13 item 4): a decode step queued while the previous one
runs, its input ids copied on the device from the previous step's sampled ids. On a CPU the steps run one after
the other, so these tests check the bookkeeping: the same tokens as the synchronous engine, rows of requests that
stopped meanwhile dropped, every block returned, and the cases that must not run ahead."""
import collections

import pytest
import torch

from apex_compile.config import ApexConfig, TuningConfig
from apex_compile.model import optimize
from apex_compile.runtime.request import Request, SamplingParams
from apex_compile.runtime.scheduler import Scheduler

MB = 1 << 20
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [1, 2, 3, 4, 5, 6], [7]]
LENGTHS = (9, 20, 3, 30, 14)


def run(model, async_scheduling, sampling, prompts=PROMPTS, **config):
    config = dict(dict(offload="never", gpu_cache_size=4 * MB, cpu_cache_size=4 * MB), **config)
    engine = optimize(model, ApexConfig(async_scheduling=async_scheduling, **config)).engine
    completions = engine.generate(prompts, sampling)
    assert engine.blocks_in_use() == {"device": 0, "host": 0} and engine._ahead is None
    return [(c.token_ids, c.finish_reason) for c in completions], engine.stats, completions


def common_token(model):
    """A token the greedy run produces often, so that as EOS it stops some requests early."""
    tokens, _, _ = run(model, False, [SamplingParams(max_new_tokens=n) for n in LENGTHS])
    return collections.Counter(t for ids, _ in tokens for t in ids).most_common(3)[2][0]


@pytest.mark.parametrize("case", ["greedy", "eos", "seeded", "max_model_len"])
def test_steps_run_ahead_give_the_synchronous_tokens(tiny_llama, case):
    eos = (common_token(tiny_llama),) if case in ("eos", "seeded") else ()
    sampling = [SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in LENGTHS]
    if case == "seeded":
        sampling[1] = SamplingParams(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=30, seed=4,
                                     eos_token_ids=eos)
        sampling[3] = SamplingParams(max_new_tokens=30, do_sample=True, top_p=0.8, seed=7, eos_token_ids=eos)
    config = {"max_model_len": 24} if case == "max_model_len" else {}
    expected, sync_stats, sync_completions = run(tiny_llama, False, sampling, **config)
    got, stats, completions = run(tiny_llama, True, sampling, **config)
    assert got == expected
    assert [c.steps_per_pool for c in completions] == [c.steps_per_pool for c in sync_completions]
    assert sync_stats.ahead_steps == 0 and stats.ahead_steps >= stats.steps // 2
    assert sync_stats.not_ahead == {}  # the synchronous engine never tries
    reasons = [reason for _, reason in got]
    if case == "eos":
        assert "eos" in reasons and "length" in reasons  # some requests stopped while a step was queued ahead
    if case == "max_model_len":
        assert all(len(PROMPTS[i]) + len(ids) == 24 for i, (ids, _) in enumerate(got) if LENGTHS[i] >= 21)


def test_a_queue_the_next_step_could_admit_is_left_to_the_scheduler(tiny_llama):
    prompts = PROMPTS * 2
    sampling = [SamplingParams(max_new_tokens=n) for n in LENGTHS * 2]
    expected, _, _ = run(tiny_llama, False, sampling, prompts, max_num_seqs=3)
    got, stats, _ = run(tiny_llama, True, sampling, prompts, max_num_seqs=3)
    assert got == expected
    assert 0 < stats.ahead_steps < stats.steps  # ahead while the running set is full, not when a slot frees
    assert stats.not_ahead.get("admits", 0) > 0  # a finished request freed a slot that a waiting one may take


def test_swaps_under_async_scheduling_lose_nothing(tiny_llama):
    # a device pool of 4 blocks of 16 tokens for five requests of up to 36 tokens: requests are parked and resumed
    sampling = [SamplingParams(max_new_tokens=n) for n in LENGTHS]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x block x head dim x fp32
    config = dict(gpu_cache_size=4 * block_bytes)
    expected, sync_stats, _ = run(tiny_llama, False, sampling, **config)
    got, stats, _ = run(tiny_llama, True, sampling, **config)
    assert got == expected
    assert sync_stats.parked > 0 and stats.parked > 0 and stats.ahead_steps > 0


@pytest.mark.parametrize("rule", ["repetition_penalty", "min_new_tokens"])
def test_rules_that_need_the_last_token_on_the_host_run_in_step(tiny_llama, rule):
    eos = (common_token(tiny_llama),)
    extra = {"repetition_penalty": 1.3} if rule == "repetition_penalty" else {"min_new_tokens": 8}
    sampling = [SamplingParams(max_new_tokens=n, eos_token_ids=eos, **extra) for n in LENGTHS]
    expected, _, _ = run(tiny_llama, False, sampling)
    got, stats, _ = run(tiny_llama, True, sampling)
    assert got == expected
    if rule == "repetition_penalty":
        assert stats.ahead_steps == 0 and stats.not_ahead.get("host rules", 0) > 0
    else:  # ahead once every request is past its minimum
        assert all(len(ids) >= min(8, n) for (ids, _), n in zip(got, LENGTHS)) and stats.ahead_steps > 0


def test_a_stream_closed_with_a_step_queued_ahead_returns_everything(tiny_llama):
    engine = optimize(tiny_llama, ApexConfig(offload="never", gpu_cache_size=4 * MB, cpu_cache_size=4 * MB,
                                             async_scheduling=True)).engine
    sampling = SamplingParams(max_new_tokens=20)
    stream = engine.stream(PROMPTS, sampling)
    for _ in range(3 * len(PROMPTS)):
        next(stream)
    assert engine._ahead is not None  # a step is queued beyond the tokens taken so far
    stream.close()
    assert engine._ahead is None and engine.blocks_in_use() == {"device": 0, "host": 0}
    again = [c.token_ids for c in engine.generate(PROMPTS, sampling)]
    fresh = optimize(tiny_llama, ApexConfig(offload="never", gpu_cache_size=4 * MB, cpu_cache_size=4 * MB,
                                            async_scheduling=False)).engine
    assert again == [c.token_ids for c in fresh.generate(PROMPTS, sampling)]


def test_admits_nothing_is_true_only_where_the_next_step_admits_nothing():
    from apex_compile.runtime.kv_manager import DEVICE_POOL, CacheShape, KVManager

    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    kv = KVManager(shape, 4, 4, torch.device("cpu"))
    # no growth reserve: the block counts below are the first chunks' alone (the reserve's own test is in
    # tests/runtime/test_runtime_scheduler.py)
    sched = Scheduler(ApexConfig(offload="never", max_num_seqs=2, max_num_batched_tokens=64, growth_reserve=0.0), kv)
    assert sched.admits_nothing()  # nothing waits
    first = Request(0, list(range(1, 33)), SamplingParams(max_new_tokens=4))
    sched.add(first)
    assert not sched.admits_nothing()  # 2 blocks needed, 4 free
    sched.schedule()
    second = Request(1, list(range(1, 49)), SamplingParams(max_new_tokens=4))
    sched.add(second)
    assert sched.admits_nothing()  # 3 blocks needed, 2 free
    kv.grow(first.request_id, DEVICE_POOL, 16)  # (already held: nothing changes)
    sched.waiting[0] = Request(2, list(range(1, 17)), SamplingParams(max_new_tokens=4))
    assert not sched.admits_nothing()  # 1 block needed, 2 free
    sched.schedule()
    sched.add(Request(3, [1, 2], SamplingParams(max_new_tokens=4)))
    assert len(sched.running) == 2 and sched.admits_nothing()  # max_num_seqs reached


@pytest.mark.parametrize("lanes", [1, 2])
def test_staggered_steps_run_ahead_give_the_synchronous_tokens(lanes, monkeypatch):
    """With the staggered block, a step queued ahead takes on the device both its device rows' ids and (one lane)
    the block's group-0 ids that the step before samples; requests that stop by EOS meanwhile leave the
    pipeline without losing a token or a block."""
    from apex_compile.runtime.stagger import StaggerPipeline
    from tests.runtime.test_runtime_stagger import sharp_model, staggered

    torch.manual_seed(31)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10, 11)]
    lengths = [14, 9, 16, 11, 15, 8, 13, 16, 10, 12]
    pending, removed = [], []
    real_pending, real_remove = StaggerPipeline.pending_input_rows, StaggerPipeline.remove
    monkeypatch.setattr(StaggerPipeline, "pending_input_rows",
                        lambda self: pending.append(real_pending(self)) or pending[-1])
    monkeypatch.setattr(StaggerPipeline, "remove",
                        lambda self, ids: removed.append(list(ids)) or real_remove(self, ids))

    def generate(async_scheduling, eos=()):
        apex = staggered(model, width=2, lanes=lanes, device_blocks=6, async_scheduling=async_scheduling)
        sampling = [SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in lengths]
        done = apex.engine.generate(prompts, sampling)
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0} and not apex.engine.stagger.members()
        return [(c.token_ids, c.finish_reason, c.steps_per_pool) for c in done], apex.engine.stats

    def tokens(results):  # which pool served each step may differ: members move to the device pool when it
        return [(ids, reason) for ids, reason, _ in results]  # has room, and a step queued ahead moves that point

    plain, _ = generate(False)
    eos = (collections.Counter(t for ids, _, _ in plain for t in ids).most_common(3)[2][0],)
    expected, sync_stats = generate(False, eos)
    pending.clear()
    removed.clear()
    got, stats = generate(True, eos)
    assert tokens(got) == tokens(expected)
    assert sync_stats.ahead_steps == 0 and stats.ahead_steps > 0
    assert "eos" in [reason for _, reason, _ in got] and sum(1 for _, _, s in got if s["host"]) >= 3
    if lanes == 1:  # ids sampled by the step before, taken on the device; some stopped in a later group
        assert any(pending) and removed
    else:
        assert not any(pending)


def test_a_parked_request_admits_nothing_until_the_device_pool_can_take_it_back():
    """A parked request resumes before anything waiting starts: while its blocks and next token do not fit in the
    device pool the next step starts nothing (it may be queued ahead), and once they fit it resumes."""
    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
    from apex_compile.runtime.request import RequestStatus

    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    kv = KVManager(shape, 4, 8, torch.device("cpu"))
    sched = Scheduler(ApexConfig(offload="never", preemption="swap", max_num_seqs=4, max_num_batched_tokens=64), kv)
    running = Request(0, list(range(1, 41)), SamplingParams(max_new_tokens=4))
    running.num_computed, running.status = 40, RequestStatus.RUNNING
    kv.grow(running.request_id, DEVICE_POOL, 41)  # 3 of the 4 device blocks
    sched.running.append(running)
    parked = Request(1, list(range(1, 33)), SamplingParams(max_new_tokens=4))
    parked.output_token_ids, parked.num_computed, parked.status = [7], 32, RequestStatus.PARKED
    kv.grow(parked.request_id, HOST_POOL, 32)  # 2 blocks, and a third for its next token
    sched.parked.append(parked)
    sched.add(Request(2, [1, 2], SamplingParams(max_new_tokens=4)))  # would fit, but waits behind the parked one
    assert sched.admits_nothing()
    out = sched.schedule()
    assert not out.resumed and [c.request for c in out.chunks] == [running] and len(sched.waiting) == 1
    sched.finish(running, "length")
    assert not sched.admits_nothing()
    assert sched.schedule().resumed == [parked] and kv.pool_of(parked.request_id) == DEVICE_POOL


def test_with_the_staggered_plan_a_parked_request_keeps_the_device_pool_not_the_pipeline():
    """While a parked request waits for the device pool, waiting requests may start in the staggered pipeline's
    host pool (never in the device pool ahead of it): the next step admits one while the pipeline has a row."""
    import types

    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
    from apex_compile.runtime.request import RequestStatus

    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    kv = KVManager(shape, 4, 16, torch.device("cpu"))
    pipeline = types.SimpleNamespace(num_members=0, capacity=2, closed=False, steps=0, members=lambda: [],
                                     leaving=set())
    sched = Scheduler(ApexConfig(offload="staggered", preemption="swap", max_num_seqs=8,
                                 max_num_batched_tokens=64), kv, stagger=pipeline)
    running = Request(0, list(range(1, 41)), SamplingParams(max_new_tokens=4))
    running.num_computed, running.status = 40, RequestStatus.RUNNING
    kv.grow(running.request_id, DEVICE_POOL, 41)  # 3 of the 4 device blocks: one free
    sched.running.append(running)
    parked = Request(1, list(range(1, 33)), SamplingParams(max_new_tokens=4))
    parked.output_token_ids, parked.num_computed, parked.status = [7], 32, RequestStatus.PARKED
    kv.grow(parked.request_id, HOST_POOL, 32)
    sched.parked.append(parked)
    short = Request(2, [1, 2], SamplingParams(max_new_tokens=4))  # one block: would fit in the device pool
    sched.add(short)
    assert not sched.admits_nothing()
    out = sched.schedule()
    assert not out.resumed and kv.pool_of(short.request_id) == HOST_POOL and sched.parked[0] is parked
    assert kv.num_free(DEVICE_POOL) == 1  # kept for the parked request
    sched.add(Request(3, [3, 4], SamplingParams(max_new_tokens=4)))
    pipeline.num_members = 1  # with `short` prefilling, the pipeline is full
    assert sched.admits_nothing()
    assert [c.request for c in sched.schedule().chunks] == [running, short]


def test_the_pipeline_leaves_the_host_pool_room_to_park_the_device_pools_requests():
    """A request starts in the staggered pipeline only while the host pool keeps room to park the device pool's
    blocks (else full pools would recompute evicted requests from their prompts): the next step admits nothing.
    Without a growth reserve (the block counts below; the reserve's room: test_runtime_stagger)."""
    import types

    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
    from apex_compile.runtime.request import RequestStatus

    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    kv = KVManager(shape, 4, 12, torch.device("cpu"))
    sched = Scheduler(ApexConfig(offload="staggered", preemption="swap", max_num_seqs=8, max_num_batched_tokens=64,
                                 tuning=TuningConfig(pipeline_reserve=0.0)),
                      kv, stagger=types.SimpleNamespace(num_members=0, capacity=8, closed=False, steps=0,
                                                        members=lambda: [], leaving=set()))
    running = Request(0, list(range(1, 64)), SamplingParams(max_new_tokens=1))
    running.num_computed, running.status = 63, RequestStatus.RUNNING
    kv.grow(running.request_id, DEVICE_POOL, 64)  # the whole device pool
    sched.running.append(running)
    member = Request(1, list(range(1, 50)), SamplingParams(max_new_tokens=30))
    kv.grow(member.request_id, HOST_POOL, 79)  # a pipeline member's 5 blocks: 7 host blocks free
    sched.add(Request(2, list(range(1, 21)), SamplingParams(max_new_tokens=40)))  # 2 blocks, + 4 kept: fits
    sched.add(Request(3, list(range(1, 21)), SamplingParams(max_new_tokens=40)))  # 2 more: would leave 3 of 4
    assert not sched.admits_nothing()
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == [0, 2] and kv.num_free(HOST_POOL) == 5
    assert sched.admits_nothing() and [c.request.request_id for c in sched.schedule().chunks] == [0, 2]


@pytest.mark.parametrize("delay", [0, 3, 10 ** 6])
def test_overlapped_moves_park_ahead_and_lose_nothing(tiny_llama, delay):
    """Overlapped moves on a CPU stand-in for the swap stream whose copies run only when they land
    (`DeferredSwap`: at once, after a few queries, or only when waited for): the scheduler parks ahead (the
    newest device request, after its step is queued, its blocks held until its copy lands), resumes wait on
    the compute side, and the tokens are the synchronous engine's with every block back."""
    from tests.helpers import DeferredSwap

    sampling = [SamplingParams(max_new_tokens=n) for n in LENGTHS]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    config = dict(offload="never", gpu_cache_size=4 * block_bytes, cpu_cache_size=4 * MB)
    expected, sync_stats, _ = run(tiny_llama, False, sampling, **config)
    engine = optimize(tiny_llama, ApexConfig(async_scheduling=True, **config)).engine
    engine.kv._swap = swap = DeferredSwap(delay)
    holds = []
    move = engine.kv.move
    engine.kv.move = lambda request_id, dst, hold=False, **kw: (holds.append(hold), move(request_id, dst, hold, **kw))
    completions = engine.generate(PROMPTS, sampling)
    assert [(c.token_ids, c.finish_reason) for c in completions] == expected
    assert any(holds) and swap.issued == len(holds) > 0 and engine.stats.parked > 0
    engine.kv.sync_moves()
    assert engine.blocks_in_use() == {"device": 0, "host": 0}


@pytest.mark.parametrize("delay", [0, 3, 10 ** 6])
def test_a_step_queued_ahead_parks_ahead_and_the_next_one_goes_on(tiny_llama, delay):
    """With overlapped moves the engine need not stop queueing ahead to park: the parks a step queued ahead
    leaves due are planned with it and issued once it is queued (their copies behind it), and the step after a
    park queues ahead too (the parked request's token arrives while it is parked). Tokens are the synchronous
    engine's, every block comes back, whether the copies land at once, later or only when waited for."""
    from tests.helpers import DeferredSwap

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    sampling = [SamplingParams(max_new_tokens=n) for n in (60, 50, 40)]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x block x head dim x fp32
    config = dict(offload="never", gpu_cache_size=7 * block_bytes, cpu_cache_size=4 * MB)
    expected, _, _ = run(tiny_llama, False, sampling, prompts, **config)
    engine = optimize(tiny_llama, ApexConfig(async_scheduling=True, **config)).engine
    engine.kv._swap = DeferredSwap(delay)
    scheduler = engine.scheduler
    planned_ahead = []
    plan = scheduler.plan_parks_ahead
    scheduler.plan_parks_ahead = lambda tokens: (plan(tokens), planned_ahead.append(len(scheduler._park_after)))
    launched_ahead = []
    launch = engine._launch_ahead
    engine._launch_ahead = lambda launched: launched_ahead.append(launch(launched)) or launched_ahead[-1]
    completions = engine.generate(prompts, sampling)
    assert [(c.token_ids, c.finish_reason) for c in completions] == expected
    assert sum(planned_ahead) > 0 and engine.stats.parked >= sum(planned_ahead)  # parked from queued steps
    # no step scheduled on the host for a park, nor after one; only copies that land when waited for make a
    # step find its blocks still held
    assert not {"park", "rows"} & set(engine.stats.not_ahead)
    assert delay == 10 ** 6 or "evict" not in engine.stats.not_ahead
    engine.kv.sync_moves()
    assert engine.blocks_in_use() == {"device": 0, "host": 0}


@pytest.mark.parametrize("delay", [0, 10 ** 6])
def test_a_growth_reserve_parks_less_and_changes_no_token(tiny_llama, delay):
    """ApexConfig.growth_reserve with overlapped moves and steps queued ahead: a request enters or resumes in the
    device pool only with room for a share of every device request's remaining tokens, so fewer are parked; the
    tokens are those of the synchronous engine without a reserve, and every block comes back."""
    from tests.helpers import DeferredSwap

    sampling = [SamplingParams(max_new_tokens=n) for n in LENGTHS]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    config = dict(offload="never", gpu_cache_size=4 * block_bytes, cpu_cache_size=4 * MB)
    expected, _, _ = run(tiny_llama, False, sampling, **config)
    parked = {}
    for reserve in (0.0, 0.5):
        engine = optimize(tiny_llama, ApexConfig(async_scheduling=True, growth_reserve=reserve, **config)).engine
        engine.kv._swap = DeferredSwap(delay)
        completions = engine.generate(PROMPTS, sampling)
        assert [(c.token_ids, c.finish_reason) for c in completions] == expected
        engine.kv.sync_moves()
        assert engine.blocks_in_use() == {"device": 0, "host": 0}
        parked[reserve] = engine.stats.parked
    assert parked[0.0] > 0 and parked[0.5] < parked[0.0], parked
