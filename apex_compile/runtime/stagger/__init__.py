"""The staggered plan: host-pool requests whose tokens cross the decoder layers one layer per turn.

Why: every row of a layer's GEMMs needs that layer's attention done before the output projection, so in one
batch the CPU's attention of host rows can hide only behind the device rows' attention, a small part of a
step that is mostly weight reads. Here a host request's token instead moves one layer
further per turn, and the CPU attends each layer between two turns, while the GPU runs whole steps: the GPU
never waits while the CPU keeps up, and the weights are still read once per step (the host rows join the
device rows' GEMMs).

Layout: the step's first `width` rows are the staggered block. Two lanes take turns (even and odd steps);
each lane's group g (0..num_layers) holds the requests (one per row) that entered it g turns ago with their
current token. In a lane's step the block's rows at layer L hold group L before the attention op (their
q/k/v are staged for the CPU) and group L + 1 after it (they get the attention of layer L computed since the
lane's last step; the graph swaps their residual and RoPE rows, `passes.stagger`). Group 0 embeds its token,
group num_layers gets the LM head and samples. Each turn the groups shift by one; a request that sampled and
goes on re-enters group 0 in the same row, free rows of group 0 take requests that finished their prefill.
A host token thus takes 2 * (num_layers + 1) steps: throughput, not latency.

Why two lanes: the whole step's host work then sits between steps. Before a step its lane's attention
outputs (computed during the step before) go to the device in one copy; inside the step the attention op
only copies rows between device buffers at fixed addresses (so whole-step CUDA graphs capture it, as for
GPU-only decode); after the step the staged q/k/v of every layer go to the host in one copy and one job on
the CPU worker appends and attends all layers, during the next step. The job is one C++ call that waits for
pinned counters the GPU stream raises behind those copies, so from its inputs' arrival to its end it needs no
GIL; it writes a lane's pinned output only after that buffer's last copy to the device (the guard). On a
CPU-only run the job runs at once.

Modules, one job each: `row_limit` (the rows' control law), `pipeline` (the lanes' state machine and each
turn's CPU job), `jobs` (the executors and their threads), `pinning` (the worker's and the launcher's cores).
"""
from apex_compile.runtime.stagger.jobs import ABORTED, AsyncJobs, CudaCopies, LayerJobs, SyncJobs
from apex_compile.runtime.stagger.pinning import LauncherPin, _pin_worker, worker_cores  # noqa: F401 (scripts)
from apex_compile.runtime.stagger.pipeline import (LANES, ROPE_KINDS, HostJob, StaggerGroup, StaggerPipeline,
                                                   host_attention, rope_tables)
from apex_compile.runtime.stagger.row_limit import (EMA, IDLE_HOLD, MAX_IDLE_HOLD, PRIOR_SPREAD, REGROW_STEPS,
                                                    RowLimit)

__all__ = ["ABORTED", "AsyncJobs", "CudaCopies", "EMA", "HostJob", "IDLE_HOLD", "LANES", "LauncherPin", "LayerJobs",
           "MAX_IDLE_HOLD", "PRIOR_SPREAD", "REGROW_STEPS", "ROPE_KINDS", "RowLimit", "StaggerGroup",
           "StaggerPipeline", "SyncJobs", "host_attention", "rope_tables", "worker_cores"]
