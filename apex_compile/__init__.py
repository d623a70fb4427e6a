"""apex_compile: hybrid CPU-GPU decode for HuggingFace LLaMA-family models.

`apex_compile.optimize(hf_model)` returns an `ApexModel` whose `.generate()` behaves like HF's;
`torch.compile(model, backend="apex")` applies the fusion passes; `apex_compile.ops` holds the kernels.
"""
from apex_compile.config import ApexConfig, compile_cache_dir

compile_cache_dir()  # before any compile: dynamo reads its profiles from inductor's cache dir when it starts
from apex_compile import ops  # noqa: F401,E402
from apex_compile.model import ApexModel, optimize  # noqa: E402
from apex_compile.runtime.request import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ApexConfig", "ApexModel", "SamplingParams", "compile_cache_dir", "ops", "optimize"]
