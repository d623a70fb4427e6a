"""The GPU kernels of a captured decode step by batch size: what a whole-step CUDA graph (GPU-only, and the
staggered plan's, quiet: its waits satisfied) spends per kernel, replayed on the inputs its capture held.

Prints each size's kernel time per replay by kernel name and the difference between two sizes, to find what
grows with the rows (e.g. the step from 16 to 24 rows). `--copy-mb N` also times each graph with an N MB
device-to-host and host-to-device copy (pinned, on a side stream) issued beside each replay: what a park's or a
resume's block copy does to a step (the staggered step's per-layer exchange reads and writes host memory over
the same link).

    python benchmarks/graph_kernels.py --shape llama3_8b --sizes 8,16,24 --out /tmp/out/graph_kernels.json
"""
import argparse
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import GiB, hybrid_config  # noqa: E402
from e2e_throughput import SHAPES, random_llama  # noqa: E402

from apex_compile import optimize  # noqa: E402


def kernels_per_replay(replay, replays: int) -> dict:
    """{kernel name: us per replay} of `replay()` over `replays` runs under the torch profiler."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / replays if hasattr(event, "device_time") else \
                event.cuda_time / replays
    return dict(totals)


def wall_us(replay, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def wall_with_copy_us(replay, replays: int, dst: torch.Tensor, src: torch.Tensor) -> float:
    """wall_us of `replay` with dst.copy_(src) issued on a side stream just before each replay."""
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def both():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        replay()
        main.wait_stream(side)
    return wall_us(both, replays)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b")
    parser.add_argument("--sizes", default="8,16,24")
    parser.add_argument("--device-gib", type=float, default=1)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--copy-mb", type=int, default=0, help="also time each graph beside a copy of this size")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = random_llama(SHAPES[args.shape])
    config = hybrid_config("staggered:8", int(args.device_gib * GiB), 4 * GiB, 64, 1024 + 64, 256)
    apex = optimize(model, config)
    engine = apex.engine
    engine.warmup()
    result = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "graphs": {}}
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {}
    for size in sizes:
        if size in engine.graphs.graphs:
            runs[f"gpu-only {size}"] = lambda size=size: engine.graphs.replay(size)
    for size in sizes:
        if engine.stagger_graphs is not None and size in engine.stagger_graphs.graphs:
            runs[f"staggered {size}+{engine.stagger.width}"] = lambda size=size: engine.stagger_graphs.replay(size)
    copies = {}
    if args.copy_mb:
        count = args.copy_mb << 19  # bf16 elements
        device_buffer = torch.empty(count, dtype=torch.bfloat16, device="cuda")
        host_buffer = torch.empty(count, dtype=torch.bfloat16, pin_memory=True)
        copies = {"device-to-host": (host_buffer, device_buffer), "host-to-device": (device_buffer, host_buffer)}
    with engine.plan.quiet():
        for name, replay in runs.items():
            kernels = kernels_per_replay(replay, args.replays)
            result["graphs"][name] = {"wall_us": wall_us(replay, args.replays), "kernels_us": kernels,
                                      "kernel_sum_us": sum(kernels.values())}
            print(f"== {name}: {result['graphs'][name]['wall_us']:.0f} us a replay, kernels "
                  f"{result['graphs'][name]['kernel_sum_us']:.0f} us", flush=True)
            for kernel, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"   {us:8.1f}  {kernel}", flush=True)
            if copies:
                entry = result["graphs"][name]
                for direction, (dst, src) in copies.items():
                    entry[f"wall_with_{direction}_us"] = wall_with_copy_us(replay, args.replays, dst, src)
                    print(f"   with a {args.copy_mb} MB {direction} copy beside it: "
                          f"{entry[f'wall_with_{direction}_us']:.0f} us a replay", flush=True)
    names = list(result["graphs"])
    for a, b in zip(names, names[1:]):
        ka, kb = result["graphs"][a]["kernels_us"], result["graphs"][b]["kernels_us"]
        diff = {k: kb.get(k, 0.0) - ka.get(k, 0.0) for k in set(ka) | set(kb)}
        print(f"== {b} minus {a}: wall {result['graphs'][b]['wall_us'] - result['graphs'][a]['wall_us']:+.0f} us, "
              f"kernels {sum(diff.values()):+.0f} us", flush=True)
        for kernel, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]:
            print(f"   {us:+8.1f}  {kernel}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    apex.engine.close()


if __name__ == "__main__":
    main()
