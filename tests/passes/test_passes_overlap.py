"""overlap: apex.attention -> offload_launch / device_attention / offload_wait, placement and numerics."""
import torch
import torch.fx as fx
import torch.nn.functional as F

from apex_compile.runtime.context import attention_runner
from apex_compile.passes.overlap import overlap_attention
from apex_compile.passes.partition_attention import partition_attention
from tests.helpers import DenseCausalRunner, compile_with, engine_step, rel_err, runner_for, tiny_model

OPS = torch.ops.apex


def _paged_overlap(gm, report):
    partition_attention(gm, report)
    overlap_attention(gm, report)


def _heads(x, heads):
    b, s, _ = x.shape
    return x.view(b, s, heads, 16).transpose(1, 2)


def attention_then_independent_work(q, k, v, x, w):
    """Work that does not need the attention output sits between SDPA and its first (compute) user."""
    k_heads = _heads(k, 2) * 2  # the last of q/k/v to be computed
    attn = F.scaled_dot_product_attention(_heads(q, 4), k_heads, _heads(v, 2), is_causal=True, enable_gqa=True)
    independent = torch.tanh(x @ w)
    merged = attn.transpose(1, 2).reshape(1, -1, 64)
    return merged @ w + independent


def _position(gm: fx.GraphModule, node: fx.Node) -> int:
    return list(gm.graph.nodes).index(node)


def test_launch_early_wait_late_ordered_by_token():
    q, k, v = torch.randn(1, 6, 64), torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    x, w = torch.randn(1, 6, 64), torch.randn(64, 64) / 8
    compiled, records = compile_with(attention_then_independent_work, _paged_overlap)
    runner = DenseCausalRunner(1, 2, 16)
    with attention_runner(runner):
        out = compiled(q, k, v, x, w)
    gm, report = records[0]
    nodes = list(gm.graph.nodes)
    (launch,) = [n for n in nodes if n.target is OPS.offload_launch.default]
    (device,) = [n for n in nodes if n.target is OPS.device_attention.default]
    (wait,) = [n for n in nodes if n.target is OPS.offload_wait.default]
    assert not any(n.target is OPS.attention.default for n in nodes)
    # ordering is carried by the token alone
    assert device.args[5] is launch and wait.args[0] is launch and wait.args[1] is device
    # launch right after the last of q/k/v (k_heads) and its token-major view; device part right after it
    (k_heads,) = [n for n in nodes if n.name == "k_heads"]
    between = nodes[_position(gm, k_heads) + 1:_position(gm, launch)]
    assert launch.prev is launch.args[1] and all(n.target in ("transpose", "flatten") for n in between)
    assert device.prev is launch
    # the wait comes after the independent tanh and right before the first compute user of the output
    (tanh,) = [n for n in nodes if n.target is torch.tanh]
    assert _position(gm, tanh) < _position(gm, wait)
    after_wait = nodes[_position(gm, wait) + 1:]
    first_compute = next(n for n in after_wait if n.op != "call_method")
    assert all(n.op == "call_method" for n in after_wait[:after_wait.index(first_compute)])
    assert runner.calls == [("offload_launch", 0), ("device_attention", 0), ("offload_wait", 0)]
    assert report.counts["overlap"] == 1 and report.attention_sites[0].form == "launch/device/wait"
    reference = attention_then_independent_work(q.double(), k.double(), v.double(), x.double(), w.double())
    assert rel_err(out, reference) <= 1e-6


def test_graph_without_apex_attention_is_left_alone():
    def plain(x):
        return x * 2

    compiled, records = compile_with(plain, overlap_attention)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert records[0][1].counts["overlap"] == 0


def test_decoder_with_overlap_matches_eager_over_steps():
    model = tiny_model("llama", layers=2)
    compiled, records = compile_with(engine_step(model), _paged_overlap, dynamic=True)
    ids = torch.randint(0, 96, (1, 10))
    runner = runner_for(model)
    with torch.no_grad(), attention_runner(runner):
        reference = model(ids).logits[0]
        prefill = compiled(ids[:, :7], torch.arange(7)[None], torch.arange(7))
        chunk = compiled(ids[:, 7:], torch.arange(7, 10)[None], torch.arange(3))
    assert rel_err(prefill, reference[:7]) <= 1e-5 and rel_err(chunk, reference[7:]) <= 1e-5
    per_layer = [("offload_launch", 0), ("device_attention", 0), ("offload_wait", 0),
                 ("offload_launch", 1), ("device_attention", 1), ("offload_wait", 1)]
    assert runner.calls == per_layer * 2
    gm, report = records[0]
    assert report.counts == {"rms_norm": 0, "swiglu": 0, "silu_mul": 0, "qkv": 0, "attention": 2, "overlap": 2}
    # each wait sits after its device part and before the o_proj linear that needs it
    for wait in (n for n in gm.graph.nodes if n.target is OPS.offload_wait.default):
        user = next(iter(wait.users))
        while user.op == "call_method":
            user = next(iter(user.users))
        assert user.target is F.linear
