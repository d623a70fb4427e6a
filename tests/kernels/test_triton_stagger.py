"""The staggered plan's row-exchange kernels (apex_compile.kernels.stagger) against torch's splices and copies:
CUDA, or CPU tensors under TRITON_INTERPRET=1 (test_triton_interpreter.py runs this file that way)."""
import pytest
import torch

from apex_compile.kernels.stagger import exchange_rows, swap_rows

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


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,heads,kv_heads,dim", [(3, 4, 2, 32), (1, 6, 6, 16), (5, 4, 1, 80)])
def test_exchange_rows_stages_qkv_and_returns_the_arriving_rows(device, dtype, width, heads, kv_heads, dim):
    """q/k/v are views of one projection output (as the graph passes them: strided rows and heads); staged and
    the output rows are slices of larger buffers, which must be left alone outside them."""
    torch.manual_seed(width * heads + dim)
    qkv = torch.randn(width + 2, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device)
    query, key, value = qkv[:width].view(width, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    staged_all = torch.full((2, width, heads + 2 * kv_heads, dim), float("nan"), dtype=dtype, device=device)
    arriving = torch.randn(2, width, heads, dim, dtype=dtype, device=device)
    out_all = torch.full((width + 3, heads, dim), float("nan"), dtype=dtype, device=device)
    exchange_rows(query, key, value, staged_all[1], arriving[1], out_all[:width])
    assert torch.equal(staged_all[1], torch.cat([query, key, value], dim=1))
    assert torch.isnan(staged_all[0]).all() and torch.isnan(out_all[width:]).all()
    assert torch.equal(out_all[:width], arriving[1])


def test_exchange_rows_checks_its_inputs():
    q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="staged"):
        exchange_rows(q, kv, kv, torch.zeros(2, 7, 16), q.clone(), q.clone())
    with pytest.raises(TypeError, match="one dtype"):
        exchange_rows(q, kv, kv, torch.zeros(2, 8, 16), q.clone(), q.clone().half())
