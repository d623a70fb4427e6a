"""Why the staggered CPU job reads KV slower than e2e_hybrid's B_cpu probe: the same op timed from the probe's
setting to the job's, one difference at a time, in one run (rounds interleaved, so all see the same host).

  probe     e2e_hybrid's B_cpu as `cpu_attention_bandwidth` takes it: `paged_attention_cpu` per layer, 8 sequences
            over the whole of a 1 GiB pool's blocks (1024 tokens each), consecutive block ids, every thread;
  wrap4     8 sequences x 4096 tokens over that 1 GiB pool: the ids wrap, each layer re-reads its 32 MB four times
            (from the last-level cache where it holds them; session 37's first run called this case "probe");
  big       8 x 4096 tokens over the engine's host pool size (--pool-gib, page-locked like the engine's): no wrap;
  scatter   + random block ids (a served pool's tables after churn);
  short     + the job's rows: --rows x 32 layers' sequences of --context tokens (one call per layer);
  job       `stagger_layer_job` on those rows (the flow schedule: items claimed across layers), every thread;
  job15     the same on the worker's threads (all cores but the first, pinned as the engine pins them);
  job15/split=a-b-c  "job15" with the attention's work split set to (items_per_thread, min_item_bytes,
            min_thread_bytes) (--splits: whether the items' size is what the short rows lose);
  job_l3    "job" with the same rows every step (its few hundred MB partly still in the last-level cache: session
            37's first run had only this, under the name "job").
"short" and "job" take --variants sets of rows in turn, as the pipeline's groups do, so none re-reads the KV
the step before left in the last-level cache. With --decode SHAPE, "job15" is also timed while the main thread
runs an engine's decode loop (offload "never", a randomly initialised model of that shape: the launcher and the
GPU busy as in a run, no host row), in rounds alternating with the host idle: "job15+decode" against "job15"
tells whether the run around the staggered job slows it; "job15+decode/pin" runs the decode loop with its thread
kept off the worker's cores (`LauncherPin`, the engine's pin_launcher): whether the launcher landing on a worker
core is what slows it.
Each prints GB/s (K+V bytes read / median seconds) and its ratio to "probe".

    python benchmarks/cpu_probe_gap.py --pool-gib 32 --out probe_gap.json
    python benchmarks/cpu_probe_gap.py --pool-gib 32 --decode llama3_8b --out probe_gap.json  # GPU machine
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.ops import allocate_kv_cache_cpu, cpu_attention_work_split, paged_attention_cpu  # noqa: E402
from apex_compile.runtime.stagger import LauncherPin, _pin_worker, worker_cores  # noqa: E402

LAYERS, KV_HEADS, HEADS, DIM, BLOCK = 32, 8, 32, 128, 16  # Llama-3-8B, bf16
BLOCK_BYTES = 2 * KV_HEADS * BLOCK * DIM * 2  # K+V of one block of one layer


def make_pool(gib: float, pin: bool):
    """32 layers' (key, value) caches of `gib` GiB in all, written (an untouched page reads as the zero page)."""
    blocks = max(int(gib * (1 << 30) / (BLOCK_BYTES * LAYERS)), 64)
    caches = [allocate_kv_cache_cpu(blocks, KV_HEADS, BLOCK, DIM, torch.bfloat16) for _ in range(LAYERS)]
    for k, v in caches:
        k.fill_(0.01)
        v.fill_(0.02)
    registration = None
    if pin and torch.cuda.is_available():
        from apex_compile.runtime.kv_manager import HostRegistration

        registration = HostRegistration()
        for k, v in caches:
            registration.register(k)
            registration.register(v)
    return caches, blocks, registration


def tables_for(seqs: int, context: int, blocks: int, scattered: bool, gen) -> torch.Tensor:
    per_seq = -(-context // BLOCK)
    if scattered:
        ids = torch.randperm(blocks, generator=gen)[:seqs * per_seq] if seqs * per_seq <= blocks else \
            torch.randint(0, blocks, (seqs * per_seq,), generator=gen)
    else:
        ids = torch.arange(seqs * per_seq) % blocks
    return ids.to(torch.int32).view(seqs, per_seq)


def per_layer_step(caches, seqs, context, blocks, scattered, gen, variants=1):
    """One call per layer (the probe's way), each layer with its own tables; `variants` sets of tables taken in
    turn, so that a step does not re-read what the step before left in the last-level cache."""
    query = torch.randn(seqs, HEADS, DIM).to(torch.bfloat16)
    sets = [[tables_for(seqs, context, blocks, scattered, gen) for _ in range(LAYERS)] for _ in range(variants)]
    lens = torch.full((seqs,), context, dtype=torch.int32)
    turn = [0]

    def step():
        turn[0] += 1
        for (k, v), t in zip(caches, sets[turn[0] % variants]):
            paged_attention_cpu(query, k, v, t, lens, DIM ** -0.5)
    return step, 2 * LAYERS * seqs * KV_HEADS * DIM * 2 * context


def job_step(caches, rows, context, blocks, gen, width=8, variants=1):
    """`stagger_layer_job` with `rows` rows in each layer of `context` tokens, its flags already raised; `variants`
    sets of rows' tables taken in turn (as the pipeline's groups are: no step re-reads the last one's KV)."""
    picked = torch.tensor([layer * width + r for layer in range(LAYERS) for r in range(rows)], dtype=torch.int64)
    cache_index = (picked // width).to(torch.int32)
    sets = [tables_for(len(picked), context, blocks, True, gen) for _ in range(variants)]
    lens = torch.full((len(picked),), context, dtype=torch.int32)
    slots = [t[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK for t in sets]
    staged = torch.randn(LAYERS, width, HEADS + 2 * KV_HEADS, DIM).to(torch.bfloat16)
    out = torch.zeros(LAYERS, width, HEADS, DIM, dtype=torch.bfloat16)
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    ready = torch.full((LAYERS,), 1 << 40, dtype=torch.int64)
    done = torch.zeros(LAYERS, dtype=torch.int64)
    timings = torch.zeros(2, dtype=torch.float64)
    turn = [0]

    def step():
        turn[0] += 1
        v = turn[0] % variants
        torch.ops.apex.stagger_layer_job(staged, keys, values, cache_index, sets[v], lens, slots[v], picked, HEADS,
                                         DIM ** -0.5, out, ready, done, turn[0], 60.0, timings)
    return step, 2 * LAYERS * rows * KV_HEADS * DIM * 2 * context


TINY = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=1024, max_position_embeddings=2048)  # --decode tiny: a smoke test without a GPU


def decode_engine(shape_name: str, device_gib: float):
    """An engine (offload "never") over a randomly initialised Llama of that shape, and a step function that keeps
    it decoding: 512-token prompts topped up so requests always wait, 512 new tokens each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from apex_compile import ApexConfig, SamplingParams, optimize

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e_throughput import SHAPES

    shape = TINY if shape_name == "tiny" else SHAPES[shape_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    apex = optimize(model, ApexConfig(offload="never", gpu_cache_size=int(device_gib * (1 << 30)),
                                      cpu_cache_size=1 << 30, max_num_seqs=64))
    engine = apex.engine
    engine.warmup()
    prompt = 512 if device == "cuda" else 32
    prompts = torch.randint(3, shape["vocab_size"], (16, prompt)).tolist()
    sampling = SamplingParams(max_new_tokens=512 if device == "cuda" else 16)
    supplied = [0]

    def step():
        while len(engine.scheduler.waiting) < 8:
            engine.add_request(prompts[supplied[0] % len(prompts)], sampling)
            supplied[0] += 1
        engine.step()
    return apex, step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-gib", type=float, default=32.0)
    parser.add_argument("--probe-gib", type=float, default=1.0, help="the pool of e2e_hybrid's probe (its 1 GiB)")
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--context", type=int, default=563)
    parser.add_argument("--variants", type=int, default=16,
                        help="sets of tables the job's cases take in turn (1: the same rows every step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--splits", default="",
                        help="comma-separated work splits 'a-b-c' (items_per_thread-min_item_bytes-min_thread_bytes) "
                             "to time job15 with, each its own case")
    parser.add_argument("--decode", default=None,
                        help="also time job15 beside an engine's decode loop of this shape (llama3_8b, llama2_7b; "
                             "tiny: a smoke test)")
    parser.add_argument("--decode-gib", type=float, default=1.0, help="the decode engine's device KV pool")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    begin = time.perf_counter()
    small, small_blocks, small_reg = make_pool(args.probe_gib, pin=True)
    big, big_blocks, big_reg = make_pool(args.pool_gib, pin=True)
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; pools of {small_blocks} and {big_blocks} "
          f"blocks per layer written and page-locked in {time.perf_counter() - begin:.0f} s", flush=True)
    cores = worker_cores(None)
    worker = concurrent.futures.ThreadPoolExecutor(1, initializer=_pin_worker, initargs=(cores,))
    cases = {
        "probe": per_layer_step(small, 8, min(small_blocks * BLOCK, 32768) // 8, small_blocks, False, gen),
        "wrap4": per_layer_step(small, 8, 4096, small_blocks, False, gen),
        "big": per_layer_step(big, 8, 4096, big_blocks, False, gen),
        "scatter": per_layer_step(big, 8, 4096, big_blocks, True, gen),
        "short": per_layer_step(big, args.rows, args.context, big_blocks, True, gen, args.variants),
        "job": job_step(big, args.rows, args.context, big_blocks, gen, variants=args.variants),
        "job15": job_step(big, args.rows, args.context, big_blocks, gen, variants=args.variants),
        "job_l3": job_step(big, args.rows, args.context, big_blocks, gen),  # the same rows every step
    }
    default_split = list(cpu_attention_work_split().values())
    splits = {}
    for text in filter(None, args.splits.split(",")):
        values = [int(v) for v in text.split("-")]
        if len(values) != 3 or min(values) <= 0:
            parser.error(f"--splits: {text!r} is not three positive integers a-b-c")
        splits[f"job15/split={text}"] = values
        cases[f"job15/split={text}"] = cases["job15"]
    samples = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (step, _) in cases.items():
                run = (lambda f: worker.submit(f).result()) if name.startswith("job15") else (lambda f: f())

                def timed(step=step):
                    out = []
                    step()  # warm
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        step()
                        out.append(time.perf_counter() - t)
                    return out
                cpu_attention_work_split(*splits.get(name, default_split))
                try:
                    samples[name].extend(run(timed))
                finally:
                    cpu_attention_work_split(*default_split)
    if args.decode:
        apex, decode_step = decode_engine(args.decode, args.decode_gib)
        for _ in range(50):  # the engine full and decoding before the first round
            decode_step()
        step, nbytes = cases["job15"]
        arms = ("job15 idle", "job15+decode", "job15+decode/pin")
        for name in arms:
            cases[name] = (step, nbytes)
            samples[name] = []
        pin = LauncherPin(cores)
        steps_beside = 0
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name in arms:
                    def timed(step=step):
                        out = []
                        for _ in range(args.repeats + 1):
                            t = time.perf_counter()
                            step()
                            out.append(time.perf_counter() - t)
                        return out[1:]
                    if name.endswith("/pin"):
                        pin.ensure()
                    try:
                        future = worker.submit(timed)
                        while name != "job15 idle" and not future.done():
                            decode_step()
                            steps_beside += 1
                        samples[name].extend(future.result())
                    finally:
                        pin.release()
        print(f"decode loop beside the job: {args.decode}, {steps_beside} engine steps", flush=True)
        apex.close()
    rates = {name: cases[name][1] / statistics.median(s) / 1e9 for name, s in samples.items()}
    for name, rate in rates.items():
        print(f"{name:12} {rate:6.1f} GB/s  {rate / rates['probe']:.2f} x probe  (median of {len(samples[name])}, "
              f"{cases[name][1] / 1e6:.0f} MB a step)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "cpu_probe_gap", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "args": vars(args), "cpus": os.cpu_count(), "worker_threads": len(cores),
                       "GBps": rates, "samples_s": samples}, f, indent=1)
    worker.shutdown()
    for reg in (small_reg, big_reg):
        if reg is not None:
            reg.close()


if __name__ == "__main__":
    main()
