"""Hybrid decoding on one CUDA GPU: offload "auto" against "never" and fixed host shares, judged by ideal_gain.

Per shape (random LLaMA-shaped bf16 model) and device KV pool size (emulating smaller GPUs), in one run, each
mode at steady state: the engine is kept supplied with requests (so every batch, and the staggered pipeline,
stays full), and after a fill-in of --warm-steps steps the tokens generated over the next --window-steps steps
give its tokens/s; the median step of that window is its step time. Modes: never, auto, a fixed host share
(overlap plan), "staggered:W" (the staggered plan with W rows per step; "staggered:auto": the rows in use
follow the measured CPU job); a suffix "/1lane" or "/2lane" sets the staggered plan's lanes, "/pw" runs mixed
steps piecewise, "/pin" pins the launching thread off the worker's cores, "/t14" runs 14 CPU attention threads,
"/cap64" lets a decoding step take 64 device-pool prompt tokens (--prefill-while-decoding for the others),
"/reserve=0" sets ApexConfig.growth_reserve, "/width=8" gives an adaptive staggered block (auto,
"staggered:auto") that many rows (TuningConfig.auto_stagger_width), "/share=0.9" the CPU job's share of a step
(TuningConfig.job_share), "/host=48" gives the mode a host pool of that many GiB (instead of --host-gib),
"/hostreserve=0.3" the share of the host requests' remaining tokens the pipeline keeps host blocks free for
(TuningConfig.pipeline_reserve).
Per configuration also: ideal_gain (the tokens/s the CPU's measured attention
bandwidth could add: B_cpu / KV bytes a host request reads per step) with its inputs, auto's
offload efficiency (auto - never) / ideal_gain, the model's predicted decode step against the measured one, and
HF generate with its offloaded cache (KV in host memory) over as many requests as the device pool holds.
ideal_gain comes twice: at the workload's nominal mean context (prompt + new/2) and at the mean context of the
window's host tokens ("eff@host", the figure to judge by). A staggered host request gains a token per
num_layers + 1 steps, so within a window it stays near its prompt's length and reads less KV per token than the
nominal context says. Never named again ("never,auto,never/r2": an A-B-A order) makes the baseline the mean of
its runs: runs of one plan in one process differ by up to a few percent.

Steady state: a window's tokens come partly from requests prefilled before it (the staggered pipeline's members,
parked requests resuming without a prefill), and a mode whose window happens to hold fewer prefill steps reads
faster than it runs. So each mode also gets `steady_tokens_per_s`: the window's time with its own prefill taken
out (each prefill step over the decode median) and every window token charged its request's share of a prefill
(prompt / new_tokens prefill tokens per token; device tokens at never's seconds per prefill token, host tokens at
the larger of the mode's and never's); the efficiencies are given both ways. The default window is two request
lifetimes (2 x --new-tokens steps, at least 300), so that it does not sit in one phase of the request waves.

    python benchmarks/e2e_hybrid.py --out benchmarks/results/e2e_hybrid_<date>_<machine>.json
"""
import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import os
import platform
import re
import statistics
import sys
import time
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_throughput import SHAPES, kv_bytes_per_token, random_llama, timed_generate, write_json  # noqa: E402

from apex_compile import ApexConfig, SamplingParams, optimize  # noqa: E402
from apex_compile.config import TuningConfig  # noqa: E402
from apex_compile.ops import cpu_attention_work_split  # noqa: E402
from apex_compile.runtime.engine import PHASES  # noqa: E402
from apex_compile.runtime.kv_manager import HOST_POOL  # noqa: E402
from apex_compile.runtime.perf_model import (PerfModel, StepCalibration, online_predictions,  # noqa: E402
                                             step_host_context)
from apex_compile.runtime.perf_profile import cpu_attention_bandwidth, engine_profile  # noqa: E402

GiB = 1 << 30


FILL_SAMPLE = 20  # steps between two records of the rows' limits before the window (fill_limit_steps)
# the per-step RowLimit fields summarised over the window as (median, min, max) (row_limits); per step, auto's
# records also hold its model's last verdict and learned host gaps (row_limit_steps)
LIMIT_KEYS = ("measured", "guard", "ceiling", "limit", "share", "step_s", "members", "capacity", "parked", "prefill")


def huge_page_share(tensors, smaps: str = None) -> float:
    """Share of the memory mappings holding `tensors` that Linux backs with transparent huge pages
    (`smaps`, default /proc/self/smaps: AnonHugePages over Size; NaN where unknown): a host pool on 4 KiB pages
    costs the CPU attention TLB misses on its scattered blocks, so a probe or a job on fewer huge pages reads
    slower."""
    if smaps is None:
        try:
            with open("/proc/self/smaps") as f:
                smaps = f.read()
        except OSError:
            return float("nan")
    lines = smaps.splitlines()
    ranges = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    size = huge = 0
    inside = False
    for line in lines:
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(a < end and b > start for a, b in ranges)
        elif inside and head == "Size:":
            size += int(line.split()[1])
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1])
    return huge / size if size else float("nan")


def cpu_topology(root: str = "/sys/devices/system/cpu") -> dict:
    """The host's CPUs as Linux reports them: how many, in how many physical cores and sockets, and the SMT
    sibling groups (a CPU attention team on hyperthread siblings shares its cores' load ports with them)."""
    cores, siblings = set(), set()
    cpus = sorted(int(name[3:]) for name in os.listdir(root) if name[3:].isdigit() and name.startswith("cpu"))
    for cpu in cpus:
        topology = os.path.join(root, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as f:
                package = int(f.read())
            with open(os.path.join(topology, "core_id")) as f:
                cores.add((package, int(f.read())))
            with open(os.path.join(topology, "thread_siblings_list")) as f:
                siblings.add(f.read().strip())
        except OSError:
            return {"cpus": len(cpus)}
    shared = sorted(group for group in siblings if "," in group or "-" in group)
    return {"cpus": len(cpus), "cores": len(cores), "sockets": len({p for p, _ in cores}), "smt_groups": shared}


def host_pool_tensors(engine):
    pool = engine.kv.pools[HOST_POOL]
    return list(pool.key_caches) + list(pool.value_caches)


def probe_cpu_bandwidth(model, device_bytes: int, max_seqs: int, with_profile: bool = False):
    """(the engine's profile when `with_profile` (else None: with APEX_COMPILE_PROFILE_REFRESH it is measured
    anew), B_cpu now: the CPU attention op's bytes/s over a 1 GiB host pool, `cpu_attention_bandwidth`, that
    pool's share on huge pages), from an engine of its own."""
    probe = optimize(model, ApexConfig(offload="never", gpu_cache_size=device_bytes, cpu_cache_size=1 << 30,
                                       max_num_seqs=max_seqs))
    try:
        bandwidth = cpu_attention_bandwidth(probe.engine)
        profile = engine_profile(probe.engine) if with_profile else None
        return profile, bandwidth, huge_page_share(host_pool_tensors(probe.engine))
    finally:
        probe.close()


def pipeline_bound(engine, request_tokens: int) -> dict:
    """What bounds the staggered pipeline's members now: its rows' capacity, or the host pool (each member keeps
    blocks for its whole length, `request_tokens`; `Scheduler.park_room` is kept free to park)."""
    kv, block = engine.kv, engine.kv.shape.block_bytes
    return {"members": engine.stagger.num_members, "capacity": engine.stagger.capacity,
            "host_free_bytes": kv.num_free(HOST_POOL) * block, "host_bytes": kv.pools[HOST_POOL].num_blocks * block,
            "member_bytes": kv.blocks_for(request_tokens) * block,
            "park_room_bytes": engine.scheduler.pipeline_rules.park_room() * block, "stalled": engine.stagger.stalled}


def steady_state(engine, prompts, sampling, warm_steps, window_steps, fill_steps=0, probe=None, start_step=0):
    """Tokens/s over `window_steps` steps after `warm_steps`, the engine topped up from `prompts` (cycled) so
    requests always wait; with the staggered plan first up to `fill_steps` steps until its pipeline is full
    (a host request lives 2 * (layers + 1) steps per token, so the window would otherwise be its ramp).
    Returns {tokens_per_s, host_tokens, fill_steps, fill_s, steps: [(gpu rows, cpu rows, mean context,
    seconds, prefill tokens)] of the window, prefill: [(seconds, prefill tokens)] of every step outside it,
    decode_phase_s: the median main-thread seconds per part of `engine.step()` over the window's decode steps,
    window_start: the steps run before the window, queued_ahead: per window step whether it was queued ahead,
    not_ahead: the window's steps not queued ahead per reason (EngineStats.not_ahead), unqueued_excess_s: their
    time above a queued step's median, window_events}. More warm-up steps run until `start_step` steps are done:
    the workload's requests start together and finish in waves, so windows of modes compared must start at the
    same step (a pipeline's fill would otherwise put its window in another phase of the waves).
    probe(one_step), when given, runs after the window with the engine still full (its result under "probe")."""
    stagger = engine.stagger
    supplied = 0
    scheduled = []
    schedule = engine._schedule

    def recording_schedule():
        chunks = schedule()
        scheduled.append(sum(c.num_tokens for c in chunks if not c.decodes))
        return chunks

    engine._schedule = recording_schedule

    def top_up():
        nonlocal supplied
        while len(engine.scheduler.waiting) < 8:
            engine.add_request(prompts[supplied % len(prompts)], sampling)
            supplied += 1

    def one_step():
        top_up()
        running = list(engine.scheduler.running)
        # the requests whose token this step comes from the host pool (the pipeline's, or running there); not
        # those that once ran there (a request parked out of the pipeline resumes in the device pool)
        host_ids = {r.request_id for r in running if engine.kv.pool_of(r.request_id) == HOST_POOL}
        on_host = len(host_ids)
        if stagger is not None:
            host_ids.update(r.request_id for r in stagger.members())
        # the block's rows holding a request: the lane's mean group size (each group is one layer of the CPU job),
        # unrounded, as the engine's gap samples take it, so the model prices a 1.6-row job as such
        staggered = stagger.host_rows if stagger is not None else 0
        context = sum(r.num_tokens for r in running) / max(len(running), 1)
        # the context the step's CPU job prices its rows at (a staggered host request lags the device rows')
        host_context = stagger.rows.context if staggered else None
        before = dict(engine.stats.phase_seconds)
        counts = _event_counts(engine)
        scheduled_before = len(scheduled)
        queued.append(engine._ahead is not None)  # this step was queued by the call before
        start = time.perf_counter()
        # a step that hangs dumps every thread's Python stack (no GIL needed); not a mode's first steps, whose
        # compiles can outlast it (faulthandler's dump of a thread inside a compile can crash the process)
        watched = WATCHDOG_S and engine.stats.steps >= WATCHDOG_AFTER_STEPS
        if watched:
            faulthandler.dump_traceback_later(WATCHDOG_S)
        sampled = engine.step()
        if watched:
            faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - start
        # a step queued ahead by the call before (async scheduling) was not scheduled here: it only decodes
        prefill_tokens = scheduled[-1] if len(scheduled) > scheduled_before else 0
        phases.append({k: v - before[k] for k, v in engine.stats.phase_seconds.items()})
        if stagger is not None:  # the rows' limits after the step: which of them binds, and when
            r = stagger.rows
            limits.append({"measured": r.measured, "guard": r.guard, "ceiling": r.ceiling, "limit": r.limit,
                           "share": r.share(), "fit": r.job_fit(),  # (fixed s, s per context token of a row)
                           "host_context": r.context,  # the job's rows' mean context (auto's model prices them so)
                           "step_s": r.step or 0.0, "members": stagger.num_members, "capacity": stagger.capacity,
                           "closed": stagger.closed,
                           "parked": len(engine.scheduler.parked), "prefill": prefill_tokens})
            policy = engine.auto_policy
            if policy is not None:  # auto: its model's last verdict and the host gaps it learned (GPU-only, host)
                limits[-1].update(model_rows=engine.plan.model_rows,
                                  gap_s=[policy.gap.seconds(False), policy.gap.seconds(True)])
        events.append({k: v - counts[k] for k, v in _event_counts(engine).items() if v != counts[k]})
        # each host token's context: the KV its attention read (ideal_gain at the window's own host contexts)
        hosted = [r.num_tokens - 1 for r in sampled if r.request_id in host_ids]
        return (len(running) - on_host, on_host + staggered, context, seconds, prefill_tokens, host_context), hosted

    phases = []  # per step: the main thread's seconds per part of engine.step() (EngineStats.phase_seconds)
    limits = []  # per step with the staggered plan: its RowLimit after the step (job fit + guard, guard, ceiling)
    events = []  # per step: what changed in the engine's counters (_event_counts) during it
    queued = []  # per step: whether the call before queued it ahead (async scheduling)
    begin = time.perf_counter()
    filled, prefill = 0, []

    def fill():
        nonlocal filled
        while stagger is not None and filled < fill_steps and stagger.num_members < stagger.capacity:
            step, _ = one_step()
            prefill.append((step[3], step[4]))
            filled += 1

    fill()
    for _ in range(warm_steps):
        step, _ = one_step()
        prefill.append((step[3], step[4]))
    fill()  # an adaptive pipeline's capacity follows its measured rows: full again at the window's start
    while len(prefill) < start_step:
        step, _ = one_step()
        prefill.append((step[3], step[4]))
    window_start = len(prefill)
    fill_s = time.perf_counter() - begin
    filled_share = (stagger.num_members / max(stagger.capacity, 1) if stagger is not None and stagger.capacity
                    else None)  # < 1: cut by fill_steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    # Python's collections in the window (any thread: the collector holds the GIL), per generation
    collections_seen = {}
    collecting = {}

    def on_gc(phase, info):
        if phase == "start":
            collecting["t"] = time.perf_counter()
        elif "t" in collecting:
            seconds = time.perf_counter() - collecting.pop("t")
            count, total, longest = collections_seen.get(info["generation"], (0, 0.0, 0.0))
            collections_seen[info["generation"]] = (count + 1, total + seconds, max(longest, seconds))

    gc.callbacks.append(on_gc)
    begin, tokens, host_tokens, host_context, steps = time.perf_counter(), engine.stats.generated_tokens, 0, 0, []
    ahead, not_ahead = engine.stats.ahead_steps, dict(engine.stats.not_ahead)
    captured = engine.plan.captured_seconds()
    try:
        for _ in range(window_steps):
            step, hosted = one_step()
            steps.append(step)
            host_tokens += len(hosted)
            host_context += sum(hosted)
    finally:
        gc.callbacks.remove(on_gc)
    seconds = time.perf_counter() - begin
    captured = engine.plan.captured_seconds() - captured  # graphs of shapes first met inside the window
    ahead = engine.stats.ahead_steps - ahead  # the window's steps queued before the previous step's tokens
    not_ahead = {k: v - not_ahead.get(k, 0) for k, v in engine.stats.not_ahead.items() if v != not_ahead.get(k, 0)}
    window_queued = queued[-window_steps:] if window_steps else []
    # the window's time in steps not queued ahead, above the median of those that were (the GPU idle meanwhile)
    queued_median = statistics.median([s[3] for s, q in zip(steps, window_queued) if q] or [0.0])
    unqueued_excess = sum(max(s[3] - queued_median, 0.0) for s, q in zip(steps, window_queued) if not q)
    window_phases = phases[-window_steps:] if window_steps else []
    window_limits = limits[-window_steps:] if window_steps else []
    decode_phases = [p for p, s in zip(window_phases, steps) if not s[4]]
    prefill_phases = [p for p, s in zip(window_phases, steps) if s[4]]
    generated = engine.stats.generated_tokens - tokens
    slow = slow_steps(steps, window_phases, events[-window_steps:] if window_steps else [])
    pipeline_end = pipeline_bound(engine, len(prompts[0]) + sampling.max_new_tokens) if stagger is not None else None
    probed = probe(lambda: one_step()[0]) if probe is not None else None
    engine.abort()
    engine._schedule = schedule
    return {"tokens_per_s": generated / seconds, "window_s": seconds, "tokens": generated,
            "host_tokens": host_tokens, "host_context": host_context / host_tokens if host_tokens else None,
            # {generation: [collections, seconds, longest]} in the window
            "window_gc": {str(g): list(v) for g, v in sorted(collections_seen.items())},
            "fill_steps": filled, "fill_s": fill_s, "pipeline_filled": filled_share,
            "ahead_steps": ahead, "not_ahead": not_ahead, "unqueued_excess_s": unqueued_excess,
            "pipeline_end": pipeline_end,
            "window_capture_s": captured,
            "queued_ahead": window_queued, "window_start": window_start,
            # per window step: what changed in the engine's counters (_event_counts), to tie slow steps to parks
            "window_events": events[-window_steps:] if window_steps else [],
            "steps": steps, "prefill": prefill,
            "row_limits": {k: (statistics.median(x[k] for x in window_limits), min(x[k] for x in window_limits),
                               max(x[k] for x in window_limits)) for k in LIMIT_KEYS} if window_limits else None,
            "row_limit_steps": window_limits,  # per window step (runs of a zero ceiling show here, not in the median)
            # every FILL_SAMPLE-th step before the window (fill, warm-up): how the rows and members ramped
            "fill_limit_steps": [dict(x, step=i) for i, x in enumerate(limits[:window_start]) if i % FILL_SAMPLE == 0],
            "probe": probed, "slow_decode_steps": slow,
            "excess_by_kind": excess_by_kind(steps, window_queued, events[-window_steps:] if window_steps else []),
            # per window step: the main thread's microseconds per part of engine.step(), in PHASES order
            "phase_names": list(PHASES),
            "window_phase_us": [[round(p[k] * 1e6) for k in PHASES] for p in window_phases],
            "decode_phase_s": {k: statistics.median(p[k] for p in decode_phases)
                               for k in decode_phases[0]} if decode_phases else None,
            "prefill_phase_s": {k: statistics.median(p[k] for p in prefill_phases)
                                for k in prefill_phases[0]} if prefill_phases else None}


def _event_counts(engine) -> dict:
    """Counters whose change during a step says what else it did: requests moved between pools, parked
    (swapped out) or recomputed, the running requests (one finished or joined) and the staggered pipeline's
    members."""
    stats, stagger = engine.stats, engine.stagger
    return {"moved": stats.moved, "parked": stats.parked, "recomputed": stats.recomputed,
            "running": len(engine.scheduler.running),
            "members": stagger.num_members if stagger is not None else 0}


def slow_steps(steps, phases, events, factor=1.5):
    """The window's decode-only steps slower than `factor` x their median: how many, their share of the
    window's time above that median, their median main-thread phases, and how often each event (_event_counts)
    happened in them against the other decode steps (a long step's cause: a swap, a pipeline join, ...)."""
    decode = [(s[3], p, e) for s, p, e in zip(steps, phases, events) if not s[4]]
    if not decode:
        return None
    median = statistics.median(t for t, _, _ in decode)
    slow = [d for d in decode if d[0] > factor * median]
    rest = [d for d in decode if d[0] <= factor * median]

    def rate(group, key):
        return sum(1 for _, _, e in group if key in e) / max(len(group), 1)

    keys = sorted({k for _, _, e in decode for k in e})
    return {"count": len(slow), "of": len(decode), "median_s": median,
            "excess_share": sum(t - median for t, _, _ in slow) / max(sum(s[3] for s in steps), 1e-12),
            "phase_s": {k: statistics.median(p[k] for _, p, _ in slow) for k in slow[0][1]} if slow else None,
            "event_rate": {k: (rate(slow, k), rate(rest, k)) for k in keys}}


def excess_by_kind(steps, queued, events, short=0.7):
    """The window's time above its median decode-only step, per kind of step: prompt or decode, queued ahead or
    not, and what changed during it (_event_counts: "parked+", "running-", ...). A step shorter than `short` x
    the median is counted with the step before it: a step that returns late (a park's copy, a resume) leaves
    the next one short, and counted alone the pair would read as one slow step. Returns {kind: [steps, excess
    seconds]}, largest excess first."""
    decode = [s[3] for s in steps if not s[4]]
    if not decode:
        return {}
    median = statistics.median(decode)
    kinds: Dict[str, list] = {}
    i = 0
    while i < len(steps):
        excess, j = steps[i][3] - median, i + 1
        while j < len(steps) and not steps[j][4] and steps[j][3] < short * median:
            excess += steps[j][3] - median
            j += 1
        kind = ("prompt" if steps[i][4] else "decode") + ("" if queued[i] else "/unqueued")
        changed = ",".join(sorted(f"{k}{'+' if v > 0 else '-'}" for k, v in events[i].items()))
        kind += f"/{changed}" if changed else ""
        entry = kinds.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += excess
        i = j
    return dict(sorted(kinds.items(), key=lambda kv: -abs(kv[1][1])))


def without_host_tokens(runs) -> list:
    """The modes other than never whose window decoded no token from the host pool (their tokens/s against
    never's is then no host gain: an auto that stopped its host rows ran never's plan)."""
    nevers = never_modes(runs)
    return [m for m, r in runs.items() if m not in nevers and not r["host_tokens"]]


def never_modes(runs) -> list:
    """The runs of plain never (its "/rN" repeats too, not e.g. "never/spinning"): the baseline."""
    return [m for m in runs if REPEAT_SUFFIX.sub("", m) == "never"]


def baseline(values: dict, runs) -> Optional[float]:
    """The mean of `values` (a figure per mode) over never's runs (None without one): runs of one plan in one
    process differ by up to a few percent, so never run first and last ("never,...,never/r2") is a steadier
    baseline than one run."""
    own = [values[m] for m in never_modes(runs) if m in values]
    return sum(own) / len(own) if own else None


def _decode_median(run) -> float:
    """The median step of a run's window without prompt chunks (all its steps if every one had some)."""
    decode = [s[3] for s in run["steps"] if not s[4]] or [s[3] for s in run["steps"]]
    return statistics.median(decode)


def amortized(run, prompt_len, new_tokens):
    """Tokens/s of the window with the prefill time its host tokens' requests would need at steady state
    added (a host request's prefill happens before the window: prompt_len / new_tokens prefill tokens per
    generated token, at the measured seconds per prefill token of the steps outside the window over their
    decode-only median, the median over steps with at least 256 prefill tokens). A secondary figure: the
    steps outside the window include graph captures, and few of them may have prefilled (their count is
    returned with it); the table and the efficiencies use the window's own tokens/s."""
    base = _decode_median(run)
    # the median over steps with a sizeable prefill (a few steps outside the window also capture graphs)
    per_step = [max(sec - base, 0.0) / tok for sec, tok in run["prefill"] if tok >= 256]
    per_token = statistics.median(per_step) if per_step else 0.0
    added = run["host_tokens"] * prompt_len / new_tokens * per_token
    return run["tokens"] / (run["window_s"] + added), per_token, len(per_step)


def steady_tokens_per_s(runs, prompt_len, new_tokens):
    """Each mode's tokens/s at steady state (module docstring): the window without its own prefill time, plus
    every window token's share of its request's prefill."""
    never = runs.get("never")
    rates = {}
    for m, run in runs.items():
        base = _decode_median(run)
        own_prefill = sum(max(s[3] - base, 0.0) for s in run["steps"] if s[4])
        device_rate = (never or run)["prefill_s_per_token"]
        host_rate = max(run["prefill_s_per_token"], device_rate)
        host = run["host_tokens"]
        charged = prompt_len / new_tokens * ((run["tokens"] - host) * device_rate + host * host_rate)
        rates[m] = run["tokens"] / (run["window_s"] - own_prefill + charged)
    return rates


PIECEWISE_SUFFIX = "/pw"  # a mode run with its mixed steps piecewise (mixed_graphs=False): the same-run A/B
LANE_SUFFIXES = {"/1lane": 1, "/2lane": 2}  # a mode run with that many staggered lanes (else the engine's default)
PIN_SUFFIX = "/pin"  # a mode run with the launching thread pinned off the worker's cores (pin_launcher=True)
THREADS_SUFFIX = re.compile(r"/t(\d+)\b")  # "/t14": a mode run with that many CPU attention threads
# "/split=4-32768-65536": a mode run with the CPU attention's work split set so (items_per_thread, min_item_bytes,
# min_thread_bytes; torch.ops.apex.cpu_attention_work_split), the op's own split restored after it
SPLIT_SUFFIX = re.compile(r"/split=(\d+)-(\d+)-(\d+)")
BLOCK_SUFFIX = re.compile(r"/bs(\d+)\b")  # "/bs64": a mode run with KV blocks of that many tokens (block_size)
# "/cap64": a mode whose decoding steps take at most that many device-pool prompt tokens (instead of
# --prefill-while-decoding; ApexConfig.prefill_tokens_while_decoding)
CAP_SUFFIX = re.compile(r"/cap(\d+)\b")
# "/reserve=0.3": a mode whose device pool keeps room for that share of its requests' remaining tokens before it
# admits or resumes one ("/reserve=0": none; ApexConfig.growth_reserve; benchmarks/park_churn.py)
RESERVE_SUFFIX = re.compile(r"/reserve=([0-9.]+)")
# "/share=0.97": a mode run whose adaptive rows keep the CPU job within that share of a step (TuningConfig.job_share)
SHARE_SUFFIX = re.compile(r"/share=([0-9.]+)")
# "/r2": a mode run again under its own name and otherwise the same settings, for an A-B-A order (the first hybrid
# mode of a run can come out lowest: its process is the coldest)
REPEAT_SUFFIX = re.compile(r"/r\d+")
# "/width=12": a mode whose adaptive staggered block has that many rows, of which the measured CPU job and the
# model use what fits (TuningConfig.auto_stagger_width, also the rows explain() considers)
WIDTH_SUFFIX = re.compile(r"/width=(\d+)\b")
# "/host=48": a mode whose host KV pool holds that many GiB (instead of --host-gib): it bounds the staggered
# pipeline's members
HOST_SUFFIX = re.compile(r"/host=([0-9.]+)")
# "/hostreserve=0.3": a mode whose pipeline members take host blocks as they grow, that share of the host requests'
# remaining tokens kept free (TuningConfig.pipeline_reserve)
HOST_RESERVE_SUFFIX = re.compile(r"/hostreserve=([0-9.]+)")
_SUFFIX_NAMES = {PIECEWISE_SUFFIX, PIN_SUFFIX, *LANE_SUFFIXES}
_SUFFIX_PATTERNS = (THREADS_SUFFIX, SPLIT_SUFFIX, BLOCK_SUFFIX, CAP_SUFFIX, RESERVE_SUFFIX, SHARE_SUFFIX,
                    REPEAT_SUFFIX, WIDTH_SUFFIX, HOST_SUFFIX, HOST_RESERVE_SUFFIX)


def _share_of(mode: str):
    """(mode without its "/share=X", X) or (mode, None); ValueError on a share outside (0, 1.5]."""
    named = SHARE_SUFFIX.search(mode)
    if not named:
        return mode, None
    share = float(named.group(1))
    if not 0.0 < share <= 1.5:
        raise ValueError(f"{named.group(0)}: the CPU job's share of a step must be in (0, 1.5]")
    return SHARE_SUFFIX.sub("", mode), share


def check_modes(modes) -> None:
    """Raises ValueError on a mode that names an unknown suffix or twice the same mode (a typo would otherwise run
    the default settings under the name of an A/B's other arm)."""
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is named twice in {modes} (add \"/r2\" to run one again)")
    for mode in modes:
        parse_mode(mode)
        _share_of(mode)
        for part in mode.split("/")[1:]:
            suffix = "/" + part
            if suffix not in _SUFFIX_NAMES and not any(p.fullmatch(suffix) for p in _SUFFIX_PATTERNS):
                raise ValueError(f"mode {mode!r}: unknown suffix {suffix!r}")


def parse_mode(mode: str):
    """(offload, stagger width) of a mode string (its "/" suffixes aside)."""
    mode = mode.split("/")[0]
    if mode.startswith("staggered"):
        width = mode.partition(":")[2]
        return "staggered", (width if width == "auto" else int(width)) if width else None
    return (mode if mode in ("never", "auto", "all") else float(mode)), None


def step_budget(prompt_len, max_seqs):
    """The benchmark's step budget: 2048 tokens, or more where a whole host prompt and every row's decode token
    would not fit (a host prompt split across steps attends its continued chunk on the CPU)."""
    return max(2048, prompt_len + max_seqs)


def hybrid_config(mode, device_bytes, host_bytes, max_seqs, max_tokens, prefill_while_decoding, cpu_threads=None,
                  prompt_len=0):
    """The engine config of a mode in this benchmark: a step budget that takes whole host prompts
    (`step_budget`), the prompt cap beside decoding, requests up to `max_tokens` (prompt + new tokens), and the
    settings its suffixes name."""
    offload, width = parse_mode(mode)
    threads = THREADS_SUFFIX.search(mode)
    cpu_threads = int(threads.group(1)) if threads else cpu_threads
    block_size = BLOCK_SUFFIX.search(mode)
    extra = {"block_size": int(block_size.group(1))} if block_size else {}
    cap = CAP_SUFFIX.search(mode)
    prefill_while_decoding = int(cap.group(1)) if cap else prefill_while_decoding
    reserve = RESERVE_SUFFIX.search(mode)
    if reserve:
        extra["growth_reserve"] = float(reserve.group(1))
    tuning = {}
    named = WIDTH_SUFFIX.search(mode)
    if named:
        tuning["auto_stagger_width"] = int(named.group(1))
    share = _share_of(mode)[1]
    if share is not None:
        tuning["job_share"] = share
    named = HOST_RESERVE_SUFFIX.search(mode)
    if named:
        tuning["pipeline_reserve"] = float(named.group(1))
    return ApexConfig(offload=offload, stagger_width=width, gpu_cache_size=device_bytes, tuning=TuningConfig(**tuning),
                      mixed_graphs=PIECEWISE_SUFFIX not in mode,
                      stagger_lanes=next((n for s, n in LANE_SUFFIXES.items() if s in mode), None),
                      cpu_attention_threads=cpu_threads, pin_launcher=True if PIN_SUFFIX in mode else None,
                      cpu_cache_size=host_bytes, max_num_seqs=max_seqs,
                      max_num_batched_tokens=step_budget(prompt_len, max_seqs),
                      prefill_tokens_while_decoding=prefill_while_decoding,
                      max_model_len=max_tokens + 64, **extra)


def run_mode(model, mode, device_bytes, host_bytes, prompts, new_tokens, max_seqs, args, start_step=0):
    """{tokens_per_s, decode_step_s, host_requests, steps: [(gpu rows, cpu rows, mean context, seconds)]} at
    steady state (a first, shorter run captures the graphs its step shapes need), its window from step
    `start_step` on at the earliest."""
    named = HOST_SUFFIX.search(mode)
    if named:
        host_bytes, mode = int(float(named.group(1)) * GiB), HOST_SUFFIX.sub("", mode)
    with process_settings(mode) as mode:
        return _run_engine_mode(model, mode, device_bytes, host_bytes, prompts, new_tokens, max_seqs, args,
                                start_step)


def job_records(jobs, window_steps: int) -> dict:
    """The CPU jobs of the window's end from a staggered executor (`LayerJobs` / `AsyncJobs`; {} without job
    timings): medians of their running time, their wait for inputs, the team's busy share (the one-lane job's
    thread-seconds inside work items over running time x threads) and the device's waits for the CPU; and, per
    job and per step in order, (waiting for inputs, running, busy thread-seconds or None) and those waits, to
    line the GPU's waits up with the jobs behind them."""
    if jobs is None or not getattr(jobs, "job_seconds", None):
        return {}
    window = list(jobs.job_seconds)[-window_steps:]
    out = {"cpu_job_s": statistics.median(run for _, run in window),
           "cpu_job_ready_wait_s": statistics.median(wait for wait, _ in window)}
    busy = list(getattr(jobs, "job_busy", []))[-window_steps:]
    if len(busy) != len(window):
        busy = [float("nan")] * len(window)
    shares = [b / (ran * len(jobs.cores)) for b, (_, ran) in zip(busy, window) if b == b and ran > 0]
    if shares:
        out["cpu_job_busy_share"] = statistics.median(shares)
    waits = list(jobs.collect_seconds)[-window_steps:]
    out["collect_wait_s"] = statistics.median(waits) if waits else 0.0
    out["cpu_jobs"] = [[wait, ran, b if b == b else None] for (wait, ran), b in zip(window, busy)]
    times = list(getattr(jobs, "job_times", []))[-window_steps:]
    if len(times) > 1:  # the worker between jobs: starved (nothing submitted) or picking the next one up (the GIL)
        pairs = list(zip(times, times[1:]))
        pickup = [started - max(ended, submitted) for (_, _, ended), (submitted, started, _) in pairs]
        out["job_gaps"] = {"pickup_s": sum(pickup), "pickup_median_s": statistics.median(pickup),
                           "starved_s": sum(max(submitted - ended, 0.0) for (_, _, ended), (submitted, _, _) in pairs),
                           "span_s": sum(ended - started for _, started, ended in times[1:])}
    every = list(getattr(jobs, "job_parts", []))
    parts, before = every[-window_steps:], every[:-window_steps]
    if before:  # the fill's (and warm-up's) jobs held at their gates by prompt exports: admission's cost
        out["exports_before_window"] = {"seconds": sum(p[0] for p in before),
                                        "jobs": sum(1 for p in before if p[0] > 1e-4), "of": len(before)}
    if parts:  # the jobs' time outside running and waiting for flags: exports, the C++ call's own, Python's
        out["job_gaps"] = dict(out.get("job_gaps", {}), exports_s=sum(p[0] for p in parts),
                               exports_jobs=sum(1 for p in parts if p[0] > 1e-4),
                               planning_s=sum(p[1] for p in parts), planning_median_s=statistics.median(
                                   p[1] for p in parts),
                               glue_s=sum(p[2] for p in parts), glue_median_s=statistics.median(p[2] for p in parts))
    out["collect_waits_s"] = waits
    return out


@contextlib.contextmanager
def process_settings(mode):
    """The CPU attention's work split a mode's "/split=a-b-c" names (an op setting of the process) in effect;
    yields the mode without it and restores the op's own split after it."""
    split = list(cpu_attention_work_split().values())
    try:
        named = SPLIT_SUFFIX.search(mode)
        if named:
            cpu_attention_work_split(*(int(v) for v in named.groups()))
            mode = SPLIT_SUFFIX.sub("", mode)
        yield mode
    finally:
        cpu_attention_work_split(*split)


def _run_engine_mode(model, mode, device_bytes, host_bytes, prompts, new_tokens, max_seqs, args, start_step):
    """`run_mode` once the mode's process-wide setting is in effect."""
    apex = optimize(model, hybrid_config(mode, device_bytes, host_bytes, max_seqs, len(prompts[0]) + new_tokens,
                                         args.prefill_while_decoding, args.cpu_threads, prompt_len=len(prompts[0])))
    engine = apex.engine
    engine.warmup()
    sampling = SamplingParams(max_new_tokens=new_tokens)
    run = steady_state(engine, prompts, sampling, args.warm_steps, args.window_steps, args.fill_steps,
                       start_step=start_step)
    decode = [s[3] for s in run["steps"] if not s[4]]
    run["amortized_tokens_per_s"], run["prefill_s_per_token"], run["prefill_samples"] = amortized(
        run, len(prompts[0]), new_tokens)
    result = dict(run, decode_step_s=statistics.median(s[3] for s in run["steps"]),
                  decode_only_step_s=statistics.median(decode) if decode else None,
                  decode_only_steps=len(decode), host_requests=engine.stats.requests_per_pool[HOST_POOL],
                  explain=apex.offload_decision())
    jobs = getattr(engine.stagger, "executor", None) if engine.stagger is not None else None
    result.update(job_records(jobs, args.window_steps))
    if engine.stagger is not None:  # the rows in use per turn at the window's end (below the width when adaptive)
        rows = engine.stagger.rows
        result["stagger_rows"] = [rows.limit, rows.width]
        # the CPU job's fit at the window's end: its fixed part, a row's part at the job rows' last mean context
        # (the one its limit uses; host rows lag the device rows' context)
        result["row_fit"] = {"fixed_s": rows.fixed, "measured": rows.measured, "ceiling": rows.ceiling,
                             "per_row_s": rows.row_seconds(), "context": rows.context}
    result["plan"] = "staggered" if engine.stagger is not None else "overlap"  # of the steps with host rows
    result["host_pool_huge_pages"] = huge_page_share(host_pool_tensors(engine))
    result["calibration"] = dataclasses.asdict(engine.calibration)  # the model's replays of this engine's graphs
    apex.close()  # its pools and threads go now, not at a later garbage collection
    del apex, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def hf_generate(model, prompts, new_tokens: int, batch: int, cache_implementation="offloaded") -> dict:
    """HF `generate` (greedy, no EOS) over the first `batch` prompts with that cache (HF's own answer to a KV
    cache larger than the GPU: "offloaded" keeps it in host memory and prefetches a layer at a time):
    tokens/s of the whole call (prefill included) and the decode step (the difference of two lengths, so the
    prefill cancels). An error (e.g. out of memory) is returned, not raised: a baseline does not stop a run."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts[:batch], device=device)
    kwargs = dict(pad_token_id=0)
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation

    def timed(tokens):
        return timed_generate(model, ids, tokens, **kwargs)

    try:
        timed(2)  # warm-up (kernel selection, allocator)
        short_s, short = timed(max(new_tokens // 2, 1))
        long_s, generated = timed(new_tokens)
    except Exception as error:  # noqa: BLE001 (recorded with the row)
        return {"cache": cache_implementation, "batch": batch, "error": f"{type(error).__name__}: {error}"[:300]}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step = (long_s - short_s) / max(generated - short, 1)
    return {"cache": cache_implementation, "batch": batch, "tokens_per_s": batch * generated / long_s,
            "decode_step_s": step, "decode_tokens_per_s": batch / step if step > 0 else None}


def staggered_bound(never: dict, ideal_gain: float, pool_rows: int, prompt: int, new_tokens: int,
                    job_share: float = TuningConfig.job_share) -> dict:
    """What the staggered plan can add at most on this window, from never's own measurements: host rows per step
    at most what the host pool holds (`pool_rows`) and what a CPU job at the profile's bandwidth fits in
    `job_share` of a decode step (D x ideal_gain rows: a row costs 1 / ideal_gain seconds of CPU); one token per
    row every step, decode or mixed (S, the mean step, so the CPU idles through the longer mixed steps); each
    host token bringing prompt / new_tokens tokens of GPU prefill that the device rows lose. Computed, not run."""
    decode = never["decode_only_step_s"] or never["decode_step_s"]
    mean_step = never["window_s"] / max(len(never["steps"]), 1)
    rows = min(float(pool_rows), job_share * decode * ideal_gain)
    host = rows / mean_step
    lost = host * prompt / new_tokens * never["prefill_s_per_token"] * never["tokens_per_s"]
    return {"rows": rows, "mean_step_s": mean_step, "decode_step_s": decode, "host_tokens_per_s": host,
            "prefill_loss_tokens_per_s": lost, "gain": host - lost, "efficiency": (host - lost) / ideal_gain}


def prediction_error(model: PerfModel, steps, plan="overlap", online=False):
    """Median |predicted - measured| / measured over the window's decode-only steps (each at its own
    composition; `plan`: that of the steps with host rows); `online`: with the host gap learned from the steps
    before each one (`online_predictions`)."""
    if online:
        pairs = online_predictions(model, steps, plan)
    else:
        pairs = [(model.predict(plan if s[1] else "never", *s[:3], cpu_context=step_host_context(s)).step_s, s[3])
                 for s in steps if not s[4]]
    errors = [abs(predicted - seconds) / seconds for predicted, seconds in pairs]
    return statistics.median(errors) if errors else None


WATCHDOG_S = 0.0  # --watchdog
WATCHDOG_AFTER_STEPS = 32  # the steps of a mode before the watchdog is armed


def main():
    global WATCHDOG_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3_8b")
    parser.add_argument("--device-gib", default="1,2,4")
    parser.add_argument("--host-gib", type=float, default=32)
    parser.add_argument("--max-seqs", type=int, default=64, help="max_num_seqs (rows of a step)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="never,auto,0.25,0.5",
                        help="offload modes (never, auto, all, a fraction, staggered[:width]); a mode + \"/pw\" runs "
                             "its mixed steps piecewise (mixed_graphs=False), the A/B of whole mixed graphs; "
                             "'/split=a-b-c' sets the CPU attention's work split, '/bs64' the KV block size, "
                             "'/share=0.95' the CPU job's share of a step (TuningConfig.job_share), '/t14' the CPU "
                             "attention threads, '/pin' pins the launching thread, '/1lane' or '/2lane' the staggered "
                             "lanes, for that mode; "
                             "'/r2' runs a mode again (an A-B-A order)")
    parser.add_argument("--fill-steps", type=int, default=600,
                        help="at most this many steps to fill the staggered pipeline before --warm-steps")
    parser.add_argument("--warm-steps", type=int, default=100, help="steps before the measured window")
    parser.add_argument("--window-steps", type=int, default=None,
                        help="steps of the measured window (default: 2 x --new-tokens, at least 300)")
    parser.add_argument("--prefill-while-decoding", type=lambda v: None if v == "none" else int(v), default=256,
                        help="prefill_tokens_while_decoding: prompt tokens a step that decodes takes into the device "
                             "pool ('none': up to the step budget, which whole host prompts need: step_budget)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="cpu_attention_threads of the staggered plan's CPU worker (default: all cores but one)")
    parser.add_argument("--hf-tokens", type=int, default=64,
                        help="new tokens of the HF baseline's longest generate (its decode step is the difference of "
                             "this and half of it; an offloaded cache reads every layer's KV from the host each step, "
                             "so the whole --new-tokens would take minutes)")
    parser.add_argument("--hf-batch", type=int, default=0,
                        help="HF generate with its offloaded cache over this many requests (0: as many as the "
                             "device pool holds; -1: skip)")
    parser.add_argument("--watchdog", type=float, default=0.0,
                        help="seconds after which a step still running dumps every thread's Python stack (0: off; "
                             "from a mode's 33rd step on, after its compiles)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    WATCHDOG_S = args.watchdog
    if args.window_steps is None:
        args.window_steps = max(300, 2 * args.new_tokens)
    if not torch.cuda.is_available():
        sys.exit("e2e_hybrid.py needs a CUDA GPU")
    result = {"benchmark": "e2e_hybrid", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(),
                          "topology": cpu_topology(), "affinity": sorted(os.sched_getaffinity(0)),
                          "torch": torch.__version__, "python": platform.python_version()},
              "args": vars(args), "rows": []}
    modes = args.modes.split(",")
    try:
        check_modes(modes)
    except ValueError as error:
        sys.exit(f"--modes: {error}")
    topology = result["machine"]["topology"]
    print(f"host CPUs: {topology}; this process may run on {len(result['machine']['affinity'])}")
    print(f"prompt tokens a decoding step takes into the device pool: {args.prefill_while_decoding or 'no cap'} "
          f"(step budget {step_budget(args.prompt, args.max_seqs)})")
    print(f"{'shape':10} {'pool GiB':>8} {'reqs':>4} | " + " | ".join(f"{str(m):>16}" for m in modes)
          + " | ideal_gain  auto eff  eff@host  model err")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        torch.manual_seed(0)
        model = random_llama(shape)
        per_request = (args.prompt + args.new_tokens + 16) * kv_bytes_per_token(shape)
        for gib in (float(g) for g in args.device_gib.split(",")):
            device_bytes = int(gib * GiB)
            count = max(device_bytes // per_request, 1)  # requests the device pool holds
            prompts = torch.randint(3, shape["vocab_size"], (64, args.prompt)).tolist()
            runs = {}
            profile, probed_before, huge_before = probe_cpu_bandwidth(model, device_bytes, args.max_seqs,
                                                                         with_profile=True)
            for m in modes:  # one line per mode as it ends: a run cut short keeps what it measured
                begin = time.perf_counter()
                # every window starts where the longest fill would end it: the same phase of the request waves
                runs[m] = run_mode(model, m, device_bytes, int(args.host_gib * GiB), prompts, args.new_tokens,
                                   args.max_seqs, args, start_step=args.warm_steps + args.fill_steps)
                r = runs[m]
                cpu = (f"; CPU job {r['cpu_job_s'] * 1e3:.2f} ms (+{r['cpu_job_ready_wait_s'] * 1e3:.2f} waiting for "
                       f"its inputs"
                       + (f", team busy {r['cpu_job_busy_share']:.0%}" if "cpu_job_busy_share" in r else "")
                       + f"), collect wait {r['collect_wait_s'] * 1e3:.2f} ms" if "cpu_job_s" in r else "")
                if r.get("window_gc"):
                    cpu += "; Python's collector in the window: " + ", ".join(
                        f"gen {g} {n}x {t * 1e3:.0f} ms (longest {m * 1e3:.1f})"
                        for g, (n, t, m) in r["window_gc"].items())
                # the window's time outside engine.step(): this benchmark's own records of each step (a user's
                # loop would not pay it; whether the GPU idled meanwhile depends on the step queued ahead)
                cpu += (f"; the benchmark's own time between steps "
                        f"{(r['window_s'] - sum(s[3] for s in r['steps'])) * 1e3:.0f} ms")
                if r.get("collect_waits_s"):
                    cpu += f", the GPU waited {sum(r['collect_waits_s']) * 1e3:.0f} ms for the CPU in all"
                if r.get("job_gaps"):
                    g = r["job_gaps"]
                    cpu += (f", the worker between jobs: {g['pickup_s'] * 1e3:.0f} ms picking the next up (median "
                            f"{g['pickup_median_s'] * 1e6:.0f} us), {g['starved_s'] * 1e3:.0f} ms with none submitted, "
                            f"jobs' spans {g['span_s'] * 1e3:.0f} ms")
                    if "planning_s" in g:
                        cpu += (f" (of which waiting for prompt exports {g['exports_s'] * 1e3:.0f} ms in "
                                f"{g['exports_jobs']} jobs, the C++ calls' checks, plans and frees "
                                f"{g['planning_s'] * 1e3:.0f} ms (median {g['planning_median_s'] * 1e6:.0f} us), "
                                f"the worker's time outside them (a Python worker's glue and GIL; the C++ "
                                f"runner's own) {g['glue_s'] * 1e3:.0f} ms (median "
                                f"{g['glue_median_s'] * 1e6:.0f} us))")
                if "stagger_rows" in r:
                    cpu += f", rows in use {r['stagger_rows'][0]} of {r['stagger_rows'][1]}"
                    fit = r["row_fit"]
                    if fit["per_row_s"]:
                        cpu += (f" (job fit {fit['fixed_s'] * 1e3:.2f} ms + {fit['per_row_s'] * 1e3:.2f} ms a row of "
                                f"{fit.get('context', 0):.0f} tokens: "
                                f"{fit['measured']} rows; model {fit['ceiling']})")
                if r.get("row_limits"):
                    lim = r["row_limits"]
                    cpu += (", over the window (median, min-max) rows fit with the guard {0[0]:g} ({0[1]:g}-{0[2]:g}), "
                            "the guard {1[0]:g} ({1[1]:g}-{1[2]:g}), the model {2[0]:g} ({2[1]:g}-{2[2]:g}), "
                            "step average {3:.2f} ms").format(lim["measured"], lim["guard"], lim["ceiling"],
                                                             lim["step_s"][0] * 1e3)
                cpu += f", {r['ahead_steps']} of {args.window_steps} steps queued ahead"
                if r.get("not_ahead"):
                    cpu += (" (not: " + ", ".join(f"{k} {v}" for k, v in sorted(r["not_ahead"].items()))
                            + f"; their time above a queued step's median {r['unqueued_excess_s'] * 1e3:.0f} ms, "
                            f"{r['unqueued_excess_s'] / r['window_s']:.1%} of the window)")
                if r.get("pipeline_end"):
                    p = r["pipeline_end"]
                    cpu += (f", pipeline at the window's end {p['members']} members, its rows room for "
                            f"{p['capacity']} (host pool {p['host_bytes'] / GiB:.1f} GiB, "
                            f"{p['host_free_bytes'] / GiB:.2f} free, {p['park_room_bytes'] / GiB:.2f} kept to park; "
                            f"a member keeps {p['member_bytes'] / 2 ** 20:.0f} MiB at most; member-turns waiting "
                            f"for a block {p['stalled']})")
                if r.get("window_capture_s"):
                    cpu += f", graphs captured inside the window {r['window_capture_s'] * 1e3:.0f} ms"
                only = r["decode_only_step_s"]
                full = f" (pipeline {r['pipeline_filled']:.0%} full)" if r.get("pipeline_filled") is not None else ""
                if r.get("exports_before_window"):
                    e = r["exports_before_window"]
                    full += (f" (before the window {e['jobs']} of {e['of']} jobs waited for prompt exports, "
                             f"{e['seconds'] * 1e3:.0f} ms)")
                print(f"   {shape_name} {gib:g} GiB {m}: {r['tokens_per_s']:.0f} tokens/s ({r['host_tokens']} of "
                      f"{r['tokens']} from the host; {r['amortized_tokens_per_s']:.0f} with their prefill at "
                      f"{r['prefill_s_per_token'] * 1e6:.0f} us/token from {r['prefill_samples']} steps), "
                      f"median step {r['decode_step_s'] * 1e3:.2f} ms"
                      f" ({r['decode_only_steps']} decode-only: "
                      f"{only * 1e3 if only else float('nan'):.2f} ms), fill {r['fill_steps']} steps "
                      f"{r['fill_s']:.0f} s{full}, window from step {r['window_start']}{cpu} "
                      f"({time.perf_counter() - begin:.0f} s in all); "
                      f"{r['explain'].splitlines()[0][:120]}", flush=True)
                kinds = list(r.get("excess_by_kind", {}).items())[:5]
                if kinds:
                    print(f"   {shape_name} {gib:g} GiB {m} time above the median decode step by kind of step (a short "
                          "step merged into the one before): " + ", ".join(
                              f"{k} {n} steps {e * 1e3:+.0f} ms" for k, (n, e) in kinds), flush=True)
                slow = r.get("slow_decode_steps")
                if slow and slow["count"]:
                    print(f"   {shape_name} {gib:g} GiB {m} slow decode steps (> 1.5x median): {slow['count']} of "
                          f"{slow['of']}, {slow['excess_share']:.0%} of the window above the median; phases "
                          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in slow["phase_s"].items()) + " ms; events "
                          "(slow vs other steps) " + ", ".join(f"{k} {a:.0%}/{b:.0%}"
                                                               for k, (a, b) in slow["event_rate"].items()),
                          flush=True)
                for kind in ("decode", "prefill"):
                    if r.get(f"{kind}_phase_s"):
                        mixed = [s[3] for s in r["steps"] if bool(s[4]) == (kind == "prefill")]
                        print(f"   {shape_name} {gib:g} GiB {m} {kind} steps ({len(mixed)}, median "
                              f"{statistics.median(mixed) * 1e3:.2f} ms), main thread: " + ", ".join(
                                  f"{k} {v * 1e3:.3f} ms" for k, v in r[f"{kind}_phase_s"].items()), flush=True)
                partial = {"shape": shape_name, "device_gib": gib, "partial": True,
                           "modes": runs}
                write_json(args.out, dict(result, rows=result["rows"] + [partial]))
            hf = None
            if args.hf_batch >= 0:
                hf = hf_generate(model, prompts, min(args.new_tokens, args.hf_tokens), args.hf_batch or count)
                print(f"   {shape_name} {gib:g} GiB HF generate, offloaded cache, batch {hf['batch']}: "
                      + (hf["error"] if "error" in hf else f"{hf['tokens_per_s']:.0f} tokens/s, decode step "
                         f"{hf['decode_step_s'] * 1e3:.1f} ms ({hf['decode_tokens_per_s']:.0f} tokens/s)"),
                      flush=True)
            perf = PerfModel(profile)
            # B_cpu probed in this run, before and after the modes (the cached profile may come from a busier
            # moment, which would flatter every efficiency); a single probe varies from run to run on one
            # host, so the mean of the two is taken
            _, probed_after, huge_after = probe_cpu_bandwidth(model, device_bytes, args.max_seqs)
            cpu_bandwidth = (probed_before + probed_after) / 2
            context = args.prompt + args.new_tokens / 2
            ideal = perf.ideal_gain(context, cpu_bandwidth)
            # never's tokens/s, the mean over its runs (None: an A/B run of other modes)
            never = baseline({m: r["tokens_per_s"] for m, r in runs.items()}, runs)
            nevers = never_modes(runs)
            efficiency = (runs["auto"]["tokens_per_s"] - never) / ideal if "auto" in runs and never else None
            efficiencies = {m: (r["tokens_per_s"] - never) / ideal for m, r in runs.items()
                            if never and m not in nevers}
            # the same at each mode's own host contexts (the KV its host tokens read in the window): a host request
            # gains a token per num_layers + 1 steps, so in a window it runs near its prompt's length, not at the
            # workload's mean context, and the nominal ideal_gain misprices what the window's host tokens cost
            host_ideal = {m: perf.ideal_gain(r["host_context"], cpu_bandwidth) for m, r in runs.items()
                          if r.get("host_context")}
            host_efficiencies = {m: (runs[m]["tokens_per_s"] - never) / g for m, g in host_ideal.items()
                                 if never and m not in nevers}
            # and against either probe alone (ideal_gain is proportional to B_cpu): how far the probes' spread moves
            # the figure judged by
            per_probe = {m: [e * cpu_bandwidth / b for b in (probed_before, probed_after)]
                         for m, e in host_efficiencies.items()}
            bounds = {}
            for lanes in (2, 1):
                groups = lanes * (shape["num_hidden_layers"] + 1)  # host requests per staggered row
                pool_rows = int(args.host_gib * GiB // per_request // groups)
                if "never" in runs:
                    bounds[lanes] = (pool_rows, staggered_bound(runs["never"], ideal, pool_rows, args.prompt,
                                                                args.new_tokens))
            bound = bounds[2][1] if 2 in bounds else None
            # each mode's model: the profile, calibrated by the replays of that mode's own captured graphs
            calibrated = {m: PerfModel(perf.profile, StepCalibration(**r["calibration"])) for m, r in runs.items()}
            errors = {m: prediction_error(calibrated[m], r["steps"], r["plan"]) for m, r in runs.items()}
            raw_errors = {m: prediction_error(perf, r["steps"], r["plan"]) for m, r in runs.items()}
            # the calibrated model with its online host gap (what the engine's steps add to the GPU's time)
            online_errors = {m: prediction_error(calibrated[m], r["steps"], r["plan"], online=True)
                             for m, r in runs.items()}
            best = max(runs, key=lambda m: runs[m]["tokens_per_s"])
            steady = steady_tokens_per_s(runs, args.prompt, args.new_tokens)
            steady_never = baseline(steady, runs)
            steady_eff = {m: (v - steady_never) / ideal for m, v in steady.items()
                          if m not in nevers and never}
            row = {"shape": shape_name, "device_gib": gib, "requests": count, "context": context,
                   "ideal_gain": ideal, "cpu_attention_GBps": cpu_bandwidth / 1e9,
                   "cpu_attention_GBps_before_after": [probed_before / 1e9, probed_after / 1e9],
                   "probe_huge_pages_before_after": [huge_before, huge_after],
                   "profile_cpu_attention_GBps": perf.cpu_bandwidth() / 1e9,
                   "gpu_attention_GBps": perf.gpu_bandwidth() / 1e9,
                   "kv_bytes_per_host_request_step": perf.profile.kv_bytes_per_token * context,
                   "auto_efficiency": efficiency, "model_error": errors, "uncalibrated_model_error": raw_errors,
                   "online_model_error": online_errors, "profile": dataclasses.asdict(perf.profile),
                   "staggered_bound": bound, "staggered_bound_1lane": bounds[1][1] if 1 in bounds else None,
                   "efficiency": efficiencies, "steady_tokens_per_s": steady, "steady_efficiency": steady_eff,
                   "host_context": {m: r.get("host_context") for m, r in runs.items()},
                   "ideal_gain_at_host_context": host_ideal, "efficiency_at_host_context": host_efficiencies,
                   "efficiency_at_host_context_per_probe": per_probe,
                   "never_tokens_per_s": never, "never_runs": nevers, "best_mode": best,
                   "hf_offloaded": hf, "without_host_tokens": without_host_tokens(runs),
                   "best_efficiency": (runs[best]["tokens_per_s"] - never) / ideal if never else None,
                   "modes": {m: {k: v for k, v in r.items() if k != "steps"} for m, r in runs.items()},
                   "steps": {m: r["steps"] for m, r in runs.items()}}
            result["rows"].append(row)
            cells = " | ".join(f"{runs[m]['tokens_per_s']:7.0f} {runs[m]['decode_step_s'] * 1e3:6.1f}ms"
                               for m in modes)
            err = errors.get("auto") if errors.get("auto") is not None else errors.get("never")
            eff = f"{efficiency:8.2f}" if efficiency is not None else "       -"
            err_text = f"{err:9.1%}" if err is not None else "        -"
            # eff@host: against ideal_gain at auto's own host contexts in the window (the bytes its host tokens read)
            at_host = host_efficiencies.get("auto")
            eff_host = f"{at_host:9.2f}" if at_host is not None else "        -"
            print(f"{shape_name:10} {gib:8.1f} {count:4d} | {cells} | {ideal:10.0f} {eff} {eff_host} {err_text}",
                  flush=True)
            best_eff = f"{row['best_efficiency']:.2f}" if row["best_efficiency"] is not None else "-"
            print(f"   best {best}: efficiency {best_eff}; model error per mode: "
                  + ", ".join(f"{m} {e:.1%}" for m, e in errors.items() if e is not None)
                  + " (uncalibrated: " + ", ".join(f"{m} {e:.1%}" for m, e in raw_errors.items() if e is not None)
                  + "; with the online host gap: "
                  + ", ".join(f"{m} {e:.1%}" for m, e in online_errors.items() if e is not None) + ")", flush=True)
            print(f"   ideal_gain {ideal:.0f} tokens/s: CPU attention {cpu_bandwidth / 1e9:.1f} GB/s, the mean of "
                  f"{probed_before / 1e9:.1f} probed before the modes and {probed_after / 1e9:.1f} after (the cached "
                  f"profile the model starts from: {perf.cpu_bandwidth() / 1e9:.1f} GB/s), "
                  f"{perf.profile.kv_bytes_per_token * context / 1e6:.0f} MB of KV per host request-step", flush=True)
            print(f"   host pools on huge pages: the probes' {huge_before:.0%} before and {huge_after:.0%} after; "
                  + ", ".join(f"{m} {r['host_pool_huge_pages']:.0%}" for m, r in runs.items()), flush=True)
            if len(nevers) > 1:
                print(f"   never's baseline: {never:.0f} tokens/s, the mean of " + ", ".join(
                    f"{m} {runs[m]['tokens_per_s']:.0f}" for m in nevers), flush=True)
            if efficiencies:
                print("   efficiency per mode: " + ", ".join(f"{m} {e:.2f}" for m, e in efficiencies.items()),
                      flush=True)
            if host_ideal:
                print(f"   at the window's host contexts (nominal {context:.0f}): " + ", ".join(
                    f"{m} {runs[m]['host_context']:.0f} tokens, ideal_gain {g:.0f}"
                    + (f", efficiency {host_efficiencies[m]:.2f}" if m in host_efficiencies else "")
                    for m, g in host_ideal.items()), flush=True)
            if per_probe:
                print(f"   the same against either probe alone ({probed_before / 1e9:.1f} / {probed_after / 1e9:.1f} "
                      "GB/s): " + ", ".join(f"{m} {b:.2f} / {a:.2f}" for m, (b, a) in per_probe.items()), flush=True)
            print("   steady state (the window's own prefill out, every token charged its request's prefill): "
                  + ", ".join(f"{m} {v:.0f}" + (f" ({steady_eff[m]:.2f})" if m in steady_eff else "")
                              for m, v in steady.items()) + " tokens/s (efficiency)", flush=True)
            if row["without_host_tokens"]:
                print(f"   {', '.join(row['without_host_tokens'])}: no host token in the window, so the difference "
                      "from never is the window's phase (e.g. parked requests resuming without a prefill) and "
                      "noise, not a host gain", flush=True)
            for lanes, (pool_rows, b) in bounds.items():
                print(f"   staggered plan's bound, {lanes} lane{'s' if lanes > 1 else ''} (computed from never's run): "
                      f"{b['rows']:.1f} rows (host pool {pool_rows}, CPU job in {TuningConfig().job_share:.0%} of a "
                      f"{b['decode_step_s'] * 1e3:.2f} ms decode step), +{b['host_tokens_per_s']:.0f} host "
                      f"tokens/s at the mean step {b['mean_step_s'] * 1e3:.2f} ms, -{b['prefill_loss_tokens_per_s']:.0f} "
                      f"for their prefill: +{b['gain']:.0f} tokens/s, efficiency {b['efficiency']:.2f}", flush=True)
            print("   auto: " + runs["auto"]["explain"] if "auto" in runs else "", flush=True)
            write_json(args.out, result)  # after every row: a run cut short keeps what it measured
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
