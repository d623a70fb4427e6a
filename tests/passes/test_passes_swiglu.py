"""fuse_swiglu on small synthetic graphs and on real HF decoders' traced graphs."""
import pytest
import torch
import torch.nn.functional as F

import apex_compile.ops  # noqa: F401  (registers apex::swiglu, apex::silu_mul)
import apex_compile.passes.fuse_swiglu
from apex_compile.passes import PassReport
from apex_compile.passes.fuse_swiglu import fuse_swiglu
from tests.helpers import capture, compile_with, count_calls, engine_step, rel_err, tiny_model

SWIGLU = torch.ops.apex.swiglu.default
SILU_MUL = torch.ops.apex.silu_mul.default


def gate_first(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def up_first(x, w_gate, w_up, w_down):
    return F.linear(F.linear(x, w_up) * F.silu(F.linear(x, w_gate)), w_down)


def _weights(hidden=32, inter=80, dtype=torch.float32):
    w_gate = torch.randn(inter, hidden, dtype=dtype) / hidden ** 0.5
    w_up = torch.randn(inter, hidden, dtype=dtype) / hidden ** 0.5
    return w_gate, w_up, torch.randn(hidden, inter, dtype=dtype) / inter ** 0.5


@pytest.mark.parametrize("variant", [gate_first, up_first], ids=lambda f: f.__name__)
def test_separate_projections_fuse_and_match_float64(variant):
    x = torch.randn(2, 7, 32)
    weights = _weights()
    compiled, records = compile_with(variant, fuse_swiglu)
    out = compiled(x, *weights)
    gm, report = records[0]
    assert count_calls(gm, SWIGLU) == 1 and report.counts["swiglu"] == 1
    assert count_calls(gm, F.linear) == 1  # only the down projection is left
    assert rel_err(out, variant(x.double(), *(w.double() for w in weights))) <= 1e-6


def test_module_mlp_fuses():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 40, bias=False)
            self.up_proj = torch.nn.Linear(16, 40, bias=False)
            self.down_proj = torch.nn.Linear(40, 16, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = MLP()
    x = torch.randn(3, 16)
    compiled, records = compile_with(mlp, fuse_swiglu)
    with torch.no_grad():
        out = compiled(x)
        reference = mlp.double()(x.double())
    assert count_calls(records[0][0], SWIGLU) == 1
    assert rel_err(out, reference) <= 1e-6


def test_chunked_gate_up_becomes_silu_mul():
    def chunked(x, w_gate_up, w_down):
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w_down)

    x, w_gate_up, w_down = torch.randn(5, 32), torch.randn(160, 32) / 6, torch.randn(32, 80) / 9
    compiled, records = compile_with(chunked, fuse_swiglu)
    out = compiled(x, w_gate_up, w_down)
    gm, report = records[0]
    assert count_calls(gm, SILU_MUL) == 1 and report.counts["silu_mul"] == 1
    assert rel_err(out, chunked(x.double(), w_gate_up.double(), w_down.double())) <= 1e-6


def _misses(fn, *args):
    gm, _ = capture(fn, *args)
    report = PassReport()
    assert fuse_swiglu(gm, report) == 0
    assert count_calls(gm, SWIGLU) == 0 and count_calls(gm, SILU_MUL) == 0
    return [m.reason for m in report.misses]


def test_biased_projections_are_not_fused():
    def biased(x, w_gate, w_up, bias):
        return F.silu(F.linear(x, w_gate, bias)) * F.linear(x, w_up)

    w_gate, w_up, _ = _weights()
    (reason,) = _misses(biased, torch.randn(4, 32), w_gate, w_up, torch.randn(80))
    assert "bias-free" in reason


def test_projections_of_different_inputs_are_not_fused():
    def two_inputs(x, y, w_gate, w_up):
        return F.silu(F.linear(x, w_gate)) * F.linear(y, w_up)

    w_gate, w_up, _ = _weights()
    (reason,) = _misses(two_inputs, torch.randn(4, 32), torch.randn(4, 32), w_gate, w_up)
    assert "different inputs" in reason


def test_gate_with_another_user_is_not_fused():
    def shared_gate(x, w_gate, w_up):
        gate = F.linear(x, w_gate)
        return F.silu(gate) * F.linear(x, w_up), gate

    w_gate, w_up, _ = _weights()
    (reason,) = _misses(shared_gate, torch.randn(4, 32), w_gate, w_up)
    assert "other users" in reason


def test_unregistered_op_is_reported(monkeypatch):
    monkeypatch.setattr(apex_compile.passes.fuse_swiglu, "apex_op", lambda name: None)
    (reason,) = _misses(gate_first, torch.randn(4, 32), *_weights())
    assert "not registered" in reason


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_real_decoders_fuse_every_mlp(kind):
    model = tiny_model(kind, layers=3)
    ids = torch.randint(0, 96, (1, 6))
    gm, _ = capture(engine_step(model), ids, torch.arange(6)[None], torch.arange(6), dynamic=True)
    report = PassReport()
    assert fuse_swiglu(gm, report) == 3 == count_calls(gm, SWIGLU)
    assert [report.layer_counts(layer)["swiglu"] for layer in range(3)] == [1, 1, 1]
    assert not report.misses
