"""The device pool's parks and resumes under the real Scheduler, and the tokens/s they cost under a step-time model.

e2e_hybrid's workload (512-token prompts, a fixed max_new_tokens, the engine kept supplied with requests) runs
through `Scheduler` alone (no model; the KV pools hold one tiny layer, only their block counts matter) over a
Llama-3-8B-sized device pool, for each `ApexConfig.growth_reserve`. Each step's time is modelled from what an
H200 measured (session 45, `benchmarks/results/e2e_2026-12-05_h200_s45.txt`, never at 2 GiB): a decode step of
4.6 ms + 0.042 ms a row, 24.7 us a prompt token; and what a park or a resume added to its step over the median
(--park-ms, --resume-ms): by default as an H100 measured them in session 47 (never at 2 and 4 GiB: a park ~0, a
resume ~5.7 ms), once the host pool's copies ran asynchronously again; session 45's runs, whose copies blocked
the launching thread, measured a park ~10 ms and a resume ~7 ms.
Moves here are synchronous (no GPU): parks happen when a request needs the block, not a step ahead. A model, not
a measurement: it ranks the reserves; e2e_hybrid's "/reserve=X" measures them.

    python benchmarks/park_churn.py --device-gib 1,2,4 --reserves 0,0.1,0.15,0.2,0.3
"""
import argparse
import collections

import torch

from apex_compile.config import ApexConfig
from apex_compile.runtime.kv_manager import CacheShape, KVManager
from apex_compile.runtime.request import Request, SamplingParams
from apex_compile.runtime.scheduler import Scheduler

KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16: K and V of 32 layers x 8 KV heads x 128


def simulate(device_tokens, reserve, prompt=512, new_tokens=512, steps=2324, window_start=1300, max_seqs=64,
             prefill_cap=256, step_budget=2048, base_s=4.6e-3, row_s=0.042e-3, prompt_token_s=24.7e-6,
             park_s=0.0, resume_s=5.7e-3):
    """{tokens_per_s, parks, resumes, prompt_steps, mean_rows, mean_step_ms} over steps window_start..steps-1."""
    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    kv = KVManager(shape, device_tokens // 16, 64 * (prompt + new_tokens) // 16 * 4, torch.device("cpu"))
    config = ApexConfig(offload="never", max_num_seqs=max_seqs, max_num_batched_tokens=step_budget,
                        prefill_tokens_while_decoding=prefill_cap, max_model_len=prompt + new_tokens + 64,
                        growth_reserve=reserve)
    scheduler = Scheduler(config, kv)
    counts, seconds, rows, next_id = collections.Counter(), 0.0, 0, 0
    for step in range(steps):
        while len(scheduler.waiting) < 8:
            scheduler.add(Request(next_id, [1] * prompt, SamplingParams(max_new_tokens=new_tokens)))
            next_id += 1
        plan = scheduler.schedule()
        decoding = sum(1 for c in plan.chunks if c.decodes)
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if not c.decodes)
        generated = 0
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
            if chunk.samples:
                chunk.request.output_token_ids.append(2)
                generated += 1
                if len(chunk.request.output_token_ids) == new_tokens:
                    scheduler.finish(chunk.request, "length")
        if step >= window_start:
            seconds += (base_s + row_s * decoding + prompt_token_s * prompt_tokens + park_s * len(plan.parked)
                        + resume_s * len(plan.resumed))
            counts.update(tokens=generated, parks=len(plan.parked), resumes=len(plan.resumed),
                          prompt_steps=prompt_tokens > 0)
            rows += decoding
    window = steps - window_start
    return {"tokens_per_s": counts["tokens"] / seconds, "parks": counts["parks"], "resumes": counts["resumes"],
            "prompt_steps": counts["prompt_steps"], "mean_rows": rows / window, "mean_step_ms": seconds / window * 1e3}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-gib", default="1,2,4")
    parser.add_argument("--reserves", default="0,0.1,0.15,0.2,0.3")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2324, help="steps in all; the last 1024 are the window")
    parser.add_argument("--park-ms", type=float, default=0.0, help="a park's time above the median step")
    parser.add_argument("--resume-ms", type=float, default=5.7, help="a resume's time above the median step")
    args = parser.parse_args(argv)
    print(f"{'pool GiB':>8} {'reserve':>7} | {'tokens/s':>8} {'parks':>5} {'resumes':>7} {'prompt steps':>12} "
          f"{'rows':>5} {'step ms':>7}")
    for gib in (float(g) for g in args.device_gib.split(",")):
        device_tokens = int(gib * 2 ** 30) // KV_BYTES_PER_TOKEN
        base = None
        for reserve in (float(r) for r in args.reserves.split(",")):
            r = simulate(device_tokens, reserve, args.prompt, args.new_tokens, args.steps,
                         window_start=max(args.steps - 1024, 0), park_s=args.park_ms * 1e-3,
                         resume_s=args.resume_ms * 1e-3)
            base = base or r["tokens_per_s"]
            print(f"{gib:8g} {reserve:7.2f} | {r['tokens_per_s']:8.0f} {r['parks']:5d} {r['resumes']:7d} "
                  f"{r['prompt_steps']:12d} {r['mean_rows']:5.1f} {r['mean_step_ms']:7.2f}"
                  f"  ({r['tokens_per_s'] / base:.3f}x the first)", flush=True)


if __name__ == "__main__":
    main()
