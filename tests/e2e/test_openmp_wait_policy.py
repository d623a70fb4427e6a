"""`import apex_compile` chooses libgomp's wait policy before torch loads libgomp (read once, at load), and leaves
a policy the user set, or one it can no longer change, alone; passive waits on hosts without an NVIDIA driver."""
import json
import os
import subprocess
import sys

import apex_compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "APEX_COMPILE_OMP_WAIT_POLICY")


def _environment_after(code: str, **preset: str) -> dict:
    """OMP_WAIT_POLICY and GOMP_SPINCOUNT as a fresh interpreter sees them after `code`, from `preset`."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    env.update(preset)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    probe = code + "\nimport json, os\nprint(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', " \
                   "'GOMP_SPINCOUNT')}))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_apex_compile_first_sets_its_wait_policy():
    chosen = apex_compile.openmp_wait_choice()
    seen = _environment_after("import apex_compile")
    assert seen == {k: chosen.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert _environment_after("import apex_compile", APEX_COMPILE_OMP_WAIT_POLICY="passive") == {
        "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}


def test_a_users_policy_or_keep_or_torch_first_is_left_alone():
    assert _environment_after("import apex_compile", OMP_WAIT_POLICY="ACTIVE") == {
        "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert _environment_after("import apex_compile", GOMP_SPINCOUNT="5") == {
        "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5"}
    assert _environment_after("import apex_compile", APEX_COMPILE_OMP_WAIT_POLICY="keep") == {
        "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    assert _environment_after("import torch\nimport apex_compile") == {
        "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
