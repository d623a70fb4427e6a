"""The staggered plan's row-exchange kernels (apex_compile.kernels.stagger) against torch's splices and copies:
CUDA, or CPU tensors under TRITON_INTERPRET=1 (test_triton_interpreter.py runs this file that way)."""
import pytest
import torch

from apex_compile.kernels.stagger import exchange_rows, exchange_rows_waiting, raise_flag, set_flag, swap_rows

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


def _host(*shape, dtype=torch.float32, device="cpu", fill=0.0):
    """A host buffer the kernel reads or writes directly (pinned when the kernel runs on a GPU)."""
    return torch.full(shape, fill, dtype=dtype, pin_memory=device == "cuda")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_waiting_exchange_reads_and_writes_host_rows_once_the_cpu_is_done(device, dtype):
    """One lane: the kernel waits on the device until the CPU job of the turn before raised the layer's done
    flag (here from another thread, 0.2 s late), then stages q/k/v into host memory and takes the arriving rows
    from it; `raise_flag` then writes the turn into the host's ready flag. The stall is recorded."""
    import threading
    import time

    width, heads, kv_heads, dim = 3, 4, 2, 32
    torch.manual_seed(3)
    qkv = torch.randn(width + 2, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device)
    query, key, value = qkv[:width].view(width, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    staged = _host(2, width, heads + 2 * kv_heads, dim, dtype=dtype, device=device, fill=float("nan"))
    arriving = _host(2, width, heads, dim, dtype=dtype, device=device)
    arriving.copy_(torch.randn(arriving.shape).to(dtype))
    out = torch.full((width + 3, heads, dim), float("nan"), dtype=dtype, device=device)
    counters = _host(6, dtype=torch.int64, device=device)  # done [2], ready [2], status, stall
    done, ready, status, stall = counters[0:2], counters[2:4], counters[4:5], counters[5:6]
    turn, after = torch.tensor([7], device=device), torch.tensor([6], device=device)
    done[1] = 6  # a first call that does not wait: the kernels compile before the timed one
    exchange_rows_waiting(query, key, value, staged[1], arriving[1], out[:width], done[1:2], after, status, stall)
    raise_flag(ready[1:2], turn)
    if device == "cuda":
        torch.cuda.synchronize()
    staged.fill_(float("nan"))
    out.fill_(float("nan"))
    ready.zero_()
    done[1] = 5
    timer = threading.Timer(0.2, lambda: done.__setitem__(1, 6))
    timer.start()
    start = time.perf_counter()
    exchange_rows_waiting(query, key, value, staged[1], arriving[1], out[:width], done[1:2], after, status, stall)
    raise_flag(ready[1:2], turn)
    if device == "cuda":
        torch.cuda.synchronize()
    assert time.perf_counter() - start >= 0.15
    timer.join()
    assert torch.equal(staged[1], torch.cat([query, key, value], dim=1).cpu())
    assert torch.isnan(staged[0]).all() and torch.isnan(out[width:]).all()
    assert torch.equal(out[:width].cpu(), arriving[1])
    assert ready.tolist() == [0, 7] and int(status) == 0 and int(stall) > 0


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_waiting_exchange_gives_up_after_its_timeout_and_marks_the_status(device, monkeypatch):
    """A CPU job that never comes cannot hang the GPU: the wait ends after its timeout, the turn goes into the
    status word (the engine raises on it) and the step goes on."""
    from apex_compile.kernels import stagger as kernels

    monkeypatch.setattr(kernels, "INTERPRETER_MAX_POLLS", 64)
    query = torch.randn(2, 4, 16, device=device)
    key = torch.randn(2, 2, 16, device=device)
    staged, arriving = _host(2, 8, 16, device=device), _host(2, 4, 16, device=device)
    counters = _host(3, dtype=torch.int64, device=device)
    out = torch.zeros(2, 4, 16, device=device)
    exchange_rows_waiting(query, key, key, staged, arriving, out, counters[0:1], torch.tensor([4], device=device),
                          counters[1:2], counters[2:3], timeout_s=0.05)
    if device == "cuda":
        torch.cuda.synchronize()
    assert int(counters[1]) == 4 and torch.equal(staged, torch.cat([query, key, key], dim=1).cpu())


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_set_flag_writes_its_value_behind_the_work_queued_before(device):
    """The K/V exports' copy flag: the device writes the value (any int64) into the host counter once the stream
    reaches it, not before."""
    flag = _host(1, dtype=torch.int64, device=device)
    set_flag(flag, 1 << 40, device)  # (compiles the int64 and the int32 variants)
    set_flag(flag, 3, device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)
    set_flag(flag, (1 << 40) + 5, device)
    if device == "cuda":
        assert int(flag[0]) == 3
        torch.cuda.synchronize()
    assert int(flag[0]) == (1 << 40) + 5
    with pytest.raises(ValueError, match="flag must be a one-element int64"):
        set_flag(torch.zeros(2, dtype=torch.int64), 1, device)


def test_waiting_exchange_checks_its_inputs():
    q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    flag = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="staged"):
        exchange_rows_waiting(q, kv, kv, torch.zeros(2, 7, 16), q.clone(), q.clone(), flag, flag, flag, flag)
    with pytest.raises(ValueError, match="done must be a one-element int64"):
        exchange_rows_waiting(q, kv, kv, torch.zeros(2, 8, 16), q.clone(), q.clone(), torch.zeros(2, dtype=torch.int64),
                              flag, flag, flag)
    with pytest.raises(ValueError, match="flag must be a one-element int64"):
        raise_flag(torch.zeros(1), flag)
