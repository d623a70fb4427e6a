"""Benchmark of the Triton paged prefill attention against torch SDPA on one CUDA GPU.

    python benchmarks/triton_prefill.py --out prefill.json [--quick] [--block-size 16]

Section:
  prefill    paged_prefill_attention_gpu over packed causal prompts (Llama-3-8B layout; a few tile configs, the
             first the default) vs torch SDPA called once per prompt
Timing and the command line: benchmarks/kernel_bench.py. triton_kernels.py runs this with the other families.
"""
import sys

import torch
import triton

# kernel_bench first: it puts the repository root on sys.path for the apex_compile imports.
from kernel_bench import ATTENTION_LAYOUTS, DEVICE, DTYPE, check_close, main, sdpa_function

from apex_compile.kernels.prefill_attention import default_prefill_config, paged_prefill_launch
from apex_compile.ops import cache_append_gpu

SECTIONS = ("prefill",)
PREFILL_CASES = {
    "full": {"1x4096": [4096], "4x1024": [1024] * 4, "16x256": [256] * 16,
             "8 ragged": [1500, 100, 731, 1024, 37, 512, 900, 260]},
    "quick": {"1x4096": [4096], "8 ragged": [1500, 100, 731, 1024, 37, 512, 900, 260]},
}
PREFILL_EXTRA_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
]


def prefill_row(bench, label, lens, block_size):
    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS["llama3-8b"]
    name = f"llama3-8b bs={block_size} {label}"
    total = sum(lens)
    query = torch.randn(total, num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    key = torch.randn(total, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    value = torch.randn_like(key)
    blocks = [triton.cdiv(n, block_size) for n in lens]
    key_cache = torch.empty(sum(blocks), num_kv_heads, block_size, head_dim, dtype=DTYPE, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    order = torch.randperm(sum(blocks)).tolist()
    block_tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    slots = []
    for seq, (n, used) in enumerate(zip(lens, blocks)):
        block_tables[seq, :used] = torch.tensor([order.pop() for _ in range(used)], dtype=torch.int32)
        tokens = torch.arange(n)
        slots.append(block_tables[seq, tokens // block_size].long() * block_size + tokens % block_size)
    block_tables = block_tables.to(DEVICE)
    cache_append_gpu(key, value, key_cache, value_cache, torch.cat(slots).to(DEVICE))
    starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (query, key_cache, value_cache, block_tables, starts, context_lens)
    flops = sum(4 * num_heads * head_dim * n * (n + 1) / 2 for n in lens)

    per_prompt, begin = [], 0
    for n in lens:
        rows = slice(begin, begin + n)
        per_prompt.append(tuple(t[rows].transpose(0, 1)[None].contiguous() for t in (query, key, value)))
        begin += n
    calls = [sdpa_function(q, k, v, causal=True) for q, k, v in per_prompt]
    backend = calls[0][1]

    def sdpa_all():
        return [call() for call, _ in calls]

    ref = torch.cat([o[0].transpose(0, 1) for o in sdpa_all()])
    base = bench.measure([sdpa_all])
    default = default_prefill_config(head_dim, query.device)
    configs = [default] + [c for c in PREFILL_EXTRA_CONFIGS if c != default]
    for config in configs:
        out = paged_prefill_launch(*args, max_query_len=max(lens), config=config)
        check_close(f"prefill {config}", out, ref)
        kernel = bench.measure([lambda c=config: paged_prefill_launch(*args, max_query_len=max(lens), config=c)],
                               eager=config is default)
        suffix = " (default)" if config is default else ""
        bench.add("prefill", f"{name} BM{config['BLOCK_M']}/BN{config['BLOCK_N']}/w{config['num_warps']}"
                  f"/s{config['num_stages']}{suffix}", kernel, base, flops=flops, sdpa_backend=backend, config=config)


def bench_prefill(bench, grid, block_size):
    for label, lens in PREFILL_CASES[grid].items():
        bench.guard("prefill", label, lambda lens=lens, label=label: prefill_row(bench, label, lens, block_size))


def run(bench, sections, grid, args):
    """The chosen sections of this family (see kernel_bench's family protocol)."""
    if "prefill" in sections:
        bench_prefill(bench, grid, args.block_size)
    return {}


if __name__ == "__main__":
    main([sys.modules[__name__]], __doc__)
