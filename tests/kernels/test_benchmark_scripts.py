"""The Triton kernel benchmark scripts without a GPU: each imports and answers --help, the driver runs every
family's sections in the historical order, and a dry run on a fake CUDA device (fake_cuda_bench.py: meta
tensors, stubbed kernels) builds every row with no error. Each script runs in a subprocess."""
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
FAKE_CUDA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda_bench.py")
FAMILIES = {  # script -> its sections, in driver order
    "triton_rms_norm": ["rms_norm"],
    "triton_swiglu": ["silu_mul", "mlp"],
    "triton_decode": ["decode"],
    "triton_prefill": ["prefill"],
    "triton_rope": ["rope"],
}
DRIVER_SECTIONS = ["rms_norm", "silu_mul", "mlp", "decode", "prefill", "rope"]
"""triton_kernels.py's sections before the split into family scripts: results files stay comparable."""
SCRIPTS = ["triton_kernels", *FAMILIES, "triton_sweep"]


def run_python(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    result = run_python(os.path.join(BENCHMARKS, f"{script}.py"), "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--out" in result.stdout
    for section in FAMILIES.get(script, DRIVER_SECTIONS if script == "triton_kernels" else []):
        assert section in result.stdout, f"{script} --help does not list section {section}"


def test_driver_runs_every_family_in_order():
    """The driver's families are the family scripts, their sections the driver's historical list."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import kernel_bench, triton_kernels, triton_sweep;"
            "print(json.dumps({f.__name__: list(f.SECTIONS) for f in triton_kernels.FAMILIES}));"
            "print(json.dumps(kernel_bench.section_names(triton_kernels.FAMILIES)))")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    families, sections = (json.loads(line) for line in result.stdout.splitlines()[-2:])
    assert families == FAMILIES
    assert sections == DRIVER_SECTIONS
    on_disk = {name[:-3] for name in os.listdir(BENCHMARKS) if name.startswith("triton_") and name.endswith(".py")}
    assert on_disk == set(SCRIPTS), "a new triton_*.py script: register it in the driver and in this test"


def fake_run(tmp_path, script, *args):
    out = tmp_path / f"{script}.json"
    result = run_python(FAKE_CUDA, script, "--out", str(out), *args)
    assert result.returncode == 0, f"{script} {args}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return json.loads(out.read_text()), result.stdout


def test_driver_dry_run(tmp_path):
    data, stdout = fake_run(tmp_path, "triton_kernels", "--quick")
    assert list(data) == ["env", "rows", "swiglu_dispatch", "errors"]
    assert data["errors"] == []
    assert {row["section"] for row in data["rows"]} == {*DRIVER_SECTIONS, "decode-bs", "decode-cfg"}
    assert any(row["name"].endswith("kernel without PDL") for row in data["rows"]), "rms_norm rows without PDL"
    judged = [row for row in data["rows"] if "meets" in row]
    assert {row["section"] for row in judged} == {"rms_norm", "silu_mul", "mlp", "decode"}
    assert all({"name", "ms", "baseline_ms", "gbps", "pct_hbm", "speedup", "target"} <= set(row) for row in judged)
    assert set(data["swiglu_dispatch"]["shapes"]) == {"bfloat16/4096x11008", "bfloat16/4096x14336",
                                                      "bfloat16/576x1536"}
    assert f"targets met (GPU time): {sum(row['meets'] for row in judged)}/{len(judged)}" in stdout
    assert "swiglu dispatch table" in stdout


@pytest.mark.parametrize("script", list(FAMILIES))
def test_family_dry_run(tmp_path, script):
    """Each family alone: only its own rows; the dispatch table only from triton_swiglu."""
    data, _ = fake_run(tmp_path, script, "--quick")
    assert data["errors"] == []
    sections = {row["section"] for row in data["rows"]}
    assert sections == set(FAMILIES[script]) | ({"decode-bs", "decode-cfg"} if script == "triton_decode" else set())
    assert ("swiglu_dispatch" in data) == (script == "triton_swiglu")


def test_section_choice_dry_run(tmp_path):
    data, stdout = fake_run(tmp_path, "triton_kernels", "--quick", "--sections", "silu_mul,prefill")
    assert {row["section"] for row in data["rows"]} == {"silu_mul", "prefill"}
    assert data["swiglu_dispatch"] is None and "swiglu dispatch table" not in stdout


def test_sweep_dry_run(tmp_path):
    data, _ = fake_run(tmp_path, "triton_sweep")
    assert {row["section"] for row in data["rows"]} == {"timing", "rms_norm", "rms_copy", "rms_store", "rms_order",
                                                       "decode"}


def test_unknown_section_is_refused(tmp_path):
    result = run_python(FAKE_CUDA, "triton_rms_norm", "--sections", "mlp")
    assert result.returncode != 0 and "unknown sections: ['mlp']" in result.stderr


def test_kv_move_dry_run(tmp_path):
    """benchmarks/kv_move.py on the CPU (both pools in host memory): each variant's request makes the round trip,
    its host blocks are one run in a fresh pool and one run a block in the scattered one; a bad variant is
    refused."""
    out = tmp_path / "kv_move.json"
    script = os.path.join(BENCHMARKS, "kv_move.py")
    result = run_python(script, "--shape", "tiny", "--tokens", "40,100", "--host-gib", "0.001", "--repeat", "2",
                        "--device", "cpu", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["variant"], r["tokens"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [(v, t) for v in ("busy", "contiguous", "scattered") for t in (40, 100)]
    for tokens, blocks in ((40, 3), (100, 7)):
        assert rows["contiguous", tokens]["host_runs"] == 1 and rows["contiguous", tokens]["blocks"] == blocks
        assert rows["scattered", tokens]["host_runs"] == blocks
        assert rows["scattered", tokens]["copies"] == blocks * 2 * 2  # runs x (K, V) x layers
        assert all(rows[v, tokens]["park_ms"] > 0 and rows[v, tokens]["resume_ms"] > 0 for v in ("contiguous",
                                                                                                  "scattered"))
    bad = run_python(script, "--variants", "sideways", "--device", "cpu")
    assert bad.returncode != 0 and "unknown variants" in bad.stderr


def test_cache_append_bench_checks_and_times_both_layouts(tmp_path):
    """benchmarks/cache_append.py on a small case: both kinds checked against gather_kv, one row per kind and
    thread count."""
    out = tmp_path / "cache_append.json"
    result = run_python(os.path.join(BENCHMARKS, "cache_append.py"), "--shape", "llama3_8b", "--tokens", "100",
                        "--threads", "1,2", "--pool-blocks", "64", "--repeats", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["threads"]) for r in rows] == [("prompt", 1), ("prompt", 2), ("decode", 1), ("decode", 2)]
    assert all(r["gb_s"] > 0 for r in rows)
