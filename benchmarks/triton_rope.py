"""Whether a fused RoPE kernel could pay, on one CUDA GPU: compiled RoPE's time beside the QKV GEMM it would join.

    python benchmarks/triton_rope.py --out rope.json [--quick]

Section:
  rope       HF's apply_rotary_pos_emb on q/k views of a fused QKV output, eager vs compiled by inductor (what
             the apex backend's inner compiler does with it on CUDA), beside the QKV projection GEMM it would be
             fused into, Llama-2/3 layouts, tokens 1..4096
Timing and the command line: benchmarks/kernel_bench.py. triton_kernels.py runs this with the other families.
"""
import sys

import torch
import torch.nn.functional as F

from kernel_bench import ATTENTION_LAYOUTS, DEVICE, DTYPE, Timing, check_close, interleaved_medians, main

SECTIONS = ("rope",)
ROPE_TOKENS = {"full": [1, 8, 64, 512, 4096], "quick": [1, 64, 4096]}
ROPE_HIDDEN = 4096
"""Model width of the rope rows' QKV projection (Llama-2-7B and Llama-3-8B)."""


def rope_row(bench, model, tokens):
    """One rope row: HF's apply_rotary_pos_emb compiled by inductor against the same function eager, and the QKV
    projection GEMM of the same tokens, timed in interleaved rounds. The compiled RoPE's time bounds what
    fusing RoPE into the QKV GEMM's epilogue could save (the GEMM would still write q and k once); its
    fraction of the GEMM is stored as `rope_fraction_of_qkv_gemm`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    qk_bytes = tokens * (num_heads + num_kv_heads) * head_dim * 2
    bytes_moved = 2 * qk_bytes + 2 * tokens * head_dim * 2  # q, k read and written; cos, sin read
    weight = torch.randn(qkv_width, ROPE_HIDDEN, dtype=DTYPE, device=DEVICE) / ROPE_HIDDEN ** 0.5
    sets = []
    for _ in range(bench.rotation(bytes_moved)):
        x = torch.randn(tokens, ROPE_HIDDEN, dtype=DTYPE, device=DEVICE)
        qkv = F.linear(x, weight)
        # q and k as LlamaAttention makes them: views of the projection output, transposed to [1, heads, M, D].
        q = qkv[:, :num_heads * head_dim].view(1, tokens, num_heads, head_dim).transpose(1, 2)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
            1, tokens, num_kv_heads, head_dim).transpose(1, 2)
        angles = torch.rand(1, tokens, head_dim // 2, device=DEVICE) * 1000
        angles = torch.cat([angles, angles], dim=-1)
        sets.append((x, q, k, angles.cos().to(DTYPE), angles.sin().to(DTYPE)))
    torch._dynamo.reset()  # a fresh cache per row: one compiled graph per shape, no recompile limit
    compiled = torch.compile(apply_rotary_pos_emb, dynamic=False)
    _, q, k, cos, sin = sets[0]
    for got, want in zip(compiled(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        check_close("rope (inductor)", got, want)
    graphs = {"inductor": bench.capture([lambda s=s: compiled(*s[1:]) for s in sets]),
              "eager": bench.capture([lambda s=s: apply_rotary_pos_emb(*s[1:]) for s in sets]),
              "qkv_gemm": bench.capture([lambda s=s: F.linear(s[0], weight) for s in sets])}
    timed = interleaved_medians(graphs, len(sets))
    name = f"{model} M={tokens}"
    bench.add("rope", f"{name} inductor", Timing(timed["inductor"]), Timing(timed["eager"]), bytes_moved=bytes_moved,
              rope_fraction_of_qkv_gemm=timed["inductor"] / timed["qkv_gemm"])
    bench.add("rope", f"{name} QKV GEMM it would fuse into", Timing(timed["qkv_gemm"]),
              bytes_moved=qkv_width * ROPE_HIDDEN * 2 + tokens * (ROPE_HIDDEN + qkv_width) * 2,
              flops=2 * tokens * ROPE_HIDDEN * qkv_width)


def bench_rope(bench, grid):
    for model in ATTENTION_LAYOUTS:
        for tokens in ROPE_TOKENS[grid]:
            bench.guard("rope", f"{model} M={tokens}",
                        lambda model=model, tokens=tokens: rope_row(bench, model, tokens))
    fractions = [f"{r['name'].removesuffix(' inductor')} {100 * r['rope_fraction_of_qkv_gemm']:.1f}%"
                 for r in bench.rows if "rope_fraction_of_qkv_gemm" in r]
    print(f"rope: compiled RoPE time as a share of its QKV GEMM (the most fusing could save): {', '.join(fractions)}")


def run(bench, sections, grid, args):
    """The chosen sections of this family (see kernel_bench's family protocol)."""
    if "rope" in sections:
        bench_rope(bench, grid)
    return {}


if __name__ == "__main__":
    main([sys.modules[__name__]], __doc__)
