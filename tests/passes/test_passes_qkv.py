"""fuse_qkv and apex::qkv_linear: the pass on synthetic and real HF graphs, the op against float64, and the
weight merge that lets the op run one GEMM."""
import pytest
import torch
import torch.nn.functional as F

import apex_compile.ops  # noqa: F401  (registers apex::qkv_linear)
from apex_compile.ops.linear import merge_projection_weights, merged_view, qkv_linear
from apex_compile.passes import PassReport
from apex_compile.passes.fuse_qkv import fuse_qkv
from tests.helpers import capture, compile_with, count_calls, engine_step, rel_err, tiny_model

QKV = torch.ops.apex.qkv_linear.default


def attention_inputs(x, w_q, w_k, w_v, *biases):
    b_q, b_k, b_v = biases or (None, None, None)
    return F.linear(x, w_q, b_q) * 2, F.linear(x, w_k, b_k).sum(-1), F.linear(x, w_v, b_v) - 1


def _weights(hidden=32, rows=(48, 16, 16), bias=False, dtype=torch.float32):
    weights = [torch.randn(n, hidden, dtype=dtype) / hidden ** 0.5 for n in rows]
    return weights + ([torch.randn(n, dtype=dtype) for n in rows] if bias else [])


@pytest.mark.parametrize("bias", [False, True])
def test_three_projections_fuse_and_match_float64(bias):
    x = torch.randn(2, 5, 32)
    weights = _weights(bias=bias)
    compiled, records = compile_with(attention_inputs, fuse_qkv)
    out = compiled(x, *weights)
    gm, report = records[0]
    assert count_calls(gm, QKV) == 1 and report.counts["qkv"] == 1
    assert count_calls(gm, F.linear) == 0
    expected = attention_inputs(x.double(), *(w.double() for w in weights))
    for got, ref in zip(out, expected):
        assert rel_err(got, ref) <= 1e-6


def test_two_projections_are_left_alone():
    def pair(x, w_a, w_b):
        return F.linear(x, w_a) + F.linear(x, w_b)

    gm, _ = capture(pair, torch.randn(3, 32), torch.randn(8, 32), torch.randn(8, 32))
    report = PassReport()
    assert fuse_qkv(gm, report) == 0 and count_calls(gm, F.linear) == 2 and not report.misses


def test_mixed_biases_are_reported():
    def mixed(x, w_q, w_k, w_v, b_q):
        return F.linear(x, w_q, b_q), F.linear(x, w_k), F.linear(x, w_v)

    gm, _ = capture(mixed, torch.randn(3, 32), *_weights(), torch.randn(48))
    report = PassReport()
    assert fuse_qkv(gm, report) == 0
    assert ["bias" in m.reason for m in report.misses] == [True]


@pytest.mark.parametrize("merged,bias", [(True, False), (False, False), (True, True), (False, True)])
def test_op_matches_float64_merged_or_not(merged, bias):
    x = torch.randn(7, 32)
    weights = _weights(bias=bias)
    if merged:  # back to back in one buffer, as merge_projection_weights leaves them
        groups = [weights[:3]] + ([weights[3:]] if bias else [])
        for group in groups:
            buffer = torch.cat(group)
            offsets = [0]
            for t in group:
                offsets.append(offsets[-1] + t.shape[0])
            group[:] = [buffer[a:b] for a, b in zip(offsets, offsets[1:])]
        weights = groups[0] + (groups[1] if bias else [])
    assert (merged_view(weights[:3]) is not None) == merged
    out = torch.full((7, 80), float("nan"))
    out.copy_(qkv_linear(x, *weights))
    expected = torch.cat([F.linear(x.double(), w.double(), None if not bias else b.double())
                          for w, b in zip(weights[:3], (weights[3:] if bias else [None] * 3))], -1)
    assert rel_err(out, expected) <= 1e-6


def test_op_rejects_bad_inputs():
    x, (w_q, w_k, w_v) = torch.randn(3, 32), _weights()
    with pytest.raises(ValueError, match="features"):
        qkv_linear(torch.randn(3, 31), w_q, w_k, w_v)
    with pytest.raises(ValueError, match="all three biases"):
        qkv_linear(x, w_q, w_k, w_v, torch.randn(48))
    with pytest.raises(ValueError, match="does not match"):
        qkv_linear(x.double(), w_q, w_k, w_v)


def test_merged_view_needs_adjacent_rows():
    buffer = torch.randn(10, 4)
    assert merged_view([buffer[:3], buffer[3:10]]) is not None
    assert merged_view([buffer[:3], buffer[4:10]]) is None  # a gap
    assert merged_view([buffer[3:10], buffer[:3]]) is None  # wrong order
    assert merged_view([buffer[:3], torch.randn(7, 4)]) is None  # another storage


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_merge_keeps_values_and_outputs(kind):
    model = tiny_model(kind, layers=2)
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert merge_projection_weights(model) == 4  # q/k/v and gate/up of each layer
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    attn = model.model.layers[1].self_attn
    assert merged_view([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    if kind == "qwen2":
        assert merged_view([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
    assert merge_projection_weights(model) == 4  # idempotent
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, before, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_real_decoders_fuse_every_attention_projection(kind):
    model = tiny_model(kind, layers=3)
    merge_projection_weights(model)
    ids = torch.randint(0, 96, (1, 6))
    step = engine_step(model)
    args = (ids, torch.arange(6)[None], torch.arange(6))
    compiled, records = compile_with(step, fuse_qkv, dynamic=True)
    with torch.no_grad():
        out = compiled(*args)
        ref = step(*args)
    gm, report = records[0]
    assert count_calls(gm, QKV) == 3 and not report.misses
    assert [report.layer_counts(layer)["qkv"] for layer in range(3)] == [1, 1, 1]
    assert rel_err(out, ref) <= 1e-5
