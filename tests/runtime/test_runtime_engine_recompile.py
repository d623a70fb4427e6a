"""Past dynamo's recompile limit the engine must fail loudly, never run the unrewritten HF forward."""
import pytest
import torch

import apex_compile
from apex_compile.runtime import model_step as step_module
from tests.helpers import tiny_model


def _generate(model, prompt_len):
    apex = apex_compile.optimize(model, apex_compile.ApexConfig(gpu_cache_size=1 << 22, cpu_cache_size=1 << 22))
    ids = torch.randint(0, 96, (1, prompt_len))
    return ids, apex.generate(ids, max_new_tokens=4, do_sample=False)


def test_recompile_limit_hit_raises_instead_of_eager_fallback(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(step_module, "RECOMPILE_LIMIT", 1)
    # A prefill step (T > 1) then a decode step (T == 1): the second shape needs a second graph.
    with pytest.raises(Exception, match="(?i)recompil"):
        _generate(tiny_model("llama", layers=1), prompt_len=5)
    torch._dynamo.reset()


def test_default_limit_serves_prefill_and_decode_shapes():
    torch._dynamo.reset()
    model = tiny_model("llama", layers=1)
    ids, out = _generate(model, prompt_len=5)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)
    torch._dynamo.reset()


def test_each_model_step_counts_its_own_graphs(monkeypatch):
    """The limit is per model step, not shared by every model of the process: with room for two graphs (a
    prefill and a decode shape) per step, three models in a row each generate; one code object shared by their
    steps would hit the limit at the second model."""
    torch._dynamo.reset()
    monkeypatch.setattr(step_module, "RECOMPILE_LIMIT", 2)
    steps = [step_module.model_step(tiny_model("llama", layers=1)) for _ in range(2)]
    assert steps[0].__code__ is not steps[1].__code__
    for _ in range(3):
        model = tiny_model("llama", layers=1)
        ids, out = _generate(model, prompt_len=5)
        with torch.no_grad():
            assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
    torch._dynamo.reset()
