"""What the one-lane plan's CPU jobs lose between two jobs, run by a Python worker thread (`LayerJobs` without
caches, the way before session 38) or by the C++ runner's thread (`StaggerRunner`, the default), while the
launching thread holds the GIL as the engine's does for most of a step.

The main thread plays the engine: each step of --step-ms it takes the finished jobs' timings (`collect`), queues
the job of the next turn (the engine's closure around `stagger_layer_job` on the Python worker, `submit` on the
runner) and then, for the rest of the step, runs pure Python (its own work: it releases the GIL only where the
interpreter forces a switch), raising layer l's ready flag at l / layers of the step through raw memory as the
GPU's staging would. Each job has --rows rows of --context tokens in each of 32 layers (Llama-3-8B's KV heads,
scattered blocks). Modes alternate in rounds, so both see the same host. Printed per mode: the workers' time
between jobs (picking the next one up after the last ended, and the job's Python glue with the GIL taken back:
the team idle), the jobs' C++ running time, how late the last job ends after its step, and the main thread's
Python work per step (what the worker's GIL takes from the launching thread). With --burst N, each mode also
queues N jobs back to back with their flags raised before (a CPU behind the GPU): what a job costs around its work.

    python benchmarks/stagger_runner.py --rows 2 --context 256 --steps 150 --out stagger_runner.json
"""
import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import allocate_kv_cache_cpu, stagger_layer_job  # noqa: E402
from apex_compile.runtime.stagger import LayerJobs, worker_cores  # noqa: E402

LAYERS, KV_HEADS, HEADS, DIM, BLOCK = 32, 8, 32, 128, 16


def make_inputs(rows, context, width, gen):
    """A host pool of 32 layers sized for the job, and the job's rows (scattered blocks) as the engine hands them."""
    per_row = -(-(context + 1) // BLOCK)
    blocks = max(4 * rows * per_row, 64)
    caches = [allocate_kv_cache_cpu(blocks, KV_HEADS, BLOCK, DIM, torch.bfloat16) for _ in range(LAYERS)]
    for k, v in caches:
        k.fill_(0.01)
        v.fill_(0.02)
    picked = torch.tensor([layer * width + r for layer in range(LAYERS) for r in range(rows)], dtype=torch.int64)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:per_row] for _ in range(len(picked))]).to(torch.int32)
    lens = torch.full((len(picked),), context, dtype=torch.int32)
    slots = tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    meta = dict(cache_index=(picked // width).to(torch.int32), block_tables=tables, context_lens=lens,
                slot_mapping=slots, rows=picked)
    return caches, meta


def observe(waited, ran, busy):
    """The engine feeds its row fit here; nothing to fit in this benchmark."""


def make_jobs(native, caches, args, width):
    """`LayerJobs` over the pool: on the C++ runner's thread (native) or on a Python worker thread."""
    staged = torch.randn(LAYERS, width, HEADS + 2 * KV_HEADS, DIM).to(torch.bfloat16)
    outputs = torch.zeros(LAYERS, width, HEADS, DIM, dtype=torch.bfloat16)
    jobs = LayerJobs(staged, outputs, pin_memory=False, threads=args.threads,
                     caches=([k for k, _ in caches], [v for _, v in caches]) if native else None)
    jobs.staged.copy_(staged)
    return jobs


def queue_job(jobs, native, turn, caches, meta):
    """Queues `turn`'s job as the engine does: `submit` on the runner, or its closure around `stagger_layer_job`
    (stagger.end_step) on the Python worker."""
    if native:
        jobs.submit(turn, observe, num_heads=HEADS, scale=DIM ** -0.5, **meta)
        return
    keys, values = [k for k, _ in caches], [v for _, v in caches]

    def layer_job(staged, out, ready_flags, done):
        called = time.perf_counter()
        waited, ran, busy, call = stagger_layer_job(
            staged, keys, values, meta["cache_index"], meta["block_tables"], meta["context_lens"],
            meta["slot_mapping"], meta["rows"], HEADS, DIM ** -0.5, out, ready_flags, done, turn,
            with_busy=True, with_call=True)
        jobs.job_parts.append((0.0, call - waited - ran, time.perf_counter() - called - call))
        jobs.job_busy.append(busy)
        observe(waited, ran, busy)
        return waited, ran

    jobs.launch(turn, layer_job, [jobs.staged], jobs.outputs)


def run_mode(native, caches, meta, args, width):
    """The paced run: a job a step, the main thread in pure Python between (module docstring)."""
    jobs = make_jobs(native, caches, args, width)
    ready = [ctypes.c_int64.from_address(jobs.ready.data_ptr() + 8 * layer) for layer in range(LAYERS)]
    step_s = args.step_ms / 1e3
    work_per_step = []
    for turn in range(1, args.steps + 1):
        begin = time.perf_counter()
        jobs.collect(0, jobs.outputs)
        queue_job(jobs, native, turn, caches, meta)
        # the rest of the step: pure Python, each layer's ready flag raised at its share of the step
        iterations, layer = 0, 0
        while True:
            now = time.perf_counter()
            if now - begin >= step_s:
                break
            while layer < LAYERS and now - begin >= step_s * layer / LAYERS:
                ready[layer].value = turn
                layer += 1
            iterations += 1
        for flag in ready[layer:]:
            flag.value = turn
        work_per_step.append(iterations)
    end = time.perf_counter()
    jobs.drain()
    late = max(jobs.job_times[-1][2] - end, 0.0)  # the last job's end after the last step's
    times = list(jobs.job_times)[args.warm:]
    pairs = list(zip(times, times[1:]))
    pickup = [started - max(ended, submitted) for (_, _, ended), (submitted, started, _) in pairs]
    parts = list(jobs.job_parts)[args.warm:]
    runs = [ran for _, ran in list(jobs.job_seconds)[args.warm:]]
    jobs.close()
    return {"pickup_median_us": statistics.median(pickup) * 1e6, "pickup_mean_us": statistics.fmean(pickup) * 1e6,
            "glue_median_us": statistics.median(p[2] for p in parts) * 1e6,
            "glue_mean_us": statistics.fmean(p[2] for p in parts) * 1e6,
            "planning_median_us": statistics.median(p[1] for p in parts) * 1e6,
            "job_run_median_ms": statistics.median(runs) * 1e3,
            "python_work_per_step": statistics.median(work_per_step[args.warm:]),
            "last_job_late_ms": late * 1e3, "jobs": len(runs)}


def burst_mode(native, caches, meta, args, width):
    """--burst: that many jobs queued back to back with every layer's flag raised before, as when the CPU is behind
    the GPU: per job, the burst's wall time, the jobs' median C++ running time, and the rest (what a job costs
    around its work: picking it up, its checks, plans and frees, waking the team)."""
    jobs = make_jobs(native, caches, args, width)
    jobs.ready.fill_(args.burst)
    begin = time.perf_counter()
    for turn in range(1, args.burst + 1):
        queue_job(jobs, native, turn, caches, meta)
    jobs.drain()
    wall = time.perf_counter() - begin
    runs = [ran for _, ran in jobs.job_seconds]
    jobs.close()
    return {"per_job_us": wall / args.burst * 1e6, "ran_median_us": statistics.median(runs) * 1e6,
            "outside_us": (wall - sum(runs)) / args.burst * 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2, help="rows in each layer")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warm", type=int, default=10, help="steps left out of the figures")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="the worker's threads (default: the engine's)")
    parser.add_argument("--burst", type=int, default=0,
                        help="also time this many jobs queued back to back, their flags raised before (0: not)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    width = max(args.rows, 1)
    caches, meta = make_inputs(args.rows, args.context, width, gen)
    cores = worker_cores(args.threads)
    print(f"{os.cpu_count()} CPUs, worker on cores {cores}; {args.rows} rows x {args.context} tokens x {LAYERS} "
          f"layers a job, one per {args.step_ms} ms step", flush=True)
    results = {"python": [], "cxx": []}
    bursts = {"python": [], "cxx": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name in results:
                results[name].append(run_mode(name == "cxx", caches, meta, args, width))
                if args.burst:
                    bursts[name].append(burst_mode(name == "cxx", caches, meta, args, width))
    summary = {}
    for name, runs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        s = summary[name]
        print(f"{name:6}: between jobs: pickup {s['pickup_median_us']:.0f} us median ({s['pickup_mean_us']:.0f} mean),"
              f" Python glue + GIL {s['glue_median_us']:.0f} us median ({s['glue_mean_us']:.0f} mean); C++ checks, "
              f"plans, frees {s['planning_median_us']:.0f} us; job running {s['job_run_median_ms']:.2f} ms; last "
              f"job ends {s['last_job_late_ms']:.1f} ms after its step; main thread's Python work "
              f"{s['python_work_per_step']:.0f} loops a step", flush=True)
        if args.burst:
            b = summary[name]["burst"] = {k: statistics.median(r[k] for r in bursts[name]) for k in bursts[name][0]}
            print(f"{name:6}: {args.burst} jobs back to back: {b['per_job_us']:.0f} us a job, of which running "
                  f"{b['ran_median_us']:.0f} us (median) and around it {b['outside_us']:.0f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "stagger_runner", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "args": vars(args), "cpus": os.cpu_count(), "worker_cores": cores, "summary": summary,
                       "rounds": results, "bursts": bursts}, f, indent=1)


if __name__ == "__main__":
    main()
