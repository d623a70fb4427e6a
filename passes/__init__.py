"""FX passes of the apex torch.compile backend, imported as `apex_compile.passes` (the folder stays at the top
of the repository; installs ship it inside the package). Each is a small module with its own tests:

- `fuse_rmsnorm`: RMSNorm chain (+ the residual add feeding it) -> `apex.rms_norm`.
- `fuse_swiglu`: gate/up linears + SiLU + mul -> `apex.swiglu` (or `apex.silu_mul` on a fused gate_up).
- `partition_attention`: SDPA (+ the repeat_kv on its K/V) -> `apex.attention` per layer.
- `overlap`: `apex.attention` -> `offload_launch` / `device_attention` / `offload_wait`.
- `pack_linear`: fp32 CPU linears -> oneDNN linear on packed weights.
- `pipeline.run_pipeline` runs them and returns a `PassReport` (`report`).
Each module's pass function has the module's name (`overlap_attention` for `overlap`).
"""
from apex_compile.passes.graph_utils import PatternError
from apex_compile.passes.pipeline import run_pipeline
from apex_compile.passes.report import PassReport

__all__ = ["PassReport", "PatternError", "run_pipeline"]
