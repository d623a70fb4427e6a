"""Loads the C++ CPU ops: the ahead-of-time build from setup.py if present and current, else a JIT build."""
import glob
import logging
import os

import torch

from apex_compile import envs
from apex_compile._build_flags import CXX_FLAGS, LD_FLAGS

log = logging.getLogger("apex_compile")

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CSRC_DIR = os.path.join(os.path.dirname(PACKAGE_DIR), "csrc", "openmp")
_loaded = False


def _sources():
    return sorted(glob.glob(os.path.join(CSRC_DIR, "*.cpp")))


def _is_current(library):
    """Whether `library` exists and is newer than every C++ source and header in csrc/openmp."""
    if not os.path.exists(library):
        return False
    sources = _sources() + glob.glob(os.path.join(CSRC_DIR, "*.h"))
    return not sources or max(os.path.getmtime(s) for s in sources) <= os.path.getmtime(library)


def _prebuilt_library():
    """Path of the setup.py-built library if it exists and is current."""
    candidates = glob.glob(os.path.join(PACKAGE_DIR, "_C*.so"))
    if not candidates:
        return None
    lib = max(candidates, key=os.path.getmtime)
    return lib if _is_current(lib) else None


def load_cpu_library():
    """Registers the `apex::*` CPU kernels with torch, building them with ninja on first use if needed."""
    global _loaded
    if _loaded:
        return
    lib = None if envs.APEX_COMPILE_FORCE_JIT else _prebuilt_library()
    if lib is not None:
        torch.ops.load_library(lib)
    else:
        from torch.utils.cpp_extension import load

        if not _sources():
            raise RuntimeError(f"apex_compile: no prebuilt C++ ops and no sources in {CSRC_DIR}")
        build_dir = envs.APEX_COMPILE_BUILD_DIR
        os.makedirs(build_dir, exist_ok=True)
        if not _is_current(os.path.join(build_dir, "apex_compile_C.so")):
            log.warning("apex_compile: JIT-building the C++ CPU ops with ninja (once; cached in %s)", build_dir)
        load(
            name="apex_compile_C",
            sources=_sources(),
            extra_include_paths=[CSRC_DIR],
            extra_cflags=CXX_FLAGS,
            extra_ldflags=LD_FLAGS,
            build_directory=build_dir,
            is_python_module=False,
            verbose=False,
        )
    _loaded = True
