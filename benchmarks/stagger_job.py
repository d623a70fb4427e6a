"""Where the staggered plan's CPU job spends its fixed part: `apex::stagger_cpu_job` (the engine's one call per
lane turn) on a Llama-3-8B-shaped host pool, at 1..8 rows of every layer, on a worker thread pinned as the
engine pins it, called three ways:
  hot   back to back, its ready flags already raised;
  gap   the same after a 4 ms sleep on the worker (its OpenMP team idles as it does between two turns);
  flag  as the engine calls it: the job waits in C++ for a flag another thread raises 4 ms after submission;
  flow  the one-lane plan's layered job (`apex::stagger_layer_job`): the main thread raises layer l's ready flag
        l x --layer-us after submission (busy-waiting, as the launching thread keeps one core busy), the job
        appends and attends each layer once its flag is up (its waits are not in its running time), its team
        claiming the layers' items in order with no barrier;
  multi the same rows' attention (no append) as one `paged_attention_cpu_multi` call over every layer, no flag:
        the op's own rate on the job's shape, the yardstick for the job's (the op's profile probes read longer
        contexts).
--tables picks how a row's blocks lie in the pool: "scattered" (random blocks, the default), "contiguous"
(consecutive ids, as the performance profile's probes read them) or "runs:N" (random runs of N consecutive ids).
Each prints the running time's parts (append, attention) and a least-squares fit of fixed + per-row seconds,
beside the K+V bytes read per row and the bandwidth that implies; "flow" also the team's busy share (its
thread-seconds inside work items over the running time x threads: the rest is the team between items, at a
layer's tail or before its flag) and the bandwidth of a thread while busy. (Session 21's "before" results also have
the gathers and the output scatter the job then did: `stagger_job_*_s21_before_*`.)

    python benchmarks/stagger_job.py --rows 1,2,3,4,6,8 --context 576 --out stagger_job.json
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import allocate_kv_cache_cpu, paged_attention_cpu_multi  # noqa: E402
from apex_compile.runtime.stagger import _pin_worker, worker_cores  # noqa: E402

PARTS = ("append", "attention")
MODES = ("hot", "gap", "flag", "flow", "multi")


def fit(xs, ys):
    """Least-squares (fixed, slope) of ys = fixed + slope * xs (slope 0 over a single x)."""
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    slope, fixed = statistics.linear_regression(xs, ys)
    return fixed, slope


def block_ids(how: str, blocks: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """`count` distinct block ids of a pool of `blocks`, laid out as --tables says."""
    if how == "scattered":
        return torch.randperm(blocks, generator=gen)[:count]
    if how == "contiguous":
        return torch.arange(count)
    if how.startswith("runs:"):
        run = int(how.split(":")[1])
        starts = torch.randperm(blocks // run, generator=gen)[:-(-count // run)] * run
        return (starts[:, None] + torch.arange(run)).flatten()[:count]
    sys.exit(f"--tables takes scattered, contiguous or runs:N, got {how!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pool-gib", type=float, default=8.0, help="K+V of the pool (blocks scattered over it)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's block_size)")
    parser.add_argument("--threads", type=int, default=None, help="worker threads (default: the engine's)")
    parser.add_argument("--gap-ms", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layer-us", type=float, default=170.0,
                        help="'flow' mode: microseconds between two layers' ready flags (a GPU step / layers)")
    parser.add_argument("--modes", default="hot,gap,flag,flow,multi")
    parser.add_argument("--split", default=None,
                        help="items_per_thread,min_item_bytes,min_thread_bytes of the attention's work split (all "
                             "calls; default: the op's): a layer's few rows split finer over the team")
    parser.add_argument("--pinned", action="store_true",
                        help="a page-locked pool from torch's pinned allocator (default: plain memory with huge pages "
                             "advised, which the engine registers with CUDA: same CPU access)")
    parser.add_argument("--tables", default="scattered", help="scattered | contiguous | runs:N (see above)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; known: {','.join(MODES)}")
    layers, hk, hq, dim, bs, width = args.layers, 8, 32, 128, args.block_size, args.width
    block_bytes = 2 * hk * bs * dim * 2
    blocks = max(int(args.pool_gib * (1 << 30) / (block_bytes * layers)), 64)
    per_row = -(-(args.context + 1) // bs)
    if width * per_row > blocks:
        sys.exit(f"--pool-gib {args.pool_gib} holds {blocks} blocks per layer, fewer than {width * per_row}")
    pin = args.pinned and torch.cuda.is_available()
    caches = [allocate_kv_cache_cpu(blocks, hk, bs, dim, torch.bfloat16, pin_memory=pin) for _ in range(layers)]
    base = torch.randn(2, 1, hk, bs, dim).to(torch.bfloat16)  # one block's values, copied into every block (fast)
    for k, v in caches:
        k.copy_(base[0].expand_as(k))
        v.copy_(base[1].expand_as(v))
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    gen = torch.Generator().manual_seed(0)
    tables = torch.stack([block_ids(args.tables, blocks, width * per_row, gen) for _ in range(layers)])
    tables = tables.to(torch.int32).view(layers, width, per_row)
    staged = torch.randn(layers, width, hq + 2 * hk, dim).to(torch.bfloat16)
    out = torch.zeros(layers, width, hq, dim, dtype=torch.bfloat16)
    if pin:
        staged, out = staged.pin_memory(), out.pin_memory()
    if args.split:
        split = [int(v) for v in args.split.split(",")]
        if len(split) != 3:
            sys.exit(f"--split takes three integers, got {args.split!r}")
        torch.ops.apex.cpu_attention_work_split(*split)
    split = torch.ops.apex.cpu_attention_work_split(0, 0, 0)  # (the values now in effect)
    cores = worker_cores(args.threads)
    pool = concurrent.futures.ThreadPoolExecutor(1, initializer=_pin_worker, initargs=(cores,))
    print(f"{os.cpu_count()} CPUs, worker on {len(cores)} cores, {layers} layers x {hk} kv heads x {dim}, context "
          f"{args.context}, pool {blocks} blocks of {bs} tokens per layer, pinned={pin}, work split {list(split)}",
          flush=True)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        # the first `rows` block rows of every layer hold a request (as a lane's job picks them)
        picked = torch.tensor([layer * width + r for layer in range(layers) for r in range(rows)], dtype=torch.int64)
        cache_index = (picked // width).to(torch.int32)
        row_tables = tables.view(layers * width, per_row)[picked].contiguous()
        lens = torch.full((len(picked),), args.context + 1, dtype=torch.int32)
        slots = row_tables[:, args.context // bs].long() * bs + args.context % bs
        kv_bytes = 2 * layers * rows * hk * dim * 2 * (args.context + 1)
        query = staged.view(layers * width, hq + 2 * hk, dim)[picked, :hq].contiguous()  # "multi"'s queries
        for how in modes:
            samples = []
            layered = how == "flow"
            for i in range(args.repeats + 2):
                flags = torch.zeros(layers if layered else 1, dtype=torch.int64)
                done = torch.zeros(layers, dtype=torch.int64)
                # waiting, running, its parts, busy thread-seconds, the whole C++ call (layered jobs)
                timings = torch.zeros(4 + len(PARTS), dtype=torch.float64)
                wall = [float("nan")]  # the layered call's wall time
                if how in ("hot", "gap", "multi"):
                    flags[0] = 1

                def job():
                    if how == "gap":
                        time.sleep(args.gap_ms / 1e3)
                    with torch.inference_mode():
                        if how == "multi":  # timed here: one call, the team started once
                            begin = time.perf_counter()
                            paged_attention_cpu_multi(query, keys, values, cache_index, row_tables, lens, dim ** -0.5)
                            timings[1] = timings[2 + PARTS.index("attention")] = time.perf_counter() - begin
                            timings[4] = timings[5] = float("nan")
                        elif layered:
                            begin = time.perf_counter()
                            torch.ops.apex.stagger_layer_job(staged, keys, values, cache_index, row_tables, lens,
                                                             slots, picked, hq, dim ** -0.5, out, flags, done, 1,
                                                             60.0, timings)
                            wall[0] = time.perf_counter() - begin  # with its planning, before the first wait
                        else:
                            torch.ops.apex.stagger_cpu_job(staged, keys, values, cache_index, row_tables, lens,
                                                           slots, picked, hq, dim ** -0.5, out, flags, [1], 60.0,
                                                           timings)

                future = pool.submit(job)
                if how == "flag":
                    timer = threading.Timer(args.gap_ms / 1e3, lambda: flags.fill_(1))
                    timer.start()
                elif layered:  # the GPU's cadence: layer l staged l x layer_us after the submission
                    begin, view = time.perf_counter(), flags.numpy()
                    for layer in range(layers):
                        while time.perf_counter() - begin < layer * args.layer_us / 1e6:
                            pass
                        view[layer] = 1
                future.result()
                if i >= 2:
                    samples.append(timings.tolist() + wall)
            run = statistics.median(s[1] for s in samples)
            parts = {p: statistics.median(s[2 + j] for s in samples) for j, p in enumerate(PARTS)}
            busy = statistics.median(s[4] for s in samples)  # NaN where the call does not time its items
            # the layered call's wall time beyond its waits and running time: the C++ call's checks, plans and
            # frees, then the Python glue around it
            prep = statistics.median(s[5] - s[0] - s[1] for s in samples)
            glue = statistics.median(s[6] - s[5] for s in samples)
            row = {"rows": rows, "how": how, "run_s": run, "wait_s": statistics.median(s[0] for s in samples),
                   "parts_s": parts, "kv_bytes": kv_bytes, "GBps": kv_bytes / run / 1e9,
                   "busy_thread_s": None if busy != busy else busy, "prep_s": None if prep != prep else prep,
                   "glue_s": None if glue != glue else glue}
            results.append(row)
            team = f"  team busy {busy / (run * len(cores)):.0%}, {kv_bytes / busy / 1e9:.1f} GB/s a busy thread" \
                if busy == busy and busy > 0 else ""
            print(f"rows {rows} {how:4}: {run * 1e3:6.3f} ms ({kv_bytes / run / 1e9:5.1f} GB/s)  "
                  + "  ".join(f"{p} {v * 1e3:.3f}" for p, v in parts.items()) + team
                  + (f"  C++ checks, plans, frees {prep * 1e3:.3f} ms, Python glue {glue * 1e3:.3f} ms"
                     if glue == glue else ""), flush=True)
    for how in modes:
        pts = [(r["rows"], r["run_s"]) for r in results if r["how"] == how]
        fixed, slope = fit([p[0] for p in pts], [p[1] for p in pts])
        att = fit([p[0] for p in pts], [r["parts_s"]["attention"] for r in results if r["how"] == how])
        per_row_bytes = results[0]["kv_bytes"] / results[0]["rows"]
        print(f"fit {how:4}: {fixed * 1e3:.3f} ms + {slope * 1e3:.3f} ms a row ({per_row_bytes / max(slope, 1e-12) / 1e9:.1f}"
              f" GB/s a row); attention alone {att[0] * 1e3:.3f} ms + {att[1] * 1e3:.3f} ms a row", flush=True)
    pool.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "stagger_job", "cpus": os.cpu_count(), "worker_cores": len(cores),
                       "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                       "work_split": list(split),
                       "args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
