"""apex::rms_norm: Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1) and the torch CPU path.

The "cpu" device runs the torch implementation in a normal session and the Triton interpreter when
TRITON_INTERPRET=1 (tests/kernels/test_triton_interpreter.py runs this file that way in a subprocess).
"""

import pytest
import torch

from apex_compile.kernels.rms_norm import MAX_SINGLE_PASS_HIDDEN, rms_norm_launch
from apex_compile.ops import rms_norm

from tests.devices import DEVICES, HAS_CUDA, INTERPRET, TRITON_DEVICES, not_interpreted
from tests.helpers import assert_rel_close


def bf16_tolerance(device):
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even): allow twice the error.
    return 2e-2 if device == "cpu" and INTERPRET else 1e-2


TOLERANCE = {torch.float32: lambda device: 1e-5, torch.bfloat16: bf16_tolerance}


def reference(x, weight, eps, residual):
    """HF LlamaRMSNorm in float64, with the rounding of x + residual to x's dtype that HF performs."""
    hidden = (x.double() + residual.double()).to(x.dtype) if residual is not None else x
    h = hidden.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed, hidden


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 200), (2, 3, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(device, dtype, shape, with_residual):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    residual = torch.randn(shape, dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    y, residual_out = rms_norm(x, weight, 1e-6, residual)
    ref_y, ref_hidden = reference(x, weight, 1e-6, residual)
    assert y.shape == x.shape and y.dtype == dtype and residual_out.dtype == dtype
    rel = TOLERANCE[dtype](device)
    assert_rel_close(y, ref_y, rel, "y")
    assert_rel_close(residual_out, ref_hidden, rel, "residual_out")
    if residual is None:
        assert residual_out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_wide_rows_take_the_two_pass_kernel(device):
    hidden = MAX_SINGLE_PASS_HIDDEN + 1000
    x = torch.randn(2, hidden, device=device)
    residual = torch.randn(2, hidden, device=device)
    weight = torch.randn(hidden, device=device)
    y, residual_out = rms_norm(x, weight, 1e-5, residual)
    ref_y, ref_hidden = reference(x, weight, 1e-5, residual)
    assert_rel_close(y, ref_y, 1e-5, "y")
    assert_rel_close(residual_out, ref_hidden, 1e-6, "residual_out")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_fp32_weight_with_bf16_input_promotes_like_hf(device):
    x = torch.randn(4, 96, dtype=torch.bfloat16, device=device)
    weight = torch.randn(96, dtype=torch.float32, device=device)
    y, residual_out = rms_norm(x, weight, 1e-6)
    assert y.dtype == torch.float32 and residual_out.dtype == torch.bfloat16
    ref_y, _ = reference(x, weight, 1e-6, None)
    assert_rel_close(y, ref_y, TOLERANCE[torch.bfloat16](device), "y")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("hidden,num_warps", [(48, None), (80, 2), (MAX_SINGLE_PASS_HIDDEN + 16, None)])
def test_rms_norm_kernel_writes_every_output_element(device, hidden, num_warps):
    x = torch.randn(7, hidden, dtype=torch.bfloat16, device=device)
    residual = torch.randn(7, hidden, dtype=torch.bfloat16, device=device)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    y = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan"))
    rms_norm_launch(x, weight, 1e-6, residual, y, residual_out, num_warps=num_warps)
    ref_y, ref_hidden = reference(x, weight, 1e-6, residual)
    assert_rel_close(y, ref_y, bf16_tolerance(device), "y")
    assert_rel_close(residual_out, ref_hidden, bf16_tolerance(device), "residual_out")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=not_interpreted), DEVICES[1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_llama_rms_norm(device, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 256
    module = LlamaRMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden))
    x = torch.randn(7, hidden, dtype=dtype, device=device)
    residual = torch.randn(7, hidden, dtype=dtype, device=device)
    y, residual_out = rms_norm(x, module.weight.detach(), 1e-5, residual)
    with torch.no_grad():
        ref = module(residual + x)
    assert torch.equal(residual_out, residual + x)
    if device == "cpu":
        assert torch.equal(y, ref)  # the torch path is LlamaRMSNorm op for op
    else:
        # The kernel's fp32 sum order and rsqrt differ from torch's: bf16 results may differ by one rounding.
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -16
        assert ((y.double() - ref.double()).abs() <= ulp * ref.double().abs() + 1e-30).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_rejects_bad_inputs(device):
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.ones(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(32, device=device), 1e-6, torch.randn(2, 32, dtype=torch.float64, device=device))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        rms_norm(x.to(torch.int32), torch.ones(32, device=device), 1e-6)


@not_interpreted
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_op_registration(with_residual):
    x = torch.randn(3, 5, 32)
    residual = torch.randn(3, 5, 32) if with_residual else None
    torch.library.opcheck(torch.ops.apex.rms_norm.default, (x, torch.randn(32), 1e-6, residual))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no interpreter)")
@pytest.mark.parametrize("in_graph", [False, True])
def test_rms_norm_chained_launches_see_their_predecessors(in_graph):
    """Back-to-back launches, each reading what the previous one wrote and writing what it read (ping-pong
    buffers): with programmatic dependent launch (where the GPU has it) the results are bitwise those of
    plain launches, so no program touched memory before its predecessor finished."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape, steps = (4096, 4096), 12
    weight = torch.rand(shape[1], dtype=torch.bfloat16, device="cuda", generator=gen) + 0.5

    def chain(pdl):
        bufs = [torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(i)) for i in range(4)]

        def run():
            for step in range(steps):
                x, residual, y, residual_out = bufs if step % 2 == 0 else bufs[2:] + bufs[:2]
                rms_norm_launch(x, weight, 1e-6, residual, y, residual_out, pdl=pdl)

        if in_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            graph.replay()
        else:
            run()
        torch.cuda.synchronize()
        return bufs

    for plain, dependent in zip(chain(pdl=False), chain(pdl=None)):
        assert torch.equal(plain, dependent)
