"""Where a staggered decode step's time goes on one CUDA GPU, against the GPU-only step, in one run (Llama-3-8B
shape, cut to --layers layers; random weights). At steady state (pipeline full) per mode:

- step: wall time of `engine.step()` (median over the window);
- gpu: GPU time of the decode graph that step replays (the whole-step graph at the same padded size, timed
  alone with CUDA events, no CPU job running): the GPU-side cost of the staggered rows' copies and splices;
- host: the main thread's time in the staggered pipeline's `begin_step` / `end_step` per step;
- no-job: the staggered step with the CPU job replaced by nothing (outputs zero, tokens meaningless): what the
  job costs the step beyond its own time (contention for cores, memory, the GIL);
- job / collect: the CPU job's run time and the main thread's wait for it;
- phases: the main thread's time per part of a decode step (`EngineStats.phase_seconds`, medians): what is
  not "wait" (for the sampled ids) is host time between two graphs, on the step's critical path;
- with --trace N: a torch.profiler trace of N steps after the window, its top GPU kernels and host ops per step.

    python benchmarks/stagger_profile.py --layers 32 --width 4
"""
import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import steady_state  # noqa: E402
from e2e_throughput import SHAPES, kv_bytes_per_token, random_llama, write_json  # noqa: E402

from apex_compile import ApexConfig, SamplingParams, optimize  # noqa: E402
from apex_compile.runtime import stagger as stagger_module  # noqa: E402


def graph_seconds(graphs, size: int, repeats: int = 30) -> float:
    """Median GPU time of replaying the graph of `size` (its inputs as they are)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def trace(steps: int, top: int = 40):
    """A probe for steady_state: profiles `steps` engine steps; returns per step the top GPU kernels and host
    ops by time, [(name, microseconds per step, calls per step)] each."""

    def probe(one_step):
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                one_step()
            torch.cuda.synchronize()
        events = prof.key_averages()

        def rows(key):
            ranked = sorted((e for e in events if getattr(e, key) > 0), key=lambda e: -getattr(e, key))[:top]
            return [(e.key[:70], getattr(e, key) / steps, e.count / steps) for e in ranked]

        device_key = next(k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(events[0], k))
        return {"gpu": rows(device_key), "host": rows("self_cpu_time_total")}

    return probe


def run_isolated(args, modes):
    """Runs each mode in a child process of this script (same arguments) and merges their JSON."""
    result = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"stopped by SIGTERM during {modes}"))
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out = os.path.join(tmp, f"{mode}.json")
            argv = [sys.executable, os.path.abspath(__file__), "--modes", mode, "--out", out]
            for key, value in vars(args).items():
                if key not in ("modes", "out", "one_process") and value is not None:
                    argv += [f"--{key.replace('_', '-')}", str(value)]
            child = subprocess.Popen(argv)
            try:
                code = child.wait()
            finally:  # a parent stopped (a timeout's SIGTERM) takes its child with it
                if child.poll() is None:
                    child.kill()
            if code or not os.path.exists(out):
                print(f"{mode}: the child process failed (exit code {code})", flush=True)
                continue
            with open(out) as f:
                child = json.load(f)
            if result is None:
                result = dict(child, args=vars(args))
            else:
                result["modes"].update(child["modes"])
    if result is not None:
        write_json(args.out, result)


def timed(cls, name, store):
    """Wraps cls.name to append its wall seconds to `store`."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            store.append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--device-requests", type=int, default=12)
    parser.add_argument("--host-gib", type=float, default=40)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--window-steps", type=int, default=60)
    parser.add_argument("--cpu-threads", type=int, default=None, help="cpu_attention_threads (default: all but one)")
    parser.add_argument("--modes", default="never,staggered,staggered-no-job")
    parser.add_argument("--trace", type=int, default=0, help="profile this many steps after the window")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one-process", action="store_true",
                        help="run every mode in this process (default: one child process per mode, so that no "
                             "mode inherits another's pinned pool, caches or threads)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stagger_profile.py needs a CUDA GPU")
    modes = args.modes.split(",")
    if len(modes) > 1 and not args.one_process:
        return run_isolated(args, modes)
    shape = dict(SHAPES["llama3_8b"], num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = random_llama(shape)
    per_request = (args.prompt + args.new_tokens + 16) * kv_bytes_per_token(shape)
    prompts = torch.randint(3, shape["vocab_size"], (64, args.prompt)).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens)
    host = {"begin": [], "end": []}
    timed(stagger_module.StaggerPipeline, "begin_step", host["begin"])
    timed(stagger_module.StaggerPipeline, "end_step", host["end"])
    launch = stagger_module.AsyncJobs.launch
    result = {"benchmark": "stagger_profile", "args": vars(args), "gpu": torch.cuda.get_device_name(), "modes": {}}
    for mode in args.modes.split(","):
        if mode not in ("never", "staggered", "staggered-no-job"):
            sys.exit(f"unknown mode {mode!r}: never, staggered, staggered-no-job")
        if mode == "staggered-no-job":  # the job is dropped: collect then hands out zeros
            stagger_module.AsyncJobs.launch = lambda self, key, job, inputs, output: launch(self, key, None, inputs,
                                                                                              output)
        config = ApexConfig(offload="never" if mode == "never" else "staggered", stagger_width=args.width,
                            cpu_attention_threads=args.cpu_threads,
                            gpu_cache_size=args.device_requests * per_request,
                            cpu_cache_size=int(args.host_gib * 2**30),
                            max_num_seqs=64, max_num_batched_tokens=2048,
                            max_model_len=args.prompt + args.new_tokens + 64)
        begin = time.perf_counter()
        apex = optimize(model, config)
        engine = apex.engine
        engine.warmup()
        print(f"{mode}: warm-up done at {time.perf_counter() - begin:.0f} s", flush=True)
        for store in host.values():
            store.clear()
        window = {}

        def probe(one_step, engine=engine):  # the window's host timings kept before the traced steps add theirs
            window.update({k: list(v) for k, v in host.items()})
            jobs = getattr(engine.stagger, "executor", None)
            window["job"] = list(getattr(jobs, "job_seconds", []))
            window["collect"] = list(getattr(jobs, "collect_seconds", []))
            return trace(args.trace)(one_step) if args.trace else None

        run = steady_state(engine, prompts, sampling, 20, args.window_steps, fill_steps=600, probe=probe)
        print(f"{mode}: {run['fill_steps']} fill steps in {run['fill_s']:.1f} s, window done at "
              f"{time.perf_counter() - begin:.0f} s", flush=True)
        decode = [s[3] for s in run["steps"] if not s[4]]
        row = {"tokens_per_s": run["tokens_per_s"], "step_s": statistics.median(decode) if decode else None,
               "fill_steps": run["fill_steps"], "decode_steps": len(decode)}
        rows = round(statistics.median(s[0] for s in run["steps"]))
        if mode == "never":
            size = engine.graphs.size_for(rows)
            row["gpu_s"] = graph_seconds(engine.graphs, size)
        else:
            size = engine.stagger_graphs.size_for(rows)
            row["gpu_s"] = graph_seconds(engine.stagger_graphs, size)
            steps = max(len(run["steps"]), 1)
            row["host_begin_s"] = sum(window["begin"][-steps:]) / steps
            row["host_end_s"] = sum(window["end"][-steps:]) / steps
            if window["job"]:
                row["job_s"] = statistics.median(r for _, r in window["job"][-steps:])
            if window["collect"]:
                row["collect_s"] = statistics.median(window["collect"][-steps:])
        row["graph_size"] = size
        if run["decode_phase_s"]:  # median per part of a decode step: where its wall time goes on the main thread
            row["phase_s"] = run["decode_phase_s"]
        engine.abort()
        result["modes"][mode] = row
        if run["probe"]:
            row["trace"] = run["probe"]
            for side, ranked in run["probe"].items():
                print(f"  {mode} top {side} per step: " + "; ".join(f"{n} {us:.0f} us x{c:g}"
                                                                   for n, us, c in ranked[:12]))
        print(f"{mode:17}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" if k.endswith("_s") and isinstance(v, float)
                                         else f"{k} {v}" for k, v in row.items()
                                         if k not in ("tokens_per_s", "phase_s", "trace"))
              + f", {row['tokens_per_s']:.0f} tokens/s ({time.perf_counter() - begin:.0f} s)", flush=True)
        if "phase_s" in row:
            print(f"  {mode} decode step, main thread: " + ", ".join(f"{k} {v * 1e3:.3f} ms"
                                                                     for k, v in row["phase_s"].items()), flush=True)
        apex.close()  # its pools and threads go now, not at a later garbage collection
        del apex, engine
        gc.collect()  # the engine's cycles hold its pools: the next mode's pinned host pool would come on top
        torch.cuda.empty_cache()
    stagger_module.AsyncJobs.launch = launch
    write_json(args.out, result)


if __name__ == "__main__":
    main()
