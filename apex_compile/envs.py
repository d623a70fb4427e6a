"""Every environment variable apex_compile reads: its name, default and meaning, read here and nowhere else.

Each is read when asked for (`envs.APEX_COMPILE_CACHE_DIR`, a module attribute computed on access), so a
variable set after import (a test, a launcher) takes effect. `APEX_CPU_ISA` is listed for reference: the C++
ops read it themselves on every call (`apex_compile.ops.cpu_attention.cpu_isa`).
"""
import os
from typing import Any, Callable, Dict, Optional


def _home_cache(*parts: str) -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "apex_compile", *parts)


_VARIABLES: Dict[str, Callable[[], Any]] = {
    # the persistent compile caches (inductor, triton) and the performance profiles: ~/.cache/apex_compile
    "APEX_COMPILE_CACHE_DIR": lambda: os.environ.get("APEX_COMPILE_CACHE_DIR") or _home_cache(),
    # dequantised checkpoints of the GGUF loader: ~/.cache/apex_compile
    "APEX_COMPILE_CACHE": lambda: os.environ.get("APEX_COMPILE_CACHE", _home_cache()),
    # "1": the performance profile of offload="auto" is measured again, not read from the cache
    "APEX_COMPILE_PROFILE_REFRESH": lambda: os.environ.get("APEX_COMPILE_PROFILE_REFRESH") == "1",
    # set (non-empty): the C++ ops are JIT-built from csrc/ even where a prebuilt library is current
    "APEX_COMPILE_FORCE_JIT": lambda: bool(os.environ.get("APEX_COMPILE_FORCE_JIT")),
    # where the JIT build of the C++ ops goes: ~/.cache/apex_compile/jit
    "APEX_COMPILE_BUILD_DIR": lambda: os.environ.get("APEX_COMPILE_BUILD_DIR", _home_cache("jit")),
    # the CPU attention kernel path ("avx512", "avx2", "scalar"); unset: the best the CPU supports (read in C++)
    "APEX_CPU_ISA": lambda: os.environ.get("APEX_CPU_ISA"),
    # libgomp's wait policy that `import apex_compile` sets: "passive" or "keep" (libgomp's default) overrides the
    # host's choice (passive without an NVIDIA driver); OMP_WAIT_POLICY / GOMP_SPINCOUNT set by the user win
    "APEX_COMPILE_OMP_WAIT_POLICY": lambda: os.environ.get("APEX_COMPILE_OMP_WAIT_POLICY", "").lower(),
    "OMP_WAIT_POLICY": lambda: os.environ.get("OMP_WAIT_POLICY"),
    "GOMP_SPINCOUNT": lambda: os.environ.get("GOMP_SPINCOUNT"),
    # inductor's and triton's own cache dirs: apex points them under APEX_COMPILE_CACHE_DIR unless set
    "TORCHINDUCTOR_CACHE_DIR": lambda: os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    "TRITON_CACHE_DIR": lambda: os.environ.get("TRITON_CACHE_DIR"),
}

APEX_COMPILE_CACHE_DIR: str
APEX_COMPILE_CACHE: str
APEX_COMPILE_PROFILE_REFRESH: bool
APEX_COMPILE_FORCE_JIT: bool
APEX_COMPILE_BUILD_DIR: str
APEX_CPU_ISA: Optional[str]
APEX_COMPILE_OMP_WAIT_POLICY: str
OMP_WAIT_POLICY: Optional[str]
GOMP_SPINCOUNT: Optional[str]
TORCHINDUCTOR_CACHE_DIR: Optional[str]
TRITON_CACHE_DIR: Optional[str]


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_default(name: str, value: str) -> None:
    """Sets `name` in the environment unless it is set (for the libraries that read it themselves)."""
    os.environ.setdefault(name, value)


def set_value(name: str, value: str) -> None:
    """Sets `name` in the environment (for the libraries that read it themselves)."""
    os.environ[name] = value
