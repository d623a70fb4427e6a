"""The one-lane staggered plan's per-layer exchange on a GPU, by part: what each variant of moving the block's
rows between the device and pinned host memory costs inside a CUDA graph of every layer (32 by default).

Variants (per layer, in one graph): the two-lane exchange between device buffers; the waiting exchange reading
and writing pinned host buffers directly (zero-copy) with its flag raise; the same kernel on device buffers (the
wait and the flags alone); the flag raise alone; DMA copies of the layer's rows (staged out, outputs in) with the
device exchange; and the waiting kernel on device buffers plus those copies. Flags are already satisfied (no
wait): this is the exchange's own cost. (Session 22's first version polled the host flag from every program of
the exchange: 409 us per layer at width 8, one ~1 us host read per program, one after another.) Prints microseconds per layer, median of --reps replays.

    python benchmarks/stagger_exchange.py [--width 8] [--layers 32]
"""
import argparse
import json
import statistics

import torch

from apex_compile.kernels import stagger as ks


def timed_graph(fn, reps):
    """Median seconds of one replay of fn's captured graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w, h, kv, d, layers = args.width, args.heads, args.kv_heads, args.head_dim, args.layers
    heads = h + 2 * kv
    qkv = torch.randn(w + 4, heads * d, device=dev, dtype=dtype)
    q, k, v = qkv[:w].view(w, heads, d).split([h, kv, kv], dim=1)
    out = torch.empty(w + 4, h, d, device=dev, dtype=dtype)
    staged_dev = torch.zeros(layers, w, heads, d, device=dev, dtype=dtype)
    outputs_dev = torch.zeros(layers, w, h, d, device=dev, dtype=dtype)
    staged_host = torch.zeros(layers, w, heads, d, dtype=dtype, pin_memory=True)
    outputs_host = torch.zeros(layers, w, h, d, dtype=dtype, pin_memory=True)
    flags = torch.zeros(4 * layers, dtype=torch.int64, pin_memory=True)
    done, ready, stalls, status = flags[:layers], flags[layers:2 * layers], flags[2 * layers:3 * layers], flags[-1:]
    dev_flags = torch.zeros(4 * layers, dtype=torch.int64, device=dev)
    after = torch.zeros(1, dtype=torch.int64, device=dev)
    turn = torch.ones(1, dtype=torch.int64, device=dev)

    def waiting_kernel(staged, arriving, done_flag, stall, status_):
        ks._wait_flag_kernel[(1,)](done_flag, after, status_, stall, 10**9, TIMED=True, num_warps=1)
        ks._launch_exchange(q, k, v, staged, arriving, out[:w], host=False)

    variants = {
        "device exchange (two-lane)": lambda: [ks.exchange_rows(q, k, v, staged_dev[l], outputs_dev[l], out[:w])
                                               for l in range(layers)],
        "waiting exchange, host buffers, + raise": lambda: [
            (ks.exchange_rows_waiting(q, k, v, staged_host[l], outputs_host[l], out[:w], done[l:l + 1], after,
                                      status, stalls[l:l + 1]), ks.raise_flag(ready[l:l + 1], turn))
            for l in range(layers)],
        "waiting exchange, host buffers, no raise": lambda: [
            ks.exchange_rows_waiting(q, k, v, staged_host[l], outputs_host[l], out[:w], done[l:l + 1], after,
                                     status, stalls[l:l + 1]) for l in range(layers)],
        "waiting kernel, device buffers, host flags": lambda: [
            waiting_kernel(staged_dev[l], outputs_dev[l], done[l:l + 1], stalls[l:l + 1], status)
            for l in range(layers)],
        "waiting kernel, device buffers, device flags": lambda: [
            waiting_kernel(staged_dev[l], outputs_dev[l], dev_flags[l:l + 1], dev_flags[layers + l:layers + l + 1],
                           dev_flags[-1:]) for l in range(layers)],
        "raise_flag alone": lambda: [ks.raise_flag(ready[l:l + 1], turn) for l in range(layers)],
        "device exchange + DMA copies (out, in)": lambda: [
            (ks.exchange_rows(q, k, v, staged_dev[l], outputs_dev[l], out[:w]),
             staged_host[l].copy_(staged_dev[l], non_blocking=True),
             outputs_dev[l].copy_(outputs_host[l], non_blocking=True)) for l in range(layers)],
        "waiting kernel (device bufs, host flags) + DMA copies + raise": lambda: [
            (outputs_dev[l].copy_(outputs_host[l], non_blocking=True),
             waiting_kernel(staged_dev[l], outputs_dev[l], done[l:l + 1], stalls[l:l + 1], status),
             staged_host[l].copy_(staged_dev[l], non_blocking=True), ks.raise_flag(ready[l:l + 1], turn))
            for l in range(layers)],
    }
    result = {"width": w, "layers": layers, "us_per_layer": {}}
    for name, fn in variants.items():
        try:
            seconds = timed_graph(fn, args.reps)
            result["us_per_layer"][name] = seconds / layers * 1e6
            print(f"{name:62s} {seconds / layers * 1e6:8.1f} us per layer ({seconds * 1e3:.3f} ms per step)",
                  flush=True)
        except Exception as error:  # noqa: BLE001 (a variant that cannot run is reported, the others go on)
            result["us_per_layer"][name] = None
            print(f"{name:62s} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
