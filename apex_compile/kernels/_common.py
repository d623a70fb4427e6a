"""Shared helpers of the Triton kernels: interpreter detection, launch sizing, tensor checks.

Triton decides at decoration time whether `@triton.jit` functions compile for the GPU or run under the
interpreter (env TRITON_INTERPRET=1 read when the kernel modules are imported). `INTERPRET` records the
decision actually taken, so the ops route CPU tensors to the interpreted kernels exactly when that works.
"""
import functools
import json
import os

import torch
import triton


@triton.jit
def _probe_kernel():
    pass


INTERPRET: bool = type(_probe_kernel).__name__ == "InterpretedFunction"
"""True when this process's Triton kernels run under the interpreter (TRITON_INTERPRET=1 at import)."""

# The interpreter multiplies bf16/fp16 `tl.dot` operands as their raw integer bit patterns (numpy has no
# bf16), so interpreted kernels upcast dot operands to fp32 first. Products of two bf16/fp16 values are
# exact in fp32, so this keeps the GPU numerics (fp32 accumulation of exact products).
UPCAST_DOT_OPERANDS: bool = INTERPRET

INTERPRETER_SM_COUNT = 8
"""Streaming-multiprocessor count assumed under the interpreter (makes small tests exercise split paths)."""


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Number of SMs of `device` (a fixed small number for CPU tensors under the interpreter)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return INTERPRETER_SM_COUNT


@functools.lru_cache(maxsize=None)
def _cuda_capability_major(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).major


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch (Hopper or newer CUDA GPUs; never
    under the interpreter): such a launch lets the GPU place the next kernel's programs while this one ends,
    and each program waits (`gdc_wait`) before its first access to memory."""
    if INTERPRET or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability_major(index) >= 9


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 products for fp32 inputs (no TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    """Raises a readable error unless `tensor` is fp32, bf16 or fp16."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {tensor.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raises a readable error unless all named tensors live on one device."""
    tensor_list = list(tensors.values())
    first = tensor_list[0].device
    if any(t.device != first for t in tensor_list[1:]):
        raise ValueError(f"tensors on different devices: { {name: t.device for name, t in tensors.items()} }")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers (triton.cdiv costs microseconds per call in recent Triton)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def read_table(path: str) -> dict:
    """A measured dispatch table (JSON) beside the kernels; empty when the file is absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def cuda_device_name(index: int) -> str:
    """The name a dispatch table records for GPU `index`."""
    return torch.cuda.get_device_name(index)
