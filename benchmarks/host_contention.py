"""What a running CPU attention job costs the thread that launches GPU work: that thread's time for work of the
kinds a staggered step does before its replay, while the engine's worker (pinned as the engine pins it) is idle,
streams a host KV pool through the CPU attention op, or only polls (a job waiting for flags that never come).

Main-thread work, each timed alone, many times:
  python  `HostJob.of` over a lane of 32 groups (Python and numpy: the engine's own metadata code)
  launch  the host call of a CUDA graph replay (a graph of --nodes small kernels; synchronised between calls)
  copy    a 1 KB pinned host-to-device copy, then a 1 KB device-to-host copy, then synchronise (a round trip)
Worker loads: idle; stream (the job back to back); poll; where cores are left free, stream with the launching
thread pinned to them, and stream with one worker thread fewer (two cores free), unpinned and pinned.

    python benchmarks/host_contention.py --out host_contention.json
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import allocate_kv_cache_cpu  # noqa: E402
from apex_compile.runtime.stagger import HostJob, StaggerGroup, _pin_worker, worker_cores  # noqa: E402


def lane(layers: int, width: int, table_width: int):
    rows = np.arange(width)
    return [StaggerGroup([None] * width, rows=rows, slots=rows.copy(),
                         block_tables=np.zeros((width, table_width), dtype=np.int32),
                         context_lens=np.full(width, 600, dtype=np.int32), prefix=width) for _ in range(layers)]


class Worker:
    """The engine's CPU job in a loop on a pinned worker thread: streaming (flags raised) or polling (never)."""

    def __init__(self, threads, layers, width, context, pool_gib):
        hk, hq, dim, bs = 8, 32, 128, 16
        per_row = -(-(context + 1) // bs)
        blocks = max(int(pool_gib * (1 << 30) / (2 * hk * bs * dim * 2 * layers)), width * per_row)
        caches = [allocate_kv_cache_cpu(blocks, hk, bs, dim, torch.bfloat16) for _ in range(layers)]
        for k, v in caches:
            k.fill_(0.01)
            v.fill_(0.02)
        self.keys, self.values = [k for k, _ in caches], [v for _, v in caches]
        gen = torch.Generator().manual_seed(0)
        picked = torch.arange(layers * width, dtype=torch.int64)
        self.picked, self.cache_index = picked, (picked // width).to(torch.int32)
        self.tables = torch.stack([torch.randperm(blocks, generator=gen)[:per_row] for _ in picked]).to(torch.int32)
        self.lens = torch.full((len(picked),), context + 1, dtype=torch.int32)
        self.slots = self.tables[:, context // bs].long() * bs + context % bs
        self.staged = torch.randn(layers, width, hq + 2 * hk, dim).to(torch.bfloat16)
        self.out = torch.zeros(layers, width, hq, dim, dtype=torch.bfloat16)
        self.hq, self.dim = hq, dim
        self.cores = worker_cores(threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, initializer=_pin_worker, initargs=(self.cores,))
        self.stop = threading.Event()
        self.jobs = 0

    def start(self, how: str):
        self.stop.clear()
        flags = torch.tensor([1 if how == "stream" else 0], dtype=torch.int64)

        def loop():
            timings = torch.zeros(4, dtype=torch.float64)
            with torch.inference_mode():
                while not self.stop.is_set():
                    try:
                        torch.ops.apex.stagger_cpu_job(self.staged, self.keys, self.values, self.cache_index,
                                                       self.tables, self.lens, self.slots, self.picked, self.hq,
                                                       self.dim ** -0.5, self.out, flags, [1], 0.2, timings)
                    except RuntimeError:  # poll: the flag never comes
                        pass
                    self.jobs += 1

        self.jobs = 0
        return self.pool.submit(loop)


def timed(fn, repeats, drain=None):
    """Median and p90 of fn's time; drain (the launch: synchronise the GPU) runs untimed before each call,
    else a short pause after it (the step's rhythm: the work comes in bursts)."""
    samples = []
    for _ in range(repeats):
        if drain is not None:
            drain()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        if drain is None:
            time.sleep(0.0005)
    samples.sort()
    return {"median_us": statistics.median(samples) * 1e6, "p90_us": samples[int(0.9 * len(samples))] * 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--nodes", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    groups = lane(args.layers, args.width, 64)
    work = {"python": lambda: HostJob.of(groups, args.width)}
    if cuda:
        x = torch.zeros(256, device="cuda")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x.add_(1)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.nodes):
                    x.add_(1)
        host = torch.zeros(128, dtype=torch.int64, pin_memory=True)
        dev = torch.zeros(128, dtype=torch.int64, device="cuda")

        def launch():
            graph.replay()

        def copy():
            dev.copy_(host, non_blocking=True)
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        work["launch"], work["copy"] = launch, copy
    main_cores = sorted(os.sched_getaffinity(0))
    results = {}
    variants = [("idle", None, None, False), ("stream", None, "stream", False), ("poll", None, "poll", False)]
    if set(main_cores) - set(worker_cores()):  # a core the worker leaves free (none on two cores)
        variants.append(("stream, launcher pinned", None, "stream", True))
    if len(main_cores) >= 3:
        variants.append(("stream, one worker thread fewer", len(main_cores) - 2, "stream", False))
        variants.append(("stream, one fewer, launcher pinned", len(main_cores) - 2, "stream", True))
    workers = {}
    for name, threads, how, pin_main in variants:
        worker = workers.get(threads)
        if worker is None and how is not None:
            worker = workers[threads] = Worker(threads, args.layers, args.width, args.context, args.pool_gib)
        future = worker.start(how) if how is not None else None
        if pin_main:
            os.sched_setaffinity(0, sorted(set(main_cores) - set(worker.cores)))
        time.sleep(0.2)
        row = {}
        for kind, fn in work.items():
            for _ in range(20):
                fn()
            if cuda:
                torch.cuda.synchronize()
            # the launch: the call's host time alone, the GPU drained between calls
            row[kind] = timed(fn, args.repeats, torch.cuda.synchronize if kind == "launch" else None)
        if future is not None:
            worker.stop.set()
            future.result()
            row["jobs"] = worker.jobs
            row["worker_cores"] = len(worker.cores)
        os.sched_setaffinity(0, main_cores)
        results[name] = row
        print(f"{name:34} " + "  ".join(f"{k} {v['median_us']:7.1f} us (p90 {v['p90_us']:7.1f})"
                                         for k, v in row.items() if isinstance(v, dict))
              + (f"  [{row['jobs']} jobs]" if "jobs" in row else ""), flush=True)
    for worker in workers.values():
        worker.pool.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "host_contention", "cpus": os.cpu_count(), "args": vars(args),
                       "gpu": torch.cuda.get_device_name() if cuda else None, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
