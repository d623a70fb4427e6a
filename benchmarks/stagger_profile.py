"""Where a staggered decode step's time goes on one CUDA GPU: never vs the staggered plan at steady state on a
LLaMA-3-8B-shaped model cut to a few layers (compiles in seconds), then a torch profile of staggered steps
(host time per op) and the main thread's waits for CPU jobs.

    python benchmarks/stagger_profile.py --layers 8 --width 4
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_hybrid import steady_state  # noqa: E402
from e2e_throughput import SHAPES, kv_bytes_per_token, random_llama  # noqa: E402

from apex_compile import ApexConfig, SamplingParams, optimize  # noqa: E402
from apex_compile.runtime import stagger as stagger_module  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--device-requests", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    shape = dict(SHAPES["llama3_8b"], num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = random_llama(shape)
    per_request = (args.prompt + args.new_tokens + 16) * kv_bytes_per_token(shape)
    prompts = torch.randint(3, shape["vocab_size"], (64, args.prompt)).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens)
    waits = []
    collect = stagger_module.AsyncJobs.collect

    def timed_collect(self, key, out):
        start = time.perf_counter()
        collect(self, key, out)
        waits.append(time.perf_counter() - start)

    stagger_module.AsyncJobs.collect = timed_collect
    for mode in ("never", "staggered"):
        config = ApexConfig(offload=mode, stagger_width=args.width, gpu_cache_size=args.device_requests * per_request,
                            cpu_cache_size=8 << 30, max_num_seqs=64, max_num_batched_tokens=2048,
                            max_model_len=args.prompt + args.new_tokens + 64)
        start = time.perf_counter()
        apex = optimize(model, config)
        engine = apex.engine
        engine.warmup()
        waits.clear()
        run = steady_state(engine, prompts, sampling, 60, 60, fill_steps=400)
        tokens_per_s, steps = run["tokens_per_s"], run["steps"]
        decode = sorted(s[3] * 1e3 for s in steps)
        print(f"{mode}: {tokens_per_s:.0f} tokens/s, step median {statistics.median(decode):.2f} ms, p10 "
              f"{decode[len(decode) // 10]:.2f} ms ({time.perf_counter() - start:.0f} s incl. compile)", flush=True)
        if mode == "staggered":
            waits[:] = waits[-len(steps):]
            per_step = sum(waits) / max(len(steps), 1)
            print(f"  collect calls {len(waits)}: {per_step * 1e3:.2f} ms per step in collect (max one "
                  f"{max(waits) * 1e3:.2f} ms)", flush=True)
            for p in prompts[:40]:
                engine.add_request(p, sampling)
            for _ in range(60):
                engine.step()  # back to a pipeline in flight
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
        engine.abort()
        del apex, engine


if __name__ == "__main__":
    main()
