"""Runs a Triton kernel benchmark script on a fake CUDA device, for tests without a GPU (in its own process: it
patches torch). Tensors live on "meta", Triton launches and CUDA graphs are stubs, every timing is 0.1 ms and
the device looks like an H200 (132 SMs, PDL). Rows, targets and JSON fields are the script's own; the numbers
mean nothing.

    python tests/kernels/fake_cuda_bench.py SCRIPT [ARGS...]

SCRIPT: a module of benchmarks/ (triton_kernels, a family such as triton_rms_norm, or triton_sweep).
"""
import importlib
import os
import sys
import types

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
sys.path[:0] = [REPO_ROOT, BENCHMARKS]

from apex_compile.kernels.paged_attention import decode_chunk, decode_split_plan  # noqa: E402
from apex_compile.kernels.prefill_attention import default_prefill_config  # noqa: E402

FAKE_MS = 0.1
H200_SM_COUNT = 132


class FakeGraph:
    def replay(self):
        pass


class FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return FAKE_MS


class FakeKernel:
    """A @triton.jit kernel whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _empty_pair(x, *args, **kwargs):
    return torch.empty_like(x), torch.empty_like(x)


def _silu_mul(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _swiglu(x, w_gate, w_up, *args, **kwargs):
    return x.new_empty(x.shape[0], w_gate.shape[0])


def _like_first(x, *args, **kwargs):
    return torch.empty_like(x)


def _nothing(*args, **kwargs):
    return None


STUBS = {  # module-level names of the benchmark modules -> what they become
    "DEVICE": "meta",
    "check_close": _nothing,
    "pdl_available": lambda device: True,
    "steady_replay_ms": lambda replay, **kwargs: FAKE_MS,
    "rms_norm": _empty_pair,
    "rms_norm_launch": _nothing,
    "copy_rows_kernel": FakeKernel(),
    "_rms_norm_probe": FakeKernel(),
    "silu_mul": _silu_mul,
    "swiglu_fused_launch": _swiglu,
    "swiglu_triton": _swiglu,
    "paged_attention_gpu": _like_first,
    "paged_decode_launch": _like_first,
    "cache_append_gpu": _nothing,
    "paged_prefill_launch": _like_first,
    "default_prefill_config": lambda head_dim, device: default_prefill_config(head_dim, torch.device("cuda")),
}


def patch_torch():
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        name="fake H200", L2_cache_size=60 << 20, multi_processor_count=H200_SM_COUNT, major=9)
    cuda.get_device_name = lambda *args, **kwargs: "fake H200"
    cuda.synchronize = _nothing
    cuda.empty_cache = _nothing
    cuda.Event = FakeEvent
    torch.equal = lambda a, b: True  # meta tensors hold no values
    torch.testing.assert_close = _nothing
    torch.compile = lambda fn, **kwargs: fn
    torch._dynamo.reset = _nothing
    for fn in (decode_chunk, decode_split_plan):  # launch plans for the H200's SM count, not meta's default
        fn.__globals__["sm_count"] = lambda device: H200_SM_COUNT


def patch_module(module):
    for name, value in STUBS.items():
        if hasattr(module, name):
            setattr(module, name, value)
    bench = getattr(module, "Bench", None)
    if bench is not None and bench.__module__ == module.__name__:
        bench.capture = staticmethod(lambda calls: FakeGraph())
        bench.graph_ms = classmethod(lambda cls, calls: FAKE_MS)
        bench.flushed_graph_ms = classmethod(lambda cls, calls: FAKE_MS)
        bench.eager_ms = staticmethod(lambda calls: FAKE_MS)


def main():
    script, *args = sys.argv[1:]
    if "--write-dispatch" in args:
        sys.exit("fake_cuda_bench.py: --write-dispatch would overwrite the committed dispatch table")
    patch_torch()
    module = importlib.import_module(script)
    for loaded in list(sys.modules.values()):
        if os.path.dirname(os.path.abspath(getattr(loaded, "__file__", None) or "/")) == BENCHMARKS:
            patch_module(loaded)
    sys.argv = [f"{script}.py", *args]
    if hasattr(module, "SECTIONS") or hasattr(module, "FAMILIES"):
        import kernel_bench

        kernel_bench.main(getattr(module, "FAMILIES", [module]), module.__doc__)
    else:
        module.main()


if __name__ == "__main__":
    main()
