"""Helpers of the end-to-end benchmark scripts that run without a GPU: HF generate as a baseline (its timing
bookkeeping, and a cache that cannot run here reported as an error instead of stopping the benchmark)."""
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from apex_compile.runtime.perf_model import HostGap
from tests.helpers import tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import e2e_hybrid  # noqa: E402
import step_profile  # noqa: E402


def test_hf_generate_baseline_reports_tokens_per_s_and_decode_step(monkeypatch):
    """The baseline's bookkeeping: tokens/s of the whole call, and the decode step as the difference of two
    lengths (the real generate runs; its clock is replaced by 0.1 s a token + 0.05 s, so the check is exact)."""
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    prompts = torch.randint(3, 96, (4, 8)).tolist()
    real = e2e_hybrid.timed_generate

    def timed(model, ids, tokens, **kwargs):
        _, generated = real(model, ids, tokens, **kwargs)
        return 0.05 + 0.1 * generated, generated

    monkeypatch.setattr(e2e_hybrid, "timed_generate", timed)
    row = e2e_hybrid.hf_generate(model, prompts, 8, 3, cache_implementation=None)
    assert row["batch"] == 3 and "error" not in row
    assert row["tokens_per_s"] == pytest.approx(3 * 8 / 0.85) and row["decode_step_s"] == pytest.approx(0.1)
    assert row["decode_tokens_per_s"] == 3 / row["decode_step_s"]


def test_hf_generate_baseline_returns_an_error_it_cannot_run():
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(3, 96, (2, 8)).tolist()
    row = e2e_hybrid.hf_generate(model, prompts, 4, 2, cache_implementation="no-such-cache")
    assert row["cache"] == "no-such-cache" and row["error"] and "tokens_per_s" not in row


def test_slow_steps_name_what_happened_in_the_long_decode_steps():
    """slow_steps: decode-only steps over 1.5x their median, their share of the window above it, and how often
    each event came with them against the other decode steps (prefill steps are left out)."""
    steps = [(4, 0, 100.0, 0.010, 0)] * 8 + [(4, 0, 100.0, 0.030, 0), (4, 0, 100.0, 0.050, 256)]
    phases = [{"forward": 0.001, "wait": 0.009}] * 8 + [{"forward": 0.021, "wait": 0.009}] * 2
    events = [{}] * 7 + [{"running": 1}, {"parked": 1, "running": -1}, {"parked": 1}]
    slow = e2e_hybrid.slow_steps(steps, phases, events)
    assert slow["count"] == 1 and slow["of"] == 9 and abs(slow["median_s"] - 0.010) < 1e-12
    assert abs(slow["excess_share"] - 0.020 / sum(s[3] for s in steps)) < 1e-12
    assert slow["phase_s"] == {"forward": 0.021, "wait": 0.009}
    assert slow["event_rate"] == {"parked": (1.0, 0.0), "running": (1.0, 1 / 8)}
    assert e2e_hybrid.slow_steps(steps[-1:], phases[-1:], events[-1:]) is None


def test_excess_by_kind_merges_a_short_step_into_the_long_one_before_it():
    """excess_by_kind: the window's time above the median decode step per kind of step (prompt or decode,
    queued or not, what changed); a step under 0.7x the median counts with the step before it, so a park that
    returns late and leaves the next step short costs only their sum."""
    steps = ([(4, 0, 100.0, 0.010, 0)] * 6 + [(4, 0, 100.0, 0.019, 0), (4, 0, 100.0, 0.002, 0)]
             + [(4, 0, 100.0, 0.016, 0), (4, 0, 100.0, 0.030, 256)])
    queued = [True] * 8 + [False, False]
    events = [{}] * 6 + [{"parked": 1, "running": -1}, {}, {"running": 1}, {"running": 1}]
    kinds = e2e_hybrid.excess_by_kind(steps, queued, events)
    assert list(kinds) == ["prompt/unqueued/running+", "decode/unqueued/running+", "decode/parked+,running-",
                           "decode"]
    assert kinds["decode/parked+,running-"][0] == 1
    assert kinds["decode/parked+,running-"][1] == pytest.approx(0.019 + 0.002 - 2 * 0.010)
    assert kinds["decode/unqueued/running+"] == [1, pytest.approx(0.006)]
    assert kinds["prompt/unqueued/running+"] == [1, pytest.approx(0.020)]
    assert kinds["decode"] == [6, pytest.approx(0.0)]
    assert e2e_hybrid.excess_by_kind([(4, 0, 1.0, 0.03, 256)], [False], [{}]) == {}


def test_steady_tokens_per_s_charges_every_token_its_prefill_wherever_it_ran():
    """steady_tokens_per_s: a window that prefilled in place and one fed by requests prefilled before it (the
    same decode steps) come out equal, each window token charged prompt / new_tokens prefill tokens at never's
    rate, host tokens at the larger of the mode's and never's."""
    decode = [(10, 0, 500.0, 0.005, 0)] * 98
    prefill = [(10, 0, 500.0, 0.005 + 256 * 20e-6, 256)] * 2  # one 512-token prompt in two chunks
    never = {"steps": decode + prefill, "tokens": 1000, "host_tokens": 0, "window_s": 0.5 + 2 * 256 * 20e-6,
             "prefill_s_per_token": 20e-6}
    fed = {"steps": decode + decode[:2], "tokens": 1000, "host_tokens": 0, "window_s": 0.5,
           "prefill_s_per_token": 30e-6}  # its own prefill steps (before the window) do not set the device rate
    host = dict(fed, host_tokens=300, prefill_s_per_token=40e-6)
    rates = e2e_hybrid.steady_tokens_per_s({"never": never, "fed": fed, "host": host}, 512, 512)
    assert abs(rates["never"] - 1000 / 0.52) < 1e-6 and abs(rates["fed"] - 1000 / 0.52) < 1e-6
    assert abs(rates["host"] - 1000 / (0.5 + 700 * 20e-6 + 300 * 40e-6)) < 1e-6
    # half as many prefill tokens per generated token: half the charge
    assert abs(e2e_hybrid.steady_tokens_per_s({"never": never}, 256, 512)["never"] - 1000 / 0.51) < 1e-6


def test_gpu_busy_is_the_union_of_gpu_intervals_in_each_step_window(tmp_path):
    """step_profile.gpu_busy: a step's window runs from its start to the next step's (the last: to its end);
    overlapping kernels count once toward busy time, each in full toward its own name; CPU events do not count."""
    def event(name, ts, dur, cat):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}

    trace = {"traceEvents": [
        event("apex_step_0", 0, 10, "user_annotation"), event("apex_step_1", 100, 50, "user_annotation"),
        event("gemm", 20, 30, "kernel"), event("attn", 40, 20, "kernel"),  # overlap: busy 20..60
        event("copy", 90, 20, "gpu_memcpy"),  # crosses into step 1: 90..100 in step 0, 100..110 in step 1
        event("aten::mm", 0, 200, "cpu_op"), event("gemm", 140, 30, "kernel")]}  # step 1 ends at 150
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    busy = step_profile.gpu_busy(str(path), {"apex_step_0", "apex_step_1"})
    wall, gpu, kernels = busy["apex_step_0"]
    assert (wall, gpu) == (100, 50) and dict(kernels) == {"gemm": 30, "attn": 20, "copy": 10}
    wall, gpu, kernels = busy["apex_step_1"]
    assert (wall, gpu) == (50, 20) and dict(kernels) == {"copy": 10, "gemm": 10}


def test_windows_of_compared_modes_start_at_the_same_step():
    """The workload's requests start together and finish in waves: a mode's window starts no earlier than
    `start_step` (e2e_hybrid passes warm-up + the longest fill to every mode)."""
    from apex_compile import ApexConfig, SamplingParams, optimize

    model = tiny_model("llama", layers=2)
    engine = optimize(model, ApexConfig(offload="never", compile=False, max_num_seqs=4)).engine
    prompts = [[5, 6, 7, 8]] * 4
    run = e2e_hybrid.steady_state(engine, prompts, SamplingParams(max_new_tokens=3), warm_steps=2,
                                  window_steps=3, start_step=7)
    assert run["window_start"] == 7 and len(run["steps"]) == 3 and len(run["prefill"]) == 7
    assert run["host_tokens"] == 0
    # a CPU engine runs synchronously: no window step was queued ahead, none counted as declined
    assert run["queued_ahead"] == [False] * 3 and run["not_ahead"] == {} and run["unqueued_excess_s"] >= 0
    assert len(run["window_events"]) == 3 and all(isinstance(e, dict) for e in run["window_events"])
    # Python's collections in the window, per generation: [count, seconds, longest]; the hook removed after it
    import gc

    hooks, thresholds = len(gc.callbacks), gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # collections every few dozen allocations: some fall in the window
    try:
        run = e2e_hybrid.steady_state(engine, prompts, SamplingParams(max_new_tokens=3), warm_steps=2,
                                      window_steps=3)
    finally:
        gc.set_threshold(*thresholds)
    assert run["window_start"] == 2 and len(gc.callbacks) == hooks
    assert run["window_gc"] and "0" in run["window_gc"]
    assert all(n >= 1 and 0 <= longest <= total for n, total, longest in run["window_gc"].values())


def test_a_piecewise_mode_differs_from_its_mode_only_in_its_mixed_steps():
    """"<mode>/pw" is the same engine config with mixed_graphs=False (the same-run A/B of whole mixed graphs)."""
    for mode in ("never", "auto", "staggered:3", "0.5"):
        whole = e2e_hybrid.hybrid_config(mode, 1 << 30, 1 << 31, 64, 640, 256)
        piecewise = e2e_hybrid.hybrid_config(mode + "/pw", 1 << 30, 1 << 31, 64, 640, 256)
        assert whole.mixed_graphs and not piecewise.mixed_graphs
        assert dict(vars(whole), mixed_graphs=False) == vars(piecewise)
        one_lane = e2e_hybrid.hybrid_config(mode + "/1lane", 1 << 30, 1 << 31, 64, 640, 256)
        assert whole.stagger_lanes is None and dict(vars(whole), stagger_lanes=1) == vars(one_lane)
        two_lanes = e2e_hybrid.hybrid_config(mode + "/2lane", 1 << 30, 1 << 31, 64, 640, 256)
        assert dict(vars(whole), stagger_lanes=2) == vars(two_lanes)
        both = e2e_hybrid.hybrid_config(mode + "/1lane/pw", 1 << 30, 1 << 31, 64, 640, 256)
        assert dict(vars(whole), stagger_lanes=1, mixed_graphs=False) == vars(both)
        pinned = e2e_hybrid.hybrid_config(mode + "/1lane/pin/t14", 1 << 30, 1 << 31, 64, 640, 256)
        assert dict(vars(whole), stagger_lanes=1, pin_launcher=True, cpu_attention_threads=14) == vars(pinned)
    # the step budget takes a whole host prompt beside every row's decode token (2048 at least)
    assert e2e_hybrid.hybrid_config("auto", 1 << 30, 1 << 31, 64, 640, 256, prompt_len=512).max_num_batched_tokens \
        == 2048
    assert e2e_hybrid.hybrid_config("auto", 1 << 30, 1 << 31, 64, 2560, 256,
                                    prompt_len=2048).max_num_batched_tokens == 2048 + 64


def test_a_mode_can_name_its_block_size_its_cpu_work_split_and_its_tuning(monkeypatch):
    """"/bs64" sets the KV block size, "/width=", "/share=" and "/hostreserve=" the mode's TuningConfig;
    "/split=a-b-c" runs the mode under that CPU attention work split and restores it after it, also when it
    fails."""
    from apex_compile.config import TuningConfig
    from apex_compile.ops import cpu_attention_work_split
    whole = e2e_hybrid.hybrid_config("auto", 1 << 30, 1 << 31, 64, 640, 256)
    blocks = e2e_hybrid.hybrid_config("auto/bs64", 1 << 30, 1 << 31, 64, 640, 256)
    assert dict(vars(whole), block_size=64) == vars(blocks) and whole.block_size == 16
    capped = e2e_hybrid.hybrid_config("never/cap64", 1 << 30, 1 << 31, 64, 640, 256)
    assert whole.prefill_tokens_while_decoding == 256 and capped.prefill_tokens_while_decoding == 64
    assert dict(vars(whole), prefill_tokens_while_decoding=64, offload="never") == vars(capped)
    unreserved = e2e_hybrid.hybrid_config("auto/reserve=0", 1 << 30, 1 << 31, 64, 640, 256)
    assert whole.growth_reserve == 0.15 and dict(vars(whole), growth_reserve=0.0) == vars(unreserved)
    assert whole.tuning == TuningConfig()
    for mode, tuning in (("auto/width=8", TuningConfig(auto_stagger_width=8)),
                         ("staggered:auto/width=10/r2", TuningConfig(auto_stagger_width=10)),
                         ("auto/share=0.97", TuningConfig(job_share=0.97)),
                         ("staggered:auto/hostreserve=0/r2", TuningConfig(pipeline_reserve=0.0)),
                         ("auto/width=12/share=0.9/hostreserve=0.5",
                          TuningConfig(auto_stagger_width=12, job_share=0.9, pipeline_reserve=0.5))):
        assert e2e_hybrid.hybrid_config(mode, 1 << 30, 1 << 31, 64, 640, 256).tuning == tuning, mode
    before = cpu_attention_work_split()
    seen = []

    def fake_run(model, mode, *args, **kwargs):
        seen.append((mode, cpu_attention_work_split()))
        raise RuntimeError("run failed")

    monkeypatch.setattr(e2e_hybrid, "optimize", lambda model, config: fake_run(model, config.offload))
    with pytest.raises(RuntimeError, match="run failed"):
        e2e_hybrid.run_mode(None, "auto/split=4-32768-65536", 1 << 30, 1 << 31, [[1, 2]], 2, 64, SimpleNamespace(
            prefill_while_decoding=256, cpu_threads=None), start_step=0)
    assert seen == [("auto", {"items_per_thread": 4, "min_item_bytes": 32768, "min_thread_bytes": 65536})]
    assert cpu_attention_work_split() == before
    host_pools = []  # "/host=48": that mode's host pool instead of the run's
    monkeypatch.setattr(e2e_hybrid, "optimize", lambda model, config: host_pools.append(config.cpu_cache_size)
                        or fake_run(model, config.offload))
    for mode in ("auto/host=48/width=10", "auto/host=0.5", "never"):
        with pytest.raises(RuntimeError, match="run failed"):
            e2e_hybrid.run_mode(None, mode, 1 << 30, 1 << 31, [[1, 2]], 2, 64, SimpleNamespace(
                prefill_while_decoding=256, cpu_threads=None), start_step=0)
    assert host_pools == [48 << 30, 1 << 29, 1 << 31]


def test_modes_with_an_unknown_suffix_or_named_twice_are_refused():
    """check_modes: every suffix of e2e_hybrid's modes is known (a typo would run the defaults under an A/B arm's
    name); a mode named twice is refused, "/r2" runs it again."""
    e2e_hybrid.check_modes(["never", "auto", "auto/share=0.95", "auto/r2", "staggered:4/t14/split=4-32768-65536",
                            "0.5/pw/bs64/pin", "auto/cap64", "never/reserve=0.2", "auto/1lane/hostreserve=0.3",
                            "auto/width=12/share=0.95"])
    assert e2e_hybrid.parse_mode("auto/r2") == e2e_hybrid.parse_mode("auto")
    for modes, message in ((["auto", "auto"], "named twice"), (["auto/shar=1.0"], "unknown suffix '/shar=1.0'"),
                           (["auto/barrier"], "unknown suffix '/barrier'"), (["auto/gcfreeze"], "unknown suffix"),
                           (["auto/gil=0.1"], "unknown suffix"), (["auto/inline"], "unknown suffix"),
                           (["auto/hostreserve=whole"], "unknown suffix"),
                           (["auto/r"], "unknown suffix"), (["auto/share=1.0x"], "unknown suffix"),
                           (["auto/width=x"], "unknown suffix")):
        with pytest.raises(ValueError, match=message):
            e2e_hybrid.check_modes(modes)
    with pytest.raises(ValueError):
        e2e_hybrid.check_modes(["sometimes"])


def test_a_staggered_window_records_which_row_limit_binds():
    """With the staggered plan the window keeps its RowLimit after every step (the job fit with the guard, the
    guard, the model's ceiling, the limit, the step average, the pipeline's members) as (median, min, max) and
    per step: the next GPU run names whichever holds the rows below the job fit, and how long it held."""
    from apex_compile import ApexConfig, SamplingParams, optimize

    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # tiny_model: 2 layers, 2 KV heads x 16 dims, fp32, 16-token blocks
    model = tiny_model("llama", layers=2)
    engine = optimize(model, ApexConfig(offload="staggered", stagger_width=2, gpu_cache_size=4 * block_bytes,
                                        cpu_cache_size=128 * block_bytes, max_model_len=64)).engine
    prompts = [[5, 6, 7, 8, 9]] * 8
    gap = HostGap(min_steps=1)
    gap.observe(True, 1e-3, 3e-3)
    engine.auto_policy = SimpleNamespace(gap=gap)  # auto's records (its model runs on CUDA only): verdict, gaps
    run = e2e_hybrid.steady_state(engine, prompts, SamplingParams(max_new_tokens=4), warm_steps=3, window_steps=5,
                                  fill_steps=20)
    assert 0 < run["host_tokens"] < run["tokens"]  # the pipeline's tokens beside the device pool's
    limits = run["row_limits"]
    assert set(limits) == {"measured", "guard", "ceiling", "limit", "share", "step_s", "members", "capacity",
                           "parked", "prefill"}
    assert all(low <= median <= high for median, low, high in limits.values())
    assert limits["limit"][2] <= 2 and limits["guard"][0] == 2  # a fixed pipeline keeps its width
    per_step = run["row_limit_steps"]  # and every step's, in order
    assert len(per_step) == 5 and [s["limit"] for s in per_step].count(limits["limit"][2]) >= 1
    assert all(s["gap_s"] == [0.0, pytest.approx(2e-3)] and s["model_rows"] == 0 for s in per_step)
    # the CPU job's fit after each step (what auto's model predicts the job by), the last one the pipeline's own
    assert per_step[-1]["fit"] == engine.stagger.rows.job_fit() and per_step[-1]["fit"][1] > 0
    assert 0 < limits["members"][2] <= engine.stagger.capacity
    ramp = run["fill_limit_steps"]  # every FILL_SAMPLE-th step before the window, numbered
    assert [s["step"] for s in ramp] == list(range(0, run["window_start"], e2e_hybrid.FILL_SAMPLE))
    assert ramp[0]["members"] <= ramp[-1]["members"] and all(
        s["capacity"] == engine.stagger.num_lanes * math.floor((engine.stagger.num_layers + 1) * s["share"])
        and s["limit"] <= s["share"] < s["limit"] + 1 for s in ramp)
    # what bounds the members at the window's end (before the benchmark aborts its requests): each keeps blocks
    # for its whole length (5 + 4 tokens: one block), the device pool's 4 blocks kept free to park
    end = run["pipeline_end"]
    assert end["members"] == limits["members"][0] or 0 < end["members"] <= end["capacity"]
    assert (end["member_bytes"], end["park_room_bytes"], end["host_bytes"]) == (
        block_bytes, 4 * block_bytes, 128 * block_bytes)
    assert 0 < end["host_free_bytes"] < end["host_bytes"]
    never = optimize(model, ApexConfig(offload="never", compile=False, max_num_seqs=4)).engine
    idle = e2e_hybrid.steady_state(never, prompts, SamplingParams(max_new_tokens=3), warm_steps=1, window_steps=2)
    assert idle["row_limits"] is None and idle["row_limit_steps"] == [] and idle["pipeline_end"] is None


def test_the_staggered_bound_is_the_tighter_of_host_pool_and_cpu_less_the_prefill():
    """The staggered plan's bound from never's run: rows = min(host-pool rows, job share x decode step x
    ideal_gain), one token per row at the mean step, less the device tokens their prefill takes."""
    never = {"decode_only_step_s": 0.005, "decode_step_s": 0.005, "window_s": 1.8, "steps": [None] * 300,
             "prefill_s_per_token": 20e-6, "tokens_per_s": 2000.0}
    cpu_bound = e2e_hybrid.staggered_bound(never, 1000.0, 8, 512, 128, job_share=0.9)  # 0.9 x 5 ms x 1000 = 4.5
    assert cpu_bound["rows"] == pytest.approx(4.5) and cpu_bound["mean_step_s"] == pytest.approx(0.006)
    assert cpu_bound["host_tokens_per_s"] == pytest.approx(750.0)
    assert cpu_bound["prefill_loss_tokens_per_s"] == pytest.approx(750.0 * 4 * 20e-6 * 2000.0)
    assert cpu_bound["efficiency"] == pytest.approx((750.0 - 120.0) / 1000.0)
    pool_bound = e2e_hybrid.staggered_bound(never, 1000.0, 3, 512, 512, job_share=0.9)
    assert pool_bound["rows"] == 3 and pool_bound["efficiency"] == pytest.approx((500.0 - 20.0) / 1000.0)


def test_modes_without_host_tokens_are_named():
    """A mode whose window decoded nothing from the host pool (auto after its ceiling fell to 0) is named, so
    its ratio to never is not read as a host gain."""
    runs = {"never": {"host_tokens": 0}, "auto": {"host_tokens": 0}, "staggered": {"host_tokens": 120}}
    assert e2e_hybrid.without_host_tokens(runs) == ["auto"]
    assert e2e_hybrid.without_host_tokens({"never": {"host_tokens": 0}}) == []


def _plot_row(shape, gib, never, auto, host_tokens, partial=False):
    modes = {"never": {"tokens_per_s": never, "host_tokens": 0}, "auto": {"tokens_per_s": auto,
                                                                         "host_tokens": host_tokens}}
    row = {"shape": shape, "device_gib": gib, "modes": modes}
    if partial:
        row["partial"] = True
    else:
        row.update(ideal_gain=500.0, staggered_bound_1lane={"gain": 300.0}, hf_offloaded={"decode_tokens_per_s": 90.0})
    return row


def test_plot_rows_take_each_pools_last_row_partial_ones_included():
    """plot_hybrid plots from several results (each call may hold one pool size), the last row per (shape,
    pool): a run cut short after its modes (partial) still counts, a later finished row replaces it."""
    import plot_hybrid

    first = {"rows": [_plot_row("a", 1.0, 100, 150, 40, partial=True), {"shape": "a", "device_gib": 4.0,
                                                                       "partial": True, "modes": {}}]}
    second = {"rows": [_plot_row("a", 2.0, 200, 210, 0, partial=True), _plot_row("a", 1.0, 110, 160, 45)]}
    rows = plot_hybrid.rows_of([first, second])
    assert sorted((r["device_gib"], r["modes"]["never"]["tokens_per_s"]) for r in rows) == [(1.0, 110), (2.0, 200)]


def test_plot_series_take_the_first_listed_mode_each_row_has():
    """--series "LABEL=A|B": a row with A plots A under LABEL, one with only B plots B, one with neither no point;
    a malformed spec is refused."""
    import plot_hybrid

    series = plot_hybrid.parse_series(["new=auto/reserve=0.15/shifted|auto/reserve=0.15"])
    assert series == [("new", ["auto/reserve=0.15/shifted", "auto/reserve=0.15"])]
    both = _plot_row("a", 1.0, 100, 150, 40)
    both["modes"]["auto/reserve=0.15/shifted"] = dict(both["modes"]["auto"], tokens_per_s=170)
    both["modes"]["auto/reserve=0.15"] = dict(both["modes"]["auto"], tokens_per_s=160)
    second = _plot_row("a", 2.0, 200, 210, 0)
    second["modes"]["auto/reserve=0.15"] = dict(second["modes"]["auto"], tokens_per_s=230)
    third = _plot_row("a", 4.0, 300, 310, 0)
    rates = [plot_hybrid.tokens_per_s(plot_hybrid.add_series(r, series), False) for r in (both, second, third)]
    assert [r.get("new") for r in rates] == [170, 230, None]
    with pytest.raises(SystemExit, match="LABEL=MODE"):
        plot_hybrid.parse_series(["no-equals-sign"])


def test_plot_hybrid_draws_a_png_per_shape(tmp_path):
    pytest.importorskip("matplotlib")
    import subprocess

    paths = []
    for i, rows in enumerate([[_plot_row("a", 1.0, 100, 150, 40), _plot_row("b", 1.0, 50, 50, 0)],
                              [_plot_row("a", 2.0, 200, 210, 0, partial=True)]]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"rows": rows, "machine": {"gpu": "x"}, "date": "2026-12-03T00:00:00"}))
    script = os.path.join(os.path.dirname(e2e_hybrid.__file__), "plot_hybrid.py")
    done = subprocess.run([sys.executable, script, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "r0_a.png").stat().st_size > 0 and (tmp_path / "r0_b.png").stat().st_size > 0
    # --steady: each row's steady-state figures (a row without them has them computed from its steps)
    steady = _plot_row("a", 1.0, 100, 150, 40)
    steady.update(steady_tokens_per_s={"never": 90.0, "auto": 120.0})
    window = _plot_row("b", 1.0, 100, 150, 40)
    window.update(steps={"never": [(4, 0, 100.0, 0.01, 0)] * 4, "auto": [(4, 1, 100.0, 0.01, 0)] * 4})
    for mode, run in window["modes"].items():
        run.update(tokens=4, window_s=0.04, prefill_s_per_token=1e-3)
    paths.append(tmp_path / "steady.json")
    paths[-1].write_text(json.dumps({"rows": [steady, window], "args": {"prompt": 8, "new_tokens": 4}}))
    done = subprocess.run([sys.executable, script, str(paths[-1]), "--steady", "--out", str(tmp_path / "s.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "s_a.png").stat().st_size > 0 and (tmp_path / "s_b.png").stat().st_size > 0
    done = subprocess.run([sys.executable, script, str(paths[0]), "--series", "hybrid=staggered|auto", "--out",
                           str(tmp_path / "series.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "series_a.png").stat().st_size > 0


def test_gemm_rows_writes_swiglu_rows_where_the_fused_kernel_won(tmp_path, monkeypatch):
    import gemm_rows
    from apex_compile.kernels import swiglu as ksw

    table = {"device_name": "GPU X", "shapes": {"bfloat16/8x16": [
        {"max_m": 16, "merged": "fused", "separate": "fused", "config": {"BLOCK_M": 16}},
        {"max_m": 24, "merged": "cublas", "separate": "cublas", "config": {"BLOCK_M": 16}},  # replaced
        {"max_m": 32, "merged": "cublas", "separate": "fused", "config": {"BLOCK_M": 64}}]}}
    path = tmp_path / "swiglu_dispatch.json"
    monkeypatch.setattr(ksw, "DISPATCH_TABLE_PATH", str(path))
    monkeypatch.setattr(ksw, "load_dispatch_table", lambda: json.loads(json.dumps(table)))
    result = {"device": "GPU X", "swiglu": {
        16: {"cublas": 10.0, "fused_best": 1.0, "fused_config": {"BLOCK_M": 32}},  # not in (16, 32): untouched
        20: {"cublas": 10.0, "fused_best": 9.0, "fused_config": {"BLOCK_M": 32, "BLOCK_N": 64}},
        24: {"cublas": 10.0, "fused_best": 9.9, "fused_config": {"BLOCK_M": 32}}}}  # within the margin: no
    assert gemm_rows.write_swiglu_rows(result, "bfloat16/8x16", 0.97)
    rows = json.loads(path.read_text())["shapes"]["bfloat16/8x16"]
    assert [r["max_m"] for r in rows] == [16, 20, 24, 32]
    assert rows[0] == table["shapes"]["bfloat16/8x16"][0]
    assert (rows[1]["merged"], rows[1]["separate"], rows[1]["config"]) == ("fused", "fused", {"BLOCK_M": 32, "BLOCK_N": 64})
    assert (rows[2]["merged"], rows[2]["separate"], rows[2]["config"]) == ("cublas", "fused", {"BLOCK_M": 64})
    assert not gemm_rows.write_swiglu_rows(dict(result, device="GPU Y"), "bfloat16/8x16", 0.97)


def test_job_records_line_up_each_job_with_the_devices_waits():
    """`job_records`: medians over the window's last jobs and, per job in order, (waiting, running, busy
    thread-seconds or None) beside the device's waits per step; a schedule without busy timings (NaN) gives no
    busy share; an executor without job timings gives nothing."""
    jobs = SimpleNamespace(job_seconds=[(9.0, 9.0), (0.0, 4e-3), (1e-4, 5e-3), (0.0, 6e-3)],
                           job_busy=[9.0, 8 * 3e-3, 8 * 4e-3, float("nan")], cores=list(range(8)),
                           collect_seconds=[9.0, 0.0, 2e-4, 0.0])
    out = e2e_hybrid.job_records(jobs, window_steps=3)
    assert out["cpu_job_s"] == pytest.approx(5e-3) and out["cpu_job_ready_wait_s"] == 0.0
    assert out["cpu_job_busy_share"] == pytest.approx(0.775)  # median of 3/4 and 4/5 (the NaN left out)
    assert out["cpu_jobs"] == [[0.0, 4e-3, 8 * 3e-3], [1e-4, 5e-3, 8 * 4e-3], [0.0, 6e-3, None]]
    assert out["collect_waits_s"] == [0.0, 2e-4, 0.0] and out["collect_wait_s"] == 0.0
    json.dumps(out, allow_nan=False)  # no NaN left: valid JSON
    assert "exports_before_window" not in out
    # job_parts: (waiting for prompt exports, the call's own, the rest); the jobs before the window are the fill's
    jobs.job_parts = [(0.25, 1e-4, 0.0), (0.0, 1e-4, 0.0), (0.5, 1e-4, 0.0), (0.0, 1e-4, 0.0), (2e-3, 1e-4, 0.0)]
    out = e2e_hybrid.job_records(jobs, window_steps=3)
    assert out["exports_before_window"] == {"seconds": 0.25, "jobs": 1, "of": 2}
    assert out["job_gaps"]["exports_s"] == pytest.approx(0.502) and out["job_gaps"]["exports_jobs"] == 2
    two_lanes = SimpleNamespace(job_seconds=[(0.0, 4e-3)], cores=[0], collect_seconds=[])
    assert "cpu_job_busy_share" not in e2e_hybrid.job_records(two_lanes, 8)
    assert e2e_hybrid.job_records(SimpleNamespace(job_seconds=[]), 8) == {} == e2e_hybrid.job_records(None, 8)


def test_huge_page_share_counts_only_the_mappings_holding_the_tensors():
    smaps = """7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
7fff00000000-7fff00001000 r-xp 00000000 08:01 12 /usr/lib/libc.so
Size:                  4 kB
AnonHugePages:         0 kB
"""
    inside = SimpleNamespace(data_ptr=lambda: 0x7f0000001000, nbytes=4096)
    both = SimpleNamespace(data_ptr=lambda: 0x7f00003ff000, nbytes=8192)
    outside = SimpleNamespace(data_ptr=lambda: 0x100000, nbytes=4096)
    assert e2e_hybrid.huge_page_share([inside], smaps) == 0.5
    assert e2e_hybrid.huge_page_share([both], smaps) == 0.75
    assert math.isnan(e2e_hybrid.huge_page_share([outside], smaps))


def test_cpu_topology_counts_cores_and_smt_siblings(tmp_path):
    """`cpu_topology` reads sysfs: 4 CPUs on 2 physical cores of one socket are 2 SMT groups; without topology
    files only the CPUs are counted."""
    for cpu, core, group in [(0, 0, "0,2"), (1, 1, "1,3"), (2, 0, "0,2"), (3, 1, "1,3")]:
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "thread_siblings_list").write_text(f"{group}\n")
    (tmp_path / "cpufreq").mkdir()  # not a CPU
    assert e2e_hybrid.cpu_topology(str(tmp_path)) == {"cpus": 4, "cores": 2, "sockets": 1,
                                                       "smt_groups": ["0,2", "1,3"]}
    (tmp_path / "cpu4").mkdir()
    assert e2e_hybrid.cpu_topology(str(tmp_path)) == {"cpus": 5}


def test_the_baseline_is_the_mean_of_nevers_runs():
    """baseline: never and its "/rN" repeats (an A-B-A order) are averaged; another never variant is a mode of its
    own, compared with that baseline, and no never run is named as a mode without host tokens."""
    runs = {"never": {"host_tokens": 0}, "auto": {"host_tokens": 5}, "never/spinning": {"host_tokens": 0},
            "never/r2": {"host_tokens": 0}}
    assert e2e_hybrid.never_modes(runs) == ["never", "never/r2"]
    rates = {"never": 100.0, "auto": 130.0, "never/spinning": 90.0, "never/r2": 110.0}
    assert e2e_hybrid.baseline(rates, runs) == 105.0
    assert e2e_hybrid.baseline({"auto": 130.0}, {"auto": {}}) is None
    assert e2e_hybrid.without_host_tokens(runs) == ["never/spinning"]
