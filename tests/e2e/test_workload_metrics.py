"""The user-workload benchmarks' arithmetic (benchmarks/workload.py, online.py): lengths, metrics, arrivals."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from workload import Lengths, RequestTimes, parse_range, percentiles, summarize  # noqa: E402


def test_lengths_are_reproducible_and_within_their_ranges():
    for dist in ("fixed", "uniform", "chat"):
        spec = Lengths(dist, (128, 2048), (64, 512)) if dist != "fixed" else Lengths(dist, (768, 768), (192, 192))
        a, b = spec.draw(500, seed=3), spec.draw(500, seed=3)
        assert a == b
        prompts, outputs = np.array([p for p, _ in a]), np.array([o for _, o in a])
        assert prompts.min() >= spec.prompt[0] and prompts.max() <= spec.prompt[1]
        assert outputs.min() >= spec.output[0] and outputs.max() <= spec.output[1]
    chat = np.array([p for p, _ in Lengths("chat", (128, 2048), (64, 512)).draw(2000, 0)])
    assert np.median(chat) < chat.mean()  # skewed: a long tail above a short median
    assert parse_range("768") == (768, 768) and parse_range("128:2048") == (128, 2048)
    with pytest.raises(ValueError):
        Lengths("zipf")
    with pytest.raises(ValueError):
        Lengths("uniform", (10, 5))


def test_ttft_tpot_itl_and_goodput_follow_the_vllm_definitions():
    # request 0: submitted at 0, tokens at 1, 2, 3 -> TTFT 1, TPOT (3 - 1) / 2 = 1, ITL [1, 1]
    # request 1: submitted at 1, tokens at 1.5, 1.6 -> TTFT 0.5, TPOT 0.1
    # request 2: one token only -> no TPOT (never fails the TPOT SLO)
    times = [RequestTimes(0.0, [1.0, 2.0, 3.0]), RequestTimes(1.0, [1.5, 1.6]), RequestTimes(2.0, [2.2])]
    assert times[0].tpot == pytest.approx(1.0) and times[1].tpot == pytest.approx(0.1)
    assert times[2].tpot is None
    out = summarize(times, start=0.0, end=4.0, slo_ttft=0.6, slo_tpot=0.5)
    assert out["output_tokens"] == 6 and out["output_tokens_per_s"] == pytest.approx(1.5)
    assert out["ttft_s"]["p50"] == pytest.approx(0.5)
    assert sorted(out["itl_s"].keys()) == ["mean", "p50", "p90", "p99"]
    assert out["itl_s"]["mean"] == pytest.approx((1 + 1 + 0.1) / 3)
    assert out["good_requests"] == 2  # request 0 misses both SLOs
    assert out["goodput_rps"] == pytest.approx(0.5)
    assert percentiles([])["p99"] is None


def test_poisson_arrivals_have_the_asked_rate_and_burstiness_spreads_them():
    from online import arrival_times

    poisson = arrival_times(4000, rate=5.0, burstiness=1.0, seed=0)
    assert poisson[0] == 0.0 and np.all(np.diff(poisson) >= 0)
    assert 4000 / poisson[-1] == pytest.approx(5.0, rel=0.08)
    bursty = arrival_times(4000, rate=5.0, burstiness=0.2, seed=0)
    assert np.std(np.diff(bursty)) > 1.5 * np.std(np.diff(poisson))


def test_the_offline_benchmark_measures_a_whole_batch_and_says_where_its_steps_went(tmp_path):
    """benchmarks/offline.py end to end on the embedded model (a subprocess, as a user runs it): every request
    completes with its output length, and each row carries the engine's counters over that batch only."""
    import json
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = tmp_path / "offline.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/offline.py", "--shape", "smollm2", "--device-gib", "0.01", "--host-gib", "0.05",
         "--requests", "6", "--prompt", "16:40", "--dist", "uniform", "--output", "4:8", "--modes", "never,auto",
         "--no-rehearsal", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=os.path.abspath(root)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    expected = sum(o for _, o in Lengths("uniform", (16, 40), (4, 8)).draw(6, 0))
    assert [r["mode"] for r in rows] == ["never", "auto"]
    for row in rows:
        assert row["completed"] == 6 and row["output_tokens"] == expected
        d = row["diagnostics"]
        assert 0 < row["steps"] and 0 <= d["ahead_steps"] <= row["steps"]
        assert d["forward_seconds"] > 0 and d["phase_seconds"]["forward"] > 0
        assert d["cpu_job_wait_s"] == 0.0  # no staggered pipeline on a CPU-only run under these modes
        # the batch's slowest steps (longest first, within the batch's steps), as printed
        slowest = d["slowest_steps"]
        assert len(slowest) == min(5, row["steps"]) and all(1 <= e["step"] <= row["steps"] for e in slowest)
        assert slowest[0]["seconds"] == max(longest for n, _, longest in d["step_kinds"].values() if n)
    assert result.stdout.count("slowest steps: #") == 2


def test_a_measured_row_is_replayed_from_the_inputs_its_prediction_was_made_from():
    """benchmarks/replay_batch_model.py: a row's kept model inputs (profile, calibration, limits) and its
    workload re-drawn from the result's lengths and seed give back the batch model's prediction, printed beside
    the measured steps by kind."""
    import dataclasses

    from replay_batch_model import replay_row, report

    from apex_compile.runtime.batch_model import predict_batch
    from tests.runtime.test_runtime_batch_model import h100_like, limits

    policy, batch_limits = h100_like(), limits()
    lengths = Lengths("uniform", (900, 1100), (200, 300)).draw(300, 3)
    expected = predict_batch(policy, lengths, batch_limits, pipeline=True)
    model = policy.model
    row = {"mode": "auto", "num_requests": 300, "device_gib": 1.0, "predicted_plan": "auto", "steps": 9000,
           "duration_s": 80.0, "diagnostics": {"step_kinds": {"staggered decode": [8000, 56.0, 0.1]}},
           "model_inputs": {"profile": dataclasses.asdict(model.profile),
                            "calibration": dataclasses.asdict(model.calibration),
                            "limits": dataclasses.asdict(batch_limits)}}
    result = {"lengths": "uniform prompt 900:1100 output 200:300", "seed": 3, "rows": [row]}
    replayed = replay_row(result, row)
    assert replayed["auto"] == expected and replayed["auto"].host_requests > 0
    assert replayed["never"] == predict_batch(model, lengths, batch_limits)
    lines = report(row, replayed)
    assert f"{expected.steps} steps" in lines[0] and f"{expected.makespan_s:.1f} s" in lines[0]
    assert any("staggered decode" in line and "measured 8000 x 7.00 ms" in line for line in lines)
    with pytest.raises(ValueError, match="model_inputs"):
        replay_row(result, {"num_requests": 3})
    # piece captures: priced for the sizes the engine did not hold before the batch (`model_inputs.captured`)
    inputs = row["model_inputs"]
    inputs["limits"] = dict(inputs["limits"], piece_sizes=list(range(576, 1600, 64)))
    unpaid = replay_row(result, row)["auto"]  # (the steps padded to the sizes; no capture price measured)
    inputs["calibration"] = dict(inputs["calibration"], piece_capture_s=2.0)
    paid = replay_row(result, row)["auto"]
    assert unpaid.captures == 0 and paid.captures > 1  # prompts of 900-1100 tokens: several sizes
    assert paid.makespan_s == pytest.approx(unpaid.makespan_s + 2.0 * paid.captures, rel=1e-6)
    inputs["captured"] = list(range(576, 1600, 64))
    assert replay_row(result, row)["auto"].captures == 0


def test_offline_rows_sample_the_pipelines_row_limit_beside_the_profiles_cpu_rate():
    """A row's `row_limit` samples: the rows a step serves and the CPU job's fitted rate over all layers, beside the
    profile's; none without a pipeline or before its first fitted job."""
    from types import SimpleNamespace

    from offline import row_limit_sample

    from apex_compile.runtime.stagger.row_limit import RowLimit

    rows = RowLimit(8, 32, adaptive=True, prior_rate=40e-9)
    engine = SimpleNamespace(plan=SimpleNamespace(pipeline=SimpleNamespace(rows=rows)), stats=SimpleNamespace(steps=7))
    assert row_limit_sample(engine) is None
    for work in (3000.0, 4000.0, 5000.0, 6000.0):  # jobs of growing work: the fit's slope
        rows.observe_job(5e-4 + 42e-9 * work, work)
    sample = row_limit_sample(engine)
    assert sample["step"] == 7 and sample["rows"] == rows.fraction
    assert sample["rate_s_per_token"] == pytest.approx(rows.rate * 32)
    assert sample["profile_s_per_token"] == pytest.approx(40e-9 * 32)
    assert row_limit_sample(SimpleNamespace(plan=SimpleNamespace(pipeline=None), stats=engine.stats)) is None


def test_the_replay_maps_the_batch_gates_verdicts_over_a_grid_of_batches():
    """replay_batch_model.py --map: with a row's model, each batch of the grid predicted without new pipeline
    members and with them, the gate's verdict as the engine's (`batch_verdict`), and auto's ratio: 1 where the
    gate stays shut, the pipeline's gain where it opens (a long queue behind a small pool)."""
    import dataclasses

    from replay_batch_model import map_rows

    from apex_compile.runtime.batch_model import BATCH_MARGIN, predict_batch
    from tests.runtime.test_runtime_batch_model import h100_like, limits

    policy, batch_limits = h100_like(), limits()
    model = policy.model
    row = {"device_gib": 1.0, "model_inputs": {"profile": dataclasses.asdict(model.profile),
                                               "calibration": dataclasses.asdict(model.calibration),
                                               "limits": dataclasses.asdict(batch_limits)}}
    grid = map_rows(row, workloads=(("fixed", (1024, 1024), (256, 256)),), counts=(8, 400), pools_gib=(1.0, 2.0))
    assert [(m["device_gib"], m["requests"]) for m in grid] == [(1.0, 8), (1.0, 400), (2.0, 8), (2.0, 400)]
    lengths = Lengths("fixed", (1024, 1024), (256, 256)).draw(400, 0)
    alone = predict_batch(policy, lengths, batch_limits, pipeline=True, entries=False)
    assert grid[1]["gpu_only_s"] == pytest.approx(alone.makespan_s)
    for m in grid:
        assert m["gate"] == (m["pipeline_s"] < m["gpu_only_s"] * (1 - BATCH_MARGIN))
        assert m["auto_vs_gpu_only"] == (m["gpu_only_s"] / m["pipeline_s"] if m["gate"] else 1.0)
    assert not grid[0]["gate"] and grid[1]["gate"] and grid[1]["auto_vs_gpu_only"] > 1.2
    row["model_inputs"]["limits"]["cycle"] = 0
    with pytest.raises(ValueError, match="no staggered plan"):
        map_rows(row)


def test_offline_rows_count_the_graphs_captured_inside_the_batch():
    """A row's `captures`: per lazily captured graph family of the plan, the keys captured and their seconds (over a
    batch: the difference, the captures its makespan paid); families the plan lacks are left out."""
    from types import SimpleNamespace

    from offline import difference, graph_captures

    pieces = SimpleNamespace(pieces={(64, 64): None}, capture_seconds=0.5)
    mixed = SimpleNamespace(graphs={(8, 8): None, (16, 16): None}, capture_seconds=0.2)
    plan = SimpleNamespace(pieces=pieces, mixed=mixed, stagger_pieces=None)
    before = graph_captures(plan)
    assert before == {"pieces": [1, 0.5], "mixed": [2, 0.2]}
    pieces.pieces[(1088, 64)] = None
    pieces.capture_seconds += 3.0
    assert difference(graph_captures(plan), before) == {"pieces": [1, pytest.approx(3.0)], "mixed": [0, 0.0]}
    assert graph_captures(None) == {}
