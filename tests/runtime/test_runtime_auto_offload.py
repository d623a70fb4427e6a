"""offload="auto": the scheduler's host admissions follow the performance model (device pool first, host pool only
when predicted to pay), measured steps correct the model, and nothing is lost under full pools."""
import random

import pytest
import torch

from apex_compile.config import ApexConfig
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, Profile
from apex_compile.runtime.scheduler import Scheduler

from tests.runtime.test_runtime_scheduler import BLOCK, add, drive

KV_PER_TOKEN = 128 * 1024


def profile(cpu_gbps, gpu_gbps=300.0, linear_ms=42.0):
    ctx = [1024, 65536, 1048576]
    return Profile("synthetic", [1, 64], [linear_ms / 1e3, linear_ms * 1.04 / 1e3],
                   ctx, [c * KV_PER_TOKEN / (gpu_gbps * 1e9) for c in ctx],
                   ctx, [c * KV_PER_TOKEN / (cpu_gbps * 1e9) for c in ctx], KV_PER_TOKEN, 1 << 20, 50e9)


class Policy:
    """A stand-in policy: admits at most `limit` host requests, and records what it was asked."""

    def __init__(self, limit):
        self.limit, self.asked = limit, []

    def admit_host(self, gpu_requests, cpu_requests, context):
        self.asked.append((gpu_requests, cpu_requests))
        return cpu_requests < self.limit


def make(device_blocks, host_blocks, policy, **config):
    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BLOCK, dtype=torch.float32)
    kv = KVManager(shape, device_blocks, host_blocks, torch.device("cpu"))
    return Scheduler(ApexConfig(offload="auto", **config), kv, host_policy=policy), kv


def test_the_device_pool_fills_first_and_the_host_takes_only_what_the_policy_admits():
    policy = Policy(limit=2)
    sched, kv = make(4, 40, policy)  # the device pool holds two 30-token requests
    for i in range(6):
        add(sched, i, 20, 10)
    plan = sched.schedule()
    pools = [c.pool for c in plan.chunks]
    assert pools == [DEVICE_POOL, DEVICE_POOL, HOST_POOL, HOST_POOL]
    assert policy.asked[:3] == [(2, 0), (2, 1), (2, 2)]  # asked only once the device pool was full
    drive(sched, kv)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


def test_a_policy_that_never_pays_keeps_the_host_pool_for_parking_only():
    rng = random.Random(3)
    policy = Policy(limit=0)
    sched, kv = make(6, 40, policy, max_num_batched_tokens=64)
    requests = [add(sched, i, rng.randint(5, 40), rng.randint(1, 30)) for i in range(12)]
    plans, _ = drive(sched, kv)
    assert all(c.pool == DEVICE_POOL for plan in plans for c in plan.chunks)
    assert sum(len(plan.parked) for plan in plans) > 0  # evicted requests wait in the host pool, not recomputed
    assert all(r.finish_reason == "length" for r in requests)
    assert kv.num_used(DEVICE_POOL) == kv.num_used(HOST_POOL) == 0


def test_auto_policy_admits_while_the_model_predicts_a_gain_and_measurements_correct_it():
    policy = AutoOffload(PerfModel(profile(cpu_gbps=90)))  # T4-like: the CPU can carry many host requests
    assert policy.admit_host(8, 0, 1024)
    admitted = 0
    while policy.admit_host(8, admitted, 1024):
        admitted += 1
    assert 8 <= admitted <= 64
    predicted = policy.model.predict("overlap", 8, admitted, 1024).step_s
    for _ in range(5):  # the engine measures its host steps five times slower than predicted
        policy.observe(8, admitted, 1024, 5 * predicted)
    assert policy.correction == pytest.approx(5.0)
    assert not policy.admit_host(8, 0, 1024)
    assert policy.step_s(8, 0, 1024) == pytest.approx(policy.model.predict("never", 8, 0, 1024).step_s)
    never = policy.model.predict("never", 8, 0, 1024).step_s
    policy.observe(8, 0, 1024, 1.2 * never)  # GPU-only steps are corrected on their own
    assert policy.never_correction == pytest.approx(1.2) and policy.correction == pytest.approx(5.0)


def test_auto_is_enabled_only_where_some_typical_load_gains():
    t4 = AutoOffload(PerfModel(profile(cpu_gbps=90)))
    h200 = AutoOffload(PerfModel(profile(cpu_gbps=90, gpu_gbps=3000, linear_ms=4.6)))
    args = dict(gpu_tokens=16 * 1024, cpu_tokens=256 * 1024, max_seqs=64, contexts=(256, 1024, 4096))
    assert t4.worth_enabling(**args)
    assert not h200.worth_enabling(**args)
    assert "verdict: never" in "\n".join(h200.explain(16 * 1024, 256 * 1024, 64, 1024))
