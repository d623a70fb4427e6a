"""The offload plans (`apex_compile.runtime.plans`) on a CPU: `make_plan` picks the plan class from
`ApexConfig.offload`, and an engine of each plan gives HF greedy tokens on a tiny random LLaMA."""
import pytest
import torch

from apex_compile import ApexConfig, SamplingParams, optimize
from apex_compile.runtime.plans import GpuOnlyPlan, OverlapPlan, Plan, StaggeredPlan, make_plan
from tests.runtime.test_runtime_stagger import BLOCK_BYTES, hf_tokens, sharp_model

NEW_TOKENS = 8
# (offload, the plan make_plan picks on a CPU); a device pool of 4 blocks leaves requests to the host pool
CASES = [("never", GpuOnlyPlan), ("all", OverlapPlan), (0.5, OverlapPlan), ("staggered", StaggeredPlan),
         ("auto", GpuOnlyPlan)]


def build(model, offload):
    config = ApexConfig(offload=offload, gpu_cache_size=4 * BLOCK_BYTES, cpu_cache_size=128 * BLOCK_BYTES,
                        max_model_len=64)
    if offload == "staggered":
        config = ApexConfig(offload=offload, stagger_width=2, stagger_lanes=2, gpu_cache_size=4 * BLOCK_BYTES,
                            cpu_cache_size=128 * BLOCK_BYTES, max_model_len=64)
    return optimize(model, config)


@pytest.fixture(scope="module")
def model_and_reference():
    torch.manual_seed(3)
    model = sharp_model()
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4)]
    return model, prompts, hf_tokens(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("offload,plan_class", CASES, ids=[str(o) for o, _ in CASES])
def test_factory_picks_the_plan_and_its_tokens_equal_hf_generate(model_and_reference, offload, plan_class):
    """offload="never" and "auto" on a CPU (no performance model there): GPU-only; "all" and a fraction: the
    overlap plan (host-pool rows in the batch); "staggered": the staggered plan, its pipeline shared with the
    scheduler and the runner. Each engine's greedy tokens are HF generate's."""
    model, prompts, reference = model_and_reference
    apex = build(model, offload)
    engine = apex.engine
    try:
        assert type(engine.plan) is plan_class and isinstance(engine.plan, Plan)
        staggered = plan_class is StaggeredPlan
        if not staggered:  # the factory again on the built engine (a staggered plan would start a second pipeline)
            assert type(make_plan(engine)) is plan_class
        assert (engine.stagger is not None) == staggered
        assert engine.scheduler.stagger is engine.stagger and engine.runner.stagger is engine.stagger
        assert engine.plan.block_width == (2 if staggered else 0)
        assert engine.plan.host_policy is None and engine.scheduler.host_policy is None  # auto's model is CUDA-only
        assert not engine.overlap  # no launch / wait split on a CPU
        done = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in done] == reference
        if offload in ("all", 0.5, "staggered"):
            assert engine.stats.requests_per_pool[1] > 0  # some requests ran in the host pool
        if offload in ("never", "auto"):
            assert engine.stats.requests_per_pool[1] == 0
        if staggered:
            assert any(c.steps_per_pool["host"] for c in done) and not engine.stagger.members()
        assert engine.blocks_in_use() == {"device": 0, "host": 0}
    finally:
        apex.close()
    assert engine.plan is None and engine.stagger is None and engine.graphs is None


def test_staggered_without_a_host_pool_is_gpu_only(model_and_reference):
    """offload="staggered" with no host block has no pipeline to build: the GPU-only plan."""
    model, prompts, reference = model_and_reference
    apex = optimize(model, ApexConfig(offload="staggered", gpu_cache_size=64 * BLOCK_BYTES, cpu_cache_size=0,
                                      max_model_len=64))
    try:
        assert type(apex.engine.plan) is GpuOnlyPlan and apex.engine.stagger is None
        done = apex.engine.generate(prompts[:2], SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [c.token_ids for c in done] == reference[:2]
    finally:
        apex.close()


def test_the_plan_interface_defaults_are_those_of_a_plan_without_lead_rows():
    """A plan that only implements the abstract methods leads no step, samples no lead row and runs no loop."""

    class Minimal(Plan):
        def build_graphs(self, max_rows):
            pass

        def build_steps(self):
            pass

        def forward(self, chunks, logit_rows, device_ids=None):
            return torch.zeros(len(logit_rows), 1)

    plan = Minimal(engine=None)
    assert plan.lead_rows() == 0 and plan.lead_sampling_rows() == [] and plan.lead_input_rows() == []
    assert plan.gap_sample() is None and plan.captured_seconds() == 0.0 and not plan.overlap
    assert plan.pipeline is None and plan.host_policy is None and plan.block_width == 0 and plan.ahead_graphs() is None
    with pytest.raises(TypeError):
        Plan(engine=None)
