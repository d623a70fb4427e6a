"""Measures the performance model's `Profile` on this machine for an engine's model and pools (CUDA only).

What is timed is what a decode step runs: every linear weight of the model as one GEMM at the step's row count
(one CUDA graph), the paged decode kernel over the device pool (all layers, one CUDA graph), the CPU attention
op over the host pool (all layers, its own threads), and pinned copies. About two seconds on an 8B model; the
result is cached on disk per (GPU, CPU, model shape, dtype, block size), so later engines only read it.
"""
import os
import platform
import time
from typing import Callable, List

import torch
import torch.nn.functional as F

from apex_compile import envs
from apex_compile.runtime.cuda_graphs import replay_seconds
from apex_compile.runtime.kv_manager import DEVICE_POOL, HOST_POOL
from apex_compile.runtime.perf_model import Profile, cached_profile

LINEAR_TOKENS = (1, 8, 32, 128)  # decode rows (up to max_num_seqs)
# prompt steps' tokens (a step holds max_num_batched_tokens, plus a pipeline prompt's
# TuningConfig.pipeline_prompt_tokens; past the last point the time grows linearly): past ~128 rows the GEMMs
# turn compute-bound, so the decode points' slope, extrapolated, priced a prompt step at about half its measured
# time (DECISIONS 47). 2048 at most: the LM head's output at these rows is transient memory
# (0.5 GiB for a 128k vocabulary at 2048), and it overprices a prompt token (which computes no logits) by the
# head's share of the weights
PROMPT_TOKENS = (512, 1024, 2048)
PROFILE_VERSION = 2  # in the cache key: a profile measured without PROMPT_TOKENS is measured again
BATCH = 8  # sequences of the attention probes (their total context is what the model interpolates over)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def profile_key(engine) -> str:
    """(GPU, CPU and its threads, model shape, dtype, block size): what the profile depends on."""
    c = engine.model.config
    s = engine.shape
    return (f"{torch.cuda.get_device_name(engine.device)}|{_cpu_name()}x{torch.get_num_threads()}|"
            f"L{s.num_layers}-H{c.hidden_size}-I{c.intermediate_size}-V{c.vocab_size}-kv{s.num_kv_heads}x"
            f"{s.head_dim}-q{c.num_attention_heads}|{str(s.dtype).replace('torch.', '')}|bs{s.block_size}"
            f"|v{PROFILE_VERSION}")


def _graph_seconds(fn: Callable[[], None], replays: int = 5) -> float:
    """GPU seconds of one call of `fn`, captured in a CUDA graph and replayed back to back."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_seconds(graph, replays)


def linear_seconds(model: torch.nn.Module, tokens: int, replays: int = 5) -> float:
    """GPU seconds of every linear weight of `model` as one GEMM at `tokens` rows (the step's GEMM floor)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}

    def run():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return _graph_seconds(run, replays)


def _tables(num_blocks: int, batch: int, context: int, block_size: int, device) -> torch.Tensor:
    """Distinct block ids for `batch` sequences of `context` tokens (wrapping when the pool is smaller)."""
    per_seq = -(-context // block_size)
    ids = torch.arange(batch * per_seq, dtype=torch.int32) % max(num_blocks, 1)
    return ids.view(batch, per_seq).to(device)


def _attention_points(pool_tokens: int, largest: int) -> List[int]:
    """Total context tokens to probe: up to the pool's capacity and `largest`."""
    top = max(min(pool_tokens, largest), BATCH * 64)
    return sorted({max(top // 8, BATCH * 16), max(top // 2, BATCH * 32), top})


def _gpu_attention_seconds(engine, total: int) -> float:
    pool = engine.kv.pools[DEVICE_POOL]
    s = engine.shape
    heads = engine.model.config.num_attention_heads
    context = total // BATCH
    query = torch.randn(BATCH, heads, s.head_dim, dtype=s.dtype, device=engine.device)
    tables = _tables(pool.num_blocks, BATCH, context, s.block_size, engine.device)
    lens = torch.full((BATCH,), context, dtype=torch.int32, device=engine.device)
    op = torch.ops.apex.paged_attention_gpu

    def run():
        for k, v in zip(pool.key_caches, pool.value_caches):
            op(query, k, v, tables, lens, s.head_dim ** -0.5, context)

    return _graph_seconds(run)


def _cpu_attention_seconds(engine, total: int, repeats: int = 3) -> float:
    from apex_compile.ops import paged_attention_cpu

    pool = engine.kv.pools[HOST_POOL]
    s = engine.shape
    heads = engine.model.config.num_attention_heads
    context = total // BATCH
    query = torch.randn(BATCH, heads, s.head_dim).to(s.dtype)
    tables = _tables(pool.num_blocks, BATCH, context, s.block_size, "cpu")
    lens = torch.full((BATCH,), context, dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in zip(pool.key_caches, pool.value_caches):
            paged_attention_cpu(query, k, v, tables, lens, s.head_dim ** -0.5)
        best = min(best, time.perf_counter() - start)
    return best


def cpu_attention_bandwidth(engine, largest: int = 32768) -> float:
    """Bytes/s the CPU attention op reads now over the engine's host pool, probed as the profile's largest point
    (a benchmark's B_cpu measured in its own run, where the cached profile may come from a busier moment)."""
    s = engine.shape
    total = _attention_points(engine.kv.pools[HOST_POOL].num_blocks * s.block_size, largest)[-1]
    with torch.inference_mode():
        seconds = _cpu_attention_seconds(engine, total)
    return total * (s.block_bytes // s.block_size) / seconds


def _copy_bytes_per_s(device, nbytes: int = 16 << 20) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(4):
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 8 * nbytes / (time.perf_counter() - start)


def profile_tokens(engine) -> List[int]:
    """The row counts the linear layers are timed at: the decode points up to max_num_seqs, then every prompt
    point (whatever this engine's step budget: the profile is cached per machine and model, not per config)."""
    decode = [t for t in LINEAR_TOKENS if t <= max(engine.config.max_num_seqs, 1)] or [1]
    return decode + [t for t in PROMPT_TOKENS if t > decode[-1]]


def measure_profile(engine) -> Profile:
    """Times the step's parts on this machine (see the module docstring)."""
    s, c = engine.shape, engine.model.config
    kv_per_token = s.block_bytes // s.block_size
    tokens = profile_tokens(engine)
    with torch.inference_mode():
        linear = [linear_seconds(engine.model, t) for t in tokens]
        gpu_tokens = engine.kv.pools[DEVICE_POOL].num_blocks * s.block_size
        gpu_ctx = _attention_points(gpu_tokens, 1 << 20)
        gpu = [_gpu_attention_seconds(engine, t) for t in gpu_ctx]
        host_tokens = engine.kv.pools[HOST_POOL].num_blocks * s.block_size
        cpu_ctx = _attention_points(host_tokens, 32768)  # a few GiB of reads: a steady rate, ~0.1 s per probe
        cpu = [_cpu_attention_seconds(engine, t) for t in cpu_ctx]
        rate = _copy_bytes_per_s(engine.device)
    elem = torch.empty((), dtype=s.dtype).element_size()
    # per host row and layer: q, k, v to the host and the output back
    copy_bytes = s.num_layers * (2 * c.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim * elem
    return Profile(profile_key(engine), tokens, linear, gpu_ctx, gpu, cpu_ctx, cpu, kv_per_token, copy_bytes, rate)


def engine_profile(engine) -> Profile:
    """The engine's profile from the on-disk cache, measured first if absent ($APEX_COMPILE_CACHE_DIR)."""
    if envs.APEX_COMPILE_PROFILE_REFRESH:
        from apex_compile.runtime.perf_model import profile_path

        path = profile_path(profile_key(engine))
        if os.path.exists(path):
            os.remove(path)
    return cached_profile(profile_key(engine), lambda: measure_profile(engine))
