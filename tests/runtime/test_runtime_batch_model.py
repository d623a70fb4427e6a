"""The batch model (`runtime/batch_model.py`) on synthetic profiles: GPU-only batches whose step count and price
follow by hand, the pipeline's batch-level trade (a long queue behind a small device pool gains; a short one
would lose to the staggered steps' overhead although each request it takes finishes sooner), the state of a
running engine, and offload="auto"'s batch gate built on it: a simulated finite batch is never predicted slower
than GPU-only. GPU-only batches are also checked against the scheduler itself: a CPU engine's steps."""
import pytest
import torch

from apex_compile import ApexConfig, SamplingParams, optimize
from apex_compile.runtime.batch_model import (BatchLimits, BatchState, batch_verdict, engine_limits, engine_state,
                                              predict_batch)
from apex_compile.runtime.perf_model import AutoOffload, PerfModel, StepCalibration
from tests.runtime.test_runtime_perf_model import KV_PER_TOKEN, profile
from tests.runtime.test_runtime_stagger import sharp_model, staggered

CYCLE = 33  # one lane x (32 layers + 1)


def h100_like(stagger_extra_ms: float = 0.7) -> AutoOffload:
    """A Llama-3-8B-like machine: memory-bound decode (~5.4 ms of weights), compute-bound prompt GEMMs beyond
    256 tokens, a CPU at 100 GB/s; the staggered graph `stagger_extra_ms` over the GPU-only one."""
    prof = profile(100.0, 3000.0, 5.4)
    prof.linear_tokens += [512, 2048]
    prof.linear_s += [512 * 16e9 / 700e12 + 0.004, 2048 * 16e9 / 700e12 + 0.004]
    rows = [1, 8, 32, 64]
    step = [0.95 * PerfModel(prof).linear_s(n) + 0.0015 for n in rows]
    calibration = StepCalibration(rows, step, rows, [t + stagger_extra_ms / 1e3 for t in step], 12)
    return AutoOffload(PerfModel(prof, calibration), stagger_groups=CYCLE, max_stagger_rows=12)


def limits(device_blocks=512, **kw) -> BatchLimits:
    """1 GiB of Llama-3-8B KV (8,192 tokens), a 32 GiB host pool, the default batching limits."""
    base = dict(device_blocks=device_blocks, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                growth_reserve=0.15, cycle=CYCLE, max_rows=12, pipeline_prompt_tokens=2048, host_blocks=16384)
    base.update(kw)
    return BatchLimits(**base)


def test_a_batch_that_fits_at_once_takes_one_prompt_step_and_its_decode_steps():
    """8 requests of 32 + 6 tokens in a large pool: one step computes every prompt (and samples their first
    tokens), 5 decode steps follow, each priced by the model's GPU-only step at the rows' mean context."""
    policy = h100_like()
    model = policy.model
    out = predict_batch(model, [(32, 6)] * 8, limits(device_blocks=4096, growth_reserve=0.0))
    assert out.steps == 6 and out.output_tokens == 48 and out.host_requests == 0
    prompt_step = model.predict("never", 1, 0, 0).step_s + model.linear_s(1 + 256) - model.linear_s(1)
    decode = sum(model.predict("never", 8, 0, 33 + k).step_s for k in range(5))
    assert out.makespan_s == pytest.approx(prompt_step + decode, rel=0.02)


def test_a_pool_for_one_request_runs_the_batch_one_after_another():
    """A device pool of one request's blocks: each request's prompt in ceil(p / budget) steps (its last chunk
    samples its first token), then output - 1 decode steps, then the next is admitted."""
    model = h100_like().model
    out = predict_batch(model, [(1000, 10)] * 5, limits(device_blocks=64, growth_reserve=0.0))
    assert out.steps == 5 * (2 + 9)


def test_a_calibrated_prompt_step_prices_every_prompt_token_of_the_batch():
    """Where the warm-up timed a prompt-only step above the model's price of it, each prompt step of the batch
    costs that much more per prompt token: 8 prompts of 32 tokens in one step, 256 tokens at the residual."""
    model = h100_like().model
    c = model.calibration
    price = model.predict("never", 1, 0, 1.0).step_s + model.linear_s(1 + 512) - model.linear_s(1)
    timed = PerfModel(model.profile, StepCalibration(c.rows, c.step_s, c.stagger_rows, c.stagger_s,
                                                     c.stagger_width, prompt_tokens=512, prompt_s=price + 4e-3))
    batch, pool = [(32, 6)] * 8, limits(device_blocks=4096, growth_reserve=0.0)
    plain, calibrated = predict_batch(model, batch, pool), predict_batch(timed, batch, pool)
    assert calibrated.steps == plain.steps
    assert calibrated.makespan_s - plain.makespan_s == pytest.approx(256 * 4e-3 / 512)


def test_the_pipeline_shortens_a_long_batch_and_would_lengthen_a_short_one():
    """A long queue behind a 1 GiB pool: the pipeline takes the tail and the batch ends well before GPU-only's.
    A short batch: `pays` still lets a few tail requests in (each alone finishes sooner there), but their
    staggered steps slow every device row for their lifetime, and the batch ends later: the trade only the
    batch-level prediction sees."""
    policy = h100_like()
    long_never = predict_batch(policy, [(1024, 256)] * 400, limits())
    long_auto = predict_batch(policy, [(1024, 256)] * 400, limits(), pipeline=True)
    assert long_auto.host_requests > 100
    assert 0 < long_auto.last_entry_step < long_auto.steps and long_never.last_entry_step == 0
    assert long_auto.makespan_s < 0.8 * long_never.makespan_s
    assert long_auto.steps < long_never.steps
    short_never = predict_batch(policy, [(768, 256)] * 256, limits())
    short_auto = predict_batch(policy, [(768, 256)] * 256, limits(), pipeline=True)
    assert 0 < short_auto.host_requests < 20
    assert short_auto.makespan_s > short_never.makespan_s
    # a pipeline prompt only enters a step whose device chunks left some of the budget, as in the scheduler: the
    # issue's 192 x (768 + 192) batch takes none (the engine took none on the H100 and H200, DECISIONS 45-46)
    assert predict_batch(policy, [(768, 192)] * 192, limits(), pipeline=True).host_requests == 0


def test_each_pipeline_prompt_size_a_batch_meets_first_pays_a_capture_of_its_pieces():
    """A pipeline prompt step past PIECEWISE_MAX_TOKENS rows runs pieces captured for its padded row count, the
    first time a run meets it, over its rows padded to that count: the model prices `piece_capture_s` once per
    size (none for sizes the engine holds already), so prompts of many lengths pay many captures and fixed ones
    one; the gate weighs them."""
    import dataclasses

    policy = h100_like()
    sizes = tuple(range(576, 2600, 64))
    lims = limits(piece_sizes=sizes)
    fixed = [(1024, 256)] * 400
    free = predict_batch(policy, fixed, lims, pipeline=True)
    assert free.captures == 0  # not measured (0 s): nothing counted
    # the step's rows padded to its size's: the GEMMs run those rows too
    assert free.makespan_s > predict_batch(policy, fixed, limits(), pipeline=True).makespan_s
    policy.model.calibration = dataclasses.replace(policy.model.calibration, piece_capture_s=2.0)
    paid = predict_batch(policy, fixed, lims, pipeline=True)
    assert paid.captures == 1 and paid.steps == free.steps
    assert paid.makespan_s - free.makespan_s == pytest.approx(2.0)
    held = predict_batch(policy, fixed, lims, pipeline=True, state=BatchState(captured=set(sizes)))
    assert held.captures == 0 and held.makespan_s == pytest.approx(free.makespan_s)
    # prompts of every length: a capture per size their steps pad to, until the gate judges them too many
    g = __import__("random").Random(5)
    mixed = [(g.randint(600, 2000), 256) for _ in range(400)]
    many = predict_batch(policy, mixed, lims, pipeline=True)
    assert 10 < many.captures <= len(sizes)
    # about what a capture took on the H100 (DECISIONS 52)
    policy.model.calibration = dataclasses.replace(policy.model.calibration, piece_capture_s=3.0)
    assert batch_verdict(policy, fixed, lims)[2] and not batch_verdict(policy, mixed, lims)[2]
    assert predict_batch(policy, mixed, limits(), pipeline=True).captures == 0  # no piecewise graphs


def test_members_finish_or_move_to_the_device_pool_once_nothing_waits():
    """A pipeline with members and no queue: every member moves to the device pool (room for all), so the
    rest takes about the longest member's tokens in steps, not a token per cycle steps."""
    policy = h100_like()
    state = BatchState(members=[(1100, 100)] * 20)
    out = predict_batch(policy, [], limits(device_blocks=2048), pipeline=True, state=state)
    assert out.migrated == 20 and out.output_tokens == 2000
    assert out.steps == 100
    # a pool for 7 of them at a time: three waves, the later ones a few tokens shorter (those waiting still gain a
    # token per cycle in the pipeline), at least 100 + 97 + 94 steps (more where growth parks one)
    waves = predict_batch(policy, [], limits(), pipeline=True, state=state)
    assert waves.migrated == 20 and 291 <= waves.steps < 400


def test_members_past_the_rows_the_cpu_job_fits_wait_their_turn():
    """Members and no room in the device pool: where the CPU job fits a row per step for every 33 members, each
    gains a token per cycle (66 members, 10 tokens: ~10 cycles). Where a row's job takes 5 ms, a step serves the
    rows whose job fits 95% of its GPU work (`RowLimit`'s rule: ~1.45 rows), the 66 members share them and their
    tokens take 660 / 1.45 steps, each priced at the GPU's work (the job fits under it), not stretched to the
    two rows' 10 ms job."""
    state = BatchState(members=[(1000, 10)] * 66)
    tight = limits(device_blocks=16)  # no room to move a member into
    fast = predict_batch(h100_like(), [], tight, pipeline=True, state=state)
    assert fast.migrated == 0 and 10 * CYCLE - 1 <= fast.steps <= 10 * CYCLE + 1
    row_s = 5e-3
    calibration = h100_like().model.calibration
    slow_policy = AutoOffload(PerfModel(profile(1000 * KV_PER_TOKEN / row_s / 1e9, 3000.0, 5.4), calibration),
                              stagger_groups=CYCLE, max_stagger_rows=12)
    slow = predict_batch(slow_policy, [], tight, pipeline=True, state=state)
    gpu_step = slow_policy.model.predict("staggered", 1, 12, 1000, cpu_job=(0.0, 0.0)).step_s
    fit = 0.95 * gpu_step / row_s
    assert 1.2 < fit < 2
    assert slow.steps == pytest.approx(660 / fit, rel=0.03)
    assert slow.makespan_s == pytest.approx(slow.steps * gpu_step, rel=0.05)


def test_a_state_mid_batch_is_predicted_from_where_it_stands():
    """Requests already decoding count their remaining tokens only; a request half through its prompt computes
    the rest of it first."""
    model = h100_like().model
    state = BatchState(device=[(100, 100, 5), (40, 80, 3)])
    out = predict_batch(model, [], limits(device_blocks=4096, growth_reserve=0.0), state=state)
    # step 0: the decode row and the 40 prompt tokens left (its first token); then max(5 - 1, 3 - 1) more steps
    assert out.steps == 5 and out.output_tokens == 8


def test_a_request_the_device_pool_never_holds_is_refused_at_once():
    """The engine refuses such a request at add (`Scheduler.check_fits`); simulated, it would wait for the device
    pool forever, so the model refuses it too instead of running out of steps."""
    with pytest.raises(ValueError, match="never fits the device pool's 8192 tokens"):
        predict_batch(h100_like(), [(1024, 256), (8000, 500)], limits(), pipeline=True)


def test_requests_that_fill_the_device_pool_run_one_after_another():
    """A request whose tokens fill the device pool exactly enters an empty pool whatever its growth reserve and
    look-ahead would ask (the engine runs it: nothing else can; a CPU engine took the same 27 steps), so the
    batch ends instead of waiting forever."""
    out = predict_batch(h100_like().model, [(63, 1)] * 3 + [(40, 24)], limits(device_blocks=4), max_steps=1000)
    assert out.steps == 3 + 24 and out.output_tokens == 3 + 24


def test_bad_pipeline_limits_are_refused():
    with pytest.raises(ValueError, match="pipeline"):
        predict_batch(h100_like().model, [(8, 8)], limits(), pipeline=True)
    with pytest.raises(ValueError, match="pipeline"):
        predict_batch(h100_like(), [(8, 8)], limits(cycle=0), pipeline=True)


@pytest.mark.parametrize("count,prompt,output", [(8, 128, 64), (64, 512, 64), (192, 768, 192), (400, 1024, 256),
                                                 (1000, 1024, 256), (300, 2048, 512), (64, 2048, 512)])
def test_the_batch_gate_never_predicts_a_batch_slower_than_gpu_only(count, prompt, output):
    """offload="auto"'s batch gate on an engine (a CPU staggered engine run as auto, its policy the synthetic
    H100-like model): with the gate's verdict, the batch's predicted makespan is GPU-only's or shorter by the
    gate's margin; the gate opens exactly where the pipeline's prediction is shorter by that margin."""
    from apex_compile.runtime.batch_model import BATCH_MARGIN

    apex = staggered(sharp_model(), width="auto", device_blocks=6)
    engine = apex.engine
    engine.config.offload = "auto"
    engine.auto_policy = h100_like()
    engine.plan.attach(engine.scheduler)
    assert engine.scheduler.pipeline_rules.batch_gate is not None
    for _ in range(count):
        engine.add_request([5] * min(prompt, 40), SamplingParams(max_new_tokens=output))
    waiting, state = engine_state(engine)
    assert len(waiting) == count and not state.device and not state.members
    # the engine's own pools are tiny: price the batch as a 1 GiB pool would run it (the gate reads its limits)
    lims = limits(cycle=engine.plan.pipeline.cycle)
    lengths = [(prompt, output)] * count
    never = predict_batch(engine.auto_policy, lengths, lims)
    auto = predict_batch(engine.auto_policy, lengths, lims, pipeline=True)
    import apex_compile.runtime.batch_model as batch_model

    original = batch_model.engine_limits
    batch_model.engine_limits = lambda engine_: lims
    original_state = batch_model.engine_state
    batch_model.engine_state = lambda engine_: (lengths, BatchState())
    try:
        verdict = engine.plan.batch_pays()
    finally:
        batch_model.engine_limits = original
        batch_model.engine_state = original_state
    assert verdict == (auto.makespan_s < never.makespan_s * (1 - BATCH_MARGIN))
    chosen = auto if verdict else never
    assert chosen.makespan_s <= never.makespan_s
    apex.close()


def test_the_gate_is_predicted_again_only_when_requests_arrive_or_the_queue_halves(monkeypatch):
    apex = staggered(sharp_model(), width="auto", device_blocks=6)
    engine = apex.engine
    engine.config.offload = "auto"
    engine.auto_policy = h100_like()
    engine.plan.attach(engine.scheduler)
    calls = []
    import apex_compile.runtime.batch_model as batch_model

    real = batch_model.predict_batch
    monkeypatch.setattr(batch_model, "predict_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(8):
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    engine.plan.batch_pays()
    engine.plan.batch_pays()
    assert len(calls) == 2  # both arms once
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    engine.plan.batch_pays()
    assert len(calls) == 4
    for _ in range(5):
        engine.scheduler.waiting.pop()
    engine.plan.batch_pays()  # 4 of the 9 left: below half
    assert len(calls) == 6
    apex.close()


def test_a_batch_the_model_cannot_simulate_runs_gpu_only_with_a_warning(monkeypatch):
    """The gate runs on the launching thread: a simulation that does not end (a model fault) closes the pipeline
    for that batch, GPU-only being never slower, and says so; it does not stop the engine."""
    apex = staggered(sharp_model(), width="auto", device_blocks=6)
    engine = apex.engine
    engine.config.offload = "auto"
    engine.auto_policy = h100_like()
    engine.plan.attach(engine.scheduler)
    import apex_compile.runtime.batch_model as batch_model

    def stuck(*args, **kwargs):
        raise RuntimeError("predict_batch: the batch did not end within 10 steps")

    monkeypatch.setattr(batch_model, "batch_verdict", stuck)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    with pytest.warns(RuntimeWarning, match="could not predict this batch.*did not end"):
        assert engine.plan.batch_pays() is False
    apex.close()


def test_engine_limits_and_state_read_the_engine():
    apex = staggered(sharp_model(), width=2, device_blocks=6)
    engine = apex.engine
    lims = engine_limits(engine)
    assert lims.device_blocks == 6 and lims.cycle == engine.plan.pipeline.cycle and lims.max_rows == 2
    assert lims.piece_sizes == () and lims.lookahead == 0  # CPU: no piecewise graphs, evictions not ahead
    for n in (5, 9):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_new_tokens=6))
    engine.step()
    waiting, state = engine_state(engine)
    rest = sum(r for _, r in waiting) + sum(d[2] for d in state.device) + sum(m[1] for m in state.members)
    assert rest == 2 * 6 - 2  # each request sampled its first token
    apex.close()


def test_the_engine_counts_its_steps_by_the_kinds_the_batch_model_prices():
    """Every step is counted under one kind (`STEP_KINDS`), with the time of the step() calls that took its tokens
    and the longest of them; the run's slowest calls are kept with their phases (`EngineStats.slowest_steps`):
    a staggered engine's host-pool prompts are pipeline prompts, its steps beside members staggered ones."""
    from apex_compile.runtime.engine import PHASES, SLOWEST_STEPS, STEP_KINDS

    apex = staggered(sharp_model(), width=2, device_blocks=2)
    engine = apex.engine
    entries, step = [], engine.step

    def counted_step():
        before, host = engine.stats.steps, engine.stats.requests_per_pool[1]
        out = step()
        if engine.stats.requests_per_pool[1] > host:
            entries.append(before)
        return out

    engine.step = counted_step
    engine.generate([[5 + i, 6, 7, 8, 9, 10, 11, 12, 13][: 4 + i % 5] for i in range(8)],
                    SamplingParams(max_new_tokens=12))
    kinds = engine.stats.step_kinds
    assert set(kinds) == set(STEP_KINDS)
    assert sum(n for n, _, _ in kinds.values()) == engine.stats.steps
    assert kinds["pipeline prompt"][0] >= 1 and kinds["staggered decode"][0] >= 1
    # the last host-pool entrant: the step (counted before it) whose chunks first put a request in the host pool
    assert engine.stats.last_host_entry_step == entries[-1] < engine.stats.steps - 12
    # the longest call of a kind lies between its mean and its total
    assert all(seconds / n <= longest <= seconds and longest > 0 for n, seconds, longest in kinds.values() if n)
    # the run's slowest calls, longest first, each with the main thread's phases inside it
    slowest = engine.stats.slowest_steps
    assert len(slowest) == SLOWEST_STEPS
    assert [e["seconds"] for e in slowest] == sorted((e["seconds"] for e in slowest), reverse=True)
    assert slowest[0]["seconds"] == max(longest for _, _, longest in kinds.values())
    for e in slowest:
        assert e["kind"] in STEP_KINDS and 1 <= e["step"] <= engine.stats.steps
        assert set(e["phases"]) <= set(PHASES) and 0 < sum(e["phases"].values()) <= e["seconds"]
        assert e["captured"] == 0.0  # CPU: no CUDA graphs
        # a kind among them: its longest call is too
        assert max(f["seconds"] for f in slowest if f["kind"] == e["kind"]) == kinds[e["kind"]][2]
    apex.close()


@pytest.fixture(scope="module")
def two_layer_llama():
    from tests.helpers import tiny_model

    model = tiny_model("llama", layers=2, max_position_embeddings=1024)
    model.generation_config.eos_token_id = None
    return model


# (requests, prompt range, output range, device pool blocks, step budget): each pool small enough to swap
SCHEDULER_BATCHES = [(60, (20, 300), (5, 60), 40, 128), (40, (10, 500), (1, 100), 100, 512),
                     (120, (50, 120), (30, 30), 30, 64)]


@pytest.mark.parametrize("seed", range(len(SCHEDULER_BATCHES)))
def test_gpu_only_batches_take_the_steps_the_engines_scheduler_takes(two_layer_llama, seed):
    """The batch model replays the scheduler's rules (admission with the growth reserve, chunked prefill, swaps
    when the pool's blocks run out): on a CPU engine's GPU-only batches of random lengths, in pools small enough
    to swap, it predicts the engine's steps within 2%. Its look-ahead is the engine's (`engine_limits`): none on
    a CPU engine, whose evictions wait for the step that needs the blocks (with a CUDA engine's 8 tokens it
    predicts 2-8% more steps of these batches: twice the swaps)."""
    count, prompt, output, blocks, budget = SCHEDULER_BATCHES[seed]
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads x 16 dims, fp32, 16-token blocks
    apex = optimize(two_layer_llama, ApexConfig(offload="never", gpu_cache_size=blocks * block_bytes,
                                                cpu_cache_size=400 * block_bytes, max_model_len=700,
                                                max_num_batched_tokens=budget))
    engine = apex.engine
    g = torch.Generator().manual_seed(seed)
    lengths = [(int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g)),
                int(torch.randint(output[0], output[1] + 1, (1,), generator=g))) for _ in range(count)]
    prompts = [torch.randint(3, 96, (p,), generator=g).tolist() for p, _ in lengths]
    engine.generate(prompts, [SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in lengths],
                    progress=False)
    limits = engine_limits(engine)
    predicted = predict_batch(PerfModel(profile(100.0)), lengths, limits)
    assert limits.lookahead == 0 and engine.stats.parked > 0 and predicted.parks > 0
    assert predicted.steps == pytest.approx(engine.stats.steps, rel=0.02)
    assert predicted.output_tokens == sum(o for _, o in lengths)
    apex.close()


def test_predict_batch_says_why_it_needs_cuda():
    apex = staggered(sharp_model(), width=2, device_blocks=4)
    with pytest.raises(RuntimeError, match="profile measured on CUDA"):
        apex.engine.predict_batch([(16, 8)])
    apex.close()
