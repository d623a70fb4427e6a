"""Runs the Triton kernel test files under TRITON_INTERPRET=1 on CPU tensors, each in a fresh subprocess.

Triton picks interpreter or GPU compilation when the kernels are decorated (at import), so the interpreter
needs its own process; the rest of the test session keeps compiled kernels (and the torch CPU paths).
"""
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_TEST_FILES = ["kernels/test_triton_rms_norm.py", "kernels/test_triton_swiglu.py",
                     "kernels/test_triton_attention.py", "kernels/test_triton_stagger.py",
                     "kernels/test_triton_skinny_linear.py",
                     "runtime/test_runtime_attention_runner.py",  # the runner: the GPU pool's kernels and layout
                     "runtime/test_runtime_stagger_layered.py"]  # the one-lane plan's device waits


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already running under the interpreter")
@pytest.mark.parametrize("test_file", KERNEL_TEST_FILES)
def test_kernels_under_triton_interpreter(test_file):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
         os.path.join("tests", test_file)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, (
        f"interpreter run of {test_file} failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}")
    assert " passed" in summary, f"no interpreter test ran in {test_file}: {summary}"
