"""The staggered plan's CPU job on this machine: append + decode attention of `width` rows at every layer of a
Llama-3-8B-shaped host pool, one call per layer (as before) against one multi-layer call, on a worker thread
pinned to all cores but the first (as the engine runs it) and on the main thread with every core; pinned
(4 KiB pages) against unpinned (transparent huge pages) pools. Prints ms per job and GB/s of K+V read, and how
much a step-like host workload on the launching thread slows while the job runs (contention).

    python benchmarks/cpu_job.py --widths 4,8 --context 640
"""
import argparse
import concurrent.futures
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import (  # noqa: E402
    allocate_kv_cache_cpu,
    cache_append_cpu,
    cache_append_cpu_multi,
    paged_attention_cpu,
    paged_attention_cpu_multi,
)
from apex_compile.runtime.stagger import _pin_worker, worker_cores  # noqa: E402


def host_work(rounds: int = 300) -> float:
    """Seconds of a step-like host workload on this thread: small torch CPU ops and Python bookkeeping."""
    x = torch.zeros(64, dtype=torch.int64)
    start = time.perf_counter()
    for i in range(rounds):
        table = {j: [j] * 8 for j in range(32)}
        y = (x + i).clamp_(0, 1000)
        x.copy_(y[torch.arange(64) % 64])
        sum(len(v) for v in table.values())
    return time.perf_counter() - start


def main_thread_slowdown(job, pinned: bool) -> dict:
    """How much the launching thread's host work slows while the job runs back to back on the pinned worker
    (cores, memory bandwidth and L3 shared), unpinned and pinned to the cores the worker leaves free."""
    row = {"pinned": pinned, "what": "main-thread host work while the job runs"}
    alone = min(host_work() for _ in range(5))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    free = sorted(set(cores) - set(worker_cores())) if cores else []
    for name, affinity in (("unpinned", None), ("pinned to the free cores", free or None)):
        if affinity:
            os.sched_setaffinity(0, affinity)
        pool = concurrent.futures.ThreadPoolExecutor(1, initializer=_pin_worker, initargs=(worker_cores(),))
        stop = []

        def loop():
            while not stop:
                job()

        future = pool.submit(loop)
        time.sleep(0.05)
        busy = min(host_work() for _ in range(5))
        stop.append(True)
        future.result()
        pool.shutdown()
        if cores:
            os.sched_setaffinity(0, cores)
        row[name] = busy / alone
        print(f"pinned={pinned!s:5} main-thread host work with the job running, {name}: {busy / alone:.2f}x "
              f"its time alone ({alone * 1e3:.1f} ms)", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="4,8")
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pool-gib", type=float, default=4.0, help="K+V of the whole pool (blocks scattered over it)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    layers, hk, hq, dim, bs = args.layers, 8, 32, 128, 16
    block_bytes = 2 * hk * bs * dim * 2
    blocks = max(int(args.pool_gib * (1 << 30) / (block_bytes * layers)), 64)
    results = []
    for pinned in ([True, False] if torch.cuda.is_available() else [False]):
        caches = [allocate_kv_cache_cpu(blocks, hk, bs, dim, torch.bfloat16, pin_memory=pinned) for _ in range(layers)]
        for k, v in caches:
            k.normal_()
            v.normal_()
        keys, values = [k for k, _ in caches], [v for _, v in caches]
        widths = [int(w) for w in args.widths.split(",")]
        for width in widths:
            per_row = -(-(args.context + 1) // bs)
            gen = torch.Generator().manual_seed(width)
            if width * per_row > blocks:
                sys.exit(f"--pool-gib {args.pool_gib} holds {blocks} blocks per layer, fewer than {width * per_row}")
            tables = torch.stack([torch.randperm(blocks, generator=gen)[:width * per_row] for _ in range(layers)])
            tables = tables.to(torch.int32).view(layers, width, per_row)  # each layer's blocks scattered
            lens = torch.full((width,), args.context, dtype=torch.int32)
            slots = tables[:, :, args.context // bs].long() * bs + args.context % bs
            q = torch.randn(layers, width, hq, dim).to(torch.bfloat16)
            kv = torch.randn(layers, width, hk, dim).to(torch.bfloat16)
            out = torch.empty_like(q)
            index = torch.arange(layers, dtype=torch.int32).repeat_interleave(width)
            flat_tables, flat_lens, flat_slots = tables.view(layers * width, -1), lens.repeat(layers), slots.view(-1)

            def per_layer():
                for layer in range(layers):
                    cache_append_cpu(kv[layer], kv[layer], keys[layer], values[layer], slots[layer])
                    out[layer] = paged_attention_cpu(q[layer], keys[layer], values[layer], tables[layer], lens, 0.08)

            def multi():
                flat = kv.view(layers * width, hk, dim)
                cache_append_cpu_multi(flat, flat, keys, values, index, flat_slots)
                out.view(layers * width, hq, dim).copy_(paged_attention_cpu_multi(
                    q.view(layers * width, hq, dim), keys, values, index, flat_tables, flat_lens, 0.08))

            read = 2 * layers * width * hk * dim * 2 * args.context
            for where in ("worker", "main"):
                if where == "worker":
                    pool = concurrent.futures.ThreadPoolExecutor(1, initializer=_pin_worker,
                                                                 initargs=(worker_cores(),))
                    call = lambda fn: pool.submit(fn).result()  # noqa: E731
                else:
                    call = lambda fn: fn()  # noqa: E731
                for name, fn in (("per_layer", per_layer), ("multi", multi)):
                    call(fn)
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        call(fn)
                        best = min(best, time.perf_counter() - start)
                    row = {"pinned": pinned, "width": width, "where": where, "job": name, "ms": best * 1e3,
                           "GBps": read / best / 1e9}
                    results.append(row)
                    print(f"pinned={pinned!s:5} width {width} {where:6} {name:9}: {best * 1e3:6.2f} ms, "
                          f"{read / best / 1e9:6.1f} GB/s", flush=True)
                if where == "worker":
                    pool.shutdown()
            if width == widths[0]:
                results.append(main_thread_slowdown(multi, pinned))
        caches = keys = values = None  # the next pool replaces this one
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "cpu_job", "cpus": os.cpu_count(), "args": vars(args), "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
