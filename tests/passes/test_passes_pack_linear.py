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
