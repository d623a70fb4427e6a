"""Fixed cost per call of the CPU attention op, and how small calls scale with threads.

    python benchmarks/cpu_attention_overhead.py [--out overhead.json]

Small decode calls (batch 1, a few MiB of KV) are far from the read bandwidth on the 16-core GPU host while
large ones reach it: this separates the cost that does not depend on the KV bytes from the part that does.
  single    one 16-token item (no parallel region): the call's dispatch, checks and plan
  fork_join as many KV heads of 16 tokens as threads, run on one thread (the default split for so little
            work) and forced to one item per thread: the difference is the cost of the parallel region
  threads   SmolLM2 batch 1 at 2k/16k and Llama-2 batch 1 at 512 tokens (rotated KV, as cpu_attention.py)
            with 1..all threads, then with all threads in turns with torch SDPA (as cpu_attention.py times them)
Then the whole run is repeated in a child process with OMP_WAIT_POLICY=ACTIVE (threads spin between parallel
regions instead of sleeping), unless it is that child.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_attention import (  # noqa: E402
    DTYPES, GIB, MODELS, Pool, anon_huge_page_bytes, bench_config, busy_cores, cpu_model, timed_loop,
)

from apex_compile.ops import (  # noqa: E402
    allocate_kv_cache_cpu, cache_append_cpu, cpu_attention_work_split, paged_attention_cpu,
)

SCALING_SHAPES = [("SmolLM2-135M", 1, 2048), ("SmolLM2-135M", 1, 16384), ("Llama-2-7B", 1, 512)]


def tiny_call_us(num_kv_heads, context, seconds):
    """Median microseconds of a bf16 call over `num_kv_heads` KV heads (group 1, head_dim 64) of `context`
    tokens, cache-resident: costs other than reading KV from memory."""
    block_size = 16
    blocks = -(-context // block_size)
    key_cache, value_cache = allocate_kv_cache_cpu(blocks, num_kv_heads, block_size, 64, torch.bfloat16)
    kv = torch.randn(context, num_kv_heads, 64).to(torch.bfloat16)
    cache_append_cpu(kv, kv, key_cache, value_cache, torch.arange(context, dtype=torch.int64))
    query = torch.randn(1, num_kv_heads, 64).to(torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    lens = torch.tensor([context], dtype=torch.int32)
    median, _ = timed_loop(lambda i: paged_attention_cpu(query, key_cache, value_cache, tables, lens), seconds)
    return median * 1e6


def run(seconds, pool_gib):
    """All measurements of this process, as a dict."""
    threads = torch.get_num_threads()
    defaults = cpu_attention_work_split()
    result = {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "threads": threads}
    result["single_us"] = tiny_call_us(1, 16, seconds)
    cpu_attention_work_split(items_per_thread=1, min_item_bytes=1, min_thread_bytes=1)
    try:
        result["fork_join_us"] = tiny_call_us(threads, 16, seconds)
    finally:
        cpu_attention_work_split(**defaults)
    result["single_us_same_heads"] = tiny_call_us(threads, 16, seconds) if threads > 1 else result["single_us"]
    pool = Pool(int(pool_gib * GIB))
    result["pool_bytes"], result["huge_page_bytes"] = 2 * pool.half_bytes, anon_huge_page_bytes()
    gen = torch.Generator().manual_seed(0)
    counts = sorted({1, 2, 4, 8, threads} & set(range(1, threads + 1)))
    result["scaling"] = []
    for model, batch, context in SCALING_SHAPES:
        for count in counts:
            torch.set_num_threads(count)
            row = bench_config(pool, MODELS[model], DTYPES["bf16"], batch, context, 16, seconds, gen, with_sdpa=False)
            result["scaling"].append({"model": model, "batch": batch, "context": context, "threads": count,
                                      "op_us": row["op_ms"] * 1e3, "op_gbps": row["op_gbps"]})
    torch.set_num_threads(threads)
    result["with_sdpa_in_turns"] = []
    for model, batch, context in SCALING_SHAPES:
        row = bench_config(pool, MODELS[model], DTYPES["bf16"], batch, context, 16, seconds, gen)
        result["with_sdpa_in_turns"].append({"model": model, "batch": batch, "context": context,
                                             "op_us": row["op_ms"] * 1e3, "op_gbps": row["op_gbps"],
                                             "sdpa_us": row["sdpa_ms"] * 1e3})
    return result


def show(result):
    """Prints one process's measurements."""
    print(f"OMP_WAIT_POLICY={result['omp_wait_policy']}, {result['threads']} threads, "
          f"{result['pool_bytes'] / GIB:.1f} GiB pool, {(result['huge_page_bytes'] or 0) / GIB:.1f} GiB on huge pages")
    print(f"  single item, 1 head:                     {result['single_us']:7.1f} us")
    print(f"  single item each, {result['threads']} heads, 1 thread:    {result['single_us_same_heads']:7.1f} us")
    print(f"  one item per thread (parallel region):   {result['fork_join_us']:7.1f} us")
    for row in result["scaling"]:
        print(f"  {row['model']:<13} b{row['batch']} ctx{row['context']:6d} threads {row['threads']:2d}: "
              f"{row['op_us']:8.1f} us {row['op_gbps']:6.1f} GB/s")
    for row in result["with_sdpa_in_turns"]:
        print(f"  {row['model']:<13} b{row['batch']} ctx{row['context']:6d} in turns with SDPA: "
              f"{row['op_us']:8.1f} us {row['op_gbps']:6.1f} GB/s (SDPA {row['sdpa_us']:.1f} us)")


def main():
    """Measures in this process and (unless --child) in one with OMP_WAIT_POLICY=ACTIVE; prints, writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--pool-gib", type=float, default=2.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.seconds, args.pool_gib)))
        return
    busy = busy_cores()
    print(f"CPU: {cpu_model()}; cores busy with other work before the run: {busy}", flush=True)
    results = [run(args.seconds, args.pool_gib)]
    show(results[0])
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    child = subprocess.run([sys.executable, __file__, "--child", "--seconds", str(args.seconds),
                            "--pool-gib", str(args.pool_gib)], env=env, capture_output=True, text=True, check=True)
    results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    show(results[1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_model(), "busy_cores_before": busy, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
