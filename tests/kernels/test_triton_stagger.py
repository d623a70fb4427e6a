"""The staggered plan's residual-swap kernel (apex_compile.kernels.stagger) against torch's splice and copy:
CUDA, or CPU tensors under TRITON_INTERPRET=1 (test_triton_interpreter.py runs this file that way)."""
import pytest
import torch

from apex_compile.kernels.stagger import swap_rows

from tests.devices import TRITON_DEVICES


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,cols", [(6, 2, 64), (5, 5, 96), (9, 3, 4097), (4, 0, 32)])
def test_swap_rows_equals_splice_and_store(device, dtype, rows, width, cols):
    torch.manual_seed(rows * cols + width)
    src = torch.randn(rows, cols, dtype=dtype, device=device)
    stores = torch.randn(3, width, cols, dtype=dtype, device=device)  # one layer's slice of a [layers, ...] store
    expected_out = torch.cat([stores[1], src[width:]])
    expected_store = stores.clone()
    expected_store[1] = src[:width]
    out = swap_rows(src, stores[1])
    assert torch.equal(out, expected_out) and torch.equal(stores, expected_store)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_swap_rows_reads_strided_rows(device):
    base = torch.randn(7, 2, 48, device=device)
    src = base[:, 0]  # row stride 96, unit column stride
    store = torch.randn(2, 48, device=device)
    before = store.clone()
    out = swap_rows(src, store)
    assert torch.equal(out, torch.cat([before, src[2:]])) and torch.equal(store, src[:2])


def test_swap_rows_checks_its_inputs():
    with pytest.raises(ValueError, match="width <= n"):
        swap_rows(torch.zeros(2, 8), torch.zeros(3, 8))
    with pytest.raises(TypeError, match="dtypes"):
        swap_rows(torch.zeros(4, 8), torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        swap_rows(torch.zeros(8, 4).t(), torch.zeros(2, 8))
