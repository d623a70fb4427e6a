"""End to end on CUDA (skipped without a GPU): a small random Llama config, model on the GPU, requests in the
device pool and/or the host pool (CPU attention overlapped with the GPU through launch/device/wait).

fp32 (TF32 off): the same tokens as HF generate. bf16: forward logits within BF16_LOGITS_ATOL of HF's (the two
differ only in op order and fused kernels; bf16 keeps ~3 significant digits of logits of magnitude ~1-10).
"""
import os

import pytest
import torch

from apex_compile.config import ApexConfig, TuningConfig
from apex_compile.model import optimize

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_LOGITS_ATOL = 0.25
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
MB = 1 << 20


def random_llama(dtype, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides})).eval()
    finally:
        torch.set_default_dtype(previous)


def left_padded_batch(lengths):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, SMALL["vocab_size"], (n,), device="cuda")
        mask[i, width - n:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def fp32_model():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return random_llama(torch.float32)


@pytest.mark.parametrize("offload", ["never", "all", 0.5, "auto"])
def test_greedy_equals_hf_generate_fp32(fp32_model, offload):
    ids, mask = left_padded_batch([5, 17, 33, 64, 9, 40])
    with torch.no_grad():
        ref = fp32_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    apex = optimize(fp32_model, ApexConfig(offload=offload, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB))
    out = apex.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    assert torch.equal(out, ref)
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_steps_run_ahead_equal_hf_and_the_synchronous_engine(fp32_model):
    """Async scheduling with CUDA graphs: greedy tokens equal HF's; with EOS stops, the synchronous engine's."""
    ids, mask = left_padded_batch([5, 17, 33, 64, 9, 40])
    with torch.no_grad():
        ref = fp32_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    config = dict(offload="never", gpu_cache_size=32 * MB, cpu_cache_size=32 * MB, capture_sizes=(2, 4, 8))
    apex = optimize(fp32_model, ApexConfig(async_scheduling=True, **config))
    out = apex.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    assert torch.equal(out, ref) and apex.engine.stats.ahead_steps > 0
    from apex_compile.runtime.request import SamplingParams

    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    eos = tuple(sorted(set(ref[:, ids.shape[1] + 6].tolist())))[:3]  # some requests stop early
    sampling = [SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in (24, 9, 30, 17, 24, 5)]
    sync = optimize(fp32_model, ApexConfig(async_scheduling=False, **config))
    expected = [(c.token_ids, c.finish_reason) for c in sync.engine.generate(prompts, sampling)]
    got = [(c.token_ids, c.finish_reason) for c in apex.engine.generate(prompts, sampling)]
    assert got == expected and "eos" in {reason for _, reason in got}
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()
    sync.close()


def test_swaps_with_overlapped_moves_equal_hf_generate_fp32(fp32_model):
    """A device pool too small for the batch (requests parked to the host pool and resumed), steps queued
    ahead and captured graphs, with overlapped moves (parks ahead, device-side ordering): HF's tokens, every
    block back."""
    ids, mask = left_padded_batch([30, 12, 50, 41, 7, 26, 60, 33])
    with torch.no_grad():
        ref = fp32_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    block_bytes = 2 * SMALL["num_hidden_layers"] * SMALL["num_key_value_heads"] * 16 * 32 * 4
    apex = optimize(fp32_model, ApexConfig(offload="never", gpu_cache_size=14 * block_bytes,
                                           cpu_cache_size=64 * block_bytes, async_scheduling=True,
                                           capture_sizes=(2, 4, 8)))
    holds = []
    move = apex.engine.kv.move
    apex.engine.kv.move = lambda request_id, dst, hold=False, **kw: (holds.append(hold),
                                                                     move(request_id, dst, hold, **kw))
    out = apex.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    assert torch.equal(out, ref)
    assert apex.engine.stats.parked > 0 and any(holds)
    apex.engine.kv.sync_moves()
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_full_pools_on_cuda_keep_tokens_identical(fp32_model):
    ids, mask = left_padded_batch([30, 12, 50, 41, 7, 26, 60, 33])
    with torch.no_grad():
        ref = fp32_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    block_bytes = 2 * SMALL["num_hidden_layers"] * SMALL["num_key_value_heads"] * 16 * 32 * 4
    apex = optimize(fp32_model, ApexConfig(offload=0.5, gpu_cache_size=12 * block_bytes,
                                           cpu_cache_size=12 * block_bytes, max_num_batched_tokens=48))
    out = apex.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    assert torch.equal(out, ref)
    stats = apex.engine.stats
    assert stats.moved + stats.recomputed > 0
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_bf16_logits_within_tolerance():
    model = random_llama(torch.bfloat16)
    apex = optimize(model, ApexConfig(offload=0.5, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB))
    ids, _ = left_padded_batch([32, 32, 32, 32])
    with torch.no_grad():
        ref = model(ids).logits.float()
    ours = apex(ids).logits.float()
    assert ours.shape == ref.shape
    assert float((ours - ref).abs().max()) < BF16_LOGITS_ATOL


@pytest.mark.parametrize("offload, max_num_seqs, max_tokens", [("never", 64, 512), (0.5, 64, 512),
                                                               ("never", 4, 512), (0.5, 4, 16)])
def test_cuda_graph_replay_equals_uncaptured_steps(fp32_model, offload, max_num_seqs, max_tokens):
    """Requests of different lengths finish one by one, so decode batches shrink through every capture size
    (with padding rows); with max_num_seqs=4 waiting requests join running ones (mixed prompt + decode steps),
    and with 16-token steps prompts continue over several chunks (the paged prefill kernel). Whole decode graphs
    and piecewise graphs (prompt chunks, host-pool rows, mixed steps) or whole mixed graphs (steps of device-pool
    rows) must give the tokens of the uncaptured compiled step."""
    from apex_compile.runtime.request import SamplingParams

    torch.manual_seed(1)
    prompts = [torch.randint(3, SMALL["vocab_size"], (n,)).tolist() for n in (5, 17, 33, 9, 40, 3, 21)]
    sampling = [SamplingParams(max_new_tokens=n) for n in (3, 30, 12, 7, 25, 1, 18)]
    outputs = []
    for graphs, mixed in ((True, True), (True, False), (False, False)):
        apex = optimize(fp32_model, ApexConfig(offload=offload, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB,
                                               cuda_graphs=graphs, mixed_graphs=mixed, capture_sizes=(1, 2, 4, 8),
                                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens))
        outputs.append([c.token_ids for c in apex.engine.generate(prompts, sampling)])
        engine = apex.engine
        if graphs:
            mixed_replays = engine.mixed.replays if mixed else 0
            assert engine.pieces.replays + mixed_replays > 0
            assert engine.stats.steps == engine.pieces.replays + engine.graphs.replays + mixed_replays
        if graphs and offload == "never":
            assert engine.graphs.ready and engine.graphs.replays > 10
            assert engine.pieces.replays == 0 if mixed else engine.pieces.replays > 0  # every step fits a layout
        if graphs and mixed and offload == "never" and max_num_seqs == 4:
            assert engine.mixed.replays > 0  # waiting requests joined running ones (with host rows: piecewise)
        assert engine.blocks_in_use() == {"device": 0, "host": 0}
    assert outputs[0] == outputs[1] == outputs[2]


def test_auto_measures_a_profile_once_and_explains_its_verdict(fp32_model, tmp_path, monkeypatch):
    """offload="auto" on CUDA: the profile is measured by the first engine and read from disk by the next."""
    from apex_compile.runtime import perf_profile

    monkeypatch.setenv("APEX_COMPILE_CACHE_DIR", str(tmp_path))
    calls = []
    measure = perf_profile.measure_profile
    monkeypatch.setattr(perf_profile, "measure_profile", lambda engine: calls.append(1) or measure(engine))
    config = ApexConfig(offload="auto", gpu_cache_size=32 * MB, cpu_cache_size=32 * MB)
    first = optimize(fp32_model, config)
    second = optimize(fp32_model, config)
    assert calls == [1] and first.engine.auto_policy.model.profile == second.engine.auto_policy.model.profile
    profile = first.engine.auto_policy.model.profile
    assert all(t > 0 for t in profile.linear_s + profile.gpu_attention_s + profile.cpu_attention_s)
    assert profile.linear_tokens == perf_profile.profile_tokens(first.engine)  # prompt steps' rows too
    assert profile.linear_tokens[-1] == perf_profile.PROMPT_TOKENS[-1]
    assert "verdict:" in first.offload_decision() and "ideal_gain" in first.offload_decision()


@pytest.mark.parametrize("offload", ["never", "auto"])
def test_the_warm_up_times_a_prompt_only_step_into_the_calibration(fp32_model, offload, tmp_path, monkeypatch):
    """warmup() runs a prompt of the step budget through the engine (its graph captured first) and keeps the
    step's time for the model's prompt price; with the staggered plan under auto it also captures the pieces of
    two pipeline prompt sizes (the largest first) and keeps the second's seconds as the price of a capture; the
    user's counters and pools start clean."""
    monkeypatch.setenv("APEX_COMPILE_CACHE_DIR", str(tmp_path))
    apex = optimize(fp32_model, ApexConfig(offload=offload, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB))
    engine = apex.engine
    engine.warmup()
    c = engine.calibration
    assert c.rows and c.prompt_tokens == engine.config.max_num_batched_tokens and c.prompt_s > 0
    pieces = getattr(engine.plan, "stagger_pieces", None)
    if pieces is None:
        assert c.piece_capture_s == 0.0
    else:
        large = [size for size in pieces.sizes if size > 512]
        assert sorted(rows for rows, _ in pieces.pieces) == sorted({large[len(large) // 2], large[-1]})
        assert 0 < c.piece_capture_s <= pieces.capture_seconds
    assert engine.stats.steps == 0 and engine.blocks_in_use() == {"device": 0, "host": 0}


GREEDY_20 = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)


SMALL_POOL_LENGTHS = [5, 17, 33, 64, 9, 40, 21]


def small_pool_case(model, lengths=SMALL_POOL_LENGTHS):
    """Requests (default seven) for a device pool of 8 blocks (it holds few of them): (ids, mask, HF's greedy
    tokens, the bytes of one KV block)."""
    ids, mask = left_padded_batch(lengths)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **GREEDY_20)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    block = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * head_dim * 4
    return ids, mask, ref, block


def sharp_small_pool_case(lengths=SMALL_POOL_LENGTHS, **overrides):
    """small_pool_case of an fp32 model (SMALL with `overrides`) whose attention is sharpened (so RoPE rows
    matter), TF32 off; the model comes last."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_llama(torch.float32, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return (*small_pool_case(model, lengths), model)


@pytest.mark.parametrize("width,lanes,pin", [(1, 2, False), (3, 2, False), (1, 1, False), (3, 1, True)])
def test_staggered_equals_hf_generate_fp32(width, lanes, pin):
    """Requests the small device pool cannot take decode staggered from the host pool (CPU attention on the
    worker thread, one layer per step; one lane: each layer waits on the device for the CPU's): the same tokens
    as HF (attention sharpened so RoPE rows matter); pinned, the launching thread runs off the worker's cores
    while the engine is open."""
    ids, mask, ref, block, model = sharp_small_pool_case()
    before = os.sched_getaffinity(0)
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=width, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=lanes, pin_launcher=pin))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    if lanes == 1:
        jobs = apex.engine.stagger.executor
        assert apex.engine.stagger.layered and jobs.job_seconds and int(jobs.status[0]) == 0
    assert apex.engine.stats.requests_per_pool[1] >= 2  # some requests ran staggered from the host pool
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    workers = set(apex.engine.stagger.executor.cores)
    if pin and len(before) > len(workers):
        assert os.sched_getaffinity(0) == before - workers
    apex.close()
    assert os.sched_getaffinity(0) == before


def test_the_launching_thread_waits_on_blocking_events(monkeypatch):
    """Every CUDA event the launching thread synchronizes on through a staggered run (the sampled ids, the step
    buffers' and the pipeline's pinned copies) is a blocking one (the thread sleeps, leaving its core to the CPU
    attention team); tokens are HF's."""
    waited = []

    class Recorded(torch.cuda.Event):
        def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
            event = super().__new__(cls, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
            event.asked_blocking = blocking
            return event

        def synchronize(self):
            waited.append(self.asked_blocking)
            super().synchronize()

    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=1))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref) and apex.engine.stats.requests_per_pool[1] >= 2
    assert len(waited) >= 20 and set(waited) == {True}
    apex.close()


def test_staggered_layered_jobs_of_a_model_without_gqa_equal_hf_generate_fp32():
    """As Llama-2-7B (as many KV heads as query heads): the one-lane plan's layered jobs on the C++ runner give
    HF's tokens and every job finishes (a job over as many KV heads as query heads must not stall a device wait)."""
    ids, mask, ref, block, model = sharp_small_pool_case(num_key_value_heads=SMALL["num_attention_heads"])
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=1))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    jobs = apex.engine.stagger.executor
    assert torch.equal(out, ref)
    assert jobs.runner is not None and jobs.job_seconds and int(jobs.status[0]) == 0
    assert apex.engine.stats.requests_per_pool[1] >= 2
    apex.close()


def test_the_layered_exchange_beside_the_device_rows_equals_hf_generate_fp32():
    """One lane's exchange (device wait, host reads and writes, ready flag) on its side stream beside the device
    rows' attention: HF's tokens."""
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=3, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=1))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    assert apex.engine.stagger.layered and apex.engine.stats.requests_per_pool[1] >= 2
    assert int(apex.engine.stagger.executor.status[0]) == 0  # no device wait timed out
    apex.close()


@pytest.mark.parametrize("lanes", [2, 1])
def test_staggered_mixed_steps_replay_whole_graphs_and_equal_hf_generate_fp32(lanes):
    """Three times the small-pool requests for one staggered row (6 requests in the pipeline): device-pool
    prompts are admitted as device requests finish, beside the pipeline's block. Those mixed steps replay whole
    graphs (the block's exchange captured in them, with its device waits for one lane) and the tokens stay
    HF's."""
    ids, mask, ref, block, model = sharp_small_pool_case(SMALL_POOL_LENGTHS * 3)
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=1, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=lanes))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    assert apex.engine.stagger_mixed.replays > 0 and apex.engine.stats.requests_per_pool[1] >= 1
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


@pytest.mark.parametrize("lanes,reserve", [(2, 0.3), (1, 0.3), (2, 0.0), (1, 0.0)])
def test_members_taking_host_blocks_as_they_grow_on_the_gpu_equal_hf_generate_fp32(lanes, reserve, monkeypatch):
    """TuningConfig.pipeline_reserve on the GPU (async scheduling, captured graphs, layered jobs with one lane): a
    small host pool, the members taking blocks as they grow (with no reserve, waiting for them and recomputed
    when every member waits): HF's tokens, every block back."""
    from apex_compile.runtime.stagger import StaggerPipeline

    grown = []  # a member re-entering group 0 past its blocks
    can_grow = StaggerPipeline.can_grow
    monkeypatch.setattr(StaggerPipeline, "can_grow", lambda self, r: grown.append(
        self.kv.extra_blocks(r.request_id, r.num_computed + 1) > 0) or can_grow(self, r))
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=8 * block,
                                      cpu_cache_size=16 * block, stagger_lanes=lanes,
                                      tuning=TuningConfig(pipeline_reserve=reserve)))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    # members grew in the host pool, or moved to the device pool before they had to
    assert apex.engine.stats.requests_per_pool[1] >= 1 and (any(grown) or apex.engine.stats.migrated)
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


@pytest.mark.parametrize("lanes", [2, 1])
def test_a_fallen_row_limit_on_the_gpu_equals_hf_generate_fp32(lanes):
    """The rows' ceiling falls to 0 while three rows are in use (async scheduling, captured graphs): the
    pipeline empties as its requests sample, they are parked and resume in the device pool (their host KV moved
    back), all with HF's tokens."""
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=3, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=lanes))
    stagger = apex.engine.stagger
    begin = stagger.begin_step

    def begin_and_cut():
        begin()
        if sum(r is not None for r in stagger.groups[0].requests) >= 2:
            stagger.rows.set_ceiling(0)

    stagger.begin_step = begin_and_cut
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    assert stagger.rows.ceiling == 0 and stagger.evicted > 0 and not stagger.members()
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


def test_parked_requests_join_the_pipeline_on_the_gpu_equal_hf_generate_fp32(monkeypatch):
    """Requests parked from the device pool while the pipeline took nothing (its ceiling 0) join it once it
    takes them again (one lane: layered jobs, async scheduling, captured graphs): HF's tokens, no block lost."""
    from apex_compile.runtime.plans.pipeline_rules import PipelineRules
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=3, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB, stagger_lanes=1))
    stagger = apex.engine.stagger
    stagger.rows.set_ceiling(0)
    joined = []
    join = PipelineRules.join_parked

    def open_and_join(self):
        if self.scheduler.parked and not stagger.rows.ceiling and not joined:
            stagger.rows.set_ceiling(3)
        joined.extend(join(self))
        return joined

    monkeypatch.setattr(PipelineRules, "join_parked", open_and_join)
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref) and joined
    assert int(stagger.executor.status[0]) == 0 and apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_auto_that_chooses_the_staggered_plan_equals_hf_generate_fp32(tmp_path, monkeypatch):
    """offload="auto" whose model predicts the staggered plan pays (a profile with a fast CPU, the model's
    rows per step pinned to the block's width and the batch gate open, so the choice does not hang on this tiny
    model's timings: the gate has its own tests in test_runtime_batch_model.py): it builds the pipeline, its
    captured graphs calibrate the model, and the tokens are HF's."""
    from apex_compile.runtime import perf_model, perf_profile
    from apex_compile.runtime.plans.staggered import StaggeredPlan

    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv("APEX_COMPILE_CACHE_DIR", str(tmp_path))
    measure = perf_profile.measure_profile

    def fast_cpu(engine):  # the measured profile with a CPU attention 1000x faster
        profile = measure(engine)
        profile.cpu_attention_s = [t / 1000 for t in profile.cpu_attention_s]
        return profile

    monkeypatch.setattr(perf_profile, "measure_profile", fast_cpu)
    monkeypatch.setattr(perf_model.AutoOffload, "stagger_rows",
                        lambda self, gpu, context, width, keep=False, host_context=None, hold=False: width)
    monkeypatch.setattr(StaggeredPlan, "batch_pays", lambda self: True)
    model = random_llama(torch.float32)
    ids, mask, ref, block = small_pool_case(model)
    apex = optimize(model, ApexConfig(offload="auto", gpu_cache_size=8 * block, cpu_cache_size=32 * MB))
    assert apex.engine.stagger is not None and apex.engine.stagger.rows.adaptive
    apex.engine.warmup()
    calibration = apex.engine.calibration
    assert calibration.rows and calibration.stagger_rows and calibration.stagger_width == TuningConfig().auto_stagger_width
    assert all(t > 0 for t in calibration.step_s + calibration.stagger_s)
    assert calibration.piece_capture_s > 0  # a pipeline prompt size's pieces captured and timed (two sizes)
    assert len(apex.engine.plan.stagger_pieces.pieces) == 2
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    assert apex.engine.stats.requests_per_pool[1] >= 2  # some requests ran staggered from the host pool
    assert "staggered" in apex.offload_decision()
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}


@pytest.mark.parametrize("lanes", [2, 1])
def test_staggered_steps_run_ahead_equal_the_synchronous_engine(lanes):
    """Async scheduling beside the staggered block on the GPU (device rows' ids copied on the device, a lane
    begun before the previous step's tokens arrive): tokens and stop reasons equal the synchronous engine's,
    with pipeline requests stopping by EOS and length while long device requests keep steps running ahead."""
    from apex_compile.runtime.request import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(3)
    model = random_llama(torch.float32)
    prompts = [torch.randint(3, SMALL["vocab_size"], (n,)).tolist() for n in (3, 4, 5, 13, 9, 11, 7, 10, 12, 8)]
    eos = tuple(range(3, 60))
    sampling = [SamplingParams(max_new_tokens=60) for _ in range(3)] + [
        SamplingParams(max_new_tokens=n, eos_token_ids=eos) for n in (12, 14, 9, 16, 11, 13, 10)]
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    block = 2 * SMALL["num_hidden_layers"] * SMALL["num_key_value_heads"] * 16 * head_dim * 4
    results = []
    for async_scheduling in (False, True):
        apex = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=6 * block,
                                          cpu_cache_size=32 * MB, capture_sizes=(2, 4, 8),
                                          async_scheduling=async_scheduling, stagger_lanes=lanes))
        done = apex.engine.generate(prompts, sampling)
        results.append([(c.token_ids, c.finish_reason) for c in done])
        assert sum(1 for c in done if c.steps_per_pool["host"]) >= 3
        assert (apex.engine.stats.ahead_steps > 0) == async_scheduling
        assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
        apex.close()
    assert results[1] == results[0]


@pytest.mark.parametrize("offload", ["never", "staggered", "ahead"])
def test_decode_steps_never_wait_for_the_gpu(fp32_model, offload):
    """Once every request is past its prompt, a decode step queues its graph, the sampling and the pipeline's
    copies without the host waiting for the GPU: torch's sync debug mode raises on any such wait (a copy from
    pageable memory, .item()); the sampled ids' event is the step's only wait. The rows sample (temperature,
    top-k/top-p, seeds, repetition penalty, EOS masked by min_new_tokens), and with "staggered" the block has
    empty rows (three host requests for a width of 3 over several groups) and its rows are not 0..n-1. "ahead":
    offload "never" without the rules that need the last token on the host, so every step is queued ahead
    (async scheduling); one request may stop by EOS on the way."""
    from apex_compile.runtime.request import SamplingParams

    torch.manual_seed(2)
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    block = 2 * SMALL["num_hidden_layers"] * SMALL["num_key_value_heads"] * 16 * head_dim * 4
    staggered, ahead = offload == "staggered", offload == "ahead"
    apex = optimize(fp32_model, ApexConfig(offload="never" if ahead else offload, stagger_width=3,
                                           capture_sizes=(2, 4, 8), gpu_cache_size=(8 if staggered else 64) * block,
                                           cpu_cache_size=32 * MB))
    engine = apex.engine
    kinds = [dict(), dict(do_sample=True, temperature=0.8, top_k=50), dict(do_sample=True, top_p=0.9, seed=5),
             dict(repetition_penalty=1.3), dict(eos_token_ids=(7,), min_new_tokens=100)]
    if ahead:
        kinds[3:] = [dict(eos_token_ids=tuple(range(3, 40)))]  # stops by EOS within a few tokens
    for i, n in enumerate((5, 17, 33, 9, 40, 21, 12)):
        engine.add_request(torch.randint(3, SMALL["vocab_size"], (n,)).tolist(),
                           SamplingParams(max_new_tokens=200, **kinds[i % len(kinds)]))
    for _ in range(300):  # until every request has a token (the staggered ones ride the pipeline first)
        engine.step()
        if not engine.scheduler.waiting and all(r.output_token_ids for r in engine.scheduler.running) and not (
                staggered and engine.stagger.joining):
            break
    if staggered:
        assert engine.stagger.active and 0 < engine.stagger.num_members < engine.stagger.capacity
    replays = engine.stagger_graphs.replays if staggered else engine.graphs.replays
    ahead_steps = engine.stats.ahead_steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if ahead:  # a step was queued ahead in each call (the first call's own step was queued by the call before)
        assert engine.stats.ahead_steps == ahead_steps + 12 and engine.graphs.replays >= replays + 12
    elif staggered:  # the host-rule requests are pipeline members: the device rows' steps may run ahead
        assert engine.stagger_graphs.replays >= replays + 12
    else:  # the host rules of requests 3 and 4 (repetition penalty, min_new_tokens) keep every step in line
        assert engine.stats.ahead_steps == 0, engine.stats.not_ahead
        assert engine.graphs.replays == replays + 12
    engine.abort()
    apex.close()


def test_pipeline_prompt_steps_past_512_rows_replay_pieces_and_equal_hf_generate_fp32():
    """Host-pool prompts longer than the step budget enter the pipeline whole, in steps of up to ~900 rows: those
    replay the staggered plan's piecewise graphs (captured past PIECEWISE_MAX_TOKENS for them), the prompts'
    K/V exported to the host cache from the eager attention calls between the pieces; HF's tokens."""
    from apex_compile.runtime.cuda_graphs import PIECEWISE_MAX_TOKENS

    ids, mask, ref, block, model = sharp_small_pool_case(lengths=[600, 880, 40, 700, 65, 530])
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=3, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    pieces = apex.engine.stagger_pieces
    assert any(rows > PIECEWISE_MAX_TOKENS for rows, _ in pieces.pieces) and pieces.replays > 0
    assert apex.engine.stats.step_kinds["pipeline prompt"][0] >= 3
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


def test_pipeline_members_moving_to_the_device_pool_equal_hf_generate_fp32():
    """Staggered requests move to the device pool once the device requests finish (each parked at a token
    boundary with its host KV, copied over, resumed ahead of waiting ones): HF's tokens, every block back."""
    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload="staggered", stagger_width=3, gpu_cache_size=8 * block,
                                      cpu_cache_size=32 * MB))
    out = apex.generate(ids, attention_mask=mask, **GREEDY_20)
    assert torch.equal(out, ref)
    assert apex.engine.stats.migrated > 0 and apex.engine.stats.requests_per_pool[1] > 0
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()


@pytest.mark.parametrize("offload", ["never", "all", "staggered"])
def test_online_arrivals_through_the_front_equal_hf_generate_fp32(offload):
    """Requests submitted to the asynchronous front while others decode (online arrivals, the latency
    objective), the device pool too small for all of them (parks; with "staggered" the pipeline and its
    migrations): each stream's tokens are HF's batched greedy tokens for its prompt."""
    from apex_compile.runtime.request import SamplingParams

    ids, mask, ref, block, model = sharp_small_pool_case()
    apex = optimize(model, ApexConfig(offload=offload, stagger_width=3 if offload == "staggered" else None,
                                      gpu_cache_size=8 * block, cpu_cache_size=32 * MB))
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    expected = [row[ids.shape[1]:].tolist() for row in ref]
    front = apex.engine.front
    sampling = SamplingParams(max_new_tokens=GREEDY_20["max_new_tokens"], eos_token_ids=())
    streams = [front.submit(p, sampling) for p in prompts[:3]]
    next(iter(streams[0]))  # running: the rest arrive while it decodes
    streams += [front.submit(p, sampling) for p in prompts[3:]]
    assert [s.result(timeout=120).token_ids for s in streams] == expected
    assert apex.engine.scheduler.objective == "latency"
    front.shutdown()
    assert apex.engine.blocks_in_use() == {"device": 0, "host": 0}
    apex.close()
