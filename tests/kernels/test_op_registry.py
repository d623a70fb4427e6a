"""The apex op registry: every `apex::` op passes torch.library.opcheck (schema, fake implementation, AOT
dispatch) on small CPU inputs, importing apex_compile registers all of them with the expected kernels, and
apex_compile/kernels/ only launches (it imports nothing of apex_compile.ops and registers nothing)."""
import ast
import glob
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import apex_compile.ops as apex_ops
from apex_compile.ops import runner_slot

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(REPO_ROOT, "apex_compile")

# op -> dispatch keys that must hold a kernel (Meta comes with every fake implementation).
EXPECTED_KERNELS = {
    "cache_append_cpu": {"CPU"},
    "paged_attention_cpu": {"CPU"},
    "cache_append_cpu_multi": {"CPU"},
    "paged_attention_cpu_multi": {"CPU"},
    "stagger_cpu_job": {"CPU"},
    "stagger_layer_job": {"CPU"},
    "wait_host_flags": {"CPU"},
    "cpu_isa_code": {"CompositeExplicitAutograd"},
    "cpu_attention_work_split": {"CompositeExplicitAutograd"},
    "stagger_runner_start": {"CompositeExplicitAutograd"},
    "stagger_runner_submit": {"CPU"},
    "stagger_runner_poll": {"CompositeExplicitAutograd"},
    "stagger_runner_state": {"CompositeExplicitAutograd"},
    "stagger_runner_drain": {"CompositeExplicitAutograd"},
    "stagger_runner_stop": {"CompositeExplicitAutograd"},
    "kv_export_start": {"CompositeExplicitAutograd"},
    "kv_export_submit": {"CPU"},
    "kv_export_poll": {"CompositeExplicitAutograd"},
    "kv_export_stop": {"CompositeExplicitAutograd"},
    "cache_append_gpu": {"CPU", "CUDA"},
    "paged_attention_gpu": {"CPU", "CUDA"},
    "paged_decode_append_gpu": {"CPU", "CUDA"},
    "paged_prefill_attention_gpu": {"CPU", "CUDA"},
    "rms_norm": {"CPU", "CUDA"},
    "silu_mul": {"CPU", "CUDA"},
    "swiglu": {"CPU", "CUDA"},
    "qkv_linear": {"CPU", "CUDA"},
    "linear": {"CPU", "CUDA"},
    "attention": {"CompositeExplicitAutograd"},
    "offload_launch": {"CompositeExplicitAutograd"},
    "device_attention": {"CompositeExplicitAutograd"},
    "offload_wait": {"CompositeExplicitAutograd"},
    "stagger_residual": {"CompositeExplicitAutograd"},
    "stagger_rope_layers": {"CompositeExplicitAutograd"},
}
NO_TENSOR_OPS = {"cpu_isa_code": (), "cpu_attention_work_split": (0, 0, 0)}  # read-only calls, no fake needed
# Stateful ops of the runtime's C++ job runner (a thread behind a handle), never inside a traced graph: no opcheck
# and no fake (tests/kernels/test_stagger_runner.py runs them).
RUNTIME_OPS = {"stagger_runner_start", "stagger_runner_submit", "stagger_runner_poll", "stagger_runner_state",
               "stagger_runner_drain", "stagger_runner_stop", "kv_export_start", "kv_export_submit", "kv_export_poll",
               "kv_export_stop"}

NUM_BLOCKS, KV_HEADS, HEADS, BLOCK, DIM = 4, 2, 4, 16, 16


def registered_apex_ops() -> set:
    return {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("apex::")}


def paged_inputs():
    """A filled CPU KV cache, a block table and context lengths of two sequences."""
    torch.manual_seed(0)
    key_cache, value_cache = apex_ops.allocate_kv_cache_cpu(NUM_BLOCKS, KV_HEADS, BLOCK, DIM, torch.float32)
    key_cache.copy_(torch.randn_like(key_cache))
    value_cache.copy_(torch.randn_like(value_cache))
    block_tables = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
    context_lens = torch.tensor([20, 7], dtype=torch.int32)
    return key_cache, value_cache, block_tables, context_lens


def append_args():
    key_cache, value_cache, _, _ = paged_inputs()
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    return key, value, key_cache, value_cache, torch.tensor([5, -1, 40])


def multi_caches():
    """Two cache pairs of one geometry (the second a shifted copy of the first)."""
    key_cache, value_cache, block_tables, context_lens = paged_inputs()
    return [key_cache, key_cache + 1.0], [value_cache, value_cache - 1.0], block_tables, context_lens


def append_multi_args():
    keys, values, _, _ = multi_caches()
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    return key, value, keys, values, torch.tensor([1, 0, 1], dtype=torch.int32), torch.tensor([5, -1, 40])


def decode_multi_args():
    keys, values, block_tables, context_lens = multi_caches()
    return (torch.randn(2, HEADS, DIM), keys, values, torch.tensor([1, 0], dtype=torch.int32), block_tables,
            context_lens)


def stagger_job_args():
    """Two layers x two rows staged (q, k, v heads side by side), three of the rows holding a request."""
    keys, values, block_tables, context_lens = multi_caches()
    staged = torch.randn(2, 2, HEADS + 2 * KV_HEADS, DIM)
    rows = torch.tensor([0, 1, 3])
    return (staged, keys, values, torch.tensor([0, 0, 1], dtype=torch.int32), block_tables[[0, 1, 0]],
            torch.tensor([20, 7, 5], dtype=torch.int32), torch.tensor([19, 54, 4]), rows, HEADS, 0.3,
            torch.zeros(2, 2, HEADS, DIM), torch.tensor([3, 1]), [2, 1], 1.0, torch.zeros(2, dtype=torch.float64))


def stagger_layer_job_args():
    """stagger_job_args' rows, layer by layer: both layers staged for turn 2 (ready flags at 2)."""
    args = stagger_job_args()
    return args[:11] + (torch.tensor([2, 2]), torch.zeros(2, dtype=torch.int64), 2, 1.0,
                        torch.zeros(2, dtype=torch.float64))


def decode_args():
    return (torch.randn(2, HEADS, DIM), *paged_inputs())


def decode_append_args():
    """Two sequences' current tokens (strided key/value of one projection output) at their last slots, and a
    padding row (slot -1, context 1)."""
    key_cache, value_cache, block_tables, context_lens = paged_inputs()
    qkv = torch.randn(3, HEADS + 2 * KV_HEADS, DIM)
    return (qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:], key_cache, value_cache,
            torch.tensor([35, 54, -1]), torch.cat([block_tables, torch.zeros_like(block_tables[:1])]),
            torch.cat([context_lens, torch.ones_like(context_lens[:1])]))


def prefill_args():
    key_cache, value_cache, block_tables, context_lens = paged_inputs()
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    return torch.randn(5, HEADS, DIM), key_cache, value_cache, block_tables, query_start_loc, context_lens


def attention_args(token=False):
    q, k, v = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    return (q, k, v, 0, 0.25) + ((torch.zeros(1),) if token else ())


# (op, args, kwargs) builders; ids name the op.
CASES = [
    ("cache_append_cpu", append_args, {}),
    ("paged_attention_cpu", decode_args, {"scale": 0.3}),
    ("cache_append_cpu_multi", append_multi_args, {}),
    ("paged_attention_cpu_multi", decode_multi_args, {"scale": 0.3}),
    ("stagger_cpu_job", stagger_job_args, {}),
    ("stagger_layer_job", stagger_layer_job_args, {}),
    ("wait_host_flags", lambda: (torch.tensor([3, 1]), [2, 1], 1.0), {}),
    ("cache_append_gpu", append_args, {}),
    ("paged_attention_gpu", decode_args, {"scale": None, "max_context_len": 32}),
    ("paged_decode_append_gpu", decode_append_args, {"scale": 0.3, "max_context_len": 32}),
    ("paged_prefill_attention_gpu", prefill_args, {"max_query_len": 3}),
    ("rms_norm", lambda: (torch.randn(3, 32), torch.randn(32), 1e-6), {}),
    ("rms_norm", lambda: (torch.randn(3, 32), torch.randn(32), 1e-6, torch.randn(3, 32)), {}),
    ("silu_mul", lambda: (torch.randn(2, 3, 64),), {}),
    ("swiglu", lambda: (torch.randn(3, 32), torch.randn(48, 32), torch.randn(48, 32)), {}),
    ("qkv_linear", lambda: (torch.randn(3, 32), torch.randn(16, 32), torch.randn(8, 32), torch.randn(8, 32)), {}),
    ("qkv_linear", lambda: (torch.randn(3, 32), *torch.randn(32, 32).split([16, 8, 8]), torch.randn(16),
                            torch.randn(8), torch.randn(8)), {}),
    ("linear", lambda: (torch.randn(2, 3, 32), torch.randn(16, 32)), {}),
    ("attention", attention_args, {}),
    ("offload_launch", attention_args, {}),
    ("device_attention", lambda: attention_args(token=True), {}),
    ("offload_wait", lambda: (torch.zeros(1), torch.randn(3, KV_HEADS, DIM), 0), {}),
    ("stagger_residual", lambda: (torch.randn(1, 3, 32), 0), {}),
    ("stagger_rope_layers", lambda: (torch.randn(1, 3, DIM), 4, 1), {}),
]


class StubRunner:
    """Answers the attention ops with shapes as the runtime's runner does (no KV cache)."""

    def attention(self, layer_idx, q, k, v, scale):
        return q * scale

    def offload_launch(self, layer_idx, q, k, v, scale):
        return q.new_zeros(1)

    def device_attention(self, layer_idx, q, k, v, scale, token):
        return q * scale + token

    def offload_wait(self, layer_idx, token, device_out):
        return device_out  # an alias: the op must return a copy

    def stagger_residual(self, layer_idx, residual):
        return residual  # an alias too

    def stagger_rope_layers(self, num_layers, table, kind):
        return table.expand(num_layers, *table.shape) * (kind + 1)


@pytest.fixture
def stub_runner():
    previous = runner_slot.install(StubRunner())
    yield
    runner_slot.install(previous)


def test_every_op_is_covered():
    """A new apex op fails here until it has an opcheck case (or is a tensor-free op) and expected kernels."""
    covered = {name for name, _, _ in CASES} | set(NO_TENSOR_OPS) | RUNTIME_OPS
    assert registered_apex_ops() == covered
    assert set(EXPECTED_KERNELS) == covered


@pytest.mark.parametrize("name,make_args,kwargs", CASES, ids=[c[0] for c in CASES])
def test_opcheck(name, make_args, kwargs, stub_runner):
    op = getattr(torch.ops.apex, name).default
    # No autograd check: the ops are inference-only.
    torch.library.opcheck(op, make_args(), kwargs,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("name", sorted(EXPECTED_KERNELS))
def test_dispatch_keys(name):
    qualname = f"apex::{name}"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    missing = {key for key in EXPECTED_KERNELS[name] if not has_kernel(qualname, key)}
    assert not missing, f"{qualname} has no kernel for {sorted(missing)}"
    if name not in NO_TENSOR_OPS and name not in RUNTIME_OPS:
        assert has_kernel(qualname, "Meta"), f"{qualname} has no fake impl"


@pytest.mark.parametrize("name", sorted(NO_TENSOR_OPS))
def test_tensor_free_ops_run_under_fake_mode(name):
    op = getattr(torch.ops.apex, name)
    with FakeTensorMode():
        assert op(*NO_TENSOR_OPS[name]) == op(*NO_TENSOR_OPS[name])


def test_fake_propagation_of_the_kv_ops():
    """Fake tensors flow through the mutating append and the attention reading the caches."""
    with FakeTensorMode() as mode:
        key, value, key_cache, value_cache, slots = (mode.from_tensor(t) for t in append_args())
        torch.ops.apex.cache_append_gpu(key, value, key_cache, value_cache, slots)
        out = torch.ops.apex.paged_attention_gpu(torch.empty(2, HEADS, DIM), key_cache, value_cache,
                                                 torch.zeros(2, 2, dtype=torch.int32),
                                                 torch.ones(2, dtype=torch.int32))
    assert out.shape == (2, HEADS, DIM) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_mutating_append_under_torch_compile(backend):
    """cache_append_gpu's mutation of the caches survives functionalization (auto_functionalized) and the
    compiled step equals eager."""
    query = torch.randn(2, HEADS, DIM)
    key, value, key_cache, value_cache, _ = append_args()
    _, _, block_tables, context_lens = paged_inputs()
    slots = torch.tensor([19, 22])  # the last token of each sequence

    def step(query, key, value, key_cache, value_cache, slots):
        torch.ops.apex.cache_append_gpu(key, value, key_cache, value_cache, slots)
        return torch.ops.apex.paged_attention_gpu(query, key_cache, value_cache, block_tables, context_lens)

    eager_caches = key_cache.clone(), value_cache.clone()
    expected = step(query, key[:2], value[:2], *eager_caches, slots)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(query, key[:2], value[:2], key_cache, value_cache, slots)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(key_cache, eager_caches[0]) and torch.equal(value_cache, eager_caches[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_decode_append_under_torch_compile(backend):
    """paged_decode_append_gpu's mutation of the caches survives functionalization and the compiled step (strided
    views of one projection output in, as the engine passes them) equals eager."""
    query, key, value, key_cache, value_cache, slots, block_tables, context_lens = decode_append_args()
    qkv = torch.cat([query, key, value], dim=1)

    def step(qkv, key_cache, value_cache):
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        out = torch.ops.apex.paged_decode_append_gpu(q, k, v, key_cache, value_cache, slots, block_tables,
                                                     context_lens)
        return out * 2

    eager_caches = key_cache.clone(), value_cache.clone()
    expected = step(qkv, *eager_caches)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(qkv, key_cache, value_cache)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(key_cache, eager_caches[0]) and torch.equal(value_cache, eager_caches[1])
    assert not torch.equal(key_cache, paged_inputs()[0]), "the current tokens were not appended"


def test_importing_apex_compile_registers_every_op():
    code = ("import torch, apex_compile\n"
            "print(sorted(s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith('apex::')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(sorted(f"apex::{n}" for n in EXPECTED_KERNELS))


def _imports(tree: ast.AST) -> list:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


KERNEL_FILES = sorted(glob.glob(os.path.join(PACKAGE_DIR, "kernels", "*.py")))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=os.path.basename)
def test_kernels_only_launch(path):
    """kernels/ imports nothing of apex_compile.ops and neither defines nor calls ops (the ops own that)."""
    tree = ast.parse(open(path).read(), path)
    bad = [name for name in _imports(tree)
           if name.startswith(("apex_compile.ops", "..ops", "apex_compile.runtime", "..runtime"))]
    assert not bad, f"{os.path.basename(path)} imports {bad}"
    code = ast.unparse(tree)
    for banned in ("torch.library", "torch.ops.apex", "custom_op", "register_fake"):
        assert banned not in code, f"{os.path.basename(path)} uses {banned}"


def test_only_ops_register_ops():
    """Every torch.library registration of the package lives in apex_compile/ops/."""
    ops_dir = os.path.join(PACKAGE_DIR, "ops") + os.sep
    offenders = [path for path in glob.glob(os.path.join(PACKAGE_DIR, "**", "*.py"), recursive=True)
                 if not path.startswith(ops_dir) and "torch.library" in ast.unparse(ast.parse(open(path).read()))]
    assert not offenders
