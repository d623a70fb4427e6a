"""The performance model on synthetic profiles: interpolation, each plan's step, the choice (GPU-only when the
CPU is too slow, hybrid when the bound is large, never a plan predicted slower than GPU-only), ideal_gain,
APEX's inequality, explain(), and the on-disk profile cache."""
import pytest

from apex_compile.runtime.perf_model import (PLANS, STAGGER_HOLD_MARGIN, STAGGER_KEEP_MARGIN, STAGGER_MARGIN,
                                             AutoOffload, PerfModel, Profile, StepCalibration,
                                             apex_pipeline_inequality,
                                             cached_profile, interpolate, profile_path)

ONE_BATCH_PLANS = ("never", "overlap", "pipeline")  # plans whose host rows share every layer of one step
GROUPS = 66  # Llama-3-8B: 2 lanes x (32 layers + 1) host requests per staggered row

KV_PER_TOKEN = 128 * 1024  # Llama-3-8B bf16: 2 * 32 layers * 8 kv heads * 128 dims * 2 bytes


def profile(cpu_gbps: float, gpu_gbps: float = 3000.0, linear_ms: float = 4.6) -> Profile:
    """A memory-bound machine: linear layers nearly flat in tokens, attention = KV bytes / bandwidth."""
    ctx = [1024, 65536, 1048576]
    return Profile("synthetic", [1, 64, 256], [linear_ms / 1e3, linear_ms * 1.04 / 1e3, linear_ms * 1.2 / 1e3],
                   ctx, [c * KV_PER_TOKEN / (gpu_gbps * 1e9) for c in ctx],
                   ctx, [c * KV_PER_TOKEN / (cpu_gbps * 1e9) for c in ctx],
                   KV_PER_TOKEN, 2 * 32 * 4096 * 2 * 2, 50e9)


def test_interpolation_is_piecewise_linear_and_extends():
    assert interpolate([1, 3], [10, 30], 2) == pytest.approx(20)
    assert interpolate([1, 3], [10, 30], 5) == pytest.approx(50)
    assert interpolate([1, 3], [10, 30], 0) == pytest.approx(0)
    assert interpolate([4], [8], 2) == pytest.approx(4)


def test_plans_predict_the_documented_formulas():
    model = PerfModel(profile(cpu_gbps=90))
    never = model.predict("never", 16, 0, 1024)
    assert never.step_s == pytest.approx(model.linear_s(16) + model.gpu_attention_s(16 * 1024))
    cpu = model.cpu_attention_s(8 * 1024) + model.copy_s(8)
    overlap = model.predict("overlap", 16, 8, 1024)
    assert overlap.step_s == pytest.approx(model.linear_s(24) + max(model.gpu_attention_s(16 * 1024), cpu))
    pipeline = model.predict("pipeline", 16, 8, 1024)
    assert pipeline.step_s == pytest.approx(max(model.linear_s(16) + model.linear_s(8)
                                                + model.gpu_attention_s(16 * 1024), cpu))
    staggered = model.predict("staggered", 16, 8, 1024)
    assert staggered.step_s == pytest.approx(max(model.linear_s(24) + model.gpu_attention_s(16 * 1024)
                                                 + model.copy_s(8), model.cpu_job_s(8 * 1024)))
    # the staggered job is one call at the CPU's bandwidth: no per-layer call costs below the probes
    assert model.cpu_job_s(704) == pytest.approx(704 * KV_PER_TOKEN / model.cpu_bandwidth())
    with pytest.raises(ValueError):
        model.predict("never", 16, 1, 1024)
    with pytest.raises(ValueError):
        model.predict("sometimes", 16, 1, 1024)


def test_a_slow_cpu_keeps_everything_on_the_gpu():
    model = PerfModel(profile(cpu_gbps=0.5))
    assert model.choose(gpu_capacity=16, cpu_capacity=32, context=1024).plan == "never"


def test_a_fast_gpu_whose_step_is_its_weight_reads_keeps_everything_on_the_gpu():
    """H200-like: 4.6 ms of weights at 3 TB/s against a 90 GB/s CPU. The CPU could add ideal_gain tokens/s only
    by overlapping the whole step, which no plan does: one batch hides it behind the device rows' attention
    alone, two sub-batches cost a second weight sweep."""
    model = PerfModel(profile(cpu_gbps=90))
    assert model.choose(gpu_capacity=8, cpu_capacity=64, context=1024, plans=ONE_BATCH_PLANS).plan == "never"
    for capacity in (4, 8, 16, 32, 64):
        gain = (model.choose(capacity, 64, 1024, ONE_BATCH_PLANS).tokens_per_s
                - model.predict("never", capacity, 0, 1024).tokens_per_s)
        assert 0 <= gain < 0.35 * model.ideal_gain(1024)
    # a tiny device pool is where the second sweep pays (APEX's inequality): 4 requests gain with the pipeline
    assert model.choose(gpu_capacity=4, cpu_capacity=64, context=1024, plans=ONE_BATCH_PLANS).plan == "pipeline"


@pytest.mark.parametrize("capacity", [4, 8, 16, 32])
def test_the_staggered_plan_takes_most_of_ideal_gain_on_a_fast_gpu(capacity):
    """H200-like again: staggered host rows overlap the CPU with the whole step, so the gain approaches
    ideal_gain when the host pool holds enough requests ((layers + 1) per row)."""
    model = PerfModel(profile(cpu_gbps=90))
    never = model.predict("never", capacity, 0, 1024)
    choice = model.choose(capacity, 64 * GROUPS, 1024, stagger_groups=GROUPS)
    assert choice.plan == "staggered"
    assert 0.75 * model.ideal_gain(1024) <= choice.tokens_per_s - never.tokens_per_s <= model.ideal_gain(1024) * 1.001
    # its rows need (layers + 1) requests each: a host pool of 33 requests gives one row, no more
    assert model.choose(capacity, GROUPS, 1024, ("never", "staggered"), GROUPS).cpu_requests <= 1


def test_auto_explains_the_staggered_plan():
    tokens = {"gpu": 8 * 1024, "cpu": 400 * 1024}
    lines = AutoOffload(PerfModel(profile(cpu_gbps=90)), stagger_groups=GROUPS).explain(tokens["gpu"], tokens["cpu"],
                                                                                      64, 1024)
    (line,) = [x for x in lines if x.startswith("staggered plan")]
    best = PerfModel(profile(cpu_gbps=90)).choose(8, 400, 1024, ("never", "staggered"), GROUPS)
    assert f"{best.cpu_requests} host row(s) per step" in line and f"{best.tokens_per_s:.0f} vs" in line
    (bound,) = [x for x in lines if x.startswith("host-pool bound of the staggered plan")]
    never = PerfModel(profile(cpu_gbps=90)).predict("never", 8, 0, 1024)
    assert f"{400 // GROUPS} row(s)" in bound and f"+{(400 // GROUPS) / never.step_s:.0f} tokens/s" in bound
    # the host requests' TPOT is the step's times (layers + 1): stated beside the device rows'
    (tpot,) = [x for x in lines if x.startswith("TPOT predicted")]
    assert f"{never.step_s * 1e3:.2f} ms GPU-only" in tpot and f"a token per {GROUPS} steps" in tpot


def test_a_large_bound_is_taken_and_never_exceeds_ideal_gain():
    """T4-like: a slow weight sweep (42 ms at 300 GB/s) leaves the CPU time to attend many host rows."""
    model = PerfModel(profile(cpu_gbps=90, gpu_gbps=300, linear_ms=42))
    context = 1024
    never = model.predict("never", 8, 0, context)
    choice = model.choose(gpu_capacity=8, cpu_capacity=64, context=context, plans=ONE_BATCH_PLANS)
    assert choice.plan == "pipeline" and choice.cpu_requests > 0
    gain = choice.tokens_per_s - never.tokens_per_s
    assert 0 < gain <= model.ideal_gain(context) * 1.001
    assert model.ideal_gain(context) == pytest.approx(90e9 / (KV_PER_TOKEN * context), rel=1e-6)
    assert model.cpu_seconds_per_token() == pytest.approx(KV_PER_TOKEN / 90e9, rel=1e-6)


@pytest.mark.parametrize("cpu_gbps", [0.1, 5, 20, 90, 400])
def test_the_choice_is_never_predicted_slower_than_gpu_only(cpu_gbps):
    model = PerfModel(profile(cpu_gbps))
    for capacity in (1, 8, 64):
        never = model.predict("never", capacity, 0, 2048)
        assert model.choose(capacity, 32, 2048).tokens_per_s >= never.tokens_per_s
        assert all(model.predict(p, capacity, 0, 2048).step_s == never.step_s for p in PLANS)


def test_apex_inequality_and_explain():
    lhs, rhs, holds = apex_pipeline_inequality(8, 2, t_linear=4.0, t_attention=1.0)
    assert (lhs, rhs, holds) == (4.0, 2 * 4 + 3 + 0.25, True)
    assert not apex_pipeline_inequality(100, 1, 4.0, 1.0)[2]
    lines = PerfModel(profile(cpu_gbps=90, gpu_gbps=300, linear_ms=42)).explain(8, 64, 1024, ONE_BATCH_PLANS)
    text = "\n".join(lines)
    for phrase in ("bandwidth ratio", "attention share", "N_G/N_C < 2*T_lin/T_att + 3 + T_att/T_lin", "ideal_gain",
                   "verdict: pipeline"):
        assert phrase in text


def test_profiles_are_cached_on_disk(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return profile(cpu_gbps=42)

    first = cached_profile("H200/Xeon/llama3-8b/bf16", measure, root=str(tmp_path))
    second = cached_profile("H200/Xeon/llama3-8b/bf16", measure, root=str(tmp_path))
    assert calls == [1] and first == second
    assert profile_path("H200/Xeon/llama3-8b/bf16", str(tmp_path)).startswith(str(tmp_path / "perf_model"))


def calibrated(cpu_gbps=90.0, stagger_extra_ms=0.6, width=8):
    """An H200-like profile calibrated by graph replays: the real step 10% under the separate-GEMM sum, the
    staggered graph `stagger_extra_ms` over it (the block's row exchange)."""
    prof = profile(cpu_gbps)
    rows = [1, 8, 32, 64]
    step = [0.9 * PerfModel(prof).linear_s(n) for n in rows]
    return PerfModel(prof, StepCalibration(rows, step, rows, [t + stagger_extra_ms / 1e3 for t in step], width))


def test_a_calibrated_step_is_the_replayed_graph_plus_the_context_beyond_one_token():
    model = calibrated()
    raw = PerfModel(model.profile)
    c = model.calibration
    never = model.predict("never", 16, 0, 1024).step_s
    context = raw.gpu_attention_s(16 * 1024) - raw.gpu_attention_s(16)
    assert never == pytest.approx(interpolate(c.rows, c.step_s, 16) + context)
    staggered = model.predict("staggered", 16, 3, 1024).step_s
    gpu = interpolate(c.stagger_rows, c.stagger_s, 16) + context + raw.copy_s(8)  # every block row is copied
    assert staggered == pytest.approx(max(gpu, raw.cpu_job_s(3 * 1024)))
    # the other plans keep the profile's formulas; a calibration of the GPU-only graphs alone leaves the
    # staggered plan on them too
    assert model.predict("overlap", 16, 3, 1024).step_s == raw.predict("overlap", 16, 3, 1024).step_s
    partial = PerfModel(model.profile, StepCalibration(c.rows, c.step_s))
    assert partial.predict("staggered", 16, 3, 1024).step_s == raw.predict("staggered", 16, 3, 1024).step_s
    assert partial.predict("never", 16, 0, 1024).step_s == pytest.approx(never)


def test_prompt_tokens_add_their_linear_layers_and_the_calibrated_prompt_steps_residual():
    """A prompt token costs its linear layers; where the warm-up timed a prompt-only step, what the model's price
    of that step missed is added per token (a measured step under the price takes it back, never below zero)."""
    model = calibrated()
    linear = model.linear_s(6 + 200) - model.linear_s(6)
    assert model.prompt_s(6, 200) == pytest.approx(linear)
    assert model.prompt_s(0, 200) == pytest.approx(model.linear_s(201) - model.linear_s(1))
    assert model.prompt_s(6, 0) == 0.0
    c = model.calibration
    price = model.predict("never", 1, 0, 1.0).step_s + model.linear_s(1 + 256) - model.linear_s(1)
    slow = PerfModel(model.profile, StepCalibration(c.rows, c.step_s, prompt_tokens=256, prompt_s=price + 2e-3))
    assert slow.prompt_residual_s() == pytest.approx(2e-3 / 256)
    assert slow.prompt_s(6, 200) == pytest.approx(linear + 200 * 2e-3 / 256)
    # the calibrated step itself is priced at what was measured
    assert slow.predict("never", 1, 0, 1.0).step_s + slow.prompt_s(1, 256) == pytest.approx(price + 2e-3)
    fast = PerfModel(model.profile, StepCalibration(c.rows, c.step_s, prompt_tokens=256, prompt_s=price - 2e-4))
    assert 0 < fast.prompt_s(6, 200) == pytest.approx(linear - 200 * 2e-4 / 256)
    far = PerfModel(model.profile, StepCalibration(c.rows, c.step_s, prompt_tokens=256, prompt_s=price - 1.0))
    assert far.prompt_s(6, 200) == 0.0
    # the residual needs the decode graphs' replays it is measured against
    alone = PerfModel(model.profile, StepCalibration(prompt_tokens=256, prompt_s=price + 2e-3))
    assert alone.prompt_s(6, 200) == pytest.approx(linear)


def test_auto_stagger_rows_follow_the_calibrated_model():
    """auto's host rows per step: the best count when it beats GPU-only by the margin, else 0."""
    fast = AutoOffload(calibrated(cpu_gbps=90), stagger_groups=GROUPS)
    rows = fast.stagger_rows(12, 576, 8)
    assert 0 < rows <= 8
    best = max(range(1, 9), key=lambda r: fast.model.predict("staggered", 12, r, 576).tokens_per_s)
    assert rows == best
    # a slow CPU, or a staggered graph whose overhead eats the rows' tokens: none
    assert AutoOffload(calibrated(cpu_gbps=2), stagger_groups=GROUPS).stagger_rows(12, 576, 8) == 0
    assert AutoOffload(calibrated(stagger_extra_ms=4.0), stagger_groups=GROUPS).stagger_rows(12, 576, 8) == 0
    # a device batch so large that 8 rows are a small share: the overhead decides
    assert AutoOffload(calibrated(stagger_extra_ms=1.5), stagger_groups=GROUPS).stagger_rows(64, 576, 8) == 0


def test_the_staggered_verdict_follows_the_measured_cpu_job_over_the_profile():
    """`learn_cpu_job` (the running pipeline's job fit): a profile probed while the host was busy (a slow CPU)
    caps the rows below what the measured job fits; with the fit the rows follow the job, and a measured job
    slower than the profile takes rows away. None (no fit yet): the profile's rate."""
    slow_probe = AutoOffload(calibrated(cpu_gbps=30), stagger_groups=GROUPS)
    fast_probe = AutoOffload(calibrated(cpu_gbps=90), stagger_groups=GROUPS)
    capped, free = slow_probe.stagger_rows(12, 576, 8), fast_probe.stagger_rows(12, 576, 8)
    assert capped < free
    per_token = fast_probe.model.cpu_seconds_per_token()  # what the job measures on a host at 90 GB/s
    slow_probe.learn_cpu_job((0.0, per_token))
    assert slow_probe.stagger_rows(12, 576, 8) == free
    # the fixed part counts: a job whose per-call costs take half the step fits fewer rows
    step = fast_probe.model.predict("never", 12, 0, 576).step_s
    slow_probe.learn_cpu_job((step / 2, per_token))
    assert slow_probe.stagger_rows(12, 576, 8) < free
    fast_probe.learn_cpu_job((0.0, per_token * 3))  # a job measured 3x slower than the probe
    assert fast_probe.stagger_rows(12, 576, 8) < free
    slow_probe.learn_cpu_job(None)
    assert slow_probe.stagger_rows(12, 576, 8) == capped


def test_the_staggered_verdict_prices_the_job_at_the_host_rows_context():
    """A staggered host request gains a token per num_layers + 1 steps, so the job's rows run at a context of
    their own (near their prompt's) while the device rows' grows: the job is priced at `host_context`, the
    device rows' attention at `context`. Priced at the device rows' longer context, the job fits fewer rows."""
    policy = AutoOffload(calibrated(cpu_gbps=90), stagger_groups=GROUPS)
    model = policy.model
    short, long = 560, 800
    gpu = model.predict("staggered", 12, 5, long, cpu_context=0).step_s  # a job without work: the GPU's step
    assert model.predict("staggered", 12, 5, long, cpu_context=short).step_s == pytest.approx(
        max(gpu, model.cpu_job_s(5 * short)))
    assert model.predict("staggered", 12, 5, long, cpu_context=10 ** 6).step_s == pytest.approx(
        model.cpu_job_s(5 * 10 ** 6))
    assert model.predict("staggered", 12, 5, long, cpu_context=long).step_s == model.predict(
        "staggered", 12, 5, long).step_s
    # a job near the step: the host rows' shorter context allows more rows than the device rows' would
    policy.learn_cpu_job((0.0, gpu / (5.5 * short)))  # 5.5 rows of `short` tokens fill the GPU's step
    at_host = policy.stagger_rows(12, long, 8, host_context=short)
    assert policy.stagger_rows(12, long, 8) < at_host
    # the gap it learns is taken at the same two contexts: a measured step equal to that prediction adds none
    for _ in range(policy.gap.min_steps):
        policy.observe_staggered(12, at_host, long, policy._model_step(12, at_host, long, short).step_s,
                                 host_context=short)
    assert policy.gap.seconds(True) == pytest.approx(0.0, abs=1e-9)
    assert policy.stagger_rows(12, long, 8, host_context=short) == at_host


def test_the_staggered_plan_needs_its_margin_over_gpu_only():
    """A predicted gain below `stagger_margin` (default STAGGER_MARGIN: the plan's unmodelled costs) takes no
    host rows; above it the best count; explain() shows the best prediction and the margin."""
    model = calibrated(cpu_gbps=90)
    never = model.predict("never", 12, 0, 576).tokens_per_s
    gain = max(model.predict("staggered", 12, r, 576).tokens_per_s for r in range(1, 9)) / never - 1
    assert gain > 0
    assert AutoOffload(model, stagger_groups=GROUPS, stagger_margin=gain * 0.99).stagger_rows(12, 576, 8) > 0
    assert AutoOffload(model, stagger_groups=GROUPS, stagger_margin=gain * 1.01).stagger_rows(12, 576, 8) == 0
    assert AutoOffload(model).stagger_margin == STAGGER_MARGIN > AutoOffload(model).margin
    text = AutoOffload(model, stagger_groups=GROUPS, stagger_margin=gain * 1.01).explain(
        12 * 576, 10 ** 7, 64, 576)[-1]
    assert f"{gain:+.1%}" in text and text.endswith(": 0 row(s)")


def test_a_running_pipeline_needs_only_the_keep_margin():
    """`stagger_rows(keep=True)` (a pipeline with members) compares the best prediction with the lower
    `stagger_keep_margin`: a gain between the two margins keeps rows but does not start them."""
    model = calibrated(cpu_gbps=90)
    never = model.predict("never", 12, 0, 576).tokens_per_s
    gain = max(model.predict("staggered", 12, r, 576).tokens_per_s for r in range(1, 9)) / never - 1
    policy = AutoOffload(model, stagger_groups=GROUPS, stagger_margin=gain * 1.01, stagger_keep_margin=gain * 0.99)
    assert policy.stagger_rows(12, 576, 8) == 0 and policy.stagger_rows(12, 576, 8, keep=True) > 0
    policy.stagger_keep_margin = gain * 1.01
    assert policy.stagger_rows(12, 576, 8, keep=True) == 0
    assert AutoOffload(model).stagger_keep_margin == STAGGER_KEEP_MARGIN < STAGGER_MARGIN
    # hold=True (a closed pipeline's members): the hold margin, whatever `keep` says
    assert policy.stagger_rows(12, 576, 8, keep=True, hold=True) > 0  # the default hold margin, 0
    policy.stagger_hold_margin = gain * 1.01
    assert policy.stagger_rows(12, 576, 8, hold=True) == 0
    policy.stagger_hold_margin, policy.stagger_keep_margin = gain * 0.99, 10.0
    assert policy.stagger_rows(12, 576, 8, keep=True, hold=True) > 0
    assert AutoOffload(model).stagger_hold_margin == STAGGER_HOLD_MARGIN < STAGGER_KEEP_MARGIN


def test_the_staggered_verdict_follows_each_kind_of_steps_learned_host_gap():
    """`observe_staggered` teaches each kind of step its host gap (the time beyond the model's prediction): a
    GPU-only step measured slower than predicted makes the same host rows worth more (start margin passed),
    staggered steps measured slower again take them back; the explanation shows both gaps. Until a kind has
    its minimum of samples its gap is 0 (the plain model)."""
    model = calibrated(cpu_gbps=90)
    never = model.predict("never", 12, 0, 576).step_s
    gain = max(model.predict("staggered", 12, r, 576).tokens_per_s for r in range(1, 9)) / (12 / never) - 1
    policy = AutoOffload(model, stagger_groups=GROUPS, stagger_margin=gain * 1.05)
    assert policy.stagger_rows(12, 576, 8) == 0
    for _ in range(policy.gap.min_steps - 1):  # too few samples: no gap yet
        policy.observe_staggered(12, 0, 576, never * 1.3)
    assert policy.gap.seconds(False) == 0.0 and policy.stagger_rows(12, 576, 8) == 0
    policy.observe_staggered(12, 0, 576, never * 1.3)
    assert policy.gap.seconds(False) == pytest.approx(never * 0.3)
    rows = policy.stagger_rows(12, 576, 8)
    assert rows > 0
    assert "+%.2f ms GPU-only" % (never * 0.3 * 1e3) in policy.explain(12 * 576, 10 ** 7, 64, 576)[-1]
    slow = model.predict("staggered", 12, rows, 576).step_s * 1.3
    # steps the CPU job bounds (its measured fit as long as the step): the job's time, not a gap of every count
    for _ in range(policy.gap.min_steps):
        policy.observe_staggered(12, rows, 576, slow, job_s=slow * 0.99)
    assert policy.gap.seconds(True) == pytest.approx(slow * 0.01) and policy.stagger_rows(12, 576, 8) == rows
    for _ in range(policy.gap.residuals[True].maxlen):  # steps the job does not bound: a gap of the plan
        policy.observe_staggered(12, rows, 576, slow, job_s=slow * 0.5)
    assert policy.gap.seconds(True) > 0 and policy.stagger_rows(12, 576, 8) == 0


def test_auto_builds_the_staggered_plan_only_where_a_typical_load_gains():
    contexts = [256, 1024, 4096]
    gib = 1 << 30
    gpu_tokens, host_tokens = gib // KV_PER_TOKEN, 32 * gib // KV_PER_TOKEN
    assert AutoOffload(calibrated(90), stagger_groups=GROUPS).worth_staggering(gpu_tokens, host_tokens, 64,
                                                                              contexts, 8)
    assert not AutoOffload(calibrated(2), stagger_groups=GROUPS).worth_staggering(gpu_tokens, host_tokens, 64,
                                                                                 contexts, 8)
    # a device pool smaller than one typical request: every host row is a gain
    assert AutoOffload(calibrated(90), stagger_groups=GROUPS).stagger_rows(0, 4096, 8) > 0
    assert AutoOffload(calibrated(90), stagger_groups=GROUPS).worth_staggering(128, host_tokens, 64, contexts, 8)
    # a host pool smaller than one row's requests (stagger_groups of them) cannot hold the plan
    assert not AutoOffload(calibrated(90), stagger_groups=GROUPS).worth_staggering(gpu_tokens, 4096 * 10, 64,
                                                                                  contexts, 8)


def test_the_online_host_gap_learns_a_constant_gap_from_earlier_steps_only():
    """Steps that take the model's GPU-side prediction plus a host gap of 0.5 ms (1.5 ms with host rows) are
    predicted exactly once `min_steps` of their kind were seen, and a step's own time never enters its
    prediction (changing it changes no prediction up to and including its own)."""
    from apex_compile.runtime.perf_model import HostGap, online_predictions

    model = PerfModel(profile(90.0))
    steps = []
    for i in range(40):
        cpu = i % 3 == 0
        gpu, context = 12 + i % 4, 600.0 + i
        base = model.predict("staggered" if cpu else "never", gpu, int(cpu), context).step_s
        steps.append((gpu, int(cpu), context, base + (1.5e-3 if cpu else 0.5e-3), 0))
    steps.insert(5, (12, 0, 600.0, 1.0, 256))  # a mixed step: neither predicted nor learned from
    pairs = online_predictions(model, steps)
    assert len(pairs) == 40
    gap = HostGap()
    assert gap.min_steps == 8 and gap.seconds(False) == 0.0
    never_seen = host_seen = 0
    for (predicted, measured), step in zip(pairs, [s for s in steps if not s[4]]):
        seen = host_seen if step[1] else never_seen
        if seen >= gap.min_steps:
            assert predicted == pytest.approx(measured, rel=1e-9)
        else:
            assert measured - predicted == pytest.approx(1.5e-3 if step[1] else 0.5e-3)
        host_seen, never_seen = (host_seen + 1, never_seen) if step[1] else (host_seen, never_seen + 1)
    changed = list(steps)
    last = changed[-1]
    changed[-1] = last[:3] + (last[3] + 0.1,) + last[4:]
    assert [p for p, _ in online_predictions(model, changed)] == [p for p, _ in pairs]


def test_recorded_steps_price_their_host_rows_at_their_own_context():
    """A recorded step may carry its host rows' own context (a sixth element): the scoring prices the CPU job
    there, as the engine's model does, and a five-element record (or a None host context) at the step's context.
    With the host rows at half the device rows' context a staggered step whose job binds is predicted shorter."""
    from apex_compile.runtime.perf_model import online_predictions, step_host_context

    model = PerfModel(profile(10.0))  # a slow CPU: the job bounds the staggered step
    device, lagging = (12, 6, 1200.0, 0.01, 0), (12, 6, 1200.0, 0.01, 0, 600.0)
    assert step_host_context(device) is None and step_host_context(device + (None,)) is None
    assert step_host_context(lagging) == 600.0
    at_device = model.predict("staggered", 12, 6, 1200.0).step_s
    at_host = model.predict("staggered", 12, 6, 1200.0, cpu_context=600.0).step_s
    assert at_host < at_device
    assert [p for p, _ in online_predictions(model, [device, device + (None,)])] == [at_device, at_device]
    assert [p for p, _ in online_predictions(model, [lagging])] == [at_host]


def test_the_cpu_attention_bandwidth_is_probed_over_the_host_pool(tiny_llama, monkeypatch):
    """`perf_profile.cpu_attention_bandwidth` (a benchmark's B_cpu in its own run): the bytes the op reads at
    the profile's largest point over the host pool, per second of its best repeat; the host pool bounds it."""
    from apex_compile import ApexConfig, optimize
    from apex_compile.runtime import perf_profile

    apex = optimize(tiny_llama, ApexConfig(offload="never", compile=False, gpu_cache_size=1 << 20,
                                           cpu_cache_size=1 << 20, max_num_seqs=4))
    engine, s = apex.engine, apex.engine.shape
    probed = []

    def timed(engine_, total, repeats=3):
        probed.append(total)
        return 0.5

    monkeypatch.setattr(perf_profile, "_cpu_attention_seconds", timed)
    host_tokens = engine.kv.pools[perf_profile.HOST_POOL].num_blocks * s.block_size
    rate = perf_profile.cpu_attention_bandwidth(engine)
    assert probed == [perf_profile._attention_points(host_tokens, 32768)[-1]] and probed[0] <= max(
        host_tokens, perf_profile.BATCH * 64)
    assert rate == pytest.approx(probed[0] * (s.block_bytes // s.block_size) / 0.5)
    monkeypatch.undo()
    assert perf_profile.cpu_attention_bandwidth(engine) > 0  # the op itself, on this host


def test_the_linear_layers_are_timed_at_decode_rows_and_prompt_steps_tokens():
    """The profile times the linear layers at the decode rows (up to max_num_seqs) and at prompt steps' token
    counts, so that a prompt step is priced from measured points, not the decode points' slope extrapolated."""
    import types

    from apex_compile.runtime import perf_profile

    def tokens(max_num_seqs):
        return perf_profile.profile_tokens(types.SimpleNamespace(config=types.SimpleNamespace(
            max_num_seqs=max_num_seqs)))

    assert tokens(64) == [1, 8, 32, 512, 1024, 2048]
    assert tokens(256) == [1, 8, 32, 128, 512, 1024, 2048]
    assert tokens(1) == [1, 512, 1024, 2048]
    assert perf_profile.PROMPT_TOKENS[0] > perf_profile.LINEAR_TOKENS[-1]
