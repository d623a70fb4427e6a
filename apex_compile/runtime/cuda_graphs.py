"""Whole-forward CUDA graphs of decode steps, one per capture size, owned by one engine; whole graphs of mixed
steps (`MixedGraphs`) and piecewise graphs of steps with host-pool rows (`PiecewiseGraphs`) below.

A graph bakes in the addresses of the engine's StepBuffers views, KV caches and attention plan, so it is
captured per engine. A decode-only step of the device pool with B rows replays the graph of the smallest
capture size >= B; the rows past B are padding (slot -1, context length 1, logits ignored). Capture runs the
compiled step once per size first (outside the capture), so compilation and Triton JIT never happen inside a
capture; sizes are captured largest first into one memory pool, which the smaller graphs then reuse.
"""
import bisect
import dataclasses
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch


def capture_sizes(max_rows: int) -> List[int]:
    """2, 4, 8, then every multiple of 8 up to `max_rows`, and `max_rows` itself (at least 2).

    A lone decode row runs padded to 2: the same memory-bound GEMMs, and the step never meets dynamo's
    specialisation of size-1 dimensions, so one compiled graph serves every capture size."""
    max_rows = max(max_rows, 2)
    sizes = [s for s in (2, 4) if s < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU seconds of one replay of `graph`: one replay first, then `replays` back to back."""
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays


class DecodeGraphs:
    """The captured graphs of an engine: `size_for(rows)`, `capture(...)`, `replay(size)`."""

    def __init__(self, sizes: List[int]):
        self.sizes = sorted(sizes)
        self.graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def ready(self) -> bool:
        """Whether every size is captured."""
        return len(self.graphs) == len(self.sizes)

    def size_for(self, rows: int) -> Optional[int]:
        """The capture size that serves a step of `rows` decode rows (None when larger than every size)."""
        index = bisect.bisect_left(self.sizes, rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                progress: bool = True, pool=None) -> None:
        """Captures every size: `prepare(size)` writes and copies a padded step's inputs (outside the graph),
        `forward(size)` runs the model on them and returns its logits (captured). pool: the memory pool
        (shared with the engine's other graphs; None: a new one)."""
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        order = sorted(self.sizes, reverse=True)
        for done, size in enumerate(order, 1):
            if progress:
                print(f"\rapex_compile: capturing CUDA graphs {done}/{len(order)} (batch {size})", end="",
                      file=sys.stderr, flush=True)
            prepare(size)
            forward(size)  # warm-up: compiles this size's specialisations and kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        if progress:
            print(f"\rapex_compile: captured {len(order)} CUDA graphs in {self.capture_seconds:.1f} s",
                  file=sys.stderr, flush=True)

    def time_replays(self, replays: int = 3) -> Tuple[List[int], List[float]]:
        """(sizes, GPU seconds per replay) of every captured graph replayed back to back over the inputs it
        holds (the performance model's `StepCalibration`, taken right after a capture of padding rows)."""
        sizes = sorted(self.graphs)
        return sizes, [replay_seconds(self.graphs[size][0], replays) for size in sizes]

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` rows and returns its logits [size, vocab] (valid until the next replay)."""
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out


# GPU-only steps above this many tokens run uncaptured: their GPU time outgrows the host's launch time. The
# staggered plan's pieces also cover its pipeline prompt steps (a host request's whole prompt, up to
# `TuningConfig.pipeline_prompt_tokens` past the budget): there the uncaptured step's host time, beside the
# staggered plan's own host work, outgrew its GPU time (DECISIONS 48).
PIECEWISE_MAX_TOKENS = 512


def piecewise_sizes(max_rows: int) -> List[int]:
    """Token counts of piecewise-captured steps: the decode sizes up to 64 rows, then every 32 up to 256, every
    64 beyond, and `max_rows` itself (a step is padded to the next size; at most ~12% padding above 64 rows)."""
    max_rows = max(max_rows, 2)
    sizes = capture_sizes(min(max_rows, 64)) + list(range(96, min(max_rows, 256) + 1, 32))
    sizes += list(range(320, max_rows + 1, 64)) + [max_rows]
    return sorted(set(s for s in sizes if s <= max_rows))


# A piecewise or mixed step computes at least this many logits rows (or all its rows, if fewer): the logits
# rows (decode rows plus prompts ending) vary from step to step, and each padded count was a graph captured
# lazily inside a run (~0.1 s each); extra lm_head rows cost little beside reading its weights.
LOGITS_FLOOR = 64


def padded_key(sizes: List[int], rows: int, num_logits: int) -> Optional[Tuple[int, int]]:
    """(padded rows, padded logits rows) of a step among sorted `sizes`, or None when it has more rows than every
    size (the key of a piecewise or mixed step's graphs)."""
    index = bisect.bisect_left(sizes, rows)
    if index == len(sizes):
        return None
    logits = sizes[bisect.bisect_left(sizes, max(num_logits, 2))]
    return sizes[index], max(logits, min(LOGITS_FLOOR, sizes[index]))


def weak_ref(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s memory that does not keep that memory allocated (as vLLM's piecewise graphs
    keep a captured step's intermediates: the memory pool may reuse it for later pieces, which replay in the
    same order)."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        alias, tensor.storage_offset(), tensor.shape, tensor.stride())


class MixedGraphs:
    """Whole-forward graphs of mixed steps (decode rows and prompt chunks, every row in the device pool, with
    or without the staggered block), keyed like `PiecewiseGraphs` by (padded rows, padded logits rows).

    The step's attention runs in the fixed layout of `StepBuffers.fill(mixed_rows=...)`: kernel grids that
    depend only on the row count, metadata in the persistent buffers. So the whole step is one replay, where a
    piecewise step is launched piece by piece from Python between eager attention calls (host time that a
    busy host, such as one running the staggered plan's CPU job, stretches). Captured lazily, the first time
    a key is met, after one uncaptured run of the same step (compiles its kernels)."""

    def __init__(self, sizes: List[int], pool=None):
        self.sizes = sorted(sizes)
        self.pool = pool
        self.graphs: Dict[Tuple[int, int], Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def key_for(self, rows: int, num_logits: int) -> Optional[Tuple[int, int]]:
        """(padded rows, padded logits rows) of a step, or None when it has more rows than every size."""
        return padded_key(self.sizes, rows, num_logits)

    def capture(self, key: Tuple[int, int], forward: Callable[[], torch.Tensor]) -> None:
        """Captures `key`: `forward()` runs the compiled step over inputs already written (a step of padding
        rows in the fixed layout) and returns its logits."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread-local: the engine's worker threads may wait on CUDA events meanwhile (the per-layer offload's)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        torch.cuda.synchronize()
        self.graphs[key] = (graph, out)
        self.capture_seconds += time.perf_counter() - start

    def replay(self, key: Tuple[int, int]) -> torch.Tensor:
        """Replays `key`'s graph; returns its logits [padded logits rows, vocab] (valid until the next replay)."""
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out


# Runner methods whose tensor arguments must stay allocated until the step ends: they start work on another
# stream or thread that reads them after the call returns (the host rows' device-to-host copy).
_ASYNC_READERS = ("offload_launch",)
RUNNER_METHODS = ("attention", "offload_launch", "device_attention", "offload_wait")
# Runner methods that write into a given output (the persistent buffer: no copy at each replay). Their buffer
# is shared by every layer: the piece after a layer's call reads it before the next layer's call writes it
# (one stream, in order), and a buffer per layer would hold layers x rows x hidden (~0.7 GB for an 8B model's
# 2.5k-row pipeline prompt steps).
_WRITES_OUT = ("attention",)
# Runner methods that only copy between device buffers at fixed addresses: captured inside the piece.
CAPTURED_METHODS = ("stagger_residual", "stagger_rope_layers")


@dataclasses.dataclass
class _Call:
    """One attention-op call between two captured pieces: re-run eagerly at every replay, into `out`."""

    method: str
    args: tuple
    out: torch.Tensor

    def run(self, runner) -> None:
        if self.method in _WRITES_OUT:
            getattr(runner, self.method)(*self.args, out=self.out)
        else:
            self.out.copy_(getattr(runner, self.method)(*self.args))


class _Recorder:
    """Stands in for the runner while a step is captured: at each attention-op call it ends the piece being
    captured, runs the call eagerly on the real runner, copies the result into a persistent buffer (the address
    the next piece is captured reading) and starts the next piece."""

    def __init__(self, runner, owner: "PiecewiseGraphs"):
        self.runner, self.owner = runner, owner
        self.graphs: List[torch.cuda.CUDAGraph] = []
        self.calls: List[_Call] = []
        self.capturing = False

    def begin(self) -> None:
        graph = self.owner.new_graph()
        graph.capture_begin(pool=self.owner.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)
        self.capturing = True

    def end(self) -> None:
        self.capturing = False
        self.graphs[-1].capture_end()

    def call(self, method: str, *args):
        self.end()
        result = getattr(self.runner, method)(*args)
        layer = args[0]
        out = self.owner.persistent(method, layer, result)
        out.copy_(result)
        keep = method in _ASYNC_READERS
        self.calls.append(_Call(method, tuple(a if keep or not isinstance(a, torch.Tensor) else weak_ref(a)
                                              for a in args), out))
        self.begin()
        return out

    def __getattr__(self, name):
        if name in RUNNER_METHODS:
            return lambda *args: self.call(name, *args)
        if name in CAPTURED_METHODS:
            return getattr(self.runner, name)
        raise AttributeError(name)


class PiecewiseGraphs:
    """Every step of up to PIECEWISE_MAX_TOKENS rows that no whole graph serves (host-pool rows, more prompt chunks
    than the mixed layout holds; every prompt step with mixed_graphs=False), captured in pieces.

    The compiled step is captured as it runs, one CUDA graph per stretch between two attention-op calls (the
    graph split at the apex attention ops, as vLLM's piecewise compilation splits it, but at run time: the
    compiled code stays one graph); the calls themselves run eagerly between the pieces at every replay, with
    the step's own metadata, and write into persistent buffers that the next piece reads. Keyed by (padded
    token count, padded logits rows); the rows past the step's own are padding rows of no pool (their outputs
    are never read). Captured lazily, the first time a key is met.
    """

    def __init__(self, sizes: List[int], max_rows: int, pool=None, new_graph: Callable = None):
        self.sizes = sorted(sizes)
        self.max_rows = max_rows
        self.pool = pool
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.pieces: Dict[Tuple[int, int], Tuple[List, List[_Call], torch.Tensor]] = {}
        self.buffers: Dict[tuple, torch.Tensor] = {}
        self.stream: Optional[torch.cuda.Stream] = None  # captures run on a side stream (CUDA's rule)
        self.capture_seconds = 0.0
        self.replays = 0

    def key_for(self, rows: int, num_logits: int) -> Optional[Tuple[int, int]]:
        """(padded rows, padded logits rows) of a step, or None when it has more rows than every size."""
        return padded_key(self.sizes, rows, num_logits)

    def persistent(self, method: str, layer: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer a call's result is copied into: one per (method, layer), shared by every key (a method that
        writes into its output: one for every layer, `_WRITES_OUT`)."""
        key = (method, None if method in _WRITES_OUT else layer, tuple(like.shape[1:]), like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None:
            buf = torch.empty((max(self.max_rows, like.shape[0]),) + tuple(like.shape[1:]), dtype=like.dtype,
                              device=like.device)
            self.buffers[key] = buf
        return buf[:like.shape[0]]

    def capture(self, key: Tuple[int, int], runner, forward: Callable) -> None:
        """Captures `key`: `forward(runner)` runs the compiled step (inputs already written) with `runner`
        serving its attention ops; it runs once uncaptured first (compiles this shape's kernels)."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        forward(runner)
        torch.cuda.synchronize()
        recorder = _Recorder(runner, self)
        stream = self.stream = self.stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), warnings.catch_warnings():
            # two adjacent calls (offload launch, then device attention) leave an empty piece between them
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            recorder.begin()
            try:
                out = forward(recorder)
                recorder.end()
            except BaseException:
                if recorder.capturing:
                    try:
                        recorder.end()
                    except Exception:  # noqa: BLE001  (the first error is the one to report)
                        pass
                raise
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.pieces[key] = (recorder.graphs, recorder.calls, out)
        self.capture_seconds += time.perf_counter() - start

    def replay(self, key: Tuple[int, int], runner) -> torch.Tensor:
        """Replays `key`'s pieces with `runner` serving the calls between them; returns the logits
        [padded logits rows, vocab] (valid until the next replay)."""
        graphs, calls, out = self.pieces[key]
        for graph, call in zip(graphs, calls):
            graph.replay()
            call.run(runner)
        graphs[-1].replay()
        self.replays += 1
        return out
