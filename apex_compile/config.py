"""`ApexConfig`: memory pools, batching limits and offload policy of an `ApexModel`."""
import dataclasses
import os
from typing import Optional, Sequence, Union

from apex_compile import envs

OFFLOAD_MODES = ("auto", "never", "all", "staggered")
OBJECTIVES = ("auto", "makespan", "latency")
PREEMPTION_MODES = ("swap", "recompute")
INNER_COMPILERS = ("inductor", "eager")

GiB = 1 << 30


@dataclasses.dataclass
class TuningConfig:
    """Constants of the offload plans' control laws. The defaults are the measured optima; a benchmark that
    sweeps one builds a config with it rather than assigning a module global, so two engines in one process
    may differ.

    job_share: the share of a decode step an adaptive staggered pipeline keeps its CPU job within (the worker
        runs one job per step; the rest is the margin for the job's noise before the GPU waits; above 1 the
        rows are let grow until the guard sees the GPU wait).
    auto_stagger_width: the staggered block's rows with stagger_width="auto" (the measured CPU job and, under
        offload="auto", the performance model decide how many are used), and the most host rows per step the
        model's `explain` considers.
    pipeline_reserve: the share of every host request's remaining tokens for which the host pool keeps free
        blocks before a request enters the staggered pipeline (SGLang's new-token ratio). A member takes blocks
        for its tokens and the next one, more as it grows; one with no block for its next token waits to rejoin,
        and when every member waits so, the newest are recomputed. Taking blocks as they grow lets the same host
        pool hold more members, so it does not bind the pipeline before its rows do.
    pipeline_prompt_tokens: the longest prompt offload="auto" lets enter the staggered pipeline; one step takes
        it whole, beyond max_num_batched_tokens (at most one such prompt a step), because its K/V is exported to
        the host pool as that step computes it: a prompt split across steps would attend its cached part on
        the CPU. A longer prompt waits for the device pool. The step buffers hold this many rows more.
    """

    job_share: float = 0.95
    auto_stagger_width: int = 12
    pipeline_reserve: float = 0.3
    pipeline_prompt_tokens: int = 2048

    def __post_init__(self):
        share = self.job_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.5:
            raise ValueError(f"TuningConfig.job_share must be a share in (0, 1.5], got {share!r}")
        width = self.auto_stagger_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"TuningConfig.auto_stagger_width must be a positive number of rows, got {width!r}")
        reserve = self.pipeline_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0.0 <= reserve <= 1.0:
            raise ValueError(f"TuningConfig.pipeline_reserve must be a share in [0, 1], got {reserve!r}")
        prompt = self.pipeline_prompt_tokens
        if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
            raise ValueError(f"TuningConfig.pipeline_prompt_tokens must be a number of tokens >= 0, got {prompt!r}")


@dataclasses.dataclass
class ApexConfig:
    """Settings of the paged-KV runtime.

    gpu_cache_size: bytes of KV blocks in the device pool (the model's device; the CPU on a CPU-only run).
        None: 80% of the free CUDA memory, or 1 GiB when the model is on the CPU.
    cpu_cache_size: bytes of KV blocks in the host pool (host memory, attended by the CPU kernel). None: 1 GiB.
    block_size: tokens per KV block (a power of two in 16..256).
    offload: where running requests keep their KV and attend: "never" (device pool), "all" (host pool),
        a float in [0, 1] (that fraction of running requests in the host pool, for tests and experiments), or
        "auto": on CUDA a performance model measured once per machine and model shape (cached under the compile
        cache dir, calibrated by replays of the engine's captured graphs) chooses: where it predicts the
        staggered plan (below) gains for a typical load, that plan, with the host rows per step set each step
        by the model's prediction beside the running device requests and by the measured CPU job; else host
        requests (one-batch overlap) admitted only when the device pool is full and it predicts more
        tokens/s; else the host pool only parks swapped-out requests. On a CPU-only run "auto" is "never".
        "staggered": requests the device pool cannot take are prefilled in the host pool and then decode
        staggered: each advances one decoder layer per step, so its CPU attention overlaps a whole GPU step
        (`apex_compile.runtime.stagger`; a token takes stagger_lanes * (num_layers + 1) steps: throughput, not
        latency).
    stagger_width: rows per step of staggered host requests; the pipeline holds stagger_lanes * (num_layers + 1)
        * width requests. None: 4 with offload="staggered", "auto" with offload="auto". "auto": up to 12, the rows in
        use following the measured CPU job (as many as keep it within 95% of a step;
        `apex_compile.runtime.stagger.RowLimit`) and, under offload="auto", the performance model.
    stagger_lanes: 2: two lanes take turns, each lane's CPU job runs between two of its steps (while the other
        lane's step runs); 1: one lane, each layer's CPU attention runs between that layer of two steps, the GPU
        waiting on the device per layer (half the requests in flight for the same rows). None: 1
        with CUDA, 2 on a CPU-only run (nothing runs beside its steps there).
    cpu_attention_threads: OpenMP threads of the staggered plan's CPU attention worker on CUDA, pinned to the
        last cores this process may use. None: all of them but one, left to the thread that launches GPU work.
    pin_launcher: whether a thread that calls the engine's step() is pinned (until the engine closes) to the
        cores the CPU attention worker leaves free, where the staggered plan runs on CUDA. None: no (with one
        core left free the step is the same either way, and the launch slower on that one core).
    max_num_seqs: most requests in one step.
    max_num_batched_tokens: most tokens in one step (the chunked-prefill budget).
    prefill_tokens_while_decoding: most prompt tokens a step takes into the device pool while requests decode
        (Sarathi-Serve's stall-free batching): a decode step's GEMMs read every weight whatever its rows, so a
        few hundred prompt tokens ride along almost free, and steps stay short and uniform, which keeps the
        staggered plan's CPU job busy (it advances one layer per step, however long the step). A host-pool
        prompt is still taken whole (a continued host chunk attends on the CPU). For a large
        max_num_batched_tokens (whole host prompts): e.g. 256. None: no cap beyond max_num_batched_tokens (whose
        default already keeps steps short; a small cap would slow the admission of a long-prompt batch).
    growth_reserve: the share of each device-pool request's remaining tokens (to its max_new_tokens) for which
        the device pool keeps free blocks before it admits or resumes another request (SGLang's new-token
        ratio): a pool filled to its last block parks a request each time one grows, and a park and its resume
        hold the GPU for a few steps. 0: admit while the first chunk fits (and parks ahead keep their look-ahead);
        the default keeps room for 15% (the optimum is flat over 0.1-0.2; an early-EOS workload wants less).
    max_model_len: longest prompt + generation; None: the model's max_position_embeddings.
    preemption: what happens to a request evicted when its pool is full: "swap" (its blocks move to the other
        pool when it has room and is not running requests there; else recompute) or "recompute" (blocks freed,
        prompt + generated tokens prefilled again later).
    compile: run the model through torch.compile(backend="apex"); False runs the HF modules eagerly with their
        attention routed to the paged runner (on a CPU with oneDNN-packed fp32 linears): no dynamo trace, so a
        process's first answer comes ~20-40 s sooner on two cores, for ~12% fewer tokens/s (the main job's CPU
        default); also for debugging and models the compiler cannot capture.
    inner: what the apex backend hands the rewritten graph to: "inductor", "eager", or None (the backend's
        default: inductor on CUDA, eager on CPU). "inductor" on CPU also freezes the weights into the graph
        (oneDNN-packed linear layers; minutes of compiling on a small machine, faster steps; weights changed
        after the first step are not seen).
    cuda_graphs: on CUDA with `compile`, decode steps of the device pool replay whole-forward CUDA graphs
        captured per batch size (see `capture_sizes`); False runs every step through the compiled code
        (debugging). Ignored on the CPU.
    mixed_graphs: with `cuda_graphs`, steps that hold prompt chunks (with or without decode rows), every row in
        the device pool, replay one whole-forward graph each (attention in a fixed layout, one graph per
        padded size, captured the first time a size is met); False: such steps run piecewise up to 512 rows
        (graphs between eager attention calls) and uncaptured above, as do steps with host-pool rows.
    async_scheduling: queue a decode step while the previous one runs on the GPU, its input ids taken from
        the previous step's sampled ids on the device, so that scheduling and the step's metadata are off the
        critical path. Only steps whose rows all decode in the device pool (beside the staggered block, whose
        re-entering rows take the previous step's samples on the device too) run ahead, and only while no
        waiting or parked request could start in that step; a request that stops by EOS or a stop string gets
        one extra row, discarded. None: on
        CUDA (on a CPU the step runs on the host thread itself, so nothing would overlap).
    capture_sizes: batch sizes captured (None: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs); a decode step
        runs the smallest size >= its batch, larger batches run uncaptured.
    objective: what offload="auto" serves with the staggered plan: "makespan" (a batch judged by its last token:
        the pipeline takes the waiting requests the device pool would reach last, where they are predicted to
        finish sooner there), "latency" (online arrivals judged by TTFT and TPOT: no request enters the pipeline,
        whose members gain a token per lanes x (layers + 1) steps), or "auto": "latency" once requests arrive
        through the engine's asynchronous front (`AsyncEngine`, the server), else "makespan".
    tuning: the plans' control-law constants (`TuningConfig`).
    """

    gpu_cache_size: Optional[int] = None
    cpu_cache_size: Optional[int] = None
    block_size: int = 16
    offload: Union[str, float] = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_tokens_while_decoding: Optional[int] = None
    growth_reserve: float = 0.15
    max_model_len: Optional[int] = None
    preemption: str = "swap"
    compile: bool = True
    inner: Optional[str] = None
    cuda_graphs: bool = True
    mixed_graphs: bool = True
    async_scheduling: Optional[bool] = None
    capture_sizes: Optional[Sequence[int]] = None
    stagger_width: Union[int, str, None] = None
    stagger_lanes: Optional[int] = None
    cpu_attention_threads: Optional[int] = None
    pin_launcher: Optional[bool] = None
    objective: str = "auto"
    tuning: TuningConfig = dataclasses.field(default_factory=TuningConfig)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"ApexConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("gpu_cache_size", "cpu_cache_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                hint = f" (e.g. int({value!r}))" if isinstance(value, float) and value == value else ""
                raise ValueError(f"ApexConfig.{name} must be an int number of bytes or None, got "
                                 f"{type(value).__name__} {value!r}{hint}")
            if value is not None and value < 0:
                raise ValueError(f"ApexConfig.{name} must be a non-negative number of bytes or None, got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):  # ints (max_model_len: or None)
            value = getattr(self, name)
            if (value is not None or name != "max_model_len") and (isinstance(value, bool)
                                                                    or not isinstance(value, int)):
                raise ValueError(f"ApexConfig.{name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("compile", "cuda_graphs", "mixed_graphs"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"ApexConfig.{name} must be True or False, got {type(value).__name__} {value!r}")
        for name in ("preemption", "inner"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"ApexConfig.{name} must be a string, got {type(value).__name__} {value!r}")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"ApexConfig.block_size must be a power of two in 16..256, got {bs!r}")
        off = self.offload
        if isinstance(off, str):
            if off not in OFFLOAD_MODES:
                raise ValueError(f"ApexConfig.offload must be one of {OFFLOAD_MODES} or a fraction, got {off!r}")
        elif isinstance(off, bool) or not isinstance(off, (int, float)) or not 0.0 <= off <= 1.0:
            raise ValueError(f"ApexConfig.offload as a number must be a fraction in [0, 1], got {off!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"ApexConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"ApexConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        cap = self.prefill_tokens_while_decoding
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"ApexConfig.prefill_tokens_while_decoding must be a positive number of tokens or None, "
                             f"got {cap!r}")
        reserve = self.growth_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0.0 <= reserve <= 1.0:
            raise ValueError(f"ApexConfig.growth_reserve must be a share in [0, 1], got {reserve!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"ApexConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"ApexConfig.preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"ApexConfig.async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.capture_sizes is not None:
            sizes = list(self.capture_sizes)
            if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
                raise ValueError(f"ApexConfig.capture_sizes must be positive batch sizes, got {self.capture_sizes!r}")
            self.capture_sizes = tuple(sorted(set(sizes)))
        if self.stagger_lanes not in (None, 1, 2):
            raise ValueError(f"ApexConfig.stagger_lanes must be 1, 2 or None, got {self.stagger_lanes!r}")
        width = self.stagger_width
        if width is not None and width != "auto" and (isinstance(width, bool) or not isinstance(width, int)
                                                      or width < 1):
            raise ValueError(f"ApexConfig.stagger_width must be a positive number of rows, 'auto' or None, "
                             f"got {width!r}")
        threads = self.cpu_attention_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"ApexConfig.cpu_attention_threads must be a positive thread count or None, "
                             f"got {threads!r}")
        if self.pin_launcher is not None and not isinstance(self.pin_launcher, bool):
            raise ValueError(f"ApexConfig.pin_launcher must be True, False or None, got {self.pin_launcher!r}")
        if self.inner is not None and self.inner not in INNER_COMPILERS:
            raise ValueError(f"ApexConfig.inner must be one of {INNER_COMPILERS} or None, got {self.inner!r}")
        if not isinstance(self.tuning, TuningConfig):
            raise ValueError(f"ApexConfig.tuning must be a TuningConfig, got {self.tuning!r}")

    def host_fraction(self) -> float:
        """The fixed fraction of running requests placed in the host pool ("auto" has none: its model decides)."""
        if self.offload in ("auto", "never", "staggered"):
            return 0.0
        if self.offload == "all":
            return 1.0
        return float(self.offload)


def compile_cache_dir() -> str:
    """The directory of the persistent compile caches ($APEX_COMPILE_CACHE_DIR, default ~/.cache/apex_compile).

    Inductor's FX-graph and AOT-autograd caches and Triton's kernel cache go to its `inductor` and `triton`
    folders unless TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set, so a second process compiling the same
    model shape loads what the first compiled."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch: the same default, computed as inductor does
        import getpass
        import tempfile

        def default_cache_dir():
            return os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())

    root = envs.APEX_COMPILE_CACHE_DIR
    # Inductor writes its default into the variable the first time anything asks for its cache dir (importing
    # some transformers models does), and reads the variable on every later use: that default is replaced.
    if envs.TORCHINDUCTOR_CACHE_DIR in (None, os.path.abspath(default_cache_dir())):
        envs.set_value("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    envs.set_default("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    return root
