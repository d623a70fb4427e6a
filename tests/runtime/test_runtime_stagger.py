"""The staggered plan on a CPU: end to end against HF generate, the pipeline's rotation, the stagger pass, and
the asynchronous job executor's ordering with fake streams (a slow copy back must never see its buffer
rewritten)."""
import collections
import concurrent.futures
import os
import time

import pytest
import torch

from apex_compile import ApexConfig, SamplingParams, optimize
from apex_compile.config import TuningConfig
from apex_compile.passes import PassReport, PatternError
from apex_compile.passes.partition_attention import partition_attention
from apex_compile.passes.stagger import stagger_rows
from apex_compile.ops.cpu_attention import wait_host_flags
from apex_compile.runtime.stagger import AsyncJobs
from tests.helpers import capture, count_calls, engine_step, tiny_model

LAYERS = 3
BLOCK_BYTES = 2 * LAYERS * 2 * 16 * 16 * 4  # tiny_model: 2 KV heads x 16 dims, fp32, 16-token blocks


def sharp_model(kind="llama"):
    """A tiny random model whose attention is far from uniform, so wrong RoPE rows change its tokens."""
    model = tiny_model(kind, layers=LAYERS)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def hf_tokens(model, prompts, new_tokens):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False)
        out.append(generated[0, len(p):].tolist())
    return out


def staggered(model, width=2, device_blocks=4, lanes=2, **config):
    return optimize(model, ApexConfig(offload="staggered", stagger_width=width, gpu_cache_size=device_blocks
                                      * BLOCK_BYTES, cpu_cache_size=128 * BLOCK_BYTES, max_model_len=64,
                                      stagger_lanes=lanes, **config))


@pytest.mark.parametrize("kind,width,lanes", [("llama", 2, 2), ("qwen2", 1, 2), ("llama", 3, 2), ("llama", 2, 1),
                                              ("qwen2", 3, 1)])
def test_staggered_tokens_equal_hf_generate(kind, width, lanes):
    """Every host request decodes staggered, with two lanes or one (here each turn's CPU job runs whole after
    its step: the one-lane order without the device waits, which tests/runtime/test_runtime_stagger_layered.py
    runs under the Triton interpreter)."""
    torch.manual_seed(1)
    model = sharp_model(kind)
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6)]
    reference = hf_tokens(model, prompts, 10)
    apex = staggered(model, width, lanes=lanes)
    assert apex.engine.stagger.capacity == lanes * (LAYERS + 1) * width
    assert f"per turn of {lanes} lane(s) ({apex.engine.stagger.capacity} in flight)" in apex.offload_decision()
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=10))
    assert [c.token_ids for c in done] == reference
    on_host = [c for c in done if c.steps_per_pool["host"]]
    # every decode of a host-prefilled request staggered (a parked one joins the pipeline after device steps)
    assert len(on_host) >= 3 and all(c.steps_per_pool["host"] == 10 for c in on_host if not c.num_preemptions)
    assert all(sum(c.steps_per_pool.values()) >= 10 for c in on_host)
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    assert not apex.engine.stagger.members()


def test_staggered_tokens_equal_hf_generate_with_a_full_pipeline(monkeypatch):
    """Enough host requests that every group of a lane holds one: the CPU job then attends every layer's rows
    without gathering them (the steady state of a long run)."""
    from apex_compile.runtime.stagger import pipeline as stagger_module

    full_turns = []
    original = stagger_module.host_attention

    def recording(job, query, *args):
        if job is not None:
            full_turns.append(job.rows is None)
        return original(job, query, *args)

    monkeypatch.setattr(stagger_module, "host_attention", recording)
    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10, 5, 11, 4, 6, 9)]
    reference = hf_tokens(model, prompts, 12)
    apex = staggered(model, width=1)
    assert apex.engine.stagger.capacity == 2 * (LAYERS + 1)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [c.token_ids for c in done] == reference
    assert sum(full_turns) >= 10 and not all(full_turns)  # both the whole-block and the gathered path ran
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


class ImmediateCopies:
    """Copies that complete when issued (the order CUDA's one compute stream gives the engine's step): each
    raises its ready counter at once."""

    def __init__(self):
        self.flags = torch.zeros(2, dtype=torch.int64)

    def _raise(self, index):
        self.flags[index] += 1
        return index, int(self.flags[index])

    def stage(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return self._raise(0)

    def restore(self, dst, src):
        dst.copy_(src)
        return self._raise(1)


def test_staggered_tokens_equal_hf_generate_with_the_worker_thread():
    """The CUDA executor's order (a lane's job on the worker thread during the next step, collected at the
    lane's next turn, guarded buffers) in the whole engine, with copies that complete when issued."""
    torch.manual_seed(5)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)]
    reference = hf_tokens(model, prompts, 9)
    apex = staggered(model, width=2)
    apex.engine.stagger.executor = AsyncJobs(ImmediateCopies(), pin_memory=False, threads=1)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=9))
    assert [c.token_ids for c in done] == reference
    assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_a_staggered_step_queues_its_sampling_before_the_pipelines_host_work():
    """The sampled ids' copy goes ahead of end_step's / begin_step's device copies on the stream, so the host
    gets its tokens without waiting for them; and every step's main-thread time is split into its phases."""
    torch.manual_seed(3)
    apex = staggered(sharp_model(), width=2)
    engine = apex.engine
    order = []
    for obj, name in ((engine, "step"), (engine.sampler, "launch"), (engine.stagger, "end_step"),
                      (engine.stagger, "begin_step")):
        original = getattr(obj, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            order.append(_name.upper() if _name == "step" else _name)
            return _original(*args, **kwargs)

        setattr(obj, name, spy)
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)]
    stats_before = dict(engine.stats.phase_seconds)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.token_ids for c in done] == hf_tokens(sharp_model(), prompts, 8)
    steps = [seg.split() for seg in " ".join(order).split("STEP") if seg.strip()]
    sampling = [seg for seg in steps if "launch" in seg and "end_step" in seg]
    assert len(sampling) > 10
    assert all(seg.index("launch") < seg.index("end_step") for seg in sampling)
    spent = {k: v - stats_before[k] for k, v in engine.stats.phase_seconds.items()}
    assert set(spent) == {"schedule", "prepare", "forward", "pipeline", "wait", "finish"}
    assert all(v > 0 for v in spent.values())


def test_engine_close_stops_the_stagger_worker_midway():
    torch.manual_seed(6)
    apex = staggered(sharp_model(), width=2)
    apex.engine.stagger.executor = AsyncJobs(ImmediateCopies(), pin_memory=False, threads=1)
    stream = apex.engine.stream([torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)],
                                SamplingParams(max_new_tokens=30))
    for _, _ in zip(range(20), stream):  # the pipeline holds requests, a CPU job is in flight
        pass
    assert apex.engine.stagger.num_members
    worker = apex.engine.stagger.executor.worker
    threads = list(worker._threads)  # this engine's worker threads (other tests' engines may still hold theirs)
    assert threads and all(t.is_alive() and t.name.startswith("apex-stagger") for t in threads)
    apex.close()
    assert worker._shutdown and not any(t.is_alive() for t in threads)
    list(stream)  # it ends (its requests were cancelled) without stepping the closed engine
    with pytest.raises(RuntimeError, match="engine is closed"):
        apex.engine.step()


def test_closing_a_stream_midway_drops_pipeline_requests():
    torch.manual_seed(2)
    apex = staggered(sharp_model())
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4)]
    stream = apex.engine.stream(prompts, SamplingParams(max_new_tokens=30))
    events = [next(stream) for _ in range(40)]
    stagger = apex.engine.stagger
    assert stagger.active  # requests are in flight in the pipeline
    assert stagger.num_members == len(stagger.members()) > 0  # the kept count equals the groups' contents
    stream.close()
    assert stagger.num_members == 0 and not stagger.active
    assert len(events) == 40
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    assert not apex.engine.stagger.members() and not apex.engine.has_unfinished()
    # the engine serves the next requests normally, with the same tokens as HF
    model = apex.engine.model
    assert [c.token_ids for c in apex.engine.generate(prompts[:3], SamplingParams(max_new_tokens=6))] == \
        hf_tokens(model, prompts[:3], 6)


def test_aborting_one_pipeline_request_writes_nothing_into_its_freed_blocks(monkeypatch):
    """A request cancelled halfway through the layers: its blocks go back to the pool, no later CPU job appends
    into them (its group's metadata is rebuilt), and the others' tokens stay HF's."""
    from apex_compile.runtime.stagger import pipeline as stagger_module
    from apex_compile.runtime.kv_manager import HOST_POOL

    torch.manual_seed(4)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4)]
    reference = hf_tokens(model, prompts, 10)
    apex = staggered(model, width=2)
    engine = apex.engine
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    stagger = engine.stagger

    def middle_member():
        for lane in stagger.lanes:
            for group in lane[1:-1]:
                for r in group.requests:
                    if r is not None:
                        return r
        return None

    for _ in range(200):
        engine.step()
        victim = middle_member()
        if victim is not None and not engine.scheduler.waiting:
            break
    assert victim is not None and not engine.scheduler.waiting
    bs = engine.kv.block_size
    freed = set(engine.kv.tables[victim.request_id].block_ids)
    written, unowned = [], []
    original = stagger_module.stagger_cpu_job

    def recording(staged, key_caches, value_caches, cache_index, block_tables, context_lens, slots, *args):
        # a freed block may go to another request (a parked one joining the pipeline): writes into it are its own
        owned = {b for t in engine.kv.tables.values() if t.pool == HOST_POOL for b in t.block_ids}
        written.extend(int(s) // bs for s in slots)
        unowned.extend(int(s) // bs for s in slots if int(s) // bs not in owned)
        return original(staged, key_caches, value_caches, cache_index, block_tables, context_lens, slots, *args)

    monkeypatch.setattr(stagger_module, "stagger_cpu_job", recording)
    assert engine.abort([victim.request_id]) == 1
    assert stagger.num_members == len(stagger.members())
    while engine.has_unfinished():
        engine.step()
    assert written and not freed & set(unowned)
    kept = [(r, ref) for r, ref in zip(requests, reference) if r is not victim]
    assert [r.output_token_ids for r, _ in kept] == [ref for _, ref in kept]
    assert victim.finish_reason == "abort" and engine.blocks_in_use() == {"device": 0, "host": 0}


def test_pipeline_returns_a_request_after_every_layer():
    """A request joining a lane's group 0 samples when that lane has had num_layers more turns (its token has
    crossed every layer; the two lanes take turns, so 2 * num_layers steps later)."""
    torch.manual_seed(3)
    apex = staggered(sharp_model(), width=1, device_blocks=1)
    engine = apex.engine
    engine.add_request(list(range(3, 23)), SamplingParams(max_new_tokens=2))  # longer than the device pool
    engine.step()  # prefill in the host pool: the first token, then the request joins the pipeline
    (request,) = engine.stagger.joining
    for _ in range(2 * LAYERS):
        assert engine.step() == [] and request in engine.stagger.members()
        assert engine.stagger.num_members == 1 and engine.stagger.active
    assert engine.step() == [request] and request.is_finished and len(request.output_token_ids) == 2
    assert not engine.has_unfinished() and engine.stagger.num_members == 0 and not engine.stagger.active


def test_host_rows_are_the_lanes_mean_group_size_not_rounded():
    """StaggerPipeline.host_rows (what auto's gap samples and e2e_hybrid's step records price the CPU job by): the
    mean size of the current lane's groups, a fraction while one request crosses the layers, 0 with none."""
    torch.manual_seed(3)
    engine = staggered(sharp_model(), width=1, device_blocks=1).engine
    assert engine.stagger.host_rows == 0.0
    engine.add_request(list(range(3, 23)), SamplingParams(max_new_tokens=2))  # longer than the device pool
    engine.step()  # the host prefill; then the request joins a lane's group 0
    seen = []
    while engine.has_unfinished():
        lane = engine.stagger.groups
        seen.append(engine.stagger.host_rows)
        assert seen[-1] == sum(g.size for g in lane) / len(lane)
        engine.step()
    assert set(seen) == {0.0, 1 / (LAYERS + 1)}  # its lane's turns, and the other lane's
    assert engine.stagger.host_rows == 0.0


def test_row_limit_keeps_the_cpu_job_within_a_step():
    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    assert rows.update(576) == 8  # nothing measured yet: every row
    rows.observe_job(4.0e-3, work=32 * 4 * 576)  # four rows of 576 tokens at every layer: 1 ms a row
    rows.observe_step(6.0e-3)
    assert rows.update(576) == int(TuningConfig().job_share * 6.0 / 1.0) == 5
    assert rows.update(2 * 576) == 2  # twice the context, half the rows
    for _ in range(40):  # the CPU gets 3x slower: the average follows, the limit drops to one row
        rows.observe_job(3 * 4.0e-3, work=32 * 4 * 576)
    assert rows.update(576) == 1
    fixed = RowLimit(width=4, num_layers=32, adaptive=False)
    fixed.observe_job(1.0, work=1)
    fixed.observe_step(1e-3)
    assert fixed.update(576) == 4


def test_a_row_limit_caps_each_group_and_the_tokens_stay_hf_equal():
    """Fewer rows in use than the block has (as an adaptive pipeline chooses): each group takes at most that
    many requests, the pipeline admits that many fewer, and the tokens are still HF's."""
    torch.manual_seed(6)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)]
    reference = hf_tokens(model, prompts, 8)
    apex = staggered(model, width=3)
    stagger = apex.engine.stagger
    stagger.rows.set_ceiling(1)
    assert stagger.capacity == 2 * (LAYERS + 1)
    most, tokens = 0, [[] for _ in prompts]
    for event in apex.engine.stream(prompts, SamplingParams(max_new_tokens=8)):
        tokens[event.index].append(event.token_id)
        most = max([most] + [sum(r is not None for r in g.requests) for lane in stagger.lanes for g in lane])
    assert most == 1 and tokens == reference
    assert apex.engine.stats.requests_per_pool[1] >= 3  # requests that ran in the host pool
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_a_row_limit_keeps_the_fraction_of_a_row_the_job_fits():
    """A job that fits 4.6 rows a step runs 4.6 on average: the groups of a cycle take 4 or 5 rows in turn
    (floor or ceiling), so the job's work per step stays even; a waiting GPU takes the fraction away first; a
    model ceiling below the measured rows caps them."""
    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(4 * 1.0e-3, work=32 * 4 * 576)  # 1 ms a row of 576 tokens
    rows.observe_step(4.6e-3 / TuningConfig().job_share)
    assert rows.update(576) == 4 and rows.share() == pytest.approx(4.6)
    cycle = [rows.turn_rows(slot) for slot in range(33)]
    assert set(cycle) == {4, 5} and sum(cycle) == rows.capacity_rows(33) == int(33 * 4.6)
    for start in range(33):  # any 33 consecutive turns (as the job sees them, one group per layer) hold as many
        assert sum(cycle[(start + i) % 33] for i in range(33)) == sum(cycle)
    assert max(sum(cycle[s:s + 5]) for s in range(29)) - min(sum(cycle[s:s + 5]) for s in range(29)) <= 1
    rows.set_ceiling(3)  # the model below the measured rows: its ceiling, whole
    assert rows.share() == 3 and {rows.turn_rows(slot) for slot in range(33)} == {3}
    rows.set_ceiling(4)  # the model takes every whole row it was offered: the fraction stays
    assert rows.share() == pytest.approx(4.6)
    for _ in range(3):  # the GPU waits for the job: the first cut takes the fraction, not a whole row more
        rows.observe_step(4.6e-3 / TuningConfig().job_share, waited=1e-3)
    assert rows.guard == 4 and rows.update(576) == 4 and rows.share() == 4
    whole = RowLimit(width=8, num_layers=32, adaptive=False)
    assert whole.share() == 8 and {whole.turn_rows(slot) for slot in range(33)} == {8}


def test_groups_share_a_fractional_row_limit_and_the_tokens_stay_hf_equal():
    """1.5 rows a turn in a 3-row block: the groups hold 1 or 2 requests in turn, the pipeline admits 49 per
    lane, and the tokens are HF's."""
    torch.manual_seed(12)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8)]
    reference = hf_tokens(model, prompts, 8)
    apex = staggered(model, width=3)
    stagger = apex.engine.stagger
    stagger.rows.fraction, stagger.rows.measured, stagger.rows.limit = 1.5, 1, 1  # (a fixed pipeline keeps them)
    assert stagger.capacity == 2 * ((LAYERS + 1) * 3 // 2)
    sizes, tokens = set(), [[] for _ in prompts]
    for event in apex.engine.stream(prompts, SamplingParams(max_new_tokens=8)):
        tokens[event.index].append(event.token_id)
        sizes.update(sum(r is not None for r in g.requests) for lane in stagger.lanes for g in lane)
    assert max(sizes) == 2 and tokens == reference
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_the_row_limit_separates_the_jobs_fixed_cost_from_its_rows():
    """Jobs of a filling pipeline (1..8 rows) that cost 3.2 ms plus 0.36 ms a row: the fit finds both, so the
    limit is the rows that fit after the fixed part (a per-work average of the same jobs would allow 3)."""
    from apex_compile.runtime.stagger import RowLimit

    work_per_row = 32 * 576
    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    for used in (1, 2, 3, 4, 5, 6, 7, 8, 8, 8):
        rows.observe_job(3.2e-3 + 0.36e-3 * used, work=used * work_per_row)
    rows.observe_step(6.0e-3)
    assert rows.fixed == pytest.approx(3.2e-3, rel=1e-6)
    assert rows.rate * work_per_row == pytest.approx(0.36e-3, rel=1e-6)
    assert rows.update(576) == int((TuningConfig().job_share * 6.0 - 3.2) / 0.36) == 6
    # the same jobs read as a per-work rate: 6.08 ms for 8 rows, 0.76 ms a row, 7 rows (the fixed part would
    # count once per row); with the jobs of one row only, 3.56 ms a row: 1
    # jobs whose time grows faster than their work (a fill's contention): never a negative fixed part
    steep = RowLimit(width=8, num_layers=32, adaptive=True)
    for used in (2, 4, 6, 8):
        steep.observe_job(-1e-3 + 1e-3 * used, work=used * work_per_row)
    steep.observe_step(6.0e-3)
    assert steep.fixed == 0.0 and steep.update(576) >= int(TuningConfig().job_share * 6.0 / 1.0) - 1
    averaged = RowLimit(width=8, num_layers=32, adaptive=True)
    averaged.observe_job(3.2e-3 + 0.36e-3, work=work_per_row)
    averaged.observe_step(6.0e-3)
    assert averaged.update(576) == 1


def test_the_profiled_cpu_rate_bounds_the_job_fit():
    """Session 18's collapse: the few jobs of a pipeline that filled briefly and drained, mostly per-call costs,
    read as 3.2 ms a row (the profile: 0.71 ms), so the rows fell to 1-2 and the model's ceiling to 0 for good.
    With the profiled rate the fit stays within PRIOR_SPREAD of it both ways."""
    from apex_compile.runtime.stagger import PRIOR_SPREAD, RowLimit

    context, layers = 600, 32
    prior = 4096 / 111e9  # seconds per (layer, context token): 4 KiB of K/V per token and layer at 111 GB/s
    per_row = prior * layers * context  # 0.71 ms
    for kind in ("unbounded", "bounded"):
        rows = RowLimit(width=8, num_layers=layers, adaptive=True, prior_rate=prior if kind == "bounded" else None)
        for used_layers in (2, 3, 4, 3, 2, 1):  # small jobs: a row at a few layers, 0.5-0.8 ms each
            rows.observe_job(0.4e-3 + 0.1e-3 * used_layers, work=used_layers * context)
        rows.observe_step(6.1e-3)
        limit = rows.update(context)
        if kind == "unbounded":
            assert limit <= 2  # the collapse the bound prevents
        else:
            assert rows.rate == pytest.approx(PRIOR_SPREAD * prior)
            assert limit == int((TuningConfig().job_share * 6.1e-3 - rows.fixed) / (PRIOR_SPREAD * per_row)) >= 4
    # a flat fit that would read the CPU as nearly free: the rate is at least prior / PRIOR_SPREAD, so the
    # fixed part is what the jobs' time leaves beyond that (not the whole job)
    flat = RowLimit(width=8, num_layers=layers, adaptive=True, prior_rate=prior)
    for used in (3, 3, 4, 3, 3, 4, 3):
        flat.observe_job(2.08e-3 + 0.15e-3 * used, work=used * layers * context)
    assert flat.rate == pytest.approx(prior / PRIOR_SPREAD)
    assert flat.fixed < 2.08e-3 - 0.5e-3


def test_auto_gives_its_pipeline_the_profiled_cpu_rate():
    """offload="auto"'s adaptive pipeline bounds its job fit by the profile's CPU rate per (layer, token);
    a pipeline without a performance model has no bound."""
    apex = staggered(sharp_model(), width="auto")
    engine = apex.engine
    assert engine.stagger.rows.prior_rate is None

    class Model:
        def cpu_seconds_per_token(self):
            return 2e-6

    engine.auto_policy = type("Policy", (), {"model": Model()})()
    pipeline = engine.plan.make_pipeline("auto")
    assert pipeline.rows.prior_rate == pytest.approx(2e-6 / LAYERS)
    pipeline.close()
    apex.close()


def test_rows_are_taken_away_while_the_gpu_waits_for_the_cpu_job():
    """A fit that flatters the CPU (its jobs ran faster than the jobs now do): the steps show the launching
    thread waiting for the job, so the guard takes a row, then lets one cycle of waits pass (the job shrinks only
    as the groups re-enter under the new limit), until the waits stop; a row comes back only after REGROW_STEPS
    calm steps. Taking a row per waiting step collapsed the rows to 1 before the first cut took effect."""
    from apex_compile.runtime.stagger import REGROW_STEPS, RowLimit

    work_per_row = 32 * 576
    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    assert rows.cycle == 33
    for used in (2, 4, 6, 8):
        rows.observe_job(0.5e-3 * used, work=used * work_per_row)  # 0.5 ms a row: 8 rows fit a 6 ms step
    rows.observe_step(6e-3)
    assert rows.update(576) == 8
    entered = collections.deque([8] * rows.cycle, maxlen=rows.cycle)  # each group's rows, set as it entered
    seen = []
    for _ in range(12 * rows.cycle):  # the job now takes 1.2 ms a row: the GPU waits while it holds > 5 rows
        waited = max(1.2e-3 * sum(entered) / len(entered) - 6e-3, 0.0)
        rows.observe_step(6e-3, waited)
        seen.append(rows.update(576))
        entered.append(seen[-1])
    assert seen[:rows.cycle] == [7] * rows.cycle  # one row, then a cycle for it to take effect
    assert min(seen) == 5 and set(seen[-4 * rows.cycle:]) <= {5, 6}  # 5 rows of 1.2 ms fit; 6 is a retry
    calm = RowLimit(width=8, num_layers=32, adaptive=True)
    calm.observe_job(0.5e-3 * 8, work=8 * work_per_row)
    calm.observe_step(6e-3)
    calm.observe_step(6e-3, 3e-3)
    assert calm.update(576) == 7
    for _ in range(REGROW_STEPS - 1):
        calm.observe_step(6e-3, 0.0)
    assert calm.update(576) == 7
    calm.observe_step(6e-3, 0.0)
    assert calm.update(576) == 8  # a row comes back to try again


def test_a_draining_pipeline_does_not_win_back_the_rows_that_made_the_gpu_wait():
    """Calm steps count towards a row back only while the job's groups hold the guard's rows: a pipeline that
    drains (auto's ceiling fell to 0) after the guard's cut makes no wait at its fewer rows, and regrowing on
    them would refill it at the rows that had failed; steps at the guard's rows do regrow it."""
    from apex_compile.runtime.stagger import REGROW_STEPS, RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(0.5e-3 * 8, work=8 * 32 * 576)
    rows.observe_step(6e-3, in_use=8)
    rows.observe_step(6e-3, 3e-3, in_use=8)
    assert rows.guard == 7
    for in_use in [3.0] * (4 * REGROW_STEPS) + [0.0] * REGROW_STEPS:  # draining: fewer rows, no wait
        rows.observe_step(6e-3, 0.0, in_use=in_use)
    assert rows.guard == 7 and rows.update(576) == 7
    for _ in range(REGROW_STEPS):  # the guard's rows held, no wait: one comes back
        rows.observe_step(6e-3, 0.0, in_use=6.8)
    assert rows.guard == 8 and rows.update(576) == 8


def test_steps_with_prompt_chunks_do_not_widen_the_decode_steps_budget():
    """A filling pipeline's steps carry prompts (tens of ms each): their length stays out of the step average,
    so the rows admitted during the fill are those a decode step fits; nor do their waits cut the guard (the job
    then also waits for the prompts' K/V export, which its rows do not cost)."""
    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(4.0e-3, work=32 * 4 * 576)  # 1 ms a row
    rows.observe_step(6.0e-3)
    for _ in range(20):
        rows.observe_step(60e-3, decode=False)
    assert rows.step == pytest.approx(6.0e-3) and rows.update(576) == int(TuningConfig().job_share * 6.0 / 1.0) == 5
    mixed = RowLimit(width=8, num_layers=32, adaptive=True)  # the old average: every step counted
    mixed.observe_job(4.0e-3, work=32 * 4 * 576)
    mixed.observe_step(6.0e-3)
    for _ in range(20):
        mixed.observe_step(60e-3)
    assert mixed.update(576) == 8
    for _ in range(3):  # prompt steps that waited for the job: the guard keeps its rows
        rows.observe_step(60e-3, waited=10e-3, decode=False)
    assert rows.guard == 8
    for _ in range(3):  # decode steps that wait: it does not
        rows.observe_step(6e-3, waited=3e-3)
    assert rows.guard < 8


def test_jobs_beside_prompt_steps_stay_out_of_the_job_fit(monkeypatch):
    """A job of a turn with prompt chunks (its step's, or one of the two before) ran beside their K/V export
    into the host cache: the fit leaves it out, as the step average leaves out its step; decode turns' jobs go
    in. Read as the CPU's rate, such jobs collapsed the rows as a pipeline filled."""
    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(3.8e-3, work=32 * 4 * 576, decode=False)
    assert rows.rate is None and rows._moments is None
    rows.observe_job(3.8e-3, work=32 * 4 * 576)
    assert rows.rate == pytest.approx(3.8e-3 / (32 * 4 * 576))
    seen = []
    observe = RowLimit.observe_job
    monkeypatch.setattr(RowLimit, "observe_job",
                        lambda self, seconds, work, decode=True: seen.append(decode) or observe(self, seconds, work,
                                                                                               decode))
    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8, 10, 12)]
    apex = staggered(model, width=2)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [c.token_ids for c in done] == hf_tokens(model, prompts, 16)
    assert True in seen and False in seen  # prompts were admitted while the pipeline ran, and it decoded alone
    apex.close()


def test_jobs_and_steps_beside_lagging_exports_stay_out_of_the_fit(monkeypatch):
    """A fill's prompt K/V reach the host cache in the background, many turns after their prompt steps: a job
    launched while exports are still queued, and the step it ran beside, measure the exports' contention, so
    the job fit and the step average leave them out (on a CPU the exports land at once: here they are reported
    still queued for a stretch of decode turns)."""
    import concurrent.futures

    from apex_compile.runtime.stagger import RowLimit

    jobs, steps = [], []
    observe_job, observe_step = RowLimit.observe_job, RowLimit.observe_step
    monkeypatch.setattr(RowLimit, "observe_job", lambda self, seconds, work, decode=True: jobs.append(decode)
                        or observe_job(self, seconds, work, decode))
    monkeypatch.setattr(RowLimit, "observe_step", lambda self, seconds, waited=0.0, decode=True, in_use=None: (
        steps.append(decode) or observe_step(self, seconds, waited, decode, in_use)))
    torch.manual_seed(5)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9)]
    apex = staggered(model, width="auto")
    engine = apex.engine
    landed = concurrent.futures.Future()
    landed.set_result(None)
    lagging = {"on": False}
    queued = engine.runner.exports.queued
    engine.runner.exports.queued = lambda: [landed] if lagging["on"] else queued()
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    while engine.has_unfinished() and not engine.stagger.active:
        engine.step()
    for _ in range(6):  # decode turns with no prompt step near: measured
        engine.step()
    before = (len(jobs), len(steps))
    assert all(jobs[-2:]) and all(steps[-2:])
    lagging["on"] = True
    for _ in range(6):
        engine.step()
    assert jobs[before[0]:] and not any(jobs[before[0]:])
    assert steps[before[1] + 1:] and not any(steps[before[1] + 1:])  # the step after each such launch
    lagging["on"] = False
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == hf_tokens(model, prompts, 24)
    apex.close()


def test_the_engine_tells_the_pipeline_which_steps_carry_prompts(monkeypatch):
    """Every step with a prompt chunk (in either pool, the pipeline active or not) is noted, and no decode-only
    step is: the row limit's decode-step measures depend on it."""
    from apex_compile.runtime.stagger import StaggerPipeline

    noted = []
    monkeypatch.setattr(StaggerPipeline, "note_prompt_step", lambda self: noted.append(self.steps))
    apex = staggered(sharp_model(), width=2)
    engine = apex.engine
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22]]
    launched = []
    launch = engine._launch
    monkeypatch.setattr(engine, "_launch", lambda chunks: launched.append(
        any(not (c.num_tokens == 1 and c.start) for c in chunks)) or launch(chunks))
    engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert sum(launched) == len(noted) > 0 and not all(launched)
    apex.close()


def test_an_empty_pipeline_probes_its_rows_again_after_a_hold():
    """Rows that collapsed (the guard at 1, auto's ceiling then 0, the pipeline emptied) would never come back: with no
    job, nothing updates the limits. After IDLE_HOLD steps without a member the evidence behind the measured rows
    (guard, job fit) is dropped and one row more is allowed (auto's model then decides). The hold doubles after each
    probe, up to MAX_IDLE_HOLD; a fit that alone holds the rows down (a fill's contention in its jobs) is dropped
    too; measured rows at the width are no probe."""
    from apex_compile.runtime.stagger import IDLE_HOLD, MAX_IDLE_HOLD, REGROW_STEPS, RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(4.0e-3, work=32 * 4 * 576)  # 1 ms a row: 5 rows fit a 6 ms step
    rows.observe_step(6.0e-3)
    assert rows.update(576) == 5
    for _ in range(8 * rows.cycle):  # the launching thread waits for the job: the guard falls to one row
        rows.observe_step(6.0e-3, waited=3e-3)
    assert rows.update(576) == 1 and rows.guard == 1
    rows.set_ceiling(0)  # auto: one row does not pay
    for _ in range(IDLE_HOLD - 1):
        rows.idle_step()
    assert rows.guard == 1 and rows.update(0) == 0 and rows.measured == 1
    rows.idle_step()
    assert rows.probes == 1 and rows.guard == rows.measured == 2 and rows.rate is None
    assert rows.idle_hold == 2 * IDLE_HOLD and rows.limit == 0  # the ceiling is the model's to raise
    rows.observe_job(4.0e-3, work=32 * 4 * 576)  # the probe's jobs: the rows follow them, within the guard
    rows.observe_step(6.0e-3)
    rows.update(576)
    assert rows.measured == 2 < int(TuningConfig().job_share * 6.0 / 1.0) == 5
    for _ in range(3 * REGROW_STEPS):  # calm decode steps: the guard regrows to what the fit allows
        rows.observe_step(6.0e-3)
    rows.update(576)
    assert rows.measured == 5
    for _ in range(8 * rows.cycle):  # the job slows down: the guard takes the rows back to 1
        rows.observe_step(6.0e-3, waited=3e-3)
    rows.update(576)
    assert rows.measured == 1
    for _ in range(2 * IDLE_HOLD - 1):  # emptied again: the next probe waits twice as long
        rows.idle_step()
    assert rows.probes == 1
    rows.idle_step()
    assert rows.probes == 2 and rows.idle_hold == 4 * IDLE_HOLD and rows.measured == 2
    rows.observe_job(4.0e-3, work=32 * 4 * 576)
    rows.observe_step(6.0e-3)
    rows.update(576)
    rows.idle_hold = MAX_IDLE_HOLD
    for _ in range(MAX_IDLE_HOLD):
        rows.idle_step()
    assert rows.probes == 3 and rows.idle_hold == MAX_IDLE_HOLD  # capped
    stale = RowLimit(width=8, num_layers=32, adaptive=True)  # a fit with a large fixed part, the guard at 8
    for used in (2, 4, 6):
        stale.observe_job(3.6e-3 + 1.7e-3 * used, work=used * 32 * 576)
    stale.observe_step(5.5e-3)
    stale.update(576)
    assert stale.measured == 1 and stale.guard == 8
    for _ in range(IDLE_HOLD):
        stale.idle_step()
    assert stale.probes == 1 and stale.measured == 2 and stale.rate is None
    calm = RowLimit(width=8, num_layers=32, adaptive=True)
    for _ in range(2 * IDLE_HOLD):
        calm.idle_step()
    assert calm.probes == 0 and calm.idle_hold == IDLE_HOLD


class StubPolicy:
    """The parts of auto's policy a test's stand-in does not replace: a host gap that learns nothing."""

    def __init__(self):
        from apex_compile.runtime.perf_model import HostGap

        self.gap = HostGap()
        self.fits = []  # the pipeline's job fits the engine handed over (`AutoOffload.learn_cpu_job`)

    def observe_staggered(self, gpu_requests, cpu_rows, context, measured_s, job_s=None, host_context=None):
        pass

    def learn_cpu_job(self, fit):
        self.fits.append(fit)


def test_auto_refills_a_pipeline_its_ceiling_emptied_after_the_probe(monkeypatch):
    """offload="auto" end to end: rows collapsed to 1 (which does not pay), so the ceiling is 0, the pipeline empties
    and its requests are parked; once it has been empty for the hold, the probe drops the rows' stale evidence and
    allows one row more, the model (here: pays from 2 rows) raises the ceiling, and requests arriving later decode
    staggered again. Every request gets HF's tokens."""
    from apex_compile.runtime.plans import staggered as staggered_module

    torch.manual_seed(12)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8, 10, 12, 6, 9, 5, 7)]
    reference = hf_tokens(model, prompts, 24)
    apex = staggered(model, width="auto")
    engine, stagger = apex.engine, apex.engine.stagger

    class Policy(StubPolicy):
        def stagger_rows(self, gpu_requests, context, width, keep=False, host_context=None, hold=False):
            return width if width >= 2 else 0

    engine.auto_policy = Policy()
    engine.config.offload = "auto"  # the ceiling comes from the policy each step
    stagger.rows.guard = stagger.rows.measured = 1  # collapsed
    stagger.rows.idle_hold = 6
    monkeypatch.setattr(staggered_module, "STAGGER_RISE_STEPS", 4)
    monkeypatch.setattr(staggered_module, "STAGGER_FALL_STEPS", 4)
    sampling = SamplingParams(max_new_tokens=24)
    requests = [engine.add_request(p, sampling) for p in prompts[:8]]
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append((stagger.rows.probes, stagger.rows.ceiling, stagger.active))
        if stagger.rows.probes and len(requests) < len(prompts):  # later arrivals, after the probe
            requests += [engine.add_request(p, sampling) for p in prompts[8:]]
    # the ceiling at 0 emptied the pipeline before any probe; after the probe it is staggered again
    assert any(ceiling == 0 and not active and not probes for probes, ceiling, active in seen)
    after = [(ceiling, active) for probes, ceiling, active in seen if probes]
    assert after and max(c for c, _ in after) >= 2 and any(a for _, a in after)
    assert any(r.steps_per_pool[1] for r in requests[8:])  # the later arrivals decoded from the host pool
    # each verdict was given the pipeline's job fit once its jobs had run (none before, none after the probe's reset)
    fits = engine.auto_policy.fits
    assert fits[0] is None and any(f is not None and f[1] > 0 for f in fits)
    assert [r.output_token_ids for r in requests] == reference
    assert engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_the_row_limit_reads_its_job_fit_as_seconds_for_any_rows():
    """`RowLimit.job_seconds`: None before a fit; then the fit's fixed part plus the rows' work at the last mean
    context (what a step the job bounds is predicted by when auto learns its host gap)."""
    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=4, adaptive=True)
    assert rows.job_seconds(3) is None
    for n in (1, 2, 3, 4, 2, 3):  # jobs of n rows x 4 layers x 100 tokens: 1 ms + 0.5 ms a row
        rows.observe_job(1e-3 + n * 0.5e-3, n * 4 * 100)
    rows.update(100.0)
    assert rows.job_seconds(3) == pytest.approx(1e-3 + 3 * 0.5e-3, rel=1e-6)
    assert rows.job_seconds(6) == pytest.approx(1e-3 + 6 * 0.5e-3, rel=1e-6)


def test_auto_learns_the_host_gap_from_its_decode_steps_only(monkeypatch):
    """offload="auto" with the staggered plan: every step() that only decodes (no prompt chunk, no graph
    captured, no prompt turn or export beside the pipeline) reports its device rows, the block's host rows, the
    mean context and its wall time to the policy's host gap; prompt steps report nothing."""
    from apex_compile.runtime.perf_model import HostGap

    torch.manual_seed(5)
    apex = staggered(sharp_model(), width="auto")
    engine = apex.engine
    seen, prompt_steps, call, hosts = [], set(), [0], []

    class Policy:
        gap = HostGap()

        def stagger_rows(self, gpu_requests, context, width, keep=False, host_context=None, hold=False):
            return width

        def learn_cpu_job(self, fit):
            pass

        def observe_staggered(self, gpu_requests, cpu_rows, context, measured_s, job_s=None, host_context=None):
            seen.append((call[0], gpu_requests, cpu_rows, context, measured_s))
            hosts.append((cpu_rows, host_context))

    engine.auto_policy = Policy()
    engine.config.offload = "auto"
    # the pipeline takes every request the device pool cannot (this test is about what the steps report)
    monkeypatch.setattr(type(engine.scheduler.pipeline_rules), "pays", lambda self, request, position: True)
    schedule = engine._schedule

    def spy():
        chunks = schedule()
        if any(not c.decodes for c in chunks):
            prompt_steps.add(call[0])
        return chunks

    engine._schedule = spy
    sampling = SamplingParams(max_new_tokens=12)
    for n in (6, 9, 4, 7, 5, 8):
        engine.add_request(torch.randint(3, 96, (n,)).tolist(), sampling)
    while engine.has_unfinished():
        call[0] += 1
        if call[0] in (5, 9):  # prompts arriving while others decode
            engine.add_request(torch.randint(3, 96, (7,)).tolist(), sampling)
        engine.step()
    assert seen and len(prompt_steps) >= 3
    assert not {step for step, *_ in seen} & set(prompt_steps)
    assert any(rows for _, _, rows, _, _ in seen)  # steps with host rows in the block were measured
    assert all(seconds > 0 and context >= 1 and gpu >= 0 for _, gpu, _, context, seconds in seen)
    # steps with host rows are priced at the job's rows' own context (the pipeline's, not the device rows')
    assert all(host is not None and host >= 1 for rows, host in hosts if rows)
    # an idle pipeline keeps its last prompt turns (nothing counts them down): GPU-only steps are still measured
    engine.add_request(torch.randint(3, 96, (5,)).tolist(), sampling)
    engine.step()
    engine.stagger._prompt_turns = 3
    assert not engine.stagger.active and engine.plan.gap_sample() is not None
    apex.close()


def test_a_ceiling_of_zero_admits_nothing_and_parks_the_pipelines_requests(monkeypatch):
    """offload="auto"'s model may set the rows to 0 (no gain beside the running device requests): the
    pipeline's capacity is 0, so nothing more enters the host pool, and requests admitted before leave it as
    they sample, parked with their host KV, to resume in the device pool; either way the tokens are HF's."""
    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
    from apex_compile.runtime.plans.pipeline_rules import PipelineRules

    from apex_compile.runtime.stagger import RowLimit

    rows = RowLimit(width=8, num_layers=32, adaptive=True)
    rows.observe_job(4.0e-3, work=32 * 4 * 576)
    rows.observe_step(6.0e-3)
    rows.set_ceiling(3)
    assert rows.update(576) == 3 and rows.measured == 5  # the lower of the model's and the measured rows
    rows.set_ceiling(0)
    assert rows.update(576) == 0
    torch.manual_seed(8)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)]
    reference = hf_tokens(model, prompts, 8)
    apex = staggered(model, width=3)
    apex.engine.stagger.rows.set_ceiling(0)
    assert apex.engine.stagger.capacity == 0
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.token_ids for c in done] == reference
    assert apex.engine.stats.requests_per_pool[1] == 0  # nothing decoded from the host pool
    parked = []
    park = PipelineRules.park
    monkeypatch.setattr(PipelineRules, "park", lambda self, r: parked.append(r) or park(self, r))
    apex = staggered(model, width=3)
    stagger = apex.engine.stagger
    stagger.rows.set_ceiling(1)  # one row per turn: admitted requests queue to join
    tokens, cut = [[] for _ in prompts], False
    for event in apex.engine.stream(prompts, SamplingParams(max_new_tokens=8)):
        tokens[event.index].append(event.token_id)
        if not cut and stagger.joining and stagger.inside:  # requests inside and waiting to join
            stagger.rows.set_ceiling(0)
            cut = True
    assert cut and tokens == reference
    assert parked and all(r.steps_per_pool[HOST_POOL] and r.steps_per_pool[DEVICE_POOL] for r in parked)
    # each left by the fall (counted as emptied) or, once no request waits, moved to the device pool (migrated)
    stats = apex.engine.stats
    assert stats.emptied >= 1 and stats.emptied + stats.migrated == len(parked)
    assert not stagger.members() and apex.engine.blocks_in_use() == {"device": 0, "host": 0}


@pytest.mark.parametrize("overlap", [False, True])
def test_parked_requests_join_the_pipeline_when_it_takes_them(monkeypatch, overlap):
    """Requests parked from the device pool (their KV in the host pool, their last token sampled) join the
    staggered pipeline once it has rows for them, rather than only waiting for the device pool: a pipeline
    emptied by auto's ceiling refills once every request was admitted. Tokens are HF's, no block is lost. With
    overlapped moves (a stand-in swap stream whose copies land late) a request joins only once its park has
    landed (`KVManager.landed`, before a CPU job reads its host blocks), and the join never waits for a copy."""
    from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
    from apex_compile.runtime.plans.pipeline_rules import PipelineRules
    from tests.helpers import DeferredSwap

    torch.manual_seed(10)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8)]
    reference = hf_tokens(model, prompts, 12)
    joined = []
    join = PipelineRules.join_parked
    monkeypatch.setattr(PipelineRules, "join_parked", lambda self: joined.extend(join(self)) or joined)
    apex = staggered(model, width=2)
    engine, stagger = apex.engine, apex.engine.stagger
    ready, waited = [], []
    if overlap:
        engine.kv._swap = DeferredSwap(delay=3)
        landed = engine.kv.landed
        engine.kv.landed = lambda request_id: landed(request_id) and not ready.append(request_id)
        host_ready = engine.kv.host_ready
        engine.kv.host_ready = lambda request_id: (waited.append(request_id), host_ready(request_id))
    stagger.rows.set_ceiling(0)  # nothing enters the pipeline: the device pool's evictions are parked
    tokens, opened = [[] for _ in prompts], False
    for event in engine.stream(prompts, SamplingParams(max_new_tokens=12)):
        tokens[event.index].append(event.token_id)
        if not opened and engine.scheduler.parked:
            assert not joined
            stagger.rows.set_ceiling(2)
            opened = True
    assert opened and joined and tokens == reference
    assert all(r.num_preemptions and r.steps_per_pool[DEVICE_POOL] and r.steps_per_pool[HOST_POOL] for r in joined)
    assert not overlap or ({r.request_id for r in joined} <= set(ready) and not waited)
    assert not stagger.members() and engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_a_fallen_row_limit_sends_requests_beyond_it_back_to_wait():
    """When the limit falls below the rows in use (the CPU job fell behind, or the model's ceiling dropped to 1),
    the requests beyond it leave the pipeline at their next turn and wait first in line to rejoin (their blocks
    kept), so the CPU job shrinks at once instead of after their whole generation; one row goes on, so every
    request finishes, with HF's tokens (a ceiling of 0 empties the pipeline: the test above)."""
    torch.manual_seed(9)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8, 10)]
    reference = hf_tokens(model, prompts, 12)
    apex = staggered(model, width=3)
    stagger = apex.engine.stagger
    tokens, cut, most_after = [[] for _ in prompts], None, 0
    for step, event in enumerate(apex.engine.stream(prompts, SamplingParams(max_new_tokens=12))):
        tokens[event.index].append(event.token_id)
        in_use = max(sum(r is not None for r in g.requests) for lane in stagger.lanes for g in lane)
        if cut is None and in_use >= 2:
            stagger.rows.set_ceiling(1)
            cut = stagger.steps
        elif cut is not None and stagger.steps > cut + 2 * (LAYERS + 1):  # every group of both lanes had its turn
            most_after = max(most_after, in_use)
    assert cut is not None and stagger.evicted > 0 and most_after == 1
    assert tokens == reference
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_auto_ceiling_is_chosen_among_the_rows_the_cpu_job_fits(monkeypatch):
    """offload="auto": the model's rows are chosen among those the measured job fits, so a plan whose job fits
    fewer rows than its overhead needs to pay gets a ceiling of 0 (no request enters the pipeline), where the
    model alone would have asked for more rows than the CPU can serve. From 0 the ceiling rises only after the
    verdict held STAGGER_RISE_STEPS steps (a flickering verdict paid host prefills only to park them again)."""
    from apex_compile.runtime.plans.staggered import STAGGER_FALL_STEPS, STAGGER_RISE_STEPS

    apex = staggered(sharp_model(), width="auto")
    engine, stagger = apex.engine, apex.engine.stagger
    asked = []

    class Policy(StubPolicy):  # pays from 3 rows on (the plan's overhead needs them)
        def stagger_rows(self, gpu_requests, context, width, keep=False, host_context=None, hold=False):
            asked.append(width)
            return width if width >= 3 else 0

    engine.auto_policy = Policy()
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.scheduler.schedule()  # a running request: the ceiling is computed beside it
    engine.plan.update_ceiling()
    assert asked[-1] == stagger.width == TuningConfig().auto_stagger_width and stagger.rows.ceiling == stagger.width  # every row
    stagger.rows.measured = 2
    engine.plan.update_ceiling()
    assert asked[-1] == 2 and stagger.rows.ceiling == 0 and stagger.rows.update(0) == 0
    stagger.rows.measured = 5  # the verdict rises from 0 only once it held STAGGER_RISE_STEPS steps
    for _ in range(STAGGER_RISE_STEPS - 1):
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 0
    engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 5
    stagger.rows.measured = 2  # falling needs no wait
    engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 0
    stagger.rows.measured = 5  # a flicker shorter than the hold never raises it
    for _ in range(STAGGER_RISE_STEPS // 2):
        engine.plan.update_ceiling()
    stagger.rows.measured = 2
    engine.plan.update_ceiling()
    stagger.rows.measured = 5
    for _ in range(STAGGER_RISE_STEPS // 2 + 1):
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 0
    for _ in range(STAGGER_RISE_STEPS // 2):
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 5
    # a pipeline with members: its ceiling falls to 0 (which empties it) only after STAGGER_FALL_STEPS of none,
    # so a dip of the measured rows shorter than that keeps it
    monkeypatch.setattr(type(stagger), "num_members", property(lambda self: 3))
    stagger.rows.measured = 2
    for _ in range(STAGGER_FALL_STEPS - 1):
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 5
    stagger.rows.measured = 5
    engine.plan.update_ceiling()
    stagger.rows.measured = 2
    for _ in range(STAGGER_FALL_STEPS - 1):
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 5
    engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 0
    monkeypatch.undo()
    apex.close()


def test_a_running_pipeline_is_kept_by_the_lower_margin(monkeypatch):
    """auto asks the model with `keep=True` (the lower keep margin) only for a pipeline with members and a
    ceiling: a verdict that pays only under the keep margin keeps such a pipeline's rows, and does not raise
    an empty pipeline's ceiling from 0."""
    from apex_compile.runtime.plans.staggered import STAGGER_FALL_STEPS, STAGGER_RISE_STEPS

    apex = staggered(sharp_model(), width="auto")
    engine, stagger = apex.engine, apex.engine.stagger
    asked = []

    class Policy(StubPolicy):  # a gain between the two margins: rows only when keeping
        def stagger_rows(self, gpu_requests, context, width, keep=False, host_context=None, hold=False):
            asked.append(keep)
            return width if keep else 0

    engine.auto_policy = Policy()
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.scheduler.schedule()
    stagger.rows.set_ceiling(0)
    for _ in range(STAGGER_RISE_STEPS + 1):  # empty: the start margin, never met
        engine.plan.update_ceiling()
    assert stagger.rows.ceiling == 0 and not any(asked)
    stagger.rows.set_ceiling(4)
    engine.plan.update_ceiling()  # a ceiling without members: still the start margin, so it falls
    assert asked[-1] is False and stagger.rows.ceiling == 0
    stagger.rows.set_ceiling(4)
    monkeypatch.setattr(type(stagger), "num_members", property(lambda self: 3))
    for _ in range(STAGGER_FALL_STEPS + 1):  # members: kept, whatever the start margin says
        engine.plan.update_ceiling()
        assert asked[-1] is True and stagger.rows.ceiling == stagger.rows.measured
    monkeypatch.undo()
    apex.close()


class MarginPolicy(StubPolicy):
    """A stand-in whose verdict depends only on the margin asked: `verdicts` maps "rise", "keep", "hold" to rows."""

    def __init__(self, **verdicts):
        super().__init__()
        self.verdicts = verdicts

    def stagger_rows(self, gpu_requests, context, width, keep=False, host_context=None, hold=False):
        return min(width, self.verdicts["hold" if hold else "keep" if keep else "rise"])


def test_a_pipeline_the_keep_verdict_drops_closes_and_its_members_finish(monkeypatch):
    """auto: a pipeline with members whose keep verdict pays no rows for STAGGER_FALL_STEPS closes (no request
    joins) at the rows that still beat GPU-only (`hold=True`), instead of parking its members at once; the keep
    verdict back opens it; closed, it empties to a ceiling of 0 once no rows beat GPU-only for
    STAGGER_FALL_STEPS, or at once when its last member has left. With no rows beating GPU-only at the fall, the
    ceiling falls to 0 as before."""
    from apex_compile.runtime.plans.staggered import STAGGER_FALL_STEPS

    apex = staggered(sharp_model(), width="auto")
    engine, stagger = apex.engine, apex.engine.stagger
    policy = engine.auto_policy = MarginPolicy(rise=4, keep=0, hold=2)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.scheduler.schedule()
    members = [3]
    monkeypatch.setattr(type(stagger), "num_members", property(lambda self: members[0]))
    stagger.rows.measured = 8
    stagger.rows.set_ceiling(4)
    full = engine.scheduler.pipeline_rules.full
    assert not full()

    def update(steps):
        engine.plan._ceiling_key = None  # the verdicts are cached per model input; this stand-in's change is not one
        for _ in range(steps):
            engine.plan.update_ceiling()
        return stagger.rows.ceiling, stagger.closed

    assert update(STAGGER_FALL_STEPS - 1) == (4, False)
    assert update(1) == (2, True) and full()  # closed at the held rows: nothing joins
    policy.verdicts["keep"] = 4
    assert update(1) == (4, False) and not full()  # the keep verdict back: open again
    policy.verdicts["keep"] = 0
    assert update(STAGGER_FALL_STEPS) == (2, True)
    policy.verdicts["hold"] = 0  # closed and no rows beat GPU-only: emptied after STAGGER_FALL_STEPS
    assert update(STAGGER_FALL_STEPS - 1) == (2, True)
    assert update(1) == (0, False)  # (and a ceiling of 0 takes no request either)
    stagger.rows.set_ceiling(4)  # open, and none beats GPU-only at the fall: 0 as before, never closed
    assert update(STAGGER_FALL_STEPS - 1) == (4, False)
    assert update(1) == (0, False)
    policy.verdicts["hold"] = 2
    stagger.rows.set_ceiling(4)
    assert update(STAGGER_FALL_STEPS) == (2, True)
    members[0] = 0  # its last member left: GPU-only until a rise
    assert update(1) == (0, False)
    monkeypatch.undo()
    apex.close()


def test_a_request_only_the_host_pool_holds_runs_in_the_staggered_pipeline():
    """offload="staggered" (what auto's refusal names): a request longer than the device pool holds enters the
    pipeline at the queue's head and gets HF's tokens, beside requests the device pool runs."""
    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (20, 6, 9)]  # 20 + 20 tokens: past 2 blocks (32)
    reference = hf_tokens(model, prompts, 20)
    apex = staggered(model, width=2, device_blocks=2)
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [c.token_ids for c in done] == reference
    assert done[0].steps_per_pool["host"] > 0 and apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_under_the_makespan_objective_a_falling_verdict_keeps_members_while_requests_wait(monkeypatch):
    """auto, a batch (the makespan objective): members entered the pipeline because each finishes sooner there
    than waiting, so while requests wait a verdict that no longer pays closes the pipeline at its rows (none
    joins, none is parked ahead of the queue) even where no rows beat GPU-only; once nothing waits, or under
    the latency objective, no rows beating GPU-only empty it as before."""
    from apex_compile.runtime.plans.staggered import STAGGER_FALL_STEPS

    apex = staggered(sharp_model(), width="auto")
    engine, stagger = apex.engine, apex.engine.stagger
    engine.auto_policy = MarginPolicy(rise=4, keep=0, hold=0)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.scheduler.schedule()
    engine.add_request([5, 6, 8], SamplingParams(max_new_tokens=2))  # waits
    assert engine.scheduler.waiting and engine.scheduler.objective == "makespan"
    monkeypatch.setattr(type(stagger), "num_members", property(lambda self: 3))
    stagger.rows.measured = 8
    stagger.rows.set_ceiling(4)

    def update(steps):
        engine.plan._ceiling_key = None
        for _ in range(steps):
            engine.plan.update_ceiling()
        return stagger.rows.ceiling, stagger.closed

    assert update(STAGGER_FALL_STEPS) == (4, True)  # closed at its rows, not emptied
    assert update(3 * STAGGER_FALL_STEPS) == (4, True) and engine.scheduler.pipeline_rules.full()
    waiting = list(engine.scheduler.waiting)
    engine.scheduler.waiting.clear()  # nothing waits: no rows beating GPU-only empty it
    assert update(STAGGER_FALL_STEPS) == (0, False)
    engine.scheduler.waiting.extend(waiting)
    engine.scheduler.objective = "latency"  # online load: the per-step verdict rules
    stagger.rows.set_ceiling(4)
    assert update(STAGGER_FALL_STEPS) == (0, False)
    monkeypatch.undo()
    apex.close()


def test_a_closed_pipeline_finishes_its_members_on_the_host_and_admits_none(monkeypatch):
    """auto end to end: the keep verdict drops while the pipeline holds requests and one row still beats
    GPU-only: the pipeline closes; none of its members is parked (each finishes from the host pool), requests
    arriving after it closed run in the device pool only, and every request gets HF's tokens."""
    from apex_compile.runtime.plans import staggered as staggered_module
    from apex_compile.runtime.kv_manager import HOST_POOL

    torch.manual_seed(14)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8, 10, 12)]
    reference = hf_tokens(model, prompts, 20)
    apex = staggered(model, width="auto")
    engine, stagger = apex.engine, apex.engine.stagger
    engine.auto_policy = MarginPolicy(rise=2, keep=2, hold=1)
    engine.config.offload = "auto"
    monkeypatch.setattr(type(engine.scheduler.pipeline_rules), "pays", lambda self, request, position: True)
    monkeypatch.setattr(staggered_module, "STAGGER_FALL_STEPS", 3)
    parked, park = [], engine.scheduler.pipeline_rules.park
    monkeypatch.setattr(engine.scheduler.pipeline_rules, "park", lambda r: (parked.append(r), park(r)))
    sampling = SamplingParams(max_new_tokens=20)
    requests = [engine.add_request(p, sampling) for p in prompts[:6]]
    late, members = [], []
    while engine.has_unfinished():
        engine.step()
        members.append(stagger.num_members)
        if stagger.closed and not late:
            members_at_close = {r.request_id for r in stagger.members()}
            late = [engine.add_request(p, sampling) for p in prompts[6:]]
        elif stagger.num_members >= 2 and not late:
            engine.auto_policy.verdicts["keep"] = 0  # the keep verdict drops with the pipeline in use
    assert late and members_at_close and max(members) >= 2
    # no mass park: a member leaves the closed pipeline only to move into room the device pool freed
    assert len(parked) == engine.stats.migrated
    assert all(r.steps_per_pool[HOST_POOL] for r in requests if r.request_id in members_at_close)
    assert not any(r.steps_per_pool[HOST_POOL] for r in late)  # nothing joined the closed pipeline
    assert [r.output_token_ids for r in requests + late] == reference
    assert engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_an_adaptive_pipeline_gives_hf_tokens():

    torch.manual_seed(7)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7)]
    apex = staggered(model, width="auto")
    assert apex.engine.stagger.width == TuningConfig().auto_stagger_width and apex.engine.stagger.rows.adaptive
    done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.token_ids for c in done] == hf_tokens(model, prompts, 8)
    assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
    rows = apex.engine.stagger.rows
    assert rows.rate is not None and rows.step is not None and 1 <= rows.limit <= TuningConfig().auto_stagger_width


def test_config_checks():
    with pytest.raises(ValueError, match="stagger_width"):
        ApexConfig(stagger_width=0)
    with pytest.raises(ValueError, match="stagger_width"):
        ApexConfig(stagger_width="wide")
    with pytest.raises(ValueError, match="stagger_lanes must be 1, 2 or None"):
        ApexConfig(stagger_lanes=3)
    from tests.devices import INTERPRET
    if not INTERPRET:  # the layered jobs' device waits need a GPU or the interpreter
        from apex_compile.runtime.stagger import StaggerPipeline
        with pytest.raises(ValueError, match="a GPU or TRITON_INTERPRET=1"):
            StaggerPipeline(None, 2, 8, 2, None, torch.device("cpu"), torch.float32, 64, lanes=1, layered=True)
    with pytest.raises(ValueError, match="compile=True"):
        optimize(sharp_model(), ApexConfig(offload="staggered", compile=False, gpu_cache_size=BLOCK_BYTES,
                                           cpu_cache_size=8 * BLOCK_BYTES))


def _staggered_graph(kind="llama"):
    model = tiny_model(kind, layers=LAYERS)
    ids = torch.randint(0, 96, (1, 6))
    gm, _ = capture(engine_step(model), ids, torch.arange(6)[None], torch.arange(6), dynamic=True)
    report = PassReport("paged")
    partition_attention(gm, report)
    return gm, report


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_pass_swaps_residual_and_rope_rows_per_layer(kind):
    gm, report = _staggered_graph(kind)
    assert stagger_rows(gm, report) == LAYERS == report.staggered_layers
    ops = torch.ops.apex
    assert count_calls(gm, ops.stagger_residual.default) == LAYERS
    assert count_calls(gm, ops.stagger_rope_layers.default) == 2  # cos and sin, every layer's in one op
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    attentions = [n for n in gm.graph.nodes if n.target is ops.attention.default]
    tables = [n for n in gm.graph.nodes if n.target is ops.stagger_rope_layers.default]
    assert sorted(n.args[1:] for n in tables) == [(LAYERS, 0), (LAYERS, 1)]
    for table in tables:  # each layer reads its own slice, before its attention
        slices = sorted(table.users, key=order.__getitem__)
        assert [u.target for u in slices] == [torch.select] * LAYERS
        assert [u.args[1:] for u in slices] == [(0, layer) for layer in range(LAYERS)]
        assert all(order[u] < order[attentions[u.args[2]]] for u in slices)
        assert order[table] < order[attentions[0]]
    for node in gm.graph.nodes:
        if node.target is ops.stagger_residual.default:  # after its layer's attention, read by the residual add
            layer = node.args[1]
            assert order[node] > order[attentions[layer]]
            (add,) = node.users
            assert layer + 1 == len(attentions) or order[add] < order[attentions[layer + 1]]
    assert "staggered host rows" in str(report)


def test_pass_needs_paged_attention():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(0, 96, (1, 4))
    gm, _ = capture(engine_step(model), ids, torch.arange(4)[None], torch.arange(4), dynamic=True)
    with pytest.raises(PatternError, match="apex.attention"):
        stagger_rows(gm, PassReport())


class FakeCopies:
    """CPU stand-ins for the CUDA streams: staging copies run on one thread, copies back on another after
    `restore_delay` seconds (a slow host-to-device copy), each reading its source when it runs and raising its
    ready counter after it (as the GPU stream does behind its copies)."""

    def __init__(self, restore_delay):
        self.copy_stream = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.compute_stream = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.restore_delay = restore_delay
        self.flags = torch.zeros(2, dtype=torch.int64)
        self.issued = [0, 0]

    def _issue(self, index):
        self.issued[index] += 1
        return index, self.issued[index]

    def stage(self, pairs):
        index, value = self._issue(0)

        def run():
            for dst, src in pairs:
                dst.copy_(src)
            self.flags[index] = value

        self.copy_stream.submit(run)
        return index, value

    def restore(self, dst, src):
        index, value = self._issue(1)

        def run():
            time.sleep(self.restore_delay)
            dst.copy_(src)
            self.flags[index] = value

        self.compute_stream.submit(run)
        return index, value

    def flush(self):
        self.compute_stream.submit(lambda: None).result()


def run_jobs(jobs, copies, steps):
    """Drives `jobs` as the pipeline does (per step, for the step's lane: collect, then launch); returns what
    each collect delivered once its copy back ran."""
    delivered = {}
    for step in range(1, steps + 1):
        lane = step % 2
        out = torch.full((2, 3), float("nan"))
        jobs.collect(lane, out)
        delivered[step] = out
        q = torch.full((2, 3), float(step))

        def job(q, k, v, out, ready_flags, ready_values):
            waited = wait_host_flags(ready_flags, ready_values)
            out.copy_(q + 0.5)
            return waited, 0.0

        jobs.launch(lane, job, [q, q.clone(), q.clone()], out)
    copies.flush()
    jobs.drain()
    return delivered


def expected(step):
    return 0.0 if step <= 2 else step - 2 + 0.5  # a lane's job of two steps before


def test_async_jobs_deliver_each_lane_result_at_its_next_turn():
    copies = FakeCopies(restore_delay=0.0)
    delivered = run_jobs(AsyncJobs(copies, pin_memory=False), copies, steps=6)
    assert all(torch.all(out == expected(step)) for step, out in delivered.items()), delivered


def test_output_buffer_is_not_rewritten_before_its_copy_back():
    """A lane's copy back is slow; its next job, launched right after, writes the same pinned buffer and must
    wait for that copy (the guard: the copy's ready counter), else the delivery reads the newer result."""
    copies = FakeCopies(restore_delay=0.05)
    delivered = run_jobs(AsyncJobs(copies, pin_memory=False), copies, steps=6)
    wrong = [(step, out[0, 0].item()) for step, out in delivered.items() if not torch.all(out == expected(step))]
    assert not wrong


def test_worker_threads_run_on_their_cores():
    from apex_compile.runtime.stagger import worker_cores

    cores = sorted(os.sched_getaffinity(0))
    assert worker_cores(1) == cores[-1:]
    assert worker_cores(None) == (cores[1:] if len(cores) > 2 else cores)
    with pytest.raises(ValueError, match="cpu_attention_threads"):
        worker_cores(len(cores) + 1)
    jobs = AsyncJobs(FakeCopies(0.0), pin_memory=False, threads=1)
    seen = jobs.worker.submit(lambda: (sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
    assert seen.result() == (cores[-1:], 1)


def test_the_launching_thread_is_kept_off_the_workers_cores_until_release():
    """LauncherPin: a thread that calls ensure() runs on the cores the worker leaves free (once), and gets its
    own affinity back on release(); with no core free it changes nothing."""
    import threading

    from apex_compile.runtime.stagger import LauncherPin

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    pin = LauncherPin(cores[1:])
    assert pin.cores == cores[:1]
    seen = []

    def launcher():
        pin.ensure()
        seen.append(sorted(os.sched_getaffinity(0)))
        pin.ensure()  # once per thread
        seen.append(len(pin._pinned))
        done.wait()

    done = threading.Event()
    thread = threading.Thread(target=launcher)
    thread.start()
    while len(seen) < 2:
        time.sleep(0.001)
    assert seen == [cores[:1], 1]
    assert sorted(os.sched_getaffinity(0)) == cores  # other threads untouched
    pin.release()
    assert sorted(os.sched_getaffinity(thread.native_id)) == cores
    done.set()
    thread.join()
    pin.release()  # nothing left (an ended thread is skipped)
    everywhere = LauncherPin(cores)
    everywhere.ensure()
    assert everywhere.cores == [] and sorted(os.sched_getaffinity(0)) == cores


def test_pin_launcher_is_checked():
    with pytest.raises(ValueError, match="pin_launcher"):
        ApexConfig(pin_launcher="yes")
    assert ApexConfig(pin_launcher=False).pin_launcher is False


def test_a_whole_step_graph_fill_computes_every_row():
    """The fill of a captured staggered decode step: the device rows start after the block, are padded to the
    graph's size, and the logits of every row (block and device) are computed (the engine picks its rows)."""
    torch.manual_seed(4)
    apex = staggered(sharp_model(), width=3)
    engine = apex.engine
    parts, rows = engine.plan.fill_staggered([], [], pad_to=4)
    assert rows == 3 + 4 and [(p.start, p.end) for p in parts] == [(3, 7)]
    assert engine.buffers.logits_indices[:rows].tolist() == list(range(rows))
    assert engine.buffers.rows[0].slot[:4].tolist() == [-1] * 4  # padding rows write no cache slot


@pytest.mark.parametrize("stop,lanes", [("length", 2), ("eos", 2), ("length", 1), ("eos", 1)])
def test_steps_run_ahead_with_the_pipeline_give_the_same_tokens(stop, lanes, monkeypatch):
    """Async scheduling beside the staggered block: the next step is queued before this step's tokens are
    known, so a pipeline request that stops may have re-entered its lane's first group already; it is taken
    out of it (no CPU job appends for it). Tokens equal the synchronous engine's (and HF's without EOS)."""
    from apex_compile.runtime.stagger import StaggerPipeline

    torch.manual_seed(8)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (3, 4, 5, 13, 9, 11, 7, 10, 12, 8)]
    eos = (5, 17, 33, 50, 71, 90) if stop == "eos" else ()
    # three long device requests keep steps running ahead while the pipeline's requests come and go
    sampling = [SamplingParams(max_new_tokens=60) for _ in range(3)] + [
        SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in (12, 14, 9, 16, 11, 13, 10)]
    from_first = []
    finish = StaggerPipeline.finish

    def counting_finish(self, request):
        from_first.append(not any(r is request for lane in self.lanes for r in lane[-1].requests))
        finish(self, request)
        # the CPU jobs' groups (all but the last): metadata (rows, slots) of exactly their requests
        assert all(g.size == sum(r is not None for r in g.requests) for lane in self.lanes for g in lane[:-1])

    monkeypatch.setattr(StaggerPipeline, "finish", counting_finish)
    results = []
    for async_scheduling in (False, True):
        from_first.clear()
        apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=6 * BLOCK_BYTES,
                                          cpu_cache_size=128 * BLOCK_BYTES, max_model_len=96,
                                          async_scheduling=async_scheduling, stagger_lanes=lanes))
        done = apex.engine.generate(prompts, sampling)
        results.append([(c.token_ids, c.finish_reason) for c in done])
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0} and not apex.engine.stagger.members()
        assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
        assert (apex.engine.stats.ahead_steps > 0) == async_scheduling
        # a stop found in a first group: its lane was begun (one lane: always, the next turn is begun at once)
        assert any(from_first) == (async_scheduling or lanes == 1)
    assert results[1] == results[0]
    if stop == "eos":
        assert "eos" in {reason for _, reason in results[1]}
    else:
        assert [ids for ids, _ in results[1]] == hf_tokens(model, prompts, 60)[:3] + [
            ids[:n] for ids, n in zip(hf_tokens(model, prompts[3:], 16), (12, 14, 9, 16, 11, 13, 10))]


def test_a_growth_reserve_sends_more_requests_to_the_pipeline_and_the_tokens_stay_hf_equal():
    """ApexConfig.growth_reserve with the staggered plan: a request the device pool could start but not keep room
    to grow goes to the pipeline instead (while it has rows); tokens are HF's and every block comes back."""
    from apex_compile.runtime.kv_manager import HOST_POOL

    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (6, 11, 4, 9, 13, 5, 7, 8)]
    reference = hf_tokens(model, prompts, 12)
    host_steps = {}
    for reserve in (0.0, 1.0):
        apex = staggered(model, width=2, device_blocks=6, growth_reserve=reserve)
        done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=12))
        assert [c.token_ids for c in done] == reference
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
        host_steps[reserve] = apex.engine.stats.requests_per_pool[HOST_POOL]
        apex.close()
    assert host_steps[1.0] > host_steps[0.0], host_steps


@pytest.mark.parametrize("lanes", [2, 1])
def test_members_taking_host_blocks_as_they_grow_fit_more_requests_and_equal_hf(lanes, monkeypatch):
    """TuningConfig.pipeline_reserve: a request enters the pipeline with host blocks for its prompt and next
    token and takes more as it grows. A member finding no block for its next token waits to rejoin (`stalled`);
    with no reserve the pool runs dry and, once every member waits, the newest are recomputed. HF's tokens
    throughout, every block back."""
    from apex_compile.runtime.plans.pipeline_rules import PipelineRules

    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10, 11, 13, 2)]
    reference = hf_tokens(model, prompts, 40)
    runs, unstalled = {}, []
    unstall = PipelineRules.unstall
    monkeypatch.setattr(PipelineRules, "unstall",
                        lambda self: (lambda got: unstalled.extend(got) or got)(unstall(self)))
    for reserve, host_blocks in ((0.3, 20), (0.0, 12)):
        apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=4 * BLOCK_BYTES,
                                          cpu_cache_size=host_blocks * BLOCK_BYTES, max_model_len=64,
                                          stagger_lanes=lanes, tuning=TuningConfig(pipeline_reserve=reserve)))
        done = apex.engine.generate(prompts, SamplingParams(max_new_tokens=40))
        assert [c.token_ids for c in done] == reference
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0} and not apex.engine.stagger.members()
        runs[reserve] = (apex.engine.stats, apex.engine.stagger.stalled, len(unstalled), apex.engine.stats.migrated)
        apex.close()
    assert runs[0.3][0].requests_per_pool[1] > 0
    # stalled members leave: recomputed, or moved to the device pool as it frees room (`_migrate_to_device`)
    assert runs[0.0][1] > 0 and runs[0.0][2] + runs[0.0][3] > 0
