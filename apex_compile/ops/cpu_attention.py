"""CPU paged decode attention and KV-cache append (OpenMP + AVX-512/AVX2/portable C++ in csrc/openmp/).

The schemas are defined here (namespace ``apex``), with fake implementations so the ops trace under
torch.compile; the C++ library, loaded at import, registers the CPU kernels. KV cache layout: see
``apex_compile.ops.kv_layout`` and notes/CONVENTIONS.md ("KV cache contract").

Conventions:
- ``context_lens`` count the current token, already appended; a context of 0 is an error (every decode row
  attends at least to its own token).
- ``cache_append_cpu`` skips tokens whose slot is negative (padding rows); a slot >= num_blocks * block_size
  is an error. Duplicate slots in one call leave one of the rows (unspecified which).
- ``query`` must have the cache's dtype; accumulation is fp32; the output has the query's dtype.
- Threads: up to ``torch.get_num_threads()`` (fewer only when a call has fewer work items, or less than
  64 KiB of K+V per thread; see ``cpu_attention_work_split``).
- ``*_multi`` variants take lists of cache pairs (one geometry and dtype) and an int32 ``cache_index`` naming
  each row's pair: every layer's rows in one call.
- Kernel path: best of avx512 > avx2 > scalar that the CPU supports, or the one named by the environment
  variable ``APEX_CPU_ISA`` (read on every call; see ``cpu_isa``).
"""
import ctypes
import itertools
import math
import mmap
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from apex_compile import _build
from apex_compile.ops._library import LIB

LIB.define(
    "cache_append_cpu(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()"
)
LIB.define(
    "paged_attention_cpu(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor context_lens, float? scale=None) -> Tensor"
)
LIB.define(
    "cache_append_cpu_multi(Tensor key, Tensor value, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
    "Tensor cache_index, Tensor slot_mapping) -> ()"
)
LIB.define(
    "paged_attention_cpu_multi(Tensor query, Tensor[] key_caches, Tensor[] value_caches, Tensor cache_index, "
    "Tensor block_tables, Tensor context_lens, float? scale=None) -> Tensor"
)
LIB.define(
    "stagger_cpu_job(Tensor staged, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor cache_index, "
    "Tensor block_tables, Tensor context_lens, Tensor slot_mapping, Tensor? rows, int num_heads, float scale, "
    "Tensor(c!) out, Tensor ready_flags, int[] ready_values, float timeout_s, Tensor(d!) timings) -> ()"
)
LIB.define(
    "stagger_layer_job(Tensor staged, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor cache_index, "
    "Tensor block_tables, Tensor context_lens, Tensor slot_mapping, Tensor? rows, int num_heads, float scale, "
    "Tensor(c!) out, Tensor ready_flags, Tensor(d!) done_flags, int turn, float timeout_s, Tensor(e!) timings) -> ()"
)
LIB.define("wait_host_flags(Tensor flags, int[] values, float timeout_s) -> ()")
LIB.define("cpu_isa_code() -> int")
LIB.define("cpu_attention_work_split(int items_per_thread, int min_item_bytes, int min_thread_bytes) -> int[]")
# The layered jobs' C++ runner (`StaggerRunner`): runtime only, never traced.
LIB.define("stagger_runner_start(Tensor[] key_caches, Tensor[] value_caches, int[] cores) -> int")
LIB.define(
    "stagger_runner_submit(int runner, int turn, Tensor? staged, Tensor? cache_index, Tensor? block_tables, "
    "Tensor? context_lens, Tensor? slot_mapping, Tensor? rows, int num_heads, float scale, Tensor(a!) out, "
    "Tensor ready_flags, Tensor(b!) done_flags, float timeout_s, Tensor? gate, int gate_value) -> ()"
)
LIB.define("stagger_runner_poll(int runner) -> Tensor")
LIB.define("stagger_runner_state(int runner) -> Tensor")
LIB.define("stagger_runner_drain(int runner) -> ()")
LIB.define("stagger_runner_stop(int runner) -> ()")
# The prompt K/V exports' C++ lander (`ExportLander`): runtime only, never traced.
LIB.define("kv_export_start(Tensor copied, Tensor(a!) landed, int threads, float timeout_s) -> int")
LIB.define(
    "kv_export_submit(int lander, int index, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slots) -> ()"
)
LIB.define("kv_export_poll(int lander) -> ()")
LIB.define("kv_export_stop(int lander) -> ()")

_ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
# Pages (4 KiB) by which each huge-page tensor starts after the one allocated before it (mod a huge page), still
# wholly on huge pages; 0: every one starts on a huge-page boundary. Tensors that all start on 2 MiB boundaries
# put a layer's K and V, and every layer, on the same low address bits, where cache sets and memory banks
# collide; plain allocations fall a page apart, and so does this.
HUGE_PAGE_SHIFT_PAGES = 1
_shift_count = itertools.count()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_cpu(op: str, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        torch._check(tensor.device.type == "cpu", lambda: f"{op}: {name} must be a CPU tensor, got {tensor.device}")


@torch.library.register_fake("apex::cache_append_cpu", lib=LIB)
def _cache_append_cpu_fake(key, value, key_cache, value_cache, slot_mapping):
    _check_cpu("cache_append_cpu", key=key, value=value, key_cache=key_cache, value_cache=value_cache,
               slot_mapping=slot_mapping)


@torch.library.register_fake("apex::paged_attention_cpu", lib=LIB)
def _paged_attention_cpu_fake(query, key_cache, value_cache, block_tables, context_lens, scale=None):
    _check_cpu("paged_attention_cpu", query=query, key_cache=key_cache, value_cache=value_cache,
               block_tables=block_tables, context_lens=context_lens)
    torch._check(query.dim() == 3, lambda: f"query must be [num_seqs, num_heads, head_dim], got {query.shape}")
    torch._check(query.dtype == key_cache.dtype, lambda: f"query dtype {query.dtype} must equal {key_cache.dtype}")
    return query.new_empty(query.shape)


@torch.library.register_fake("apex::cache_append_cpu_multi", lib=LIB)
def _cache_append_cpu_multi_fake(key, value, key_caches, value_caches, cache_index, slot_mapping):
    _check_cpu("cache_append_cpu_multi", key=key, value=value, cache_index=cache_index, slot_mapping=slot_mapping)


@torch.library.register_fake("apex::paged_attention_cpu_multi", lib=LIB)
def _paged_attention_cpu_multi_fake(query, key_caches, value_caches, cache_index, block_tables, context_lens,
                                    scale=None):
    _check_cpu("paged_attention_cpu_multi", query=query, cache_index=cache_index, block_tables=block_tables,
               context_lens=context_lens)
    torch._check(query.dim() == 3, lambda: f"query must be [num_seqs, num_heads, head_dim], got {query.shape}")
    return query.new_empty(query.shape)


@torch.library.register_fake("apex::stagger_cpu_job", lib=LIB)
def _stagger_cpu_job_fake(staged, key_caches, value_caches, cache_index, block_tables, context_lens, slot_mapping,
                          rows, num_heads, scale, out, ready_flags, ready_values, timeout_s, timings):
    _check_cpu("stagger_cpu_job", staged=staged, out=out, cache_index=cache_index, timings=timings)


@torch.library.register_fake("apex::stagger_layer_job", lib=LIB)
def _stagger_layer_job_fake(staged, key_caches, value_caches, cache_index, block_tables, context_lens, slot_mapping,
                            rows, num_heads, scale, out, ready_flags, done_flags, turn, timeout_s, timings):
    _check_cpu("stagger_layer_job", staged=staged, out=out, cache_index=cache_index, ready_flags=ready_flags,
               done_flags=done_flags, timings=timings)


@torch.library.register_fake("apex::wait_host_flags", lib=LIB)
def _wait_host_flags_fake(flags, values, timeout_s):
    _check_cpu("wait_host_flags", flags=flags)


_build.load_cpu_library()  # the C++ library registers the CPU kernels of the schemas above


def allocate_kv_cache_cpu(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, pin_memory: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns uninitialised (key_cache, value_cache), each [num_blocks, num_kv_heads, block_size, head_dim].

    Only tokens written by `cache_append_cpu` (or copied in with `copy_blocks`) are ever read. `pin_memory`
    page-locks the pool for asynchronous copies to and from a GPU (needs CUDA). Unpinned pools are backed by
    transparent huge pages where Linux allows it (block tables scatter reads over the pool; huge pages save
    TLB misses).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype must be one of {_DTYPES}, got {dtype}")
    if num_blocks < 1 or num_kv_heads < 1:
        raise ValueError(f"num_blocks and num_kv_heads must be >= 1, got {num_blocks}, {num_kv_heads}")
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 16..256, got {block_size}")
    if head_dim < 16 or head_dim > 256 or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 in 16..256, got {head_dim}")
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if pin_memory:
        return tuple(torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(2))
    return tuple(_huge_page_tensor(shape, dtype) for _ in range(2))


def _huge_page_tensor(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory starts on a huge-page boundary (Linux, 4 MiB or more; or
    HUGE_PAGE_SHIFT_PAGES pages after the previous one's start, mod a huge page), advised MADV_HUGEPAGE: a
    layer's cache of a few MiB would otherwise lose up to a huge page at each end to 4 KiB pages.

    The memory is a private anonymous mapping of its own and the tensor's storage starts where the tensor does:
    torch's `is_pinned` (and so a copy's choice to run asynchronously) looks at the storage's first byte, which
    must lie inside the range the host pool page-locks (`kv_manager.HostRegistration`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes < (4 << 20):
        return torch.empty(shape, dtype=dtype)
    shift = next(_shift_count) * HUGE_PAGE_SHIFT_PAGES * mmap.PAGESIZE % _HUGE_PAGE
    memory = mmap.mmap(-1, nbytes + shift + 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # the storage keeps the mapping alive
    start = -whole.data_ptr() % _HUGE_PAGE
    # advised from the boundary before it to the one after it: the shifted tensor's pages are huge pages too
    _advise_huge_pages(whole[start:start + -(-(shift + nbytes) // _HUGE_PAGE) * _HUGE_PAGE])
    raw = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=start + shift)
    return raw.view(dtype).view(shape)


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Best effort madvise(MADV_HUGEPAGE) on the whole pages inside a fresh (untouched) tensor's memory."""
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.nbytes) // page * page
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def cache_append_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (int64 [num_tokens],
    slot = block_id * block_size + offset); tokens with a negative slot are skipped."""
    torch.ops.apex.cache_append_cpu(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Decode attention of query [num_seqs, num_heads, head_dim] (may be strided) over each sequence's cached
    tokens; block_tables int32 [num_seqs, max_blocks], context_lens int32 [num_seqs] (>= 1). Returns
    [num_seqs, num_heads, head_dim] in the query's dtype; scale defaults to head_dim ** -0.5."""
    return torch.ops.apex.paged_attention_cpu(query, key_cache, value_cache, block_tables, context_lens, scale)


def cache_append_cpu_multi(key: torch.Tensor, value: torch.Tensor, key_caches: List[torch.Tensor],
                           value_caches: List[torch.Tensor], cache_index: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """`cache_append_cpu` over several cache pairs of one geometry and dtype (e.g. every layer's) in one call:
    token t goes to key_caches[cache_index[t]] / value_caches[cache_index[t]] (cache_index int32 [num_tokens])."""
    torch.ops.apex.cache_append_cpu_multi(key, value, key_caches, value_caches, cache_index, slot_mapping)


def paged_attention_cpu_multi(query: torch.Tensor, key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                              cache_index: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: Optional[float] = None) -> torch.Tensor:
    """`paged_attention_cpu` over several cache pairs of one geometry and dtype in one call (one work split and
    one parallel region): sequence s reads key_caches[cache_index[s]] / value_caches[cache_index[s]]
    (cache_index int32 [num_seqs]); block ids index that pair."""
    return torch.ops.apex.paged_attention_cpu_multi(query, key_caches, value_caches, cache_index, block_tables,
                                                    context_lens, scale)


READY_TIMEOUT_S = 120.0
"""How long a CPU job waits for its inputs before raising (they come from copies already queued on a GPU)."""


def stagger_cpu_job(staged: torch.Tensor, key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                    cache_index: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    slot_mapping: torch.Tensor, rows: Optional[torch.Tensor], num_heads: int, scale: float,
                    out: torch.Tensor, ready_flags: Optional[torch.Tensor] = None,
                    ready_values: Sequence[int] = (), timeout_s: float = READY_TIMEOUT_S) -> Tuple[float, float]:
    """The staggered plan's CPU job as one call that needs no Python (and so no GIL) once started: waits until
    ready_flags[i] >= ready_values[i] for every i (see `wait_host_flags`), then appends the K/V of the picked
    rows of `staged` [layers, width, num_heads + 2 * num_kv_heads, head_dim] (each row's q, k, v heads side by
    side) to the caches `cache_index` names and writes their attention into the same rows of `out` [layers,
    width, num_heads, head_dim]; other rows of `out` are left as they are. rows: int64 indices into the
    flattened layers * width rows (None: all of them, in order); cache_index / block_tables / context_lens /
    slot_mapping hold one entry per picked row. Returns (seconds waiting for the flags, seconds running)."""
    timings = torch.zeros(2, dtype=torch.float64)
    flags = torch.zeros(0, dtype=torch.int64) if ready_flags is None else ready_flags
    torch.ops.apex.stagger_cpu_job(staged, key_caches, value_caches, cache_index, block_tables, context_lens,
                                   slot_mapping, rows, num_heads, scale, out, flags, list(ready_values), timeout_s,
                                   timings)
    waited, ran = timings.tolist()
    return waited, ran


def stagger_layer_job(staged: torch.Tensor, key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                      cache_index: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                      slot_mapping: torch.Tensor, rows: Optional[torch.Tensor], num_heads: int, scale: float,
                      out: torch.Tensor, ready_flags: torch.Tensor, done_flags: torch.Tensor, turn: int,
                      timeout_s: float = READY_TIMEOUT_S, with_busy: bool = False,
                      with_call: bool = False) -> Tuple[float, ...]:
    """The one-lane staggered plan's CPU job: `stagger_cpu_job` layer by layer, as the GPU step that stages the
    layers runs. Layer l's rows (those of [l * width, (l + 1) * width) in use: rows sorted by layer, cache_index
    naming each row's layer) are appended and attended once ready_flags[l] >= turn; then done_flags[l] = turn
    (int64 [layers] each, counters that only grow; release order: the layer's rows of `out` are written). Every
    layer's flags are waited for and raised, with rows or without. Raises RuntimeError if the whole job waits
    more than timeout_s (done flags of the layers not reached stay as they were). Returns (seconds waiting for
    the flags, summed over layers, seconds running without them), with_busy: and the team's thread-seconds
    inside work items, with_call: and the whole C++ call's seconds (its
    checks, plans and frees included; against the caller's wall time, what the call costs beyond its work)."""
    timings = torch.zeros(6 if with_call else 5 if with_busy else 2, dtype=torch.float64)
    torch.ops.apex.stagger_layer_job(staged, key_caches, value_caches, cache_index, block_tables, context_lens,
                                     slot_mapping, rows, num_heads, scale, out, ready_flags, done_flags, int(turn),
                                     timeout_s, timings)
    values = timings.tolist()
    extra = ([values[4]] if with_busy else []) + ([values[5]] if with_call else [])
    return (values[0], values[1], *extra)


class StaggerRunner:
    """The layered jobs' C++ runner: one thread, pinned to `cores` (empty: not pinned) with an OpenMP team that
    wide, runs `stagger_layer_job` for each submitted turn in submission order over the host pool's caches given
    here. Once submitted, a job needs no Python (nor its GIL) to start, finish or report. `poll` returns the
    finished jobs' records (RECORD_FIELDS) and raises the first failed job's error; a failed job sets its done flags
    to 1 << 62 so the device does not wait for it, and its record's "ran" is NaN."""

    RECORD_FIELDS = ("turn", "waited", "ran", "busy", "call", "gate_wait", "submitted", "started", "ended")

    def __init__(self, key_caches: List[torch.Tensor], value_caches: List[torch.Tensor], cores: Sequence[int]):
        self.handle: Optional[int] = torch.ops.apex.stagger_runner_start(list(key_caches), list(value_caches),
                                                                         [int(c) for c in cores])

    def submit(self, turn: int, out: torch.Tensor, ready_flags: torch.Tensor, done_flags: torch.Tensor,
               staged: Optional[torch.Tensor] = None, cache_index: Optional[torch.Tensor] = None,
               block_tables: Optional[torch.Tensor] = None, context_lens: Optional[torch.Tensor] = None,
               slot_mapping: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None, num_heads: int = 0,
               scale: float = 1.0, timeout_s: float = READY_TIMEOUT_S, gate: Optional[torch.Tensor] = None,
               gate_value: int = 0) -> None:
        """Queues turn's job (`stagger_layer_job`'s arguments; staged None: a turn without rows, whose done flags
        are set to turn once the jobs before it are done), to start once gate[0] >= gate_value when a gate is
        given. The tensors are held until the job is done."""
        torch.ops.apex.stagger_runner_submit(self._handle(), int(turn), staged, cache_index, block_tables,
                                             context_lens, slot_mapping, rows, int(num_heads), float(scale), out,
                                             ready_flags, done_flags, float(timeout_s), gate, int(gate_value))

    def poll(self) -> List[Tuple[float, ...]]:
        """The records of the jobs finished since the last poll, in order (raises a failed job's error once)."""
        return [tuple(r) for r in torch.ops.apex.stagger_runner_poll(self._handle()).tolist()]

    def drain(self) -> None:
        """Returns once every submitted job is done (releasing the GIL meanwhile)."""
        torch.ops.apex.stagger_runner_drain(self._handle())

    PHASES = ("idle", "waiting for its gate", "checking it", "running it")

    def state(self) -> Dict[str, object]:
        """What the runner's thread is doing now: jobs submitted, still queued and finished; its phase (PHASES) and
        the turn of the job in it (None while idle)."""
        submitted, queued, finished, phase, turn = torch.ops.apex.stagger_runner_state(self._handle()).tolist()
        return {"submitted": submitted, "queued": queued, "finished": finished, "phase": self.PHASES[phase],
                "turn": None if turn < 0 else turn}

    def close(self) -> None:
        """Runs the jobs still queued, then stops the thread (a second close does nothing)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            torch.ops.apex.stagger_runner_stop(handle)

    def _handle(self) -> int:
        if self.handle is None:
            raise RuntimeError("StaggerRunner: closed")
        return self.handle


class ExportLander:
    """The prompt K/V exports' C++ lander: one thread appends each submitted export into its host cache once
    copied[0] >= its index (a GPU raises it behind the export's copy into pinned memory), in submission order, then
    sets landed[0] to that index; `threads` OpenMP threads per append. Landing needs no Python, no GIL and no CUDA
    call. A failed export (or one whose flag did not come within timeout_s: the exports after it then fail at once,
    their flags coming in order) still sets landed; its error is raised by the next `poll` or `close`."""

    def __init__(self, copied: torch.Tensor, landed: torch.Tensor, threads: int, timeout_s: float = READY_TIMEOUT_S):
        self.handle: Optional[int] = torch.ops.apex.kv_export_start(copied, landed, int(threads), float(timeout_s))

    def submit(self, index: int, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Queues export `index` (above every earlier one): key/value [n, Hkv, D] into the caches at `slots`
        (int64 [n]); the tensors are held until it landed."""
        if self.handle is None:
            raise RuntimeError("ExportLander: closed")
        torch.ops.apex.kv_export_submit(self.handle, int(index), key, value, key_cache, value_cache, slots)

    def poll(self) -> None:
        """Lets go of the landed exports' tensors; raises the first failed export's error once."""
        if self.handle is not None:
            torch.ops.apex.kv_export_poll(self.handle)

    def close(self) -> None:
        """Lands the exports still queued, stops the thread and raises a failed one's error (a second close does
        nothing)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            torch.ops.apex.kv_export_stop(handle)


def wait_host_flags(flags: torch.Tensor, values: Sequence[int], timeout_s: float = READY_TIMEOUT_S) -> float:
    """Blocks (releasing the GIL) until flags[i] >= values[i] for every i; returns the seconds waited. flags is
    a CPU int64 tensor of counters that only grow, raised by whoever finishes what they stand for (a GPU copy
    into pinned memory queued after the guarded copies, another thread); raises RuntimeError after timeout_s.
    A negative value -v is soft: flags[i] >= v is waited for at most 30 ms (a hint when to start, not a guard)."""
    start = time.perf_counter()
    torch.ops.apex.wait_host_flags(flags, list(values), timeout_s)
    return time.perf_counter() - start


def cpu_isa() -> str:
    """Name of the kernel path the CPU ops will use now: "avx512", "avx2" or "scalar" (honours APEX_CPU_ISA;
    raises if it names a path this CPU lacks)."""
    return _ISA_NAMES[torch.ops.apex.cpu_isa_code()]


def cpu_attention_work_split(items_per_thread: int = 0, min_item_bytes: int = 0,
                             min_thread_bytes: int = 0) -> dict:
    """Process-wide work-split parameters of `paged_attention_cpu` (for tuning sweeps; results never depend
    on them): the guided divisor (each piece is the uncut work over threads * items_per_thread), smallest item
    (K+V bytes), K+V bytes per thread below which fewer threads are used. Arguments <= 0 keep the current
    value; returns the values now in effect."""
    values = torch.ops.apex.cpu_attention_work_split(items_per_thread, min_item_bytes, min_thread_bytes)
    return dict(zip(("items_per_thread", "min_item_bytes", "min_thread_bytes"), values))
