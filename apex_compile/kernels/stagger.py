"""Triton kernels of the staggered plan's row exchanges (apex_compile.runtime.stagger), one launch each where
torch needs two or three:

- residual swap: at a layer's residual add the block's first `width` rows leave (their residual is stored for
  the lane's next turn) and the stored rows of the requests arriving come back:
      out = [store; src[width:]]      store = src[:width]
  One program per (row, column block): a block row reads its stored value before overwriting it, so the swap
  is race-free within one launch.
- attention exchange: at a layer's attention the block rows' q, k, v heads are staged side by side for the CPU
  job, and the attention the CPU computed for the requests arriving fills the block's rows of the output:
      staged = [q | k | v] (along heads)      out = arriving
  One program per (row, staged head).
- waiting exchange (the one-lane plan): one program waits on the device for the CPU job of the turn before
  to have written `arriving` (a host flag it raises), then the same exchange with `staged` and `arriving` in
  pinned host memory (read and written over the bus by the kernel); `raise_flag` then tells the CPU the layer
  is staged.
  A wait that outlasts its timeout marks a host status word and goes on (the engine raises on it), so a dead
  CPU worker cannot hang the GPU.
"""
import torch
import triton
import triton.language as tl

from apex_compile.kernels._common import INTERPRET, check_same_device, next_pow2

MAX_BLOCK = 4096


@triton.jit
def _swap_rows_kernel(src_ptr, store_ptr, out_ptr, cols, width, stride_src, stride_store, stride_out,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    value = tl.load(src_ptr + row * stride_src + offsets, mask=mask)
    if row < width:
        kept = tl.load(store_ptr + row * stride_store + offsets, mask=mask)
        tl.store(store_ptr + row * stride_store + offsets, value, mask=mask)
        tl.store(out_ptr + row * stride_out + offsets, kept, mask=mask)
    else:
        tl.store(out_ptr + row * stride_out + offsets, value, mask=mask)


def swap_rows(src: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """Returns [store; src[width:]] and writes src[:width] into `store` (src [n, H], store [width, H], width
    <= n, one dtype and device, unit stride along H)."""
    check_same_device(src=src, store=store)
    if src.dim() != 2 or store.dim() != 2 or src.shape[1] != store.shape[1] or store.shape[0] > src.shape[0]:
        raise ValueError(f"swap_rows: src [n, H] and store [width <= n, H], got {tuple(src.shape)} and "
                         f"{tuple(store.shape)}")
    if src.dtype != store.dtype:
        raise TypeError(f"swap_rows: src and store dtypes differ ({src.dtype}, {store.dtype})")
    if src.stride(1) != 1 or store.stride(1) != 1:
        raise ValueError("swap_rows: rows must have unit stride")
    rows, cols = src.shape
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    if rows == 0 or cols == 0:
        return out
    block = min(next_pow2(cols), MAX_BLOCK)
    _swap_rows_kernel[(rows, triton.cdiv(cols, block))](
        src, store, out, cols, store.shape[0], src.stride(0), store.stride(0), out.stride(0), BLOCK=block,
        num_warps=4)
    return out


@triton.jit
def _exchange_kernel(q_ptr, k_ptr, v_ptr, staged_ptr, arriving_ptr, out_ptr,
                     stride_q, stride_qh, stride_k, stride_kh, stride_v, stride_vh,
                     stride_staged, stride_arriving, stride_out,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, HOST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    if head < NUM_HEADS:
        value = tl.load(q_ptr + row * stride_q + head * stride_qh + offs, mask=mask)
        if HOST:  # written by the CPU since this kernel's last run: fetched again, never from a cache
            kept = tl.load(arriving_ptr + row * stride_arriving + head * HEAD_DIM + offs, mask=mask,
                           cache_modifier=".cv")
        else:
            kept = tl.load(arriving_ptr + row * stride_arriving + head * HEAD_DIM + offs, mask=mask)
        tl.store(out_ptr + row * stride_out + head * HEAD_DIM + offs, kept, mask=mask)
    elif head < NUM_HEADS + NUM_KV_HEADS:
        value = tl.load(k_ptr + row * stride_k + (head - NUM_HEADS) * stride_kh + offs, mask=mask)
    else:
        value = tl.load(v_ptr + row * stride_v + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + offs, mask=mask)
    if HOST:  # read by the CPU: written through to host memory
        tl.store(staged_ptr + row * stride_staged + head * HEAD_DIM + offs, value, mask=mask, cache_modifier=".wt")
    else:
        tl.store(staged_ptr + row * stride_staged + head * HEAD_DIM + offs, value, mask=mask)


def exchange_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, staged: torch.Tensor,
                  arriving: torch.Tensor, out: torch.Tensor) -> None:
    """staged = cat([query, key, value], dim=1) and out = arriving, in one launch: query [w, Hq, D], key/value
    [w, Hkv, D] (rows and heads may be strided, unit stride along D), staged [w, Hq + 2 Hkv, D] and arriving /
    out [w, Hq, D] with contiguous rows; one dtype and device."""
    check_same_device(query=query, key=key, value=value, staged=staged, arriving=arriving, out=out)
    _check_exchange("exchange_rows", query, key, value, staged, arriving, out)
    _launch_exchange(query, key, value, staged, arriving, out, host=False)


def _check_exchange(op: str, query, key, value, staged, arriving, out) -> None:
    """Shapes, dtypes and strides of an exchange (`exchange_rows`, `exchange_rows_waiting`)."""
    width, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if (key.shape != value.shape or key.shape[0] != width or key.shape[2] != head_dim
            or staged.shape != (width, num_heads + 2 * num_kv_heads, head_dim)
            or arriving.shape != query.shape or out.shape != query.shape):
        raise ValueError(f"{op}: query [w, Hq, D], key/value [w, Hkv, D], staged [w, Hq + 2 Hkv, D], "
                         f"arriving/out [w, Hq, D]; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}, {tuple(staged.shape)}, {tuple(arriving.shape)}, {tuple(out.shape)}")
    if len({t.dtype for t in (query, key, value, staged, arriving, out)}) != 1:
        raise TypeError(f"{op}: query, key, value, staged, arriving and out must have one dtype")
    if any(t.stride(2) != 1 for t in (query, key, value)) or any(
            t.stride(2) != 1 or t.stride(1) != head_dim for t in (staged, arriving, out)):
        raise ValueError(f"{op}: unit stride along D, and contiguous rows of staged / arriving / out")


def _launch_exchange(query, key, value, staged, arriving, out, host: bool) -> None:
    width, num_heads, head_dim = query.shape
    if width == 0:
        return
    _exchange_kernel[(width, num_heads + 2 * key.shape[1])](
        query, key, value, staged, arriving, out, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), staged.stride(0), arriving.stride(0), out.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1], HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), HOST=host,
        num_warps=1)


WAIT_TIMEOUT_S = 60.0  # a device wait for the CPU job longer than this marks the status word and gives up
INTERPRETER_MAX_POLLS = 1 << 20  # under the interpreter (no clock): the polls before giving up


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _wait_flag_kernel(done_ptr, after_ptr, status_ptr, stall_ptr, timeout, TIMED: tl.constexpr):
    # one program: each read of a host word takes on the order of a microsecond, and the reads of one word by
    # many programs come one after another, so one program polls for them all
    target = tl.load(after_ptr)
    seen = tl.load(done_ptr, volatile=True)
    waited = tl.zeros((), tl.int64)
    if TIMED:  # timeout in ns of the GPU's clock
        start = _clock_ns()
        while (seen < target) & (waited < timeout):
            seen = tl.load(done_ptr, volatile=True)
            waited = _clock_ns() - start
    else:  # timeout in polls
        while (seen < target) & (waited < timeout):
            seen = tl.load(done_ptr, volatile=True)
            waited += 1
    if seen < target:
        tl.store(status_ptr, target)
    tl.store(stall_ptr, waited)


@triton.jit
def _raise_flag_kernel(flag_ptr, turn_ptr):
    tl.store(flag_ptr, tl.load(turn_ptr), cache_modifier=".wt")


@triton.jit(do_not_specialize=["value"])
def _set_flag_kernel(flag_ptr, value):
    tl.store(flag_ptr, value.to(tl.int64), cache_modifier=".wt")


def _check_flag(name: str, flag: torch.Tensor) -> None:
    if flag.dtype != torch.int64 or flag.numel() != 1 or flag.device.type != "cpu":
        raise ValueError(f"{name} must be a one-element int64 host tensor, got {flag.dtype} {tuple(flag.shape)} "
                         f"on {flag.device}")


def _check_host(on: torch.device, **tensors: torch.Tensor) -> None:
    """Host buffers a kernel on `on` reads or writes: pinned when `on` is a GPU (mapped into its address space)."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or (on.type == "cuda" and not tensor.is_pinned()):
            raise ValueError(f"{name} must be a host tensor{' in pinned memory' if on.type == 'cuda' else ''}, "
                             f"got one on {tensor.device}")


def exchange_rows_waiting(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, staged: torch.Tensor,
                          arriving: torch.Tensor, out: torch.Tensor, done: torch.Tensor, after: torch.Tensor,
                          status: torch.Tensor, stall: torch.Tensor, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """`exchange_rows` with `staged` and `arriving` in host memory (pinned on a GPU), once the CPU job of turn
    after[0] (the last launched) has written `arriving` and read `staged`: waits on the device until done[0] >=
    after[0] (done: a host counter the CPU job raises; after: int64 [1] on the kernel's device). A wait beyond
    timeout_s (in polls under the interpreter) writes after[0] into status[0] and goes on; stall[0] receives the
    wait (ns on a GPU, polls under the interpreter). Two launches: the wait (one program), then the exchange."""
    check_same_device(query=query, key=key, value=value, out=out, after=after)
    _check_host(query.device, staged=staged, arriving=arriving, done=done, status=status, stall=stall)
    for name, flag in (("done", done), ("status", status), ("stall", stall)):
        _check_flag(name, flag)
    if after.dtype != torch.int64 or after.numel() != 1:
        raise ValueError(f"after must be a one-element int64 tensor, got {after.dtype} {tuple(after.shape)}")
    _check_exchange("exchange_rows_waiting", query, key, value, staged, arriving, out)
    if query.shape[0] == 0:
        return
    timed = not INTERPRET and query.is_cuda
    timeout = int(timeout_s * 1e9) if timed else INTERPRETER_MAX_POLLS
    _wait_flag_kernel[(1,)](done, after, status, stall, timeout, TIMED=timed, num_warps=1)
    _launch_exchange(query, key, value, staged, arriving, out, host=True)


def set_flag(flag: torch.Tensor, value: int, device: torch.device) -> None:
    """flag[0] = value, written by `device` behind the work queued before it on its current stream (flag: a host
    counter, pinned on a GPU): the CPU sees what that work wrote to host memory once it sees the value. One launch,
    no host-device copy."""
    _check_flag("flag", flag)
    _check_host(torch.device(device), flag=flag)
    _set_flag_kernel[(1,)](flag, int(value), num_warps=1)


def raise_flag(flag: torch.Tensor, turn: torch.Tensor) -> None:
    """flag[0] = turn[0], written by the GPU behind the work queued before it (flag: a host counter, pinned on a
    GPU; turn on the kernel's device): the CPU sees everything those kernels wrote to host memory once it sees
    the flag. One launch."""
    _check_flag("flag", flag)
    _check_host(turn.device, flag=flag)
    _raise_flag_kernel[(1,)](flag, turn, num_warps=1)
