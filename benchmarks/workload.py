"""What the user-workload benchmarks (`offline.py`, `online.py`) share: request lengths, models, metrics, energy.

Metrics follow `vllm bench`: TTFT is the first token's time after the request was submitted (offline: after the
batch was), TPOT = (latency - TTFT) / (output tokens - 1) per request, ITL the gaps between a request's tokens,
E2E latency the last token's time after submission; goodput (DistServe) counts the requests per second that meet
every SLO (TTFT and TPOT).
"""
import dataclasses
import json
import os
import platform
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apex_compile.runtime.request import SamplingParams  # noqa: E402

GiB = 1 << 30
DISTRIBUTIONS = ("fixed", "uniform", "chat")


@dataclasses.dataclass
class Lengths:
    """How prompt and output lengths are drawn: "fixed" (prompt, output), "uniform" over [lo, hi] ranges, or
    "chat": log-normal, skewed to short turns with a long tail (ShareGPT-like medians: prompt ~ prompt_lo..hi's
    geometric mean / 2, output ~ output range's geometric mean / 2), clipped to the ranges."""

    distribution: str = "fixed"
    prompt: Tuple[int, int] = (768, 768)
    output: Tuple[int, int] = (192, 192)

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        for name in ("prompt", "output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {lo}:{hi}")

    def draw(self, count: int, seed: int) -> List[Tuple[int, int]]:
        """`count` (prompt length, output length) pairs, reproducible from `seed`."""
        rng = np.random.default_rng(seed)

        def one(lo: int, hi: int) -> np.ndarray:
            if self.distribution == "fixed" or lo == hi:
                return np.full(count, lo)
            if self.distribution == "uniform":
                return rng.integers(lo, hi + 1, count)
            median = max(lo, np.sqrt(lo * hi) / 2)
            return np.clip(np.round(rng.lognormal(np.log(median), 0.8, count)), lo, hi).astype(int)

        prompts, outputs = one(*self.prompt), one(*self.output)
        return [(int(p), int(o)) for p, o in zip(prompts, outputs)]

    def describe(self) -> str:
        fmt = lambda r: str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"  # noqa: E731
        return f"{self.distribution} prompt {fmt(self.prompt)} output {fmt(self.output)}"


def parse_range(text: str) -> Tuple[int, int]:
    """'768' -> (768, 768); '128:2048' -> (128, 2048)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def prompts_for(lengths: List[Tuple[int, int]], vocab: int, seed: int) -> List[List[int]]:
    """Random prompt token ids (away from the vocabulary's ends, where special tokens live)."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(10, max(vocab - 10, 11), p).tolist() for p, _ in lengths]


def run_to_length(output_len: int) -> SamplingParams:
    """Greedy sampling for `output_len` tokens that ignores EOS (benchmarks compare fixed work)."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    extra = {"ignore_eos": True} if "ignore_eos" in fields else {"eos_token_ids": ()}
    return SamplingParams(max_new_tokens=output_len, **extra)


def build_model(shape: str):
    """(model, label): a random bf16 LLaMA of a real shape on CUDA ("llama3_8b", "llama2_7b"), or the embedded
    SmolLM2-135M-Instruct ("smollm2", fp32 on the CPU unless CUDA is present)."""
    if shape == "smollm2":
        from apex_compile.runtime.loader import load_model

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, _ = load_model(None, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
        return model, "SmolLM2-135M"
    from e2e_throughput import SHAPES, random_llama

    if shape not in SHAPES:
        raise SystemExit(f"unknown --shape {shape!r}: one of smollm2, {', '.join(SHAPES)}")
    return random_llama(SHAPES[shape]), shape


def percentiles(values: Sequence[float], ps=(50, 90, 99)) -> Dict[str, Optional[float]]:
    """{"mean", "p50", ...} of `values` (None when empty)."""
    if not len(values):
        return {"mean": None, **{f"p{p}": None for p in ps}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


@dataclasses.dataclass
class RequestTimes:
    """One request's clock: when it was submitted and when each of its tokens reached the client."""

    submitted: float
    token_times: List[float] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def tpot(self) -> Optional[float]:
        n = len(self.token_times)
        return None if n < 2 else (self.latency - self.ttft) / (n - 1)

    def itl(self) -> List[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


def summarize(times: List[RequestTimes], start: float, end: float, slo_ttft: Optional[float] = None,
              slo_tpot: Optional[float] = None) -> dict:
    """Throughput and latency figures of finished requests over [start, end] (seconds of perf_counter)."""
    done = [t for t in times if t.token_times]
    duration = end - start
    tokens = sum(len(t.token_times) for t in done)
    tpots = [t.tpot for t in done if t.tpot is not None]
    out = {
        "requests": len(times), "completed": len(done), "duration_s": duration, "output_tokens": tokens,
        "requests_per_s": len(done) / duration, "output_tokens_per_s": tokens / duration,
        "ttft_s": percentiles([t.ttft for t in done]), "tpot_s": percentiles(tpots),
        "itl_s": percentiles([gap for t in done for gap in t.itl()]),
        "e2e_s": percentiles([t.latency for t in done]),
    }
    if slo_ttft is not None and slo_tpot is not None:
        good = sum(1 for t in done if t.ttft <= slo_ttft and (t.tpot is None or t.tpot <= slo_tpot))
        out.update(good_requests=good, goodput_rps=good / duration, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    return out


class EnergyMeter:
    """GPU energy over a run: NVML's energy counter when nvidia-ml-py is importable, else power sampled with
    nvidia-smi every 100 ms and integrated; None where neither is available (a CPU run)."""

    def __init__(self):
        self.joules: Optional[float] = None
        self.source = None
        self._handle = self._start_mj = self._proc = None
        self._samples: List[Tuple[float, float]] = []
        if not torch.cuda.is_available():
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self.source = "nvml energy counter"
        except Exception:  # noqa: BLE001 - no NVML binding or no counter: sample instead
            self._handle = None
            self.source = "nvidia-smi power samples"

    def __enter__(self):
        if self._handle is not None:
            import pynvml

            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        elif self.source is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        index = str(torch.cuda.current_device())
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=power.draw",
                                       "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                      timeout=5).stdout.strip()
                self._samples.append((time.perf_counter(), float(text.splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                self.source = None
                return
            self._stop.wait(0.1)

    def __exit__(self, *exc):
        if self._handle is not None:
            import pynvml

            self.joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1e3
        elif self.source is not None:
            self._stop.set()
            self._thread.join()
            s = self._samples
            if len(s) >= 2:  # trapezoids over the samples
                self.joules = float(sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(s, s[1:])))
        return False

    def report(self, tokens: int) -> dict:
        if self.joules is None:
            return {}
        return {"gpu_joules": self.joules, "tokens_per_joule": tokens / self.joules, "energy_source": self.source}


def machine() -> dict:
    """Where the run happened (written into every result)."""
    info = {"host": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(path: Optional[str], result: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def fmt_ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"
