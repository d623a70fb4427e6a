"""apex_compile: hybrid CPU-GPU decode for HuggingFace LLaMA-family models.

`apex_compile.optimize(hf_model)` returns an `ApexModel` whose `.generate()` behaves like HF's;
`torch.compile(model, backend="apex")` applies the fusion passes; `apex_compile.ops` holds the kernels.
"""
from apex_compile import ops  # noqa: F401
from apex_compile.config import ApexConfig
from apex_compile.model import ApexModel, optimize

__version__ = "0.1.0"
__all__ = ["ApexConfig", "ApexModel", "ops", "optimize"]
