"""Where a step's time goes, on the path e2e_hybrid measures: the launching thread's Python functions (cProfile)
and the GPU's busy share of each step (torch profiler), decode-only and mixed (prompt chunk) steps apart.

The engine runs at steady state as in e2e_hybrid (kept supplied with requests, 2048-token step budget and its
prompt cap); then --profile-steps steps run under cProfile, one profile per step, merged per kind; then
--trace-steps steps under the torch profiler, each step's window [its start, the next step's start] giving
the union of its GPU kernels' and copies' intervals (busy) against its wall time.

    python benchmarks/step_profile.py --mode never --device-gib 2 --out-dir /tmp/out
"""
import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import GiB, hybrid_config, steady_state  # noqa: E402
from e2e_throughput import SHAPES, random_llama  # noqa: E402

from apex_compile import SamplingParams, optimize  # noqa: E402


def gpu_busy(trace_path: str, names):
    """{step name: (wall us, GPU busy us, {kernel name: GPU us})} from a chrome trace: per user annotation in
    `names`, the GPU intervals (kernels, copies) from its start to the next one's start (the last: to its end)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("name") in names)
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"][:80]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    result = {}
    for i, (begin, end, name) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else end
        busy, cursor, kernels = 0.0, begin, collections.Counter()
        for s, e, kernel in gpu:
            if e <= begin or s >= stop:
                continue
            kernels[kernel] += min(e, stop) - max(s, begin)
            s, e = max(s, cursor), min(e, stop)
            if e > s:
                busy += e - s
                cursor = e
        result[name] = (stop - begin, busy, kernels)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b")
    parser.add_argument("--device-gib", type=float, default=2)
    parser.add_argument("--host-gib", type=float, default=32)
    parser.add_argument("--mode", default="never")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-while-decoding", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=150)
    parser.add_argument("--fill-steps", type=int, default=1500)
    parser.add_argument("--profile-steps", type=int, default=120)
    parser.add_argument("--trace-steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    model = random_llama(shape)
    apex = optimize(model, hybrid_config(args.mode, int(args.device_gib * GiB), int(args.host_gib * GiB), 64,
                                         args.prompt + args.new_tokens, args.prefill_while_decoding,
                                         prompt_len=args.prompt))
    engine = apex.engine
    engine.warmup()
    prompts = torch.randint(3, shape["vocab_size"], (64, args.prompt)).tolist()
    tag = f"{args.shape}_{args.device_gib:g}gib_{args.mode.replace(':', '-')}"

    def probe(one_step):
        profiles = {"decode": [], "mixed": []}
        walls = {"decode": [], "mixed": []}
        for _ in range(args.profile_steps):
            profile = cProfile.Profile()
            profile.enable()
            step = one_step()
            profile.disable()
            kind = "mixed" if step[4] else "decode"
            profiles[kind].append(profile)
            walls[kind].append(step[3])
        for kind, group in profiles.items():
            if not group:
                continue
            stats = pstats.Stats(group[0])
            for p in group[1:]:
                stats.add(p)
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                stats.stream = text
                stats.sort_stats(order).print_stats(args.top)
                print(f"== {tag} {kind} steps: {len(group)}, median wall under cProfile "
                      f"{statistics.median(walls[kind]) * 1e3:.2f} ms; by {order} (seconds over all {len(group)})")
                print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
        kinds = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(args.trace_steps):
                with torch.profiler.record_function(f"apex_step_{i}"):
                    step = one_step()
                kinds.append("mixed" if step[4] else "decode")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        path = os.path.join(args.out_dir, f"trace_{tag}.json")
        prof.export_chrome_trace(path)
        busy = gpu_busy(path, {f"apex_step_{i}" for i in range(args.trace_steps)})
        for kind in ("decode", "mixed"):
            rows = [busy[f"apex_step_{i}"] for i, k in enumerate(kinds) if k == kind and f"apex_step_{i}" in busy]
            if not rows:
                continue
            print(f"== {tag} {kind} steps under the torch profiler: {len(rows)}; median wall "
                  f"{statistics.median(r[0] for r in rows) / 1e3:.2f} ms, GPU busy "
                  f"{statistics.median(r[1] for r in rows) / 1e3:.2f} ms "
                  f"({statistics.median(r[1] / r[0] for r in rows):.0%}); GPU ms per step by kernel:")
            kernels = sum((r[2] for r in rows), collections.Counter())
            for kernel, total in kernels.most_common(args.top // 2):
                print(f"==   {total / 1e3 / len(rows):8.3f}  {kernel}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        os.remove(path)  # large; the numbers above are what is kept

    run = steady_state(engine, prompts, SamplingParams(max_new_tokens=args.new_tokens), args.warm_steps, 50,
                       args.fill_steps, probe=probe)
    print(f"== {tag}: the 50 steps before the profile ran at {run['tokens_per_s']:.0f} tokens/s (too few steps for a "
          f"throughput: e2e_hybrid's window is that)")
    apex.close()


if __name__ == "__main__":
    main()
