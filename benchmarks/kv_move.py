"""Swap preemption's block moves alone: one request's KV moved device -> host (a park) and back (a resume) with
`KVManager.move` then `sync_moves` (the host waits for the copy, as every move did before overlapped moves),
timed to the host's return; and `move` alone (issue ms: a move must not block the launching thread, which it
does once the host pool reads as unpinned and the copy runs synchronously).

Why: in the e2e windows every step above 7 ms coincided with a park or a resume, each costing 10-34 ms
(notes/DECISIONS.md, record 21) where the copy's bytes alone take ~2 ms over PCIe. This separates the move from
the rest of such a step. Variants:
  contiguous  the request's host blocks are one run of ids (a fresh host pool);
  scattered   every other host block is held by another request, so each block is a run of its own (a pool
              after long churn): the host side issues one copy per run and cache;
  busy        contiguous, with --busy-ms of GPU work queued first (the swap stream waits for the compute
              stream, as for a step already queued when the scheduler moves a request); its times include
              that work.
Each row: the median park and resume milliseconds over --repeat, the copies issued (runs x caches), and the
bandwidth the park implies. On a CPU (no swap stream) both pools live in host memory: a dry run of the script.

    python benchmarks/kv_move.py --shape llama3_8b --tokens 256,768,2048 --out kv_move.json
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops.kv_layout import id_runs  # noqa: E402
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL, CacheShape, KVManager  # noqa: E402

SHAPES = {  # (layers, KV heads, head dim): the KV-relevant part of benchmarks/e2e_throughput.py's SHAPES
    "llama3_8b": (32, 8, 128),
    "llama2_7b": (32, 32, 128),
    "tiny": (2, 2, 16),
}
VARIANTS = ("contiguous", "scattered", "busy")
GiB = 1 << 30


def host_runs(ids):
    """Runs of consecutive ids (the host side's copies per cache)."""
    return len(id_runs(ids))


def kv_blocks(tokens: int, shape: CacheShape) -> int:
    return -(-tokens // shape.block_size)


def sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond, timed with events (0 on a CPU)."""
    if device.type != "cuda":
        return 0.0
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def busy(cycles_per_ms: float, ms: float) -> None:
    """Queues about `ms` of GPU work on the compute stream (nothing on a CPU)."""
    if cycles_per_ms and ms > 0:
        torch.cuda._sleep(int(ms * cycles_per_ms))


def time_moves(kv: KVManager, request_id: int, repeat: int, busy_ms: float, device: torch.device):
    """(park ms, resume ms, park issue ms, resume issue ms) medians over `repeat` round trips: each move to the
    host's return from `sync_moves` (busy_ms of queued GPU work included), and to its return from `move` alone
    (an asynchronous copy returns at once, a blocking one after the queued work and its copy)."""
    cycles_per_ms = sleep_cycles_per_ms(device) if busy_ms > 0 else 0.0
    park, resume, park_issue, resume_issue = [], [], [], []
    for _ in range(repeat):
        for dst, out, issue in ((HOST_POOL, park, park_issue), (DEVICE_POOL, resume, resume_issue)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            busy(cycles_per_ms, busy_ms)
            start = time.perf_counter()
            kv.move(request_id, dst)
            issue.append((time.perf_counter() - start) * 1e3)
            kv.sync_moves()
            out.append((time.perf_counter() - start) * 1e3)
    return tuple(statistics.median(x) for x in (park, resume, park_issue, resume_issue))


def run_variant(variant: str, shape: CacheShape, tokens: int, host_blocks: int, repeat: int, busy_ms: float,
                device: torch.device) -> dict:
    kv = KVManager(shape, kv_blocks(tokens, shape) + 1, host_blocks, device)
    try:
        allocator = kv.pools[HOST_POOL].allocator
        if variant == "scattered":  # every other host block held: the request's host ids alternate
            held = allocator.allocate(allocator.num_free)
            allocator.free(held[::2])
        if not kv.grow(0, DEVICE_POOL, tokens):
            raise RuntimeError("the device pool cannot hold the request")
        blocks = len(kv.tables[0].block_ids)
        kv.move(0, HOST_POOL)
        runs = host_runs(kv.tables[0].block_ids)
        kv.move(0, DEVICE_POOL)
        kv.sync_moves()
        park_ms, resume_ms, park_issue_ms, resume_issue_ms = time_moves(
            kv, 0, repeat, busy_ms if variant == "busy" else 0.0, device)
        moved = blocks * shape.block_bytes
        return {"variant": variant, "tokens": tokens, "blocks": blocks, "host_runs": runs,
                "copies": runs * 2 * shape.num_layers, "bytes": moved, "park_ms": park_ms, "resume_ms": resume_ms,
                "park_issue_ms": park_issue_ms, "resume_issue_ms": resume_issue_ms,
                "park_GBps": moved / park_ms / 1e6, "busy_ms": busy_ms if variant == "busy" else 0.0}
    finally:
        kv.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3_8b")
    parser.add_argument("--tokens", default="256,768,2048", help="request lengths, comma-separated")
    parser.add_argument("--host-gib", type=float, default=4.0, help="host pool size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--busy-ms", type=float, default=5.0, help="GPU work queued before a 'busy' move")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    layers, heads, head_dim = SHAPES[args.shape]
    shape = CacheShape(layers, heads, head_dim, args.block_size, torch.bfloat16)
    device = torch.device(args.device)
    host_blocks = max(int(args.host_gib * GiB) // shape.block_bytes, 2)
    rows = []
    print(f"{args.shape} on {device}: a block is {shape.block_bytes} bytes over all layers; host pool "
          f"{host_blocks} blocks")
    print(f"{'variant':>10} {'tokens':>6} {'blocks':>6} {'runs':>5} {'copies':>6} {'park ms':>8} {'resume ms':>9} "
          f"{'park GB/s':>9} {'issue ms (park, resume)':>23}")
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        if 2 * kv_blocks(tokens, shape) > host_blocks:
            parser.error(f"--host-gib too small for {tokens}-token requests scattered over every other block")
        for variant in variants:
            row = run_variant(variant, shape, tokens, host_blocks, args.repeat, args.busy_ms, device)
            rows.append(row)
            print(f"{variant:>10} {tokens:>6} {row['blocks']:>6} {row['host_runs']:>5} {row['copies']:>6} "
                  f"{row['park_ms']:>8.2f} {row['resume_ms']:>9.2f} {row['park_GBps']:>9.1f} "
                  f"{row['park_issue_ms']:>11.2f} {row['resume_issue_ms']:>11.2f}", flush=True)
    if args.out:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        with open(args.out, "w") as f:
            json.dump({"benchmark": "kv_move", "date": datetime.date.today().isoformat(), "machine": machine,
                       "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
