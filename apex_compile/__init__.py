"""apex_compile: hybrid CPU-GPU decode for HuggingFace LLaMA-family models.

`apex_compile.optimize(hf_model)` returns an `ApexModel` whose `.generate()` behaves like HF's;
`torch.compile(model, backend="apex")` applies the fusion passes; `apex_compile.ops` holds the kernels.
"""
import importlib.util as _util
import os as _os
import sys as _sys


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
