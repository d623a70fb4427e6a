"""Benchmark of the Triton paged decode attention against torch SDPA on one CUDA GPU.

    python benchmarks/triton_decode.py --out decode.json [--quick] [--block-size 16]

Section:
  decode     paged_attention_gpu, bf16, Llama-2-7B (32/32 heads) and Llama-3-8B (32/8) layouts, batch 1..128,
             context 512..32k, vs torch SDPA on contiguous K/V of the same bytes; a block-size sweep (rows
             "decode-bs"); a sweep of the decode launch parameters (chunk, warps, stages, split size; rows
             "decode-cfg")
Timing and the command line: benchmarks/kernel_bench.py. triton_kernels.py runs this with the other families.
"""
import sys

import torch
import triton

# kernel_bench first: it puts the repository root on sys.path for the apex_compile imports.
from kernel_bench import ATTENTION_LAYOUTS, DEVICE, DTYPE, check_close, main, sdpa_function

from apex_compile.kernels.paged_attention import (
    DECODE_NUM_STAGES,
    decode_chunk,
    decode_split_plan,
    paged_decode_launch,
)
from apex_compile.ops import cache_append_gpu, paged_attention_gpu

SECTIONS = ("decode",)
KV_BUDGET_BYTES = 8 << 30
"""Decode rows whose KV cache would exceed this are skipped (the contiguous baseline copy doubles it)."""
DECODE_BATCHES = {"full": [1, 8, 32, 128], "quick": [1, 32, 128]}
DECODE_CONTEXTS = {"full": [512, 2048, 8192, 32768], "quick": [512, 2048, 32768]}
DECODE_SWEEP = ("llama3-8b", 32, 4096, [16, 32, 64, 128, 256])
"""Block-size sweep: layout, batch, context, block sizes."""
DECODE_TUNE = ("llama3-8b", 32, 2048)
"""Decode launch-parameter sweep (layout, batch, context): informs the defaults in paged_attention.py."""
DECODE_TUNE_LAUNCHES = [  # (block_t, num_warps, num_stages, tokens_per_split); None: the automatic choice
    (None, 4, DECODE_NUM_STAGES, None), (64, 4, 2, None), (64, 4, 3, None), (128, 4, 2, None), (128, 4, 3, None),
    (128, 8, 3, None), (32, 4, 3, None), (64, 4, 2, 512), (64, 4, 2, 1024), (128, 4, 2, 1024), (128, 4, 2, 2048),
]


def build_paged(k, v, block_size):
    """Paged caches holding contiguous k/v [B, Hkv, ctx, D] in shuffled blocks (written by cache_append_gpu)."""
    batch, num_kv_heads, ctx, head_dim = k.shape
    blocks_per_seq = triton.cdiv(ctx, block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=k.dtype, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).view(batch, blocks_per_seq)
    tokens = torch.arange(ctx, device=DEVICE)
    slots = (block_tables[:, tokens // block_size].long() * block_size + tokens % block_size).reshape(-1)
    cache_append_gpu(k.transpose(1, 2).reshape(-1, num_kv_heads, head_dim),
                     v.transpose(1, 2).reshape(-1, num_kv_heads, head_dim), key_cache, value_cache, slots)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return key_cache, value_cache, block_tables, context_lens


def decode_sets(bench, model, batch, ctx, block_size):
    """Rotating (q, k, v, paged caches) sets of one decode shape (contiguous k/v [B, Hkv, ctx, D] for SDPA)."""
    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    sets = []
    for _ in range(bench.rotation(decode_kv_bytes(model, batch, ctx))):
        q = torch.randn(batch, num_heads, head_dim, dtype=DTYPE, device=DEVICE)
        k = torch.randn(batch, num_kv_heads, ctx, head_dim, dtype=DTYPE, device=DEVICE)
        v = torch.randn_like(k)
        sets.append((q, k, v, build_paged(k, v, block_size)))
    return sets


def decode_kv_bytes(model, batch, ctx):
    """K+V bytes one decode call reads (bf16)."""
    _, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    return 2 * batch * ctx * num_kv_heads * head_dim * 2


def decode_row(bench, model, batch, ctx, block_size, section_name="decode", with_target=True):
    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    kv_bytes = decode_kv_bytes(model, batch, ctx)
    name = f"{model} bs={block_size} batch={batch} ctx={ctx}"

    def row():
        sets = decode_sets(bench, model, batch, ctx, block_size)
        q, k, v, paged = sets[0]
        sdpa, backend = sdpa_function(q[:, :, None], k, v, causal=False)
        check_close("paged decode", paged_attention_gpu(q, *paged, max_context_len=ctx), sdpa()[:, :, 0])
        kernel = bench.measure([lambda s=s: torch.ops.apex.paged_attention_gpu(s[0], *s[3], None, ctx)
                                for s in sets])
        base = bench.measure([sdpa_function(s[0][:, :, None], s[1], s[2], causal=False)[0] for s in sets])
        block_t, programs_per_sm = decode_chunk(batch, num_kv_heads, head_dim, 2, q.device)
        splits, _ = decode_split_plan(batch, num_kv_heads, ctx, q.device, block_t, programs_per_sm)

        def target(r):
            return ">=75%HBM >=1.0x SDPA", r["pct_hbm"] >= 75 and r["speedup"] >= 1.0

        judged = with_target and batch >= 32 and ctx >= 2048
        bench.add(section_name, name, kernel, base, bytes_moved=kv_bytes, target=target if judged else None,
                  sdpa_backend=backend, num_splits=splits, block_t=block_t)

    if kv_bytes > KV_BUDGET_BYTES:
        print(f"{section_name:<10} {name:<46} skipped ({kv_bytes / 2**30:.0f} GiB of KV > budget)", flush=True)
        return
    bench.guard(section_name, name, row)


def decode_tune_rows(bench, block_size):
    """One decode shape under several launch parameters (first row: the defaults)."""
    model, batch, ctx = DECODE_TUNE
    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * 2
    q = torch.randn(batch, num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    paged = build_paged(k, v, block_size)
    sdpa, backend = sdpa_function(q[:, :, None], k, v, causal=False)
    ref = sdpa()[:, :, 0]
    base = bench.measure([sdpa], eager=False)
    for block_t, num_warps, num_stages, tokens_per_split in DECODE_TUNE_LAUNCHES:
        launch = dict(max_context_len=ctx, tokens_per_split=tokens_per_split, block_t=block_t,
                      num_warps=num_warps, num_stages=num_stages)
        name = (f"{model} bs={block_size} b={batch} ctx={ctx} T{block_t or 'auto'}/w{num_warps}/s{num_stages}"
                f"/split{tokens_per_split or 'auto'}")
        check_close(name, paged_decode_launch(q, *paged, **launch), ref)
        kernel = bench.measure([lambda: paged_decode_launch(q, *paged, **launch)], eager=False)
        bench.add("decode-cfg", name, kernel, base, bytes_moved=kv_bytes, sdpa_backend=backend, launch=launch)


def bench_decode(bench, grid, block_size):
    for model in ATTENTION_LAYOUTS:
        for batch in DECODE_BATCHES[grid]:
            for ctx in DECODE_CONTEXTS[grid]:
                decode_row(bench, model, batch, ctx, block_size)
    model, batch, ctx, block_sizes = DECODE_SWEEP
    for sweep_block_size in block_sizes:
        decode_row(bench, model, batch, ctx, sweep_block_size, section_name="decode-bs", with_target=False)
    bench.guard("decode-cfg", "launch parameter sweep", lambda: decode_tune_rows(bench, block_size))


def run(bench, sections, grid, args):
    """The chosen sections of this family (see kernel_bench's family protocol)."""
    if "decode" in sections:
        bench_decode(bench, grid, args.block_size)
    return {}


if __name__ == "__main__":
    main([sys.modules[__name__]], __doc__)
