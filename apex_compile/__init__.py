"""apex_compile: hybrid CPU-GPU decode for HuggingFace LLaMA-family models.

`apex_compile.optimize(hf_model)` returns an `ApexModel` whose `.generate()` behaves like HF's;
`torch.compile(model, backend="apex")` applies the fusion passes; `apex_compile.ops` holds the kernels.
"""
import importlib.util as _util
import os as _os
import sys as _sys

from apex_compile import envs as _envs


# libgomp's wait policy, set by `import apex_compile` before torch loads libgomp (which reads it once, at load; torch's
# CPU ops and apex's C++ ops share that one libgomp). By default an idle thread of a team spins ~300k pauses before it
# sleeps: on a core another process also runs on, the spin spends the thread's share of that core, so the scheduler
# runs the other process first when the team next needs the thread. On a 2-core machine with one core busy the CPU
# engine ran 3.4x slower (HF generate 3.7x); passive waiting: 1.2x, but 27% slower on a quiet machine (each
# parallel region wakes its threads). benchmarks/results/cpu_contention/. Passive on hosts without an NVIDIA
# driver (CPU-only runs, whose team shares the cores with everything else); a GPU host keeps libgomp's default,
# where the staggered plan's CPU team runs back-to-back jobs on cores of its own and must not sleep between them.
# APEX_COMPILE_OMP_WAIT_POLICY: "passive" or "keep" (libgomp's default) overrides the choice.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def _gpu_host() -> bool:
    """Whether an NVIDIA driver is present (without importing torch)."""
    return _os.path.exists("/proc/driver/nvidia") or _os.path.exists("/dev/nvidiactl")


def openmp_wait_choice() -> dict:
    """The OpenMP environment `import apex_compile` sets on this host when nothing overrides it (see OPENMP_WAIT)."""
    forced = _envs.APEX_COMPILE_OMP_WAIT_POLICY
    if forced == "keep" or (forced != "passive" and _gpu_host()):
        return {}
    return dict(OPENMP_WAIT)


def _openmp_wait_policy() -> None:
    """Sets `openmp_wait_choice()` in the environment unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT, or torch
    (and so libgomp) is already loaded: then it could no longer take effect; export OMP_WAIT_POLICY=PASSIVE before
    starting Python instead."""
    if "torch" in _sys.modules or _envs.OMP_WAIT_POLICY is not None or _envs.GOMP_SPINCOUNT is not None:
        return
    for name, value in openmp_wait_choice().items():
        _envs.set_value(name, value)


_openmp_wait_policy()


def _checkout_passes() -> None:
    """In a source checkout the FX passes live in the top-level `passes/` folder: load it as apex_compile.passes
    (an installed wheel ships it there already, mapped by pyproject's package-dir)."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    folder = _os.path.join(_os.path.dirname(here), "passes")
    if _os.path.isdir(_os.path.join(here, "passes")) or not _os.path.isfile(_os.path.join(folder, "__init__.py")):
        return
    spec = _util.spec_from_file_location(__name__ + ".passes", _os.path.join(folder, "__init__.py"),
                                         submodule_search_locations=[folder])
    module = _util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["passes"] = module  # as the import system binds a loaded submodule to its package


_checkout_passes()

from apex_compile.config import ApexConfig, compile_cache_dir  # noqa: E402

compile_cache_dir()  # before any compile: dynamo reads its profiles from inductor's cache dir when it starts
from apex_compile import ops  # noqa: F401,E402
from apex_compile.model import ApexModel, optimize  # noqa: E402
from apex_compile.runtime.request import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ApexConfig", "ApexModel", "SamplingParams", "compile_cache_dir", "ops", "optimize"]
