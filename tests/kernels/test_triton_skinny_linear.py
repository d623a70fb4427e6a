"""The skinny linear (apex_compile.kernels.skinny_linear) and `apex::linear`: the Triton GEMM against float64
(CUDA, or CPU under TRITON_INTERPRET=1 via tests/kernels/test_triton_interpreter.py), its dispatch table lookup,
the op's CPU path, and the skinny_linear pass on a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from apex_compile.kernels import skinny_linear as sk
from apex_compile.ops import linear as ops_linear  # noqa: F401 (registers apex::linear)
from apex_compile.passes import run_pipeline
from apex_compile.passes import skinny_linear as pass_module

from tests.devices import CUDA_ONLY, TRITON_DEVICES, not_interpreted


def reference(x, w):
    return x.double() @ w.double().T


def assert_close(got, want, dtype, k):
    # fp32: products exact, sums in another order; bf16: one rounding of the fp32 sum (2^-8 relative)
    scale = want.abs().max().item() + 1e-6
    tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 1e-2
    err = (got.double() - want).abs().max().item() / scale
    assert err <= tol, f"max error {err:.3g} of the largest value (tolerance {tol:.3g})"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 70, 200), (16, 32, 96), (17, 33, 128), (32, 64, 160)])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_skinny_linear_equals_float64(device, dtype, m, n, k, split):
    torch.manual_seed(m * 1000 + n + split)
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split, "num_warps": 4, "num_stages": 2}
    got = sk.skinny_linear(x, w, config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, reference(x, w), dtype, k)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_skinny_linear_strided_input_and_given_output(device):
    x = torch.randn(4, 128, device=device)[:, :96]  # rows with a stride above K
    w = torch.randn(40, 96, device=device)
    out = torch.full((4, 40), float("nan"), device=device)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}
    assert sk.skinny_linear(x, w, config, out=out) is out
    assert_close(out, reference(x, w), torch.float32, 96)


def test_skinny_linear_rejects_bad_input():
    with pytest.raises(ValueError, match="at most 32 rows"):
        sk.skinny_linear(torch.randn(33, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        sk.skinny_linear(torch.randn(3, 8), torch.randn(4, 7))
    with pytest.raises(TypeError, match="dtypes differ"):
        sk.skinny_linear(torch.randn(3, 8), torch.randn(4, 8, dtype=torch.float64))


def test_dispatch_lookup():
    table = {"device_name": "GPU X", "shapes": {"bfloat16/64x32": [
        {"max_m": 8, "path": "triton", "config": {"BLOCK_N": 64}},
        {"max_m": 16, "path": "cublas"},
        {"max_m": 32, "path": "triton", "config": {"BLOCK_N": 32}}]}}
    key = sk.dispatch_key(torch.bfloat16, 64, 32)
    assert key == "bfloat16/64x32"
    assert sk.lookup(table, "GPU X", key, 1) == {"BLOCK_N": 64}
    assert sk.lookup(table, "GPU X", key, 8) == {"BLOCK_N": 64}
    assert sk.lookup(table, "GPU X", key, 9) is None  # cuBLAS measured faster there
    assert sk.lookup(table, "GPU X", key, 24) == {"BLOCK_N": 32}
    assert sk.lookup(table, "GPU X", key, 33) is None  # above the kernel's rows
    assert sk.lookup(table, "GPU Y", key, 1) is None  # another GPU
    assert sk.lookup(table, "GPU X", "bfloat16/64x64", 1) is None  # an unmeasured shape
    assert sk.lookup({}, "GPU X", key, 1) is None


def test_default_config_splits_k_for_few_columns():
    assert sk.default_config(8, 4096, 14336)["SPLIT_K"] > 1
    assert sk.default_config(8, 128256, 4096)["SPLIT_K"] == 1
    assert sk.default_config(24, 64, 64)["BLOCK_M"] == 32


@not_interpreted
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16)])
def test_apex_linear_op_on_cpu_is_f_linear(shape):
    x, w = torch.randn(*shape), torch.randn(24, 16)
    got = torch.ops.apex.linear(x, w)
    assert torch.equal(got, F.linear(x, w))
    torch.library.opcheck(torch.ops.apex.linear.default, (x, w))
    with pytest.raises(ValueError, match="apex.linear"):
        torch.ops.apex.linear(x, torch.randn(24, 15))


@not_interpreted
def test_pass_leaves_cpu_linears():
    linear = torch.nn.Linear(16, 24, bias=False)
    reports = []

    def backend(gm, example_inputs):
        reports.append(run_pipeline(gm, fuse=True))
        return gm.forward

    x = torch.randn(3, 16)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="no RMSNorm or SwiGLU"):
        torch.compile(linear, backend=backend)(x)
    assert reports[0].skinny_linears == 0
    assert pass_module.measured_shapes(torch.device("cpu")) == set()


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("m", [1, 16, 24, 32])
def test_cuda_llama3_shapes_default_and_table_configs(device, m):
    torch.manual_seed(m)
    for n, k in [(4096, 4096), (4096, 14336), (6144, 4096)]:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5
        want = reference(x, w)
        assert_close(sk.skinny_linear(x, w), want, torch.bfloat16, k)
        assert_close(sk.linear(x, w), want, torch.bfloat16, k)  # the table's choice on this GPU
        assert_close(torch.ops.apex.linear(x.unsqueeze(0), w)[0], want, torch.bfloat16, k)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_cuda_pass_rewrites_covered_linears(device, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 40, bias=False))
    model = model.to(device, torch.bfloat16)
    covered = sk.dispatch_key(torch.bfloat16, 48, 64)
    monkeypatch.setattr(pass_module, "measured_shapes", lambda dev: {covered})
    reports = []

    def backend(gm, example_inputs):
        reports.append(run_pipeline(gm, fuse=True))
        return gm.forward

    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    torch._dynamo.reset()
    got = torch.compile(model, backend=backend)(x)
    assert reports[0].skinny_linears == 1  # the first linear only: the second's shape is not covered
    assert_close(got, reference(reference(x, model[0].weight).to(torch.bfloat16), model[1].weight),
                 torch.bfloat16, 64)
