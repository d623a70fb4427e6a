"""The host cache append (`cache_append_cpu`) that lands prompt K/V exports: GB/s (K+V bytes written / best of
--repeats) for a prompt chunk (consecutive slots in scattered blocks, written a panel tile at a time) and for as
many decode rows (random slots, row by row), per thread count, each checked against gather_kv first.

    python benchmarks/cache_append.py --shape llama2_7b --tokens 2048 --threads 1,2,4
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import allocate_kv_cache_cpu, cache_append_cpu, gather_kv  # noqa: E402

SHAPES = {"llama2_7b": (32, 128), "llama3_8b": (8, 128)}  # kv heads, head dim (bf16)
BLOCK = 16


def slots_of(kind: str, tokens: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "prompt":  # whole blocks in a random order, as a request's table holds them
        blocks = torch.randperm(num_blocks, generator=gen)[:-(-tokens // BLOCK)]
        return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:tokens]
    return torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama2_7b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--pool-blocks", type=int, default=8192, help="blocks of the cache (a few hundred MB)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    heads, dim = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = allocate_kv_cache_cpu(args.pool_blocks, heads, BLOCK, dim, torch.bfloat16)
    key, value = (torch.randn(args.tokens, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    nbytes = 2 * key.numel() * key.element_size()
    rows = []
    for kind in ("prompt", "decode"):
        slots = slots_of(kind, args.tokens, args.pool_blocks, gen)
        cache_append_cpu(key, value, key_cache, value_cache, slots)
        table = torch.arange(args.pool_blocks, dtype=torch.int32)
        k_all, v_all = gather_kv(key_cache, value_cache, table, args.pool_blocks * BLOCK)
        if not (torch.equal(k_all[slots], key) and torch.equal(v_all[slots], value)):
            sys.exit(f"{kind}: the cache does not hold the appended rows")
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                cache_append_cpu(key, value, key_cache, value_cache, slots)
                best = min(best, time.perf_counter() - start)
            rows.append({"kind": kind, "threads": threads, "ms": best * 1e3, "gb_s": nbytes / best / 1e9})
            print(f"{kind:7s} {args.tokens} tokens x {heads} kv heads, {threads} thread(s): {best * 1e3:7.2f} ms "
                  f"{nbytes / best / 1e9:6.2f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "host": platform.node(), "args": vars(args),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
