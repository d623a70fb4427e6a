"""The pass report: what each pass rewrote or left alone, per decoder layer, and why."""
import dataclasses
from typing import Dict, List, Optional

import torch.fx as fx

from apex_compile.passes.graph_utils import layer_of, module_path

# Kinds of rewrites, in table order: fused RMSNorm, fused gate/up SwiGLU, fused silu*mul on a gate_up
# tensor, q/k/v projections as one GEMM, SDPA -> apex.attention, apex.attention -> launch/device/wait.
KINDS = ("rms_norm", "swiglu", "silu_mul", "qkv", "attention", "overlap")


@dataclasses.dataclass
class Rewrite:
    """One rewritten pattern of `kind` in `module` (inside decoder `layer`; None: outside the layers)."""
    kind: str
    layer: Optional[int]
    module: str
    detail: str


@dataclasses.dataclass
class Miss:
    """A candidate that pass `pass_name` looked at and left unchanged, with the reason."""
    pass_name: str
    layer: Optional[int]
    module: str
    reason: str


@dataclasses.dataclass
class AttentionSite:
    """One attention call: an SDPA kept dense, or the apex op(s) it became (`layer_idx`: apex layer index)."""
    layer_idx: int
    layer: Optional[int]
    module: str
    form: str  # "dense SDPA", "apex.attention" or "launch/device/wait" (overlap)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: Optional[float]


class PassReport:
    """What the pass pipeline did to one graph; `str(report)` is a readable per-layer table.

    `attention`/`overlap`: the options used; `rewrites`: list of `Rewrite`; `misses`: list of `Miss`;
    `attention_sites`: list of `AttentionSite` in graph order; `counts`: rewrites per kind.
    """

    def __init__(self, attention: str = "sdpa", overlap: bool = False):
        self.attention = attention
        self.overlap = overlap
        self.rewrites: List[Rewrite] = []
        self.misses: List[Miss] = []
        self.attention_sites: List[AttentionSite] = []
        self.packed_linears = 0  # linear layers on oneDNN packed weights (pack_linear, CPU)
        self.skinny_linears = 0  # linear layers as apex.linear (skinny_linear, CUDA)
        self.staggered_layers = 0  # layers whose first rows are swapped per layer (stagger, the staggered plan)

    def rewritten(self, kind: str, node: fx.Node, detail: str = "") -> None:
        """Records a rewrite of `kind` (one of KINDS) located at `node`."""
        assert kind in KINDS, kind
        self.rewrites.append(Rewrite(kind, layer_of(node), module_path(node), detail))

    def missed(self, pass_name: str, node: fx.Node, reason: str) -> None:
        """Records that `pass_name` left the candidate at `node` unchanged, and why."""
        self.misses.append(Miss(pass_name, layer_of(node), module_path(node), reason))

    @property
    def counts(self) -> Dict[str, int]:
        """Number of rewrites per kind."""
        return {kind: sum(r.kind == kind for r in self.rewrites) for kind in KINDS}

    @property
    def layers(self) -> List[int]:
        """Decoder layer indices where any pass found a candidate."""
        seen = {r.layer for r in self.rewrites} | {m.layer for m in self.misses}
        seen |= {s.layer for s in self.attention_sites}
        return sorted(layer for layer in seen if layer is not None)

    def layer_counts(self, layer: Optional[int]) -> Dict[str, int]:
        """Rewrites per kind inside decoder `layer` (None: outside the decoder layers)."""
        return {kind: sum(r.kind == kind and r.layer == layer for r in self.rewrites) for kind in KINDS}

    def _attention_cell(self, layer: Optional[int]) -> str:
        cells = []
        for site in (s for s in self.attention_sites if s.layer == layer):
            index = "" if site.form == "dense SDPA" else f"#{site.layer_idx} "
            cells.append(f"{index}{site.form} ({site.num_heads}q/{site.num_kv_heads}kv x {site.head_dim})")
        return "; ".join(cells) or "-"

    def __str__(self) -> str:
        header = ["layer", "rms_norm", "swiglu", "silu_mul", "qkv", "attention"]
        rows = []
        for layer in self.layers + [None]:
            counts, attention = self.layer_counts(layer), self._attention_cell(layer)
            if layer is None and not any(counts.values()) and attention == "-":
                continue
            rows.append(["other" if layer is None else str(layer), str(counts["rms_norm"]),
                         str(counts["swiglu"]), str(counts["silu_mul"]), str(counts["qkv"]), attention])
        widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]

        def line(cells):
            return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        out = [f"apex pass report (attention={self.attention}, overlap={'on' if self.overlap else 'off'})",
               line(header), "-+-".join("-" * w for w in widths)]
        out += [line(row) for row in rows]
        out.append("total: " + ", ".join(f"{kind} {n}" for kind, n in self.counts.items()))
        if self.staggered_layers:
            out.append(f"staggered host rows: residual and RoPE rows swapped at {self.staggered_layers} layers")
        if self.packed_linears:
            out.append(f"linear layers on oneDNN packed weights: {self.packed_linears}")
        if self.skinny_linears:
            out.append(f"linear layers as apex.linear (skinny GEMM at decode sizes): {self.skinny_linears}")
        if self.misses:
            out.append("not rewritten:")
            out += [f"  [{m.pass_name}] {m.module or 'graph'}: {m.reason}" for m in self.misses]
        return "\n".join(out)
