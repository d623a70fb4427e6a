"""fuse_rmsnorm on small synthetic graphs and on real HF decoders' traced graphs."""
import pytest
import torch

import apex_compile.ops  # noqa: F401  (registers apex::rms_norm)
import apex_compile.passes.fuse_rmsnorm
from apex_compile.passes import PassReport
from apex_compile.passes.fuse_rmsnorm import fuse_rmsnorm
from tests.helpers import capture, compile_with, count_calls, engine_step, rel_err, tiny_model

RMS_NORM = torch.ops.apex.rms_norm.default


def hf_rms_norm(x, weight, eps=1e-6):
    """HF LlamaRMSNorm's chain: fp32 upcast, pow/mean/rsqrt, downcast, weight first."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def no_cast_rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def square_by_mul_rms_norm(x, weight, eps=1e-6):
    variance = (x * x).mean(dim=-1, keepdim=True)
    return weight * (x * (variance + eps).rsqrt())


def torch_functions_rms_norm(x, weight, eps=1e-6):
    variance = torch.mean(torch.pow(x, 2), dim=[-1], keepdim=True)
    return torch.mul(torch.mul(x, torch.rsqrt(torch.add(variance, eps))), weight)


VARIANTS = [hf_rms_norm, no_cast_rms_norm, square_by_mul_rms_norm, torch_functions_rms_norm]


def _inputs(rows=5, hidden=48, dtype=torch.float32):
    return torch.randn(2, rows, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda f: f.__name__)
def test_chain_forms_fuse_and_match_float64(variant):
    x, weight = _inputs()
    compiled, records = compile_with(variant, fuse_rmsnorm)
    out = compiled(x, weight)
    gm, report = records[0]
    assert count_calls(gm, RMS_NORM) == 1 and report.counts["rms_norm"] == 1
    assert not any(n.op == "call_function" and n.target is torch.rsqrt for n in gm.graph.nodes)
    assert rel_err(out, variant(x.double(), weight.double())) <= 1e-6


def test_residual_add_is_fused_and_its_other_users_get_residual_out():
    def block(a, b, weight, w_out):
        h = a + b
        return hf_rms_norm(h, weight) @ w_out + h

    a, b = torch.randn(3, 7, 32), torch.randn(3, 7, 32)
    weight, w_out = torch.randn(32), torch.randn(32, 32)
    compiled, records = compile_with(block, fuse_rmsnorm)
    out = compiled(a, b, weight, w_out)
    gm, _ = records[0]
    (fused,) = [n for n in gm.graph.nodes if n.target is RMS_NORM]
    assert fused.kwargs["residual"] is not None and fused.args[2] == 1e-6
    assert not any(n.op == "call_function" and n.target is torch.add for n in gm.graph.nodes)
    assert rel_err(out, block(a.double(), b.double(), weight.double(), w_out.double())) <= 1e-6


def test_broadcasting_add_is_not_taken_as_residual():
    def block(x, bias, weight):
        return hf_rms_norm(x + bias, weight)

    x, bias, weight = torch.randn(4, 16), torch.randn(16), torch.randn(16)
    compiled, records = compile_with(block, fuse_rmsnorm)
    out = compiled(x, bias, weight)
    (fused,) = [n for n in records[0][0].graph.nodes if n.target is RMS_NORM]
    assert fused.kwargs.get("residual") is None
    assert rel_err(out, block(x.double(), bias.double(), weight.double())) <= 1e-6


def test_dynamic_shapes_module_eps_becomes_a_constant():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(24))
            self.variance_epsilon = 3e-5

        def forward(self, x):
            return hf_rms_norm(x, self.weight, self.variance_epsilon)

    norm = Norm()
    compiled, records = compile_with(norm, fuse_rmsnorm, dynamic=True)
    with torch.no_grad():
        for rows in (5, 9):
            x = torch.randn(1, rows, 24)
            assert rel_err(compiled(x), hf_rms_norm(x.double(), norm.weight.double(), 3e-5)) <= 1e-6
    assert len(records) == 1
    (fused,) = [n for n in records[0][0].graph.nodes if n.target is RMS_NORM]
    assert fused.args[2] == pytest.approx(3e-5)


def _misses(fn, *args):
    gm, _ = capture(fn, *args)
    report = PassReport()
    assert fuse_rmsnorm(gm, report) == 0
    assert count_calls(gm, RMS_NORM) == 0
    return [m.reason for m in report.misses]


def test_weight_of_another_dtype_is_not_fused():
    x, _ = _inputs()
    (reason,) = _misses(hf_rms_norm, x, torch.randn(48, dtype=torch.bfloat16))
    assert "dtypes differ" in reason


def test_mean_over_another_dim_is_not_fused():
    def wrong_dim(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6))

    (reason,) = _misses(wrong_dim, *_inputs())
    assert "last dim" in reason


def test_norm_without_weight_is_not_fused():
    def no_weight(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    (reason,) = _misses(no_weight, _inputs()[0])
    assert "weight" in reason


def test_variance_with_another_user_is_not_fused():
    def shared_variance(x, weight):
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + 1e-6)), variance

    (reason,) = _misses(shared_variance, *_inputs())
    assert "single-use" in reason


def test_unregistered_op_is_reported(monkeypatch):
    monkeypatch.setattr(apex_compile.passes.fuse_rmsnorm, "apex_op", lambda name: None)
    (reason,) = _misses(hf_rms_norm, *_inputs())
    assert "not registered" in reason


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_real_decoders_fuse_every_norm(kind):
    model = tiny_model(kind, layers=3)
    ids = torch.randint(0, 96, (1, 6))
    gm, _ = capture(engine_step(model), ids, torch.arange(6)[None], torch.arange(6), dynamic=True)
    report = PassReport()
    fuse_rmsnorm(gm, report)
    fused = [n for n in gm.graph.nodes if n.target is RMS_NORM]
    assert len(fused) == 2 * 3 + 1 == report.counts["rms_norm"]
    assert sum(n.kwargs.get("residual") is not None for n in fused) == 2 * 3  # all but the first input norm
    assert all(n.args[2] == pytest.approx(model.config.rms_norm_eps) for n in fused)
    assert report.layer_counts(0)["rms_norm"] == 2 and report.layer_counts(None)["rms_norm"] == 1
    assert not report.misses
