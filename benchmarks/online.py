"""Online serving, like `vllm bench serve`: requests arrive over time; TTFT, TPOT, ITL, E2E latency, goodput.

Arrivals are a Poisson process at each --rates value (requests/s), or gamma-distributed gaps with --burstiness
(< 1: burstier, 1: Poisson). Each (device pool, rate, mode) runs --num-requests requests to their last token on
one engine, through the engine's asynchronous front (in-process: `AsyncEngine.submit`, tokens timed as the
client receives them), or with --base-url over HTTP against `python -m apex_compile serve` (the server's own
config decides the mode then). Goodput (DistServe) is the requests per second that meet both SLOs, TTFT <=
--slo-ttft and TPOT <= --slo-tpot. "--rates auto" measures the first mode's offline capacity (requests/s of a
batch of --num-requests) and sweeps 0.25x..1.5x of it: light load to past saturation.

    python benchmarks/online.py --shape llama3_8b --device-gib 1 --rates auto --prompt 1024 --output 256
    python benchmarks/online.py --shape smollm2 --device-gib 0.01 --rates 2,4 --num-requests 16 --prompt 32 --output 16
    python benchmarks/online.py --base-url http://127.0.0.1:8000 --rates 1,2 --num-requests 50   # over HTTP
    python benchmarks/online.py --shape llama3_8b --modes never --device-gib 2 --rates 4,inf --http

--http times each (pool, mode, rate) twice, in-process and over HTTP against a server process of its own
(`serve_random.py`: the same shape and config), and reports the server's cost: tokens/s over HTTP against
in-process, and the TTFT it adds. Each engine, in-process or served, first runs a rehearsal (the workload's
first prompts for a few tokens), so that neither carries the process's first compiles into its row.
"""
import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline import engine_config, run_batch  # noqa: E402
from workload import (Lengths, RequestTimes, EnergyMeter, build_model, fmt_ms, machine, parse_range,  # noqa: E402
                      prompts_for, run_to_length, summarize, write_json)

from apex_compile import optimize  # noqa: E402


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request arrives: gamma gaps of mean 1/rate (shape = burstiness;
    1 is a Poisson process)."""
    rng = np.random.default_rng(seed + 2)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def _drive(submit_and_stream, prompts, lengths, arrivals, progress_s=10.0):
    """Submits each request at its arrival time and times its tokens as the client receives them; returns
    (times, failures, start, end)."""
    start = time.perf_counter()
    times = [RequestTimes(0.0) for _ in prompts]
    failures = []
    finished = [0]

    async def one(i):
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        times[i].submitted = time.perf_counter()
        try:
            async for _ in submit_and_stream(prompts[i], lengths[i][1]):
                times[i].token_times.append(time.perf_counter())
        except Exception as error:  # noqa: BLE001 - a refused or failed request is counted, not fatal
            failures.append(f"{type(error).__name__}: {error}")
        finished[0] += 1

    async def report():
        while True:
            await asyncio.sleep(progress_s)
            print(f"    {time.perf_counter() - start:6.0f}s  {finished[0]}/{len(prompts)} requests done", flush=True)

    reporter = asyncio.create_task(report())
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    reporter.cancel()
    return times, failures, start, time.perf_counter()


def in_process(engine):
    """submit_and_stream over the engine's asynchronous front."""
    from apex_compile.runtime.async_engine import AsyncEngine

    front = getattr(engine, "front", None) or AsyncEngine(engine)

    async def submit_and_stream(prompt, output_len):
        stream = front.submit(prompt, run_to_length(output_len))
        async for event in stream:
            yield event

    return submit_and_stream, front


def over_http(base_url: str, model_name: str):
    """submit_and_stream over the OpenAI-compatible /v1/completions endpoint (streamed, token-id prompts)."""
    import httpx

    client = httpx.AsyncClient(base_url=base_url, timeout=None)

    async def submit_and_stream(prompt, output_len):
        body = {"model": model_name, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    yield chunk

    return submit_and_stream, client


def run_rate(model, config, prompts, lengths, rate, args, base_url=None) -> dict:
    """One engine (or the server at `base_url`), one arrival rate: every request timed to its last token."""
    arrivals = arrival_times(len(prompts), rate, args.burstiness, args.seed)
    if base_url:
        submit, client = over_http(base_url, args.served_model)
        times, failures, start, end = asyncio.run(_drive(submit, prompts, lengths, arrivals))
        result = summarize(times, start, end, args.slo_ttft, args.slo_tpot)
        result["failures"] = failures[:10]
        result["failed"] = len(failures)
        return result
    apex = optimize(model, config)
    engine = apex.engine
    try:
        engine.warmup()
        submit, front = in_process(engine)
        with EnergyMeter() as energy:
            times, failures, start, end = asyncio.run(_drive(submit, prompts, lengths, arrivals))
        result = summarize(times, start, end, args.slo_ttft, args.slo_tpot)
        result.update(energy.report(result["output_tokens"]))
        result["failed"] = len(failures)
        result["failures"] = failures[:10]
        result["requests_per_pool"] = dict(zip(("device", "host"), engine.stats.requests_per_pool))
        if hasattr(front, "shutdown"):
            front.shutdown()
        return result
    finally:
        apex.close()
        del apex, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(shape: str, mode: str, pool: float, args, start_timeout_s: float = 900.0):
    """A `serve_random.py` process serving `shape` with this row's engine config; yields its base URL once
    /health answers and the rehearsal ran through it; SIGTERM (drain) at exit."""
    import httpx

    port = free_port()
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_random.py"),
               "--shape", shape, "--mode", mode, "--device-gib", str(pool), "--host-gib", str(args.host_gib),
               "--port", str(port)]
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, flag):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.perf_counter() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode} before it answered")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the server did not answer /health within {start_timeout_s:.0f} s")
            time.sleep(1.0)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def rehearse_http(url: str, model_name: str, prompts, count: int = 64) -> float:
    """The rehearsal over HTTP: the workload's first `count` prompts for 4 tokens each, all at once."""
    submit, client = over_http(url, model_name)

    async def drive():
        async def one(prompt):
            async for _ in submit(prompt, 4):
                pass
        try:
            await asyncio.gather(*(one(p) for p in prompts[:count]))
        finally:
            await client.aclose()

    start = time.perf_counter()
    asyncio.run(drive())
    return time.perf_counter() - start


def plot(result: dict, path: str) -> None:
    """Goodput and p99 TPOT against the arrival rate, one line per (mode, pool)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for row in result["rows"]:
        series.setdefault((row["mode"], row["device_gib"], row.get("transport", "")), []).append(row)
    for (mode, pool, transport), rows in sorted(series.items()):
        rows.sort(key=lambda r: r["rate"])
        label = f"{mode}, {pool} GiB" + (f", {transport}" if transport else "")
        left.plot([r["rate"] for r in rows], [r["goodput_rps"] for r in rows], marker="o", label=label)
        right.plot([r["rate"] for r in rows], [(r["tpot_s"]["p99"] or 0) * 1e3 for r in rows], marker="o",
                   label=label)
    left.set_xlabel("arrival rate (requests/s)")
    left.set_ylabel(f"goodput (requests/s within TTFT {result['slo_ttft_s']} s, TPOT {result['slo_tpot_s'] * 1e3:.0f} ms)")
    right.set_xlabel("arrival rate (requests/s)")
    right.set_ylabel("p99 TPOT (ms)")
    right.axhline(result["slo_tpot_s"] * 1e3, color="grey", linestyle="--", linewidth=1)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"online: {result['model']}, {result['lengths']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def print_row(row: dict) -> None:
    extra = ""
    if row.get("transport") == "http":
        extra = (f"  over HTTP: {row['tokens_per_s_vs_in_process']:.3f}x in-process tok/s, TTFT p50 "
                 f"{row.get('ttft_p50_added_s', float('nan')) * 1e3:+.1f} ms")
    print(f"  {row['device_gib']:>5} GiB  rate {row['rate']:6.2f}/s  {row['mode']:>10}  goodput "
          f"{row['goodput_rps']:6.2f} req/s ({row['good_requests']}/{row['requests']})  "
          f"{row['output_tokens_per_s']:8.1f} tok/s  TTFT p50/p99 {fmt_ms(row['ttft_s']['p50'])}/"
          f"{fmt_ms(row['ttft_s']['p99'])} ms  TPOT p50/p99 {fmt_ms(row['tpot_s']['p50'])}/"
          f"{fmt_ms(row['tpot_s']['p99'])} ms  ITL p99 {fmt_ms(row['itl_s']['p99'])} ms  failed {row['failed']}"
          + extra, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3_8b", help="llama3_8b | llama2_7b | smollm2 (embedded)")
    parser.add_argument("--modes", default="never,auto", help="offload modes; the first is the baseline")
    parser.add_argument("--device-gib", default="1", help="device KV pool sizes, GiB")
    parser.add_argument("--host-gib", type=float, default=32.0)
    parser.add_argument("--rates", default="auto", help="arrival rates in requests/s, or auto")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--dist", choices=("fixed", "uniform", "chat"), default="fixed")
    parser.add_argument("--prompt", default="1024")
    parser.add_argument("--output", default="256")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--base-url", default=None, help="benchmark a running server over HTTP instead")
    parser.add_argument("--served-model", default="apex", help="model name sent to the server")
    parser.add_argument("--http", action="store_true",
                        help="also time each row over HTTP against a server process of the same config")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (goodput and p99 TPOT against rate)")
    args = parser.parse_args(argv)

    lengths_spec = Lengths(args.dist, parse_range(args.prompt), parse_range(args.output))
    modes = ["server"] if args.base_url else [m.strip() for m in args.modes.split(",") if m.strip()]
    pools = [float(x) for x in args.device_gib.split(",")]
    lengths = lengths_spec.draw(args.num_requests, args.seed)
    if args.http and args.base_url:
        parser.error("--http starts its own servers: leave out --base-url")
    model, label = (None, args.served_model) if args.base_url else build_model(args.shape)
    if args.http:
        args.served_model = label  # serve_random.py serves the shape under its label
    vocab = 32000  # ids every LLaMA-family vocabulary holds: the same prompts in-process and over HTTP
    prompts = prompts_for(lengths, vocab, args.seed)
    result = {"benchmark": "online", "model": label, "lengths": lengths_spec.describe(), "modes": modes,
              "burstiness": args.burstiness, "num_requests": args.num_requests, "slo_ttft_s": args.slo_ttft,
              "slo_tpot_s": args.slo_tpot, "host_gib": args.host_gib, "machine": machine(), "rows": []}
    print(f"online: {label}, {lengths_spec.describe()}, {args.num_requests} requests per rate, modes {modes}, "
          f"SLO TTFT {args.slo_ttft}s TPOT {args.slo_tpot * 1e3:.0f}ms", flush=True)
    from offline import rehearse
    if not args.base_url:
        seconds = rehearse(model, engine_config(modes[0], pools[0], args.host_gib, args), prompts, lengths)
        print(f"  rehearsal (the process's first compiles) {seconds:.1f} s", flush=True)
    for pool in pools:
        if args.rates == "auto":
            capacity = run_batch(model, engine_config(modes[0], pool, args.host_gib, args), prompts,
                                 lengths)["requests_per_s"]
            rates = [round(capacity * f, 3) for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)]
            print(f"  {pool} GiB: {modes[0]}'s offline capacity {capacity:.2f} req/s -> rates {rates}", flush=True)
            result.setdefault("capacity_rps", {})[str(pool)] = capacity
        else:
            rates = [float(r) for r in args.rates.split(",")]
        with contextlib.ExitStack() as servers:
            urls = {}
            for rate in rates:
                base = None
                for mode in modes:
                    config = None if args.base_url else engine_config(mode, pool, args.host_gib, args)
                    row = run_rate(model, config, prompts, lengths, rate, args, base_url=args.base_url)
                    row.update(mode=mode, device_gib=pool, rate=rate)
                    if base is None:
                        base = row
                    else:
                        row["goodput_vs_baseline"] = row["goodput_rps"] / max(base["goodput_rps"], 1e-9)
                        if base["tpot_s"]["p99"] and row["tpot_s"]["p99"]:
                            row["p99_tpot_vs_baseline"] = row["tpot_s"]["p99"] / base["tpot_s"]["p99"]
                    print_row(row)
                    result["rows"].append(row)
                    write_json(args.out, result)
                    if not args.http:
                        continue
                    if mode not in urls:
                        urls[mode] = servers.enter_context(served(args.shape, mode, pool, args))
                        seconds = rehearse_http(urls[mode], label, prompts)
                        print(f"  {mode} server up; rehearsal over HTTP {seconds:.1f} s", flush=True)
                    http = run_rate(None, None, prompts, lengths, rate, args, base_url=urls[mode])
                    http.update(mode=mode, device_gib=pool, rate=rate, transport="http",
                                tokens_per_s_vs_in_process=http["output_tokens_per_s"] / row["output_tokens_per_s"])
                    for p in ("p50", "p99"):
                        if http["ttft_s"][p] is not None and row["ttft_s"][p] is not None:
                            http[f"ttft_{p}_added_s"] = http["ttft_s"][p] - row["ttft_s"][p]
                    print_row(http)
                    result["rows"].append(http)
                    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
