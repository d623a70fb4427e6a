"""offload="auto" on a finite batch and online: which requests the staggered pipeline takes (the batch's last,
where they finish sooner there than by waiting; none online), and members moving to the device pool as it frees
room, with HF's tokens throughout."""
import pytest
import torch

from apex_compile import ApexConfig, SamplingParams
from tests.runtime.test_runtime_stagger import MarginPolicy, hf_tokens, sharp_model, staggered


def auto_engine(model, device_blocks=4, **config):
    """The staggered plan run as offload="auto" with a stand-in model whose every verdict is the whole width (on a
    CPU auto builds no pipeline of its own)."""
    apex = staggered(model, width=2, device_blocks=device_blocks, **config)
    engine = apex.engine
    engine.auto_policy = MarginPolicy(rise=2, keep=2, hold=2)
    engine.config.offload = "auto"
    return apex


def test_the_pipeline_takes_a_batchs_last_requests_where_they_pay_and_tokens_equal_hf():
    """A long queue behind a small device pool: the queue's tail enters the pipeline (its wait for the device
    rows is longer than a token per cycle would take), the head waits for the device pool; HF's tokens."""
    torch.manual_seed(2)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in torch.randint(3, 13, (36,)).tolist()]
    reference = hf_tokens(model, prompts, 24)
    apex = auto_engine(model)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [c.token_ids for c in done] == reference
    on_host = [c.index for c in done if c.steps_per_pool["host"]]
    assert on_host and 0 not in on_host  # the first request never waits long enough to pay
    # the pipeline serves the batch's last requests: those it took sit in the queue's back half on average
    assert sum(on_host) / len(on_host) > len(prompts) / 2
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_a_short_batch_never_enters_the_pipeline():
    """Two requests per device row at most: waiting for the device pool is always sooner than a token per
    cycle, so auto runs the batch GPU-only."""
    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 6)]
    apex = auto_engine(model)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert not any(c.steps_per_pool["host"] for c in done)
    assert [c.token_ids for c in done] == hf_tokens(model, prompts, 16)
    apex.close()


def test_pays_rule_compares_the_wait_for_the_device_rows_with_a_token_per_cycle():
    apex = auto_engine(sharp_model())
    scheduler = apex.engine.scheduler
    cycle = apex.engine.stagger.cycle
    assert cycle == 2 * (3 + 1)
    for n in range(12):
        apex.engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=10))
    # nothing runs: the backlog ahead of position p is p requests x 10 tokens over one row
    pays = [scheduler.pipeline_rules.pays(scheduler.waiting[p], p) for p in range(12)]
    assert pays == [10 * cycle <= 10 * p + 10 for p in range(12)]
    assert not pays[0] and pays[-1]
    apex.close()


@pytest.mark.parametrize("lanes", [2, 1])
def test_members_move_to_the_device_pool_as_it_frees_room_keeping_their_tokens(lanes):
    """offload="staggered" puts requests the device pool cannot take into the pipeline; once device requests
    finish, members move there (parked with their host KV, resumed in the device pool), their host blocks freed,
    and every token equals HF's."""
    torch.manual_seed(1)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10, 11, 5, 7)]
    news = [12, 20, 6, 16, 9, 14, 18, 7, 11, 13, 20, 5]
    reference = [hf_tokens(model, [p], n)[0] for p, n in zip(prompts, news)]
    apex = staggered(model, 2, device_blocks=6, lanes=lanes)
    done = apex.engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    assert [c.token_ids for c in done] == reference
    assert apex.engine.stats.migrated > 0
    moved = [c for c in done if c.steps_per_pool["host"] and c.steps_per_pool["device"] and c.num_preemptions]
    assert moved  # decoded in the pipeline, then in the device pool
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    assert not apex.engine.stagger.members() and not apex.engine.stagger.leaving
    apex.close()


def test_the_objective_switches_between_batch_and_online():
    from apex_compile.runtime.async_engine import AsyncEngine

    with pytest.raises(ValueError, match="objective"):
        ApexConfig(objective="throughput")
    apex = auto_engine(sharp_model())
    scheduler = apex.engine.scheduler
    assert scheduler.objective == "makespan"  # generate / stream: a batch judged by its last token
    front = AsyncEngine(apex.engine)
    stream = front.submit([5, 6, 7], SamplingParams(max_new_tokens=2))
    stream.result(timeout=120)
    assert scheduler.objective == "latency"  # arrivals through the front: TTFT and TPOT
    for n in range(12):  # a queue that would pay under the makespan objective enters no pipeline
        apex.engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=10))
    assert scheduler.pipeline_rules.candidate(512) is None
    front.shutdown()
    apex.close()
    latency = auto_engine(sharp_model(), objective="latency")
    assert latency.engine.scheduler.objective == "latency"
    latency.close()


@pytest.mark.parametrize("prompt_tokens", [24, 0])
def test_a_prompt_past_the_step_budget_enters_the_pipeline_whole(prompt_tokens):
    """Prompts longer than max_num_batched_tokens: the pipeline takes one whole in a step (its K/V goes to the
    host pool as that step computes it), up to TuningConfig.pipeline_prompt_tokens; with 0 none enters, and the
    device pool takes them in chunks. HF's tokens either way."""
    from apex_compile.config import TuningConfig

    torch.manual_seed(4)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in torch.randint(17, 23, (24,)).tolist()]
    reference = hf_tokens(model, prompts, 12)
    apex = auto_engine(model, max_num_batched_tokens=16, tuning=TuningConfig(pipeline_prompt_tokens=prompt_tokens))
    scheduler = apex.engine.scheduler
    schedule, host_chunks = scheduler.schedule, []

    def recording():
        out = schedule()
        host_chunks.extend((c.start, c.num_tokens, c.request.num_tokens) for c in out.chunks
                           if c.pool == 1 and c.start == 0)  # a host prompt's first chunk
        return out

    scheduler.schedule = recording
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [c.token_ids for c in done] == reference
    on_host = [c for c in done if c.steps_per_pool["host"]]
    if prompt_tokens:
        assert on_host and host_chunks and all(n == total for _, n, total in host_chunks)
        assert max(n for _, n, _ in host_chunks) > 16  # past the step budget, whole
    else:
        assert not on_host and not host_chunks
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_a_finite_batch_under_auto_never_takes_more_steps_than_gpu_only():
    """Finite batches of random lengths behind a small device pool, counted in engine steps (the makespan on a
    machine where the pipeline's CPU work hides under the GPU's steps): the tail admission and the migrations
    never make the batch longer than GPU-only, the tokens are the same, and the pipeline serves some of them.
    Seeds 3 and 8: batches that moving members to the device pool ahead of waiting requests made longer."""
    import random

    from apex_compile import optimize
    from tests.runtime.test_runtime_stagger import BLOCK_BYTES

    model = sharp_model()
    hosted = 0
    for seed in (3, 8, 6):
        rng = random.Random(seed)
        count = rng.choice([8, 24, 48])
        prompts = [[rng.randrange(3, 96) for _ in range(rng.randrange(3, 13))] for _ in range(count)]
        sampling = [SamplingParams(max_new_tokens=rng.randrange(4, 30)) for _ in range(count)]
        never = optimize(model, ApexConfig(offload="never", gpu_cache_size=4 * BLOCK_BYTES,
                                           cpu_cache_size=128 * BLOCK_BYTES, max_model_len=64))
        expected = [c.token_ids for c in never.engine.generate(prompts, sampling)]
        never_steps = never.engine.stats.steps
        never.close()
        apex = auto_engine(model)
        done = apex.engine.generate(prompts, sampling)
        assert [c.token_ids for c in done] == expected
        assert apex.engine.stats.steps <= never_steps, (seed, apex.engine.stats.steps, never_steps)
        hosted += sum(1 for c in done if c.steps_per_pool["host"])
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
        apex.close()
    assert hosted > 0
