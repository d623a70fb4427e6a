"""How many runs of host block ids a swap move crosses in (one copy per run and cache, `kv_layout._copy_across`)
under the real scheduler and allocator: e2e_hybrid's workload for offload="never" (the waiting queue kept at 8
requests, --prompt-token prompts, --new-tokens each, the device pool's prompt cap beside decoding), replayed
as bookkeeping only: no model, a one-layer cache of the same block counts, each scheduled chunk computed and
a token appended. Prints the moves after --window-from steps (the e2e window's start) and their runs.

    python benchmarks/swap_runs.py --device-blocks 512 --host-blocks 16384 --steps 2500
(512 device blocks of 16 tokens: 1 GiB of Llama-3-8B KV; 16384: a 32 GiB host pool)
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from apex_compile.config import ApexConfig  # noqa: E402
from apex_compile.runtime.kv_manager import HOST_POOL, CacheShape, KVManager  # noqa: E402
from apex_compile.runtime.request import Request, SamplingParams  # noqa: E402
from apex_compile.runtime.scheduler import Scheduler  # noqa: E402
from kv_move import host_runs  # noqa: E402


def simulate(device_blocks, host_blocks, steps, prompt, new_tokens, window_from):
    shape = CacheShape(1, 1, 16, 16, torch.float32)
    kv = KVManager(shape, device_blocks, host_blocks, torch.device("cpu"))
    config = ApexConfig(offload="never", max_num_seqs=64, max_num_batched_tokens=2048,
                        prefill_tokens_while_decoding=256, gpu_cache_size=device_blocks * shape.block_bytes,
                        cpu_cache_size=host_blocks * shape.block_bytes)
    scheduler = Scheduler(config, kv, prompt + new_tokens)
    moves, step = [], 0
    move = kv.move

    def recording_move(request_id, dst, hold=False):
        source = kv.tables[request_id].block_ids
        move(request_id, dst, hold)
        host = kv.tables[request_id].block_ids if dst == HOST_POOL else source
        moves.append({"step": step, "to": "host" if dst == HOST_POOL else "device", "blocks": len(host),
                      "runs": host_runs(host)})

    kv.move = recording_move
    sampling = SamplingParams(max_new_tokens=new_tokens)
    next_id = 0
    for step in range(steps):
        while len(scheduler.waiting) < 8:
            scheduler.add(Request(next_id, [5] * prompt, sampling))
            next_id += 1
        for chunk in scheduler.schedule().chunks:
            request = chunk.request
            request.num_computed += chunk.num_tokens
            if request.num_computed == request.num_tokens:
                request.output_token_ids.append(7)
                if len(request.output_token_ids) >= new_tokens:
                    scheduler.finish(request, "length")
    kv.close()
    window = [m for m in moves if m["step"] >= window_from]
    summary = {}
    for to in ("host", "device"):
        runs = [m["runs"] for m in window if m["to"] == to]
        if runs:
            summary[to] = {"moves": len(runs), "runs_median": statistics.median(runs), "runs_max": max(runs),
                           "blocks_median": statistics.median(m["blocks"] for m in window if m["to"] == to)}
    return {"moves": len(moves), "window_moves": len(window), "per_300_steps": 300 * len(window) /
            max(steps - window_from, 1), "summary": summary}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-blocks", type=int, default=512)
    parser.add_argument("--host-blocks", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--window-from", type=int, default=1600)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = simulate(args.device_blocks, args.host_blocks, args.steps, args.prompt, args.new_tokens,
                      args.window_from)
    print(f"{result['moves']} moves, {result['window_moves']} from step {args.window_from} "
          f"({result['per_300_steps']:.1f} per 300 steps)")
    for to, row in result["summary"].items():
        print(f"  to the {to} pool: {row['moves']} moves of {row['blocks_median']} blocks (median), host-id runs "
              f"median {row['runs_median']}, max {row['runs_max']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "swap_runs", "args": vars(args), **result}, f, indent=2)


if __name__ == "__main__":
    main()
