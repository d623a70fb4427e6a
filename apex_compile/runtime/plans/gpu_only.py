"""The GPU-only plan: every running request in the device pool (the host pool only parks swapped-out requests).

Its forward picks, per step: a whole decode graph (every row decodes in the device pool, a capture size fits),
a whole mixed graph (prompt chunks, every row in the device pool, `MixedGraphs`), piecewise graphs (host rows,
or steps no whole graph fits, up to `PIECEWISE_MAX_TOKENS`), or the compiled step itself. The overlap and
staggered plans reuse this forward for their steps without lead rows.
"""
from typing import List, Optional

import numpy as np
import torch

from apex_compile.kernels.paged_attention import reserve_decode_counters
from apex_compile.ops.kv_layout import to_device
from apex_compile.runtime.context import attention_runner
from apex_compile.runtime.cuda_graphs import (PIECEWISE_MAX_TOKENS, DecodeGraphs, MixedGraphs, PiecewiseGraphs,
                                              capture_sizes, piecewise_sizes)
from apex_compile.runtime.kv_manager import DEVICE_POOL
from apex_compile.runtime.plans.base import Plan
from apex_compile.runtime.step_buffers import StepBuffers


def rows_of(logits: torch.Tensor, rows: List[int]) -> torch.Tensor:
    """logits[rows] of a whole-step graph's output: a slice when the rows are 0..n-1, else a gather (its index
    copied without stalling the host: a staggered block with empty rows, before the pipeline is full)."""
    if rows == list(range(len(rows))):
        return logits[:len(rows)]
    return logits.index_select(0, to_device(rows, torch.long, logits.device))


class GpuOnlyPlan(Plan):
    """Steps over the device pool's rows: decode, mixed and piecewise graphs, the compiled step."""

    name = "gpu_only"

    def __init__(self, engine):
        super().__init__(engine)
        self.graphs: Optional[DecodeGraphs] = None
        self.pieces: Optional[PiecewiseGraphs] = None
        self.mixed: Optional[MixedGraphs] = None  # whole graphs of mixed steps
        self.sizes: List[int] = []  # the decode graphs' capture sizes
        self.step_fn = None

    def build_graphs(self, max_rows: int) -> None:
        engine = self.engine
        config = engine.config
        if not (engine.device.type == "cuda" and config.cuda_graphs and config.compile):
            return
        # the decode kernel's split counters at the largest launch's size, before any capture
        reserve_decode_counters(engine.device, (max_rows + self.block_width) * engine.shape.num_kv_heads)
        self.sizes = config.capture_sizes or capture_sizes(min(config.max_num_seqs, config.max_num_batched_tokens))
        self.graphs = DecodeGraphs([n for n in self.sizes if n <= max_rows])
        pieces_rows = min(max_rows, PIECEWISE_MAX_TOKENS)
        self.pieces = PiecewiseGraphs(piecewise_sizes(pieces_rows), pieces_rows, torch.cuda.graph_pool_handle())
        if config.mixed_graphs:  # every step size: a whole graph's launch is one call at any size
            self.mixed = MixedGraphs(piecewise_sizes(max_rows), self.pieces.pool)

    def build_steps(self) -> None:
        self.step_fn = self.engine._build_step()

    def _step_fn(self, stagger_rows: int):
        """The step function that runs a step with `stagger_rows` lead rows."""
        return self.step_fn

    def run_model(self, parts, num_rows: int, num_logits: int, runner=None, stagger_rows: int = 0) -> torch.Tensor:
        """The compiled step over the buffers' first `num_rows` rows, attention served by `runner` (default: the
        engine's runner, given the step's parts); with `stagger_rows`, the staggered graph, its block first."""
        engine = self.engine
        engine.runner.set_parts(parts, num_rows, stagger_rows)
        input_ids, position_ids, indices = engine.buffers.inputs(num_rows, num_logits)
        step_fn = self._step_fn(stagger_rows)
        with attention_runner(runner or engine.runner), torch.inference_mode():
            return step_fn(input_ids, position_ids, indices)

    def logits_rows(self, count: int) -> int:
        """Rows of the LM-head GEMM for `count` wanted rows (repeated rows are computed and dropped): on CUDA at
        least two, since dynamo specialises size-0/1 dimensions and each specialisation would compile the whole
        model again (on a CPU the graph runs eagerly and a recompile is cheap)."""
        return max(count, 2) if self.engine.device.type == "cuda" else max(count, 1)

    # ----------------------------------------------------------------------------------------------------
    # graphs

    def capture_graphs(self, progress: bool = True) -> None:
        """Captures the decode CUDA graphs of every capture size (done by `warmup`, else at the first decode)."""
        if self.graphs is None or self.graphs.ready:
            return
        buffers = self.engine.buffers
        padded = {}

        def prepare(size):
            padded[size] = buffers.fill([], [], pad_to=size)
            buffers.copy_to_device()

        self.graphs.capture(prepare, lambda size: self.run_model(*padded[size], size), progress, self.pieces.pool)
        calibration = self.engine.calibration
        calibration.rows, calibration.step_s = self.graphs.time_replays()

    def warmup(self) -> None:
        self.capture_graphs()

    def _capture_pieces(self, pieces: PiecewiseGraphs, key, stagger_rows: int = 0) -> None:
        """Captures `pieces`' graphs of (rows, logits rows) `key` over a step of padding rows only (with
        `stagger_rows`, the staggered graph's, its residual rows left as they were)."""
        engine = self.engine
        buffers = engine.buffers
        rows, num_logits = key
        parts, _ = buffers.fill([], [], pad_to=rows - stagger_rows, first_row=stagger_rows)
        if stagger_rows:  # the block's rows and every logits row within the step (fill wrote rows - block of them)
            buffers.ids[:stagger_rows], buffers.positions[:stagger_rows] = 0, 0
            buffers.logits_indices[:num_logits] = np.arange(num_logits) % rows
        buffers.copy_to_device()

        def forward(runner):
            return self.run_model(parts, rows, num_logits, runner, stagger_rows)

        with torch.inference_mode(), self._quiet(stagger_rows):
            pieces.capture(key, engine.runner, forward)

    def _mixed_key(self, graphs: Optional[MixedGraphs], chunks, num_tokens: int, num_logits: int,
                   stagger_rows: int = 0):
        """The key of `graphs`' whole mixed graph that runs this step (capturing it the first time), or None: no
        mixed graphs, a chunk outside the device pool, too many prompt chunks, or too many rows."""
        if graphs is None or not StepBuffers.mixed_fits(chunks):
            return None
        buffers = self.engine.buffers
        key = graphs.key_for(num_tokens, num_logits)
        if key is not None and key not in graphs.graphs:
            rows, padded_logits = key
            parts, _ = buffers.fill([], [], first_row=stagger_rows, mixed_rows=rows - stagger_rows)
            if stagger_rows:
                buffers.ids[:stagger_rows], buffers.positions[:stagger_rows] = 0, 0
            buffers.logits_indices[:padded_logits] = np.arange(padded_logits) % rows
            buffers.copy_to_device()
            with torch.inference_mode(), self._quiet(stagger_rows):
                graphs.capture(key, lambda: self.run_model(parts, rows, padded_logits, stagger_rows=stagger_rows))
        return key

    def captured_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.pieces, self.mixed) if g is not None)

    # ----------------------------------------------------------------------------------------------------
    # the step

    def _graph_size(self, chunks) -> Optional[int]:
        """The capture size whose graph runs this step, or None (not a decode-only step of the device pool)."""
        if self.graphs is None or any(c.pool != DEVICE_POOL or not c.decodes for c in chunks):
            return None
        return self.graphs.size_for(len(chunks))

    def forward(self, chunks, logit_rows: List[int], device_ids=None) -> torch.Tensor:
        """Runs the model on the chunks (flattened in order) and returns the logits of `logit_rows`: a whole
        decode graph, a whole mixed graph (prompt chunks, every row in the device pool), piecewise graphs (host
        rows), or (without CUDA graphs) the compiled step itself. device_ids: input ids already on the device
        (a step queued before the host has them)."""
        engine = self.engine
        buffers, runner = engine.buffers, engine.runner
        size = self._graph_size(chunks)
        if size is not None and not self.graphs.ready:
            self.capture_graphs()
        num_tokens = sum(c.num_tokens for c in chunks)
        mixed = self._mixed_key(self.mixed, chunks, num_tokens, len(logit_rows)) if size is None else None
        key = (self.pieces.key_for(num_tokens, len(logit_rows))
               if size is None and mixed is None and self.pieces is not None else None)
        if key is not None and key not in self.pieces.pieces:
            self._capture_pieces(self.pieces, key)
        num_logits = len(logit_rows)
        padded = mixed or key
        padded_logits = padded[1] if padded is not None else self.logits_rows(num_logits)
        logit_rows = (logit_rows + [num_tokens - 1] * padded_logits)[:padded_logits]
        if mixed is not None:
            parts, num_rows = buffers.fill(chunks, logit_rows, mixed_rows=mixed[0])
        else:
            parts, num_rows = buffers.fill(chunks, logit_rows, pad_to=size, total_rows=key and key[0])
        buffers.copy_to_device(device_ids)
        start = engine._tick("prepare")
        if size is not None:
            logits = rows_of(self.graphs.replay(size), logit_rows[:num_logits])
        elif mixed is not None:
            runner.set_parts(parts, num_rows)
            logits = self.mixed.replay(mixed)[:num_logits]
        elif key is not None:
            runner.set_parts(parts, num_rows)
            with torch.inference_mode():
                logits = self.pieces.replay(key, runner)[:num_logits]
        else:
            logits = self.run_model(parts, num_rows, len(logit_rows))[:num_logits]
        engine.stats.forward_seconds += engine._tick("forward") - start
        engine.stats.steps += 1
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        return logits
