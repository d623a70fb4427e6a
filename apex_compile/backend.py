"""The "apex" torch.compile backend: runs the pass pipeline, then hands the graph to an inner compiler.

Registered through the `torch_dynamo_backends` entry point, so `torch.compile(model, backend="apex")` works
in a fresh interpreter. Options (`torch.compile(..., options={...})`):

- "attention": "sdpa" (default; attention stays dense SDPA, only the fusions apply) or "paged" (every SDPA
  becomes `apex.attention`, served by the engine's AttentionRunner; raises `apex_compile.passes.PatternError` when the
  graph does not match).
- "overlap": bool, default False; with "paged", splits attention into offload launch / device / wait.
- "fuse": bool, default True: RMSNorm and SwiGLU become the fused apex ops (False keeps them as traced).
- "pack_linear": bool, default False: fp32 linears on a CPU run on oneDNN packed weights (with inner "eager").
- "stagger": bool, default False; with "paged" (no overlap), the row swaps of the staggered plan (host requests
  that advance one layer per step; `apex_compile.passes.stagger`).
- "fuse_qkv": bool, default False: each layer's q/k/v projections become one `apex.qkv_linear` (one GEMM when
  the weights were merged by `apex_compile.ops.linear.merge_projection_weights`, as the engine does on CUDA).
- "inner": "inductor", "eager" or "aot_eager". Default: "inductor" when the graph's tensors are on CUDA,
  "eager" otherwise: on CPU the heavy ops are the apex kernels and ATen GEMMs, and inductor's C++
  compile of a whole decoder costs minutes on small CI machines for little gain.
- "on_report": callable receiving the `apex_compile.passes.PassReport` of each compiled graph.
- "mode": inductor's mode ("reduce-overhead", "max-autotune", ...), for torch versions whose torch.compile
  refuses `mode` and `options` together (2.11 does); torch.compile's own `mode` argument works the same.
The mode is applied to inductor only; with "paged", inductor's graph partition keeps the cudagraph-unsafe
apex attention ops out of CUDA graphs.
"""
import dataclasses
from typing import Callable, List, Optional

import torch
import torch.fx as fx

from apex_compile.config import compile_cache_dir
from apex_compile.passes.pipeline import ATTENTION_MODES, run_pipeline
from apex_compile.passes.report import PassReport

INNER_COMPILERS = ("inductor", "eager", "aot_eager")


@dataclasses.dataclass
class BackendOptions:
    """The validated `options` of the apex backend (see the module docstring)."""
    attention: str = "sdpa"
    overlap: bool = False
    fuse: bool = True
    pack_linear: bool = False
    fuse_qkv: bool = False
    stagger: bool = False
    inner: Optional[str] = None
    on_report: Optional[Callable[[PassReport], None]] = None
    mode: Optional[str] = None

    @classmethod
    def parse(cls, options: Optional[dict]) -> "BackendOptions":
        """Builds the options from torch.compile's `options` dict; unknown keys or values raise ValueError."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"apex backend: unknown option(s) {unknown}; known options: {sorted(known)}")
        parsed = cls(**options)
        if parsed.attention not in ATTENTION_MODES:
            raise ValueError(f"apex backend: attention must be one of {ATTENTION_MODES}, got {parsed.attention!r}")
        if not isinstance(parsed.overlap, bool):
            raise ValueError(f"apex backend: overlap must be a bool, got {parsed.overlap!r}")
        for name in ("fuse", "pack_linear", "fuse_qkv", "stagger"):
            if not isinstance(getattr(parsed, name), bool):
                raise ValueError(f"apex backend: {name} must be a bool, got {getattr(parsed, name)!r}")
        if parsed.stagger and (parsed.attention != "paged" or parsed.overlap):
            raise ValueError("apex backend: stagger=True needs attention='paged' and overlap=False")
        if parsed.overlap and parsed.attention != "paged":
            raise ValueError("apex backend: overlap=True needs attention='paged'")
        if parsed.inner is not None and parsed.inner not in INNER_COMPILERS:
            raise ValueError(f"apex backend: inner must be one of {INNER_COMPILERS}, got {parsed.inner!r}")
        if parsed.on_report is not None and not callable(parsed.on_report):
            raise ValueError("apex backend: on_report must be callable")
        return parsed


def _on_cuda(example_inputs: List) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def _inductor_patches(mode: Optional[str], paged: bool) -> dict:
    """Inductor config for torch.compile's `mode`; graph partition when CUDA graphs meet the apex ops."""
    from torch._inductor import config as inductor_config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    if paged and patches.get("triton.cudagraphs") and hasattr(inductor_config, "graph_partition"):
        patches["graph_partition"] = True
    return patches


def apex_backend(gm: fx.GraphModule, example_inputs: List, mode: Optional[str] = None,
                 options: Optional[dict] = None) -> Callable:
    """torch.compile backend: rewrites `gm` with the apex passes and compiles it with the inner compiler."""
    opts = BackendOptions.parse(options)
    if mode is not None and opts.mode is not None and mode != opts.mode:
        raise ValueError(f"apex backend: mode={mode!r} and options['mode']={opts.mode!r} disagree")
    mode = mode or opts.mode
    inner = opts.inner or ("inductor" if _on_cuda(example_inputs) else "eager")
    if opts.pack_linear and inner != "eager":
        raise ValueError(f"apex backend: pack_linear needs inner='eager' (got {inner!r}; inductor packs weights "
                         "itself when it freezes them)")
    report = run_pipeline(gm, attention=opts.attention, overlap=opts.overlap, fuse=opts.fuse,
                          pack_linear=opts.pack_linear, fuse_qkv=opts.fuse_qkv,
                          stagger=opts.stagger)
    if opts.on_report is not None:
        opts.on_report(report)
    if mode is not None and inner != "inductor":
        raise ValueError(f"apex backend: mode={mode!r} applies to inner='inductor' only (inner={inner!r})")
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx
    compile_cache_dir()
    return compile_fx(gm, example_inputs, config_patches=_inductor_patches(mode, opts.attention == "paged"))
