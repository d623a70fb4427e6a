"""The CPU attention op over a host pool whose layers start on huge-page boundaries (`allocate_kv_cache_cpu`)
against one of plain torch.empty layers (madvised, but a layer of a few MiB loses up to a huge page at each end
to 4 KiB pages) and one whose huge-page layers each start a page after the one before ("shifted",
`cpu_attention.HUGE_PAGE_SHIFT_PAGES` = 1, as plain allocations fall): huge-page shares and GB/s, rounds
alternated in one process. The shape is e2e_hybrid's B_cpu
probe: a Llama-3-8B pool, every block read once a step by 8 sequences a layer.

    python benchmarks/host_pool_pages.py --gib 1 --rounds 11
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import huge_page_share  # noqa: E402

from apex_compile.ops import cpu_attention  # noqa: E402

LAYERS, KV_HEADS, HEADS, BLOCK, DIM = 32, 8, 32, 16, 128


def plain_pool(blocks):
    pool = []
    for _ in range(LAYERS):
        pair = [torch.empty(blocks, KV_HEADS, BLOCK, DIM, dtype=torch.bfloat16) for _ in range(2)]
        for tensor in pair:
            cpu_attention._advise_huge_pages(tensor)
        pool.append(pair)
    return pool


def aligned_pool(blocks, shift_pages=0):
    """The engine's pool: every layer's K and V on huge pages, starting `shift_pages` pages after the cache
    allocated before it (0: on a huge-page boundary; the engine's is cpu_attention.HUGE_PAGE_SHIFT_PAGES)."""
    default, cpu_attention.HUGE_PAGE_SHIFT_PAGES = cpu_attention.HUGE_PAGE_SHIFT_PAGES, shift_pages
    try:
        return [list(cpu_attention.allocate_kv_cache_cpu(blocks, KV_HEADS, BLOCK, DIM, torch.bfloat16))
                for _ in range(LAYERS)]
    finally:
        cpu_attention.HUGE_PAGE_SHIFT_PAGES = default


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seqs", type=int, default=8)
    args = parser.parse_args(argv)
    blocks = int(args.gib * 2**30) // (LAYERS * 2 * KV_HEADS * BLOCK * DIM * 2)
    blocks -= blocks % args.seqs
    pools = {"plain": plain_pool(blocks), "aligned": aligned_pool(blocks), "shifted": aligned_pool(blocks, 1)}
    for pool in pools.values():
        for key, value in pool:
            key.normal_()
            value.normal_()
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    tables = tables.view(args.seqs, -1).repeat(LAYERS, 1)
    cache_index = torch.arange(LAYERS, dtype=torch.int32).repeat_interleave(args.seqs)
    lens = torch.full((LAYERS * args.seqs,), blocks * BLOCK // args.seqs, dtype=torch.int32)
    query = torch.randn(LAYERS * args.seqs, HEADS, DIM, dtype=torch.bfloat16)
    nbytes = LAYERS * 2 * blocks * KV_HEADS * BLOCK * DIM * 2
    print(f"{torch.get_num_threads()} threads, {nbytes / 2**30:.2f} GiB pools")
    for name, pool in pools.items():
        print(f"{name:8s} huge-page share {huge_page_share([t for pair in pool for t in pair]):.3f}")
    rates = {name: [] for name in pools}
    for r in range(args.rounds):
        for name in (list(pools) if r % 2 == 0 else list(pools)[::-1]):
            keys, values = [k for k, _ in pools[name]], [v for _, v in pools[name]]
            start = time.perf_counter()
            cpu_attention.paged_attention_cpu_multi(query, keys, values, cache_index, tables, lens, DIM ** -0.5)
            rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    for name, values in rates.items():
        print(f"{name:8s} median {statistics.median(values):.2f} GB/s ({' '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
