"""The "apex" torch.compile backend: options, plain-mode equality with eager, paged steps with a test runner,
the entry-point registration, and the no-cache-clone property."""
import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.utils._pytree import tree_leaves

from apex_compile.backend import BackendOptions, apex_backend
from apex_compile.runtime.context import attention_runner
from apex_compile.passes import run_pipeline
from tests.helpers import engine_step, rel_err, runner_for, tiny_model


def cuda(test):
    """Marked `cuda` (the device calls select tests with -m cuda) and skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _compile(fn, dynamic=None, **options):
    """`fn` compiled by the apex backend; returns (compiled fn, list of pass reports)."""
    reports = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=apex_backend, dynamic=dynamic, fullgraph=True,
                             options={**options, "on_report": reports.append})
    return compiled, reports


# ---------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("options, message", [
    ({"attention": "flash"}, "attention must be one of"),
    ({"overlap": True}, "overlap=True needs attention='paged'"),
    ({"attention": "paged", "overlap": "yes"}, "overlap must be a bool"),
    ({"inner": "tvm"}, "inner must be one of"),
    ({"on_report": 3}, "on_report must be callable"),
    ({"fusions": False}, "unknown option"),
])
def test_bad_options_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        BackendOptions.parse(options)


def test_mode_needs_inductor():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match="applies to inner='inductor' only"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apex_backend(gm, [torch.ones(2)], mode="reduce-overhead", options={"inner": "eager"})


def test_cpu_graphs_default_to_eager_inner(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module

    def no_inductor(*args, **kwargs):
        raise AssertionError("inductor must not be the default on CPU")

    monkeypatch.setattr(compile_fx_module, "compile_fx", no_inductor)
    model = tiny_model("llama", layers=1)
    compiled, reports = _compile(model)
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5
    assert reports[0].counts["rms_norm"] == 3


# ------------------------------------------------------------------------------------------- plain mode

@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_plain_compile_equals_eager(kind):
    model = tiny_model(kind, layers=2)
    compiled, reports = _compile(model)
    with torch.no_grad():
        for length in (7, 3):
            ids = torch.randint(0, 96, (2, length))
            assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5
    counts = reports[0].counts
    assert (counts["rms_norm"], counts["swiglu"], counts["attention"]) == (5, 2, 0)
    assert [site.form for site in reports[0].attention_sites] == ["dense SDPA", "dense SDPA"]


def test_plain_compile_aot_eager_inner_equals_eager():
    model = tiny_model("llama", layers=2)
    compiled, _ = _compile(model, inner="aot_eager")
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5


def test_report_table_lists_layers_and_misses():
    model = tiny_model("llama", layers=2)
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
    compiled, reports = _compile(model)
    with torch.no_grad():
        compiled(torch.randint(0, 96, (1, 4)))
    report = reports[0]
    assert report.layer_counts(0)["rms_norm"] == 2 and report.layer_counts(1)["rms_norm"] == 1
    (miss,) = report.misses
    assert miss.layer == 1 and "post_attention_layernorm" in miss.module and "dtypes differ" in miss.reason
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "apex pass report (attention=sdpa, overlap=off)"
    assert lines[1].split(" | ")[:4] == ["layer", "rms_norm", "swiglu", "silu_mul"]
    assert lines[3].startswith("0     | 2        | 1") and lines[4].startswith("1     | 1        | 1")
    assert "not rewritten:" in text and "post_attention_layernorm: dtypes differ" in text


def test_float64_model_keeps_its_ops():
    model = tiny_model("qwen2", layers=1).double()
    compiled, reports = _compile(model)
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad(), pytest.warns(UserWarning, match="compiled unchanged"):
        out = compiled(ids).logits
    with torch.no_grad():
        assert torch.equal(out, model(ids).logits)
    assert not reports[0].rewrites
    assert {m.reason for m in reports[0].misses} == {"dtype torch.float64 is not supported by the fused kernel"}


def test_gpt2_passes_through_with_a_warning():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled, reports = _compile(model)
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad(), pytest.warns(UserWarning, match="no RMSNorm or SwiGLU pattern"):
        out = compiled(ids).logits
    with torch.no_grad():
        assert rel_err(out, model(ids).logits) <= 1e-5
    assert not reports[0].rewrites


# ------------------------------------------------------------------------------------------- paged mode

@pytest.mark.parametrize("overlap", [False, True])
def test_paged_step_is_symbolic_in_tokens_and_matches_eager(overlap):
    model = tiny_model("llama", layers=2)
    compiled, reports = _compile(engine_step(model), dynamic=True, attention="paged", overlap=overlap)
    ids = torch.randint(0, 96, (1, 14))
    runner = runner_for(model)
    with torch.no_grad(), attention_runner(runner):
        reference = model(ids).logits[0]
        first = compiled(ids[:, :8], torch.arange(8)[None], torch.arange(8))
        compiles = len(reports)
        second = compiled(ids[:, 8:13], torch.arange(8, 13)[None], torch.arange(5))
        assert len(reports) == compiles  # 8 and 5 tokens: one graph with a symbolic token count
        last = compiled(ids[:, 13:], torch.arange(13, 14)[None], torch.tensor([0]))
    assert rel_err(first, reference[:8]) <= 1e-5
    assert rel_err(second, reference[8:13]) <= 1e-5
    assert rel_err(last, reference[13:]) <= 1e-5
    counts = reports[0].counts
    assert (counts["attention"], counts["overlap"], counts["rms_norm"], counts["swiglu"]) == (
        2, 2 if overlap else 0, 5, 2)


def test_paged_graph_without_attention_names_what_is_missing():
    from apex_compile.passes import PatternError

    compiled, _ = _compile(lambda x: torch.tanh(x) * 2, attention="paged")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no scaled_dot_product_attention") as error:
        compiled(torch.ones(3))
    assert isinstance(error.value.inner_exception, PatternError)


# --------------------------------------------------------------------------------------- attention ops

class StatelessRunner:
    """Pure functions of the op inputs (opcheck calls each op several times): attention over the step's rows
    only, the offload split as host half / device half; returns strided results to test the contiguity fix."""

    def attention(self, layer_idx, query, key, value, scale):
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, Hq, D] as a non-contiguous view

    def offload_launch(self, layer_idx, query, key, value, scale):
        return query.new_zeros(1)

    def device_attention(self, layer_idx, query, key, value, scale, token):
        return self.attention(layer_idx, query, key, value, scale) + token

    def offload_wait(self, layer_idx, token, device_out):
        return device_out  # aliasing its input: the op must hand back a fresh tensor


def test_attention_ops_pass_opcheck():
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    with attention_runner(StatelessRunner()):
        torch.library.opcheck(torch.ops.apex.attention.default, (q, k, v, 3, 0.25))
        token = torch.ops.apex.offload_launch(q, k, v, 3, 0.25)
        torch.library.opcheck(torch.ops.apex.offload_launch.default, (q, k, v, 3, 0.25))
        torch.library.opcheck(torch.ops.apex.device_attention.default, (q, k, v, 3, 0.25, token))
        device_out = torch.ops.apex.device_attention(q, k, v, 3, 0.25, token)
        torch.library.opcheck(torch.ops.apex.offload_wait.default, (token, device_out, 3))
        waited = torch.ops.apex.offload_wait(token, device_out, 3)
    assert waited.is_contiguous() and waited.data_ptr() != device_out.data_ptr()
    assert torch.equal(waited, device_out)
    tags = torch.ops.apex.attention.default.tags
    assert not hasattr(torch.Tag, "cudagraph_unsafe") or torch.Tag.cudagraph_unsafe in tags


def test_attention_op_outside_a_step_says_so():
    with pytest.raises(RuntimeError, match="outside an engine step"):
        torch.ops.apex.attention(torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16), 0, 0.25)


# ----------------------------------------------------------------------------------------- registration

def test_entry_point_registers_the_backend_in_a_fresh_interpreter():
    """`torch.compile(..., backend="apex")` without importing apex_compile (needs `pip install -e .`)."""
    script = """
import json, sys, torch
from torch._dynamo import list_backends
assert "apex_compile" not in sys.modules
registered = "apex" in list_backends()
layer = torch.nn.Linear(4, 4)
with torch.no_grad():
    out = torch.compile(layer, backend="apex")(torch.ones(2, 4))
    same = torch.allclose(out, layer(torch.ones(2, 4)))
print(json.dumps({"registered": registered, "same": same, "loaded": "apex_compile.backend" in sys.modules}))
"""
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True,
                            timeout=600, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"registered": True, "same": True, "loaded": True}


# ------------------------------------------------------------------------------------------ no cache clone

_TEST_LIB = torch.library.Library("apex_test", "FRAGMENT")
_TEST_LIB.define("attention_into_cache(Tensor q, Tensor(a!) key_cache, int layer_idx) -> Tensor")


def _attention_into_cache(q, key_cache, layer_idx):
    key_cache[layer_idx, :q.shape[0]] = q
    return q * 2


_TEST_LIB.impl("attention_into_cache", _attention_into_cache, "CompositeExplicitAutograd")
torch.library.register_fake("apex_test::attention_into_cache", lambda q, key_cache, layer_idx: torch.empty_like(q),
                            lib=_TEST_LIB)


def _aot_forward_graphs(fn, args, rewrite):
    """Compiles `fn` through `rewrite` + AOT autograd (functionalization, as inductor's front end does);
    returns (output, the AOT forward graphs)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    def backend(gm, example_inputs):
        rewrite(gm)
        return aot_autograd(fw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, graphs


def cache_sized_values(gm: torch.fx.GraphModule, cache_numel: int):
    """Nodes of a compiled graph that take in, copy, functionalize or produce a tensor as large as one cache."""
    found = []
    for node in gm.graph.nodes:
        values = tree_leaves(node.meta.get("val"))
        if any(isinstance(v, torch.Tensor) and v.numel() >= cache_numel for v in values):
            found.append(f"{node.op} {node.target}")
    return found


def test_detector_flags_a_cache_that_enters_the_graph():
    """The pitfall the design avoids: a mutating op on a cache graph input gets functionalized."""
    key_cache = torch.zeros(2, 512, 4)

    def step(q, key_cache):
        return torch.ops.apex_test.attention_into_cache(q + 1, key_cache, 1) + 1

    _, graphs = _aot_forward_graphs(step, (torch.randn(6, 4), key_cache), rewrite=lambda gm: None)
    flagged = cache_sized_values(graphs[0], key_cache[0].numel())
    assert any("placeholder" in f for f in flagged) and any("auto_functionalized" in f for f in flagged)


def test_paged_step_never_copies_the_cache():
    model = tiny_model("llama", layers=2)
    runner = runner_for(model, capacity=2048)
    cache_numel = runner.key_cache[0].numel()
    assert cache_numel > max(p.numel() for p in model.parameters())  # a cache-sized tensor cannot hide
    pointers = (runner.key_cache.data_ptr(), runner.value_cache.data_ptr())
    ids = torch.randint(0, 96, (1, 9))
    with attention_runner(runner):
        out, graphs = _aot_forward_graphs(engine_step(model), (ids, torch.arange(9)[None], torch.arange(9)),
                                          rewrite=lambda gm: run_pipeline(gm, "paged", overlap=True))
    (graph,) = graphs
    assert sum(node.target is torch.ops.apex.offload_launch.default for node in graph.graph.nodes) == 2
    assert cache_sized_values(graph, cache_numel) == []
    assert not [n for n in graph.graph.nodes if "auto_functionalized" in str(n.target) or "copy_" in str(n.target)]
    assert (runner.key_cache.data_ptr(), runner.value_cache.data_ptr()) == pointers
    assert runner.lengths == [9, 9] and torch.isfinite(runner.key_cache[:, :9]).all()
    assert torch.isnan(runner.key_cache[:, 9:]).all()
    with torch.no_grad():
        assert rel_err(out, model(ids).logits[0]) <= 1e-5


@pytest.mark.slow
def test_paged_overlap_with_inductor_on_cpu():
    """The inductor inner compiler on the paged + overlap graph: equal to eager, caches written in place."""
    model = tiny_model("llama", layers=1)
    compiled, reports = _compile(engine_step(model), dynamic=True, attention="paged", overlap=True,
                                 inner="inductor")
    runner = runner_for(model)
    pointers = (runner.key_cache.data_ptr(), runner.value_cache.data_ptr())
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad(), attention_runner(runner):
        reference = model(ids).logits[0]
        first = compiled(ids[:, :6], torch.arange(6)[None], torch.arange(6))
        compiles = len(reports)  # dynamo may trace twice (restarting with float attributes specialised)
        second = compiled(ids[:, 6:], torch.arange(6, 9)[None], torch.arange(3))
    assert len(reports) == compiles  # no recompile for another token count
    assert rel_err(first, reference[:6]) <= 1e-5 and rel_err(second, reference[6:]) <= 1e-5
    assert (runner.key_cache.data_ptr(), runner.value_cache.data_ptr()) == pointers and runner.lengths == [9]


# ---------------------------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    from apex_compile.runtime.loader import load_model

    model, _ = load_model()
    return model


@pytest.mark.slow
def test_smollm2_plain_equals_eager(smollm2):
    compiled, reports = _compile(smollm2)
    ids = torch.randint(0, smollm2.config.vocab_size, (1, 10))
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, smollm2(ids).logits) <= 1e-5
    counts = reports[0].counts
    assert (counts["rms_norm"], counts["swiglu"]) == (61, 30) and not reports[0].misses


@pytest.mark.slow
def test_smollm2_paged_rewrites_every_layer_and_matches_eager(smollm2):
    compiled, reports = _compile(engine_step(smollm2), dynamic=True, attention="paged", overlap=True)
    ids = torch.randint(0, smollm2.config.vocab_size, (1, 10))
    runner = runner_for(smollm2)
    with torch.no_grad(), attention_runner(runner):
        reference = smollm2(ids).logits[0]
        prefill = compiled(ids[:, :7], torch.arange(7)[None], torch.arange(7))
        chunk = compiled(ids[:, 7:], torch.arange(7, 10)[None], torch.arange(3))
    assert rel_err(prefill, reference[:7]) <= 1e-5 and rel_err(chunk, reference[7:]) <= 1e-5
    report = reports[0]
    assert report.counts["attention"] == report.counts["overlap"] == 30
    assert [s.layer_idx for s in report.attention_sites] == [s.layer for s in report.attention_sites] == list(range(30))
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in report.attention_sites} == {(9, 3, 64)}


# ------------------------------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
@cuda
def test_cuda_plain_bf16_with_inductor():
    model = tiny_model("llama", layers=2).to("cuda", torch.bfloat16)
    reference_model = tiny_model("llama", layers=2).to("cuda", torch.float64)
    compiled, reports = _compile(model)
    ids = torch.randint(0, 96, (1, 16), device="cuda")
    with torch.no_grad():
        out = compiled(ids).logits
        eager = model(ids).logits
        reference = reference_model(ids).logits
    assert reports[0].counts["rms_norm"] == 5 and reports[0].counts["swiglu"] == 2
    assert rel_err(out, reference) <= 2 * rel_err(eager, reference) + 1e-2


@pytest.mark.cuda
@cuda
def test_cuda_paged_overlap_with_cudagraphs():
    """Same-shape steps warm up, record and replay the CUDA graphs; the apex ops must run at every step."""
    model = tiny_model("llama", layers=2).to("cuda")
    reports = []
    torch._dynamo.reset()
    compiled = torch.compile(engine_step(model), backend=apex_backend, dynamic=True, fullgraph=True,
                             options={"attention": "paged", "overlap": True, "mode": "reduce-overhead",
                                      "on_report": reports.append})
    runner = runner_for(model, device="cuda")
    pointers = (runner.key_cache.data_ptr(), runner.value_cache.data_ptr())
    ids = torch.randint(0, 96, (1, 16), device="cuda")
    positions = torch.arange(16, device="cuda")[None]
    with torch.no_grad(), attention_runner(runner):
        reference = model(ids).logits[0]
        for start in range(0, 16, 4):
            chunk = compiled(ids[:, start:start + 4], positions[:, start:start + 4], torch.arange(4, device="cuda"))
            assert rel_err(chunk, reference[start:start + 4]) <= 1e-4
    assert (runner.key_cache.data_ptr(), runner.value_cache.data_ptr()) == pointers and runner.lengths == [16, 16]
    assert reports[0].counts["overlap"] == 2
