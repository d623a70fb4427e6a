"""The pass pipeline run by the apex backend on the torch-IR graph dynamo hands it."""
import warnings

import torch.fx as fx

from apex_compile.passes.fuse_qkv import fuse_qkv as fuse_qkv_projections
from apex_compile.passes.fuse_rmsnorm import fuse_rmsnorm
from apex_compile.passes.fuse_swiglu import fuse_swiglu
from apex_compile.passes.overlap import overlap_attention
from apex_compile.passes.pack_linear import pack_linear as pack_linears
from apex_compile.passes.skinny_linear import skinny_linear as skinny_linears
from apex_compile.passes.partition_attention import describe_dense, partition_attention
from apex_compile.passes.report import PassReport
from apex_compile.passes.stagger import stagger_rows

ATTENTION_MODES = ("sdpa", "paged")


def run_pipeline(gm: fx.GraphModule, attention: str = "sdpa", overlap: bool = False, fuse: bool = True,
                 pack_linear: bool = False, fuse_qkv: bool = False, stagger: bool = False) -> PassReport:
    """Rewrites `gm` in place and returns the report of what was rewritten.

    attention="sdpa": attention stays dense SDPA; only the fusions apply, and a graph without any fusable
    pattern passes through unchanged with a warning. attention="paged": every SDPA becomes `apex.attention`
    (raises `PatternError` if any does not match); overlap=True then splits them into launch/device/wait.
    fuse=True also sends CUDA linears whose shapes the skinny GEMM's table covers to `apex.linear`
    (`passes.skinny_linear`). fuse=False leaves RMSNorm and the MLP as traced (the engine on a CPU, where the
    fused ops' CPU implementations are the same aten ops behind one more dispatch). pack_linear=True runs fp32 CPU linears
    on oneDNN packed weights (`passes.pack_linear`; for graphs executed eagerly on a CPU). fuse_qkv=True turns
    each layer's q/k/v projections into one `apex.qkv_linear` (one GEMM where the engine merged the weights with
    `apex_compile.ops.linear.merge_projection_weights`; three GEMMs and a concatenation elsewhere, so off unless
    the weights are merged). stagger=True (with "paged", without overlap) adds the row swaps of the staggered
    plan (`passes.stagger`).
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if overlap and attention != "paged":
        raise ValueError("overlap=True needs attention='paged' (dense SDPA has nothing to offload)")
    if stagger and (attention != "paged" or overlap):
        raise ValueError("stagger=True needs attention='paged' and overlap=False")
    report = PassReport(attention, overlap)
    if attention == "paged":
        partition_attention(gm, report)
        if stagger:
            stagger_rows(gm, report)
        if overlap:
            overlap_attention(gm, report)
    else:
        describe_dense(gm, report)
    if fuse:
        fuse_rmsnorm(gm, report)
        fuse_swiglu(gm, report)
    if fuse_qkv:
        fuse_qkv_projections(gm, report)
    if fuse:
        skinny_linears(gm, report)
    if pack_linear:
        pack_linears(gm, report)
    gm.graph.lint()
    if fuse and not report.rewrites and not report.packed_linears and not report.skinny_linears:
        warnings.warn(
            "apex backend: no RMSNorm or SwiGLU pattern was found in this graph "
            f"({len(report.misses)} candidates rejected); it is compiled unchanged", stacklevel=2)
    return report
