"""pack_linear: fp32 CPU linears run on oneDNN packed weights, equal F.linear, and follow in-place weight
changes; other dtypes are left alone; the backend refuses it with inductor."""
import pytest
import torch
import torch.nn.functional as F

from apex_compile.backend import apex_backend
from apex_compile.passes import pack_linear as pl

pytestmark = pytest.mark.skipif(not pl.available(), reason="torch built without oneDNN")


class TwoLinears(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = torch.nn.Linear(64, 96, bias=True, dtype=dtype)
        self.b = torch.nn.Linear(96, 48, bias=False, dtype=dtype)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


def compile_with_reports(module, **options):
    reports = []
    compiled = torch.compile(module, backend=apex_backend, options={"pack_linear": True, "on_report": reports.append,
                                                                   **options})
    return compiled, reports


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_packed_linears_equal_float64_reference_and_follow_weight_updates(rows):
    torch.manual_seed(rows)
    module = TwoLinears().eval()
    compiled, reports = compile_with_reports(module)
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        out = compiled(x)
        hidden = F.silu(F.linear(x.double(), module.a.weight.double(), module.a.bias.double()))
        expected = F.linear(hidden, module.b.weight.double())
        assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)
        assert reports[0].packed_linears == 2
        module.b.weight.mul_(-2.0)  # changed in place: the packed copy must follow
        assert torch.allclose(compiled(x).double(), -2.0 * expected, rtol=1e-4, atol=1e-5)


def test_bf16_linears_are_left_alone():
    module = TwoLinears(torch.bfloat16).eval()
    compiled, reports = compile_with_reports(module)
    with torch.no_grad():
        compiled(torch.randn(1, 4, 64, dtype=torch.bfloat16))
    assert reports[0].packed_linears == 0


def test_packed_linear_needs_the_eager_inner_compiler():
    compiled, _ = compile_with_reports(TwoLinears().eval(), inner="inductor")
    with pytest.raises(Exception, match="pack_linear needs inner='eager'"):
        compiled(torch.randn(1, 4, 64))


def test_packed_linears_mode_routes_fp32_inference_linears_only(monkeypatch):
    """The eager CPU step's mode: fp32 linears without grad run packed (equal the float64 reference); bf16 and
    grad-enabled calls keep F.linear."""
    torch.manual_seed(0)
    calls = []
    real = pl.packed_linear
    monkeypatch.setattr(pl, "packed_linear", lambda *a: calls.append(a[0].dtype) or real(*a))
    module = TwoLinears().eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad(), pl.PackedLinears():
        out = module(x)
    hidden = F.silu(F.linear(x.double(), module.a.weight.double(), module.a.bias.double()))
    assert torch.allclose(out.double(), F.linear(hidden, module.b.weight.double()), rtol=1e-4, atol=1e-5)
    assert calls == [torch.float32, torch.float32]
    calls.clear()
    with torch.no_grad(), pl.PackedLinears():
        TwoLinears(torch.bfloat16).eval()(x.bfloat16())
    with pl.PackedLinears():
        module(x)  # grad enabled: autograd needs F.linear
    assert calls == []


def test_the_eager_cpu_engine_packs_its_linears_and_equals_hf(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from apex_compile import ApexConfig, optimize
    from apex_compile.runtime.request import SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    calls = []
    real = pl.packed_linear
    monkeypatch.setattr(pl, "packed_linear", lambda *a: calls.append(1) or real(*a))
    prompt = [5, 17, 33, 2, 41]
    with optimize(model, ApexConfig(offload="never", compile=False, max_num_seqs=2)) as apex:
        done = apex.engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert done[0].token_ids == hf[0, len(prompt):].tolist()
    assert len(calls) >= 8 * (2 * 4 + 1)  # every projection of every step (q/k/v/o, gate/up/down, lm_head)
