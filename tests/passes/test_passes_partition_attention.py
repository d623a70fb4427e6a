"""partition_attention on small synthetic graphs and on real HF decoders' traced graphs."""
import pytest
import torch
import torch.nn.functional as F

from apex_compile.runtime.context import attention_runner
from apex_compile.passes import PassReport, PatternError
from apex_compile.passes.partition_attention import partition_attention
from tests.helpers import (DenseCausalRunner, capture, compile_with, count_calls, engine_step, rel_err,
                            runner_for, tiny_model)

ATTENTION = torch.ops.apex.attention.default


def _heads(x, heads):
    """[B, S, H*16] -> [B, H, S, 16] the way HF does it (a transposed view; static head sizes)."""
    b, s, _ = x.shape
    return x.view(b, s, heads, 16).transpose(1, 2)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def attend_repeat_kv(q, k, v):
    return F.scaled_dot_product_attention(_heads(q, 4), repeat_kv(_heads(k, 2), 2), repeat_kv(_heads(v, 2), 2),
                                          is_causal=True)


def attend_repeat_interleave(q, k, v):
    return F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 2).repeat_interleave(2, dim=1),
                                          _heads(v, 2).repeat_interleave(2, dim=1), is_causal=True, scale=0.3)


def attend_enable_gqa(q, k, v):
    return F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 2), _heads(v, 2), is_causal=True,
                                          enable_gqa=True)


def attend_with_mask(q, k, v):
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    return F.scaled_dot_product_attention(_heads(q, 4), repeat_kv(_heads(k, 2), 2), repeat_kv(_heads(v, 2), 2),
                                          attn_mask=mask)


def _reference(q, k, v, scale=None):
    """float64 causal GQA attention of one sequence, [1, Hq, S, D]."""
    q, k, v = _heads(q.double(), 4), _heads(k.double(), 2), _heads(v.double(), 2)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True,
                                          scale=scale)


@pytest.mark.parametrize("variant, scale", [(attend_repeat_kv, None), (attend_repeat_interleave, 0.3),
                                            (attend_enable_gqa, None), (attend_with_mask, None)],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_sdpa_forms_become_apex_attention(variant, scale):
    q, k, v = torch.randn(1, 6, 64), torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    compiled, records = compile_with(variant, partition_attention)
    runner = DenseCausalRunner(1, 2, 16)
    with attention_runner(runner):
        out = compiled(q, k, v)
    gm, report = records[0]
    (op,) = [n for n in gm.graph.nodes if n.target is ATTENTION]
    assert op.args[3] == 0 and op.args[4] == pytest.approx(scale or 16 ** -0.5)
    assert count_calls(gm, F.scaled_dot_product_attention) == 0
    assert not any(n.op == "call_method" and n.target in ("expand", "repeat_interleave") for n in gm.graph.nodes)
    site = report.attention_sites[0]
    assert (site.num_heads, site.num_kv_heads, site.head_dim) == (4, 2, 16)
    assert out.shape == (1, 4, 6, 16) and rel_err(out, _reference(q, k, v, scale)) <= 1e-6
    assert runner.lengths == [6]


def test_symbolic_batch_and_tokens_flatten_to_rows():
    """B > 1: apex.attention sees B*S token rows and SDPA's users get [B, Hq, S, D] back."""
    class ShapeRunner:
        def __init__(self):
            self.shapes = []

        def attention(self, layer_idx, query, key, value, scale):
            self.shapes.append((tuple(query.shape), tuple(key.shape)))
            return query * 2

    def fn(q, k, v):
        return attend_repeat_kv(q, k, v) + 1

    compiled, records = compile_with(fn, partition_attention, dynamic=True)
    runner = ShapeRunner()
    with attention_runner(runner):
        for batch, tokens in ((2, 5), (3, 7)):
            q = torch.randn(batch, tokens, 64)
            out = compiled(q, torch.randn(batch, tokens, 32), torch.randn(batch, tokens, 32))
            assert torch.equal(out, _heads(q, 4) * 2 + 1)
    assert runner.shapes == [((10, 4, 16), (10, 2, 16)), ((21, 4, 16), (21, 2, 16))]
    assert len(records) == 1


def _pattern_error(fn, *args):
    gm, _ = capture(fn, *args)
    with pytest.raises(PatternError) as error:
        partition_attention(gm, PassReport())
    return str(error.value)


def test_graph_without_sdpa_names_what_is_missing():
    def matmul_attention(q, k, v):
        q, k, v = _heads(q, 4), _heads(k, 4), _heads(v, 4)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    message = _pattern_error(matmul_attention, *(torch.randn(1, 5, 64) for _ in range(3)))
    assert "no scaled_dot_product_attention" in message and "attn_implementation='sdpa'" in message


def test_non_causal_attention_is_rejected():
    def bidirectional(q, k, v):
        return F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4))

    assert "not causal" in _pattern_error(bidirectional, *(torch.randn(1, 5, 64) for _ in range(3)))


def test_dropout_is_rejected():
    def with_dropout(q, k, v):
        return F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=True,
                                              dropout_p=0.1)

    assert "dropout_p" in _pattern_error(with_dropout, *(torch.randn(1, 5, 64) for _ in range(3)))


def test_past_kv_flowing_into_the_graph_is_rejected():
    def with_past(q, k, v, past_k, past_v):
        k = torch.cat([past_k, _heads(k, 4)], dim=2)
        v = torch.cat([past_v, _heads(v, 4)], dim=2)
        return F.scaled_dot_product_attention(_heads(q, 4), k, v, is_causal=True)

    message = _pattern_error(with_past, *(torch.randn(1, 5, 64) for _ in range(3)), torch.randn(1, 4, 3, 16),
                             torch.randn(1, 4, 3, 16))
    assert "use_cache=False" in message


@pytest.mark.parametrize("compile_whole_model", [True, False], ids=["model", "engine-step"])
def test_graph_break_inside_the_decoder_is_rejected(compile_whole_model):
    """Graph pieces would number their attention from 0 again: no piece may be rewritten silently."""
    model = tiny_model("llama", layers=2)
    model.model.layers[1].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    outcomes = []

    def backend(gm, example_inputs):
        try:
            outcomes.append(partition_attention(gm, PassReport()))
        except PatternError as error:
            outcomes.append(str(error))
        return gm.forward

    torch._dynamo.reset()
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad(), attention_runner(runner_for(model)):
        if compile_whole_model:
            torch.compile(model, backend=backend)(ids, use_cache=False)
        else:
            torch.compile(engine_step(model), backend=backend)(ids, torch.arange(5)[None], torch.arange(5))
    assert outcomes and all(isinstance(outcome, str) for outcome in outcomes)
    assert any("graph break" in outcome for outcome in outcomes)


def test_gpt2_with_eager_attention_is_rejected():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.config._attn_implementation = "eager"
    gm, _ = capture(lambda ids: model(ids, use_cache=False).logits, torch.randint(0, 96, (1, 5)))
    with pytest.raises(PatternError, match="no scaled_dot_product_attention"):
        partition_attention(gm, PassReport())


MODELS = {
    "llama-gqa": ("llama", {}),
    "llama2-mha": ("llama", {"num_key_value_heads": 4}),
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                         "rope_theta": 500000.0, "tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
}


@pytest.mark.parametrize("name", MODELS)
def test_real_decoders_rewrite_one_op_per_layer_and_match_eager(name):
    kind, overrides = MODELS[name]
    model = tiny_model(kind, layers=3, **overrides)
    step = engine_step(model)
    compiled, records = compile_with(step, partition_attention, dynamic=True)
    ids = torch.randint(0, 96, (1, 11))
    runner = runner_for(model)
    with torch.no_grad(), attention_runner(runner):
        reference = model(ids).logits[0]
        prefill = compiled(ids[:, :6], torch.arange(6)[None], torch.arange(6))
        chunk = compiled(ids[:, 6:10], torch.arange(6, 10)[None], torch.arange(4))
        decode = compiled(ids[:, 10:], torch.arange(10, 11)[None], torch.tensor([0]))
    assert rel_err(prefill, reference[:6]) <= 1e-5
    assert rel_err(chunk, reference[6:10]) <= 1e-5
    assert rel_err(decode, reference[10:]) <= 1e-5
    assert runner.lengths == [11, 11, 11]
    gm, report = records[0]
    layer_indices = [n.args[3] for n in gm.graph.nodes if n.target is ATTENTION]
    assert layer_indices == [0, 1, 2] and report.counts["attention"] == 3
    config = model.config
    assert all((s.num_heads, s.num_kv_heads) == (config.num_attention_heads, config.num_key_value_heads)
               for s in report.attention_sites)
    assert [s.layer for s in report.attention_sites] == [0, 1, 2]
    # the mask-building code died with SDPA: no [.., S, S] boolean mask is computed any more
    assert not any(isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() == 4
                   for v in (n.meta.get("example_value") for n in gm.graph.nodes))
