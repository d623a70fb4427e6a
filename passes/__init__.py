"""FX passes of the apex torch.compile backend (each a small module with its own tests).

- `passes.fuse_rmsnorm`: RMSNorm chain (+ the residual add feeding it) -> `apex.rms_norm`.
- `passes.fuse_swiglu`: gate/up linears + SiLU + mul -> `apex.swiglu` (or `apex.silu_mul` on a fused gate_up).
- `passes.partition_attention`: SDPA (+ the repeat_kv on its K/V) -> `apex.attention` per layer.
- `passes.overlap`: `apex.attention` -> `offload_launch` / `device_attention` / `offload_wait`.
- `passes.pipeline.run_pipeline` runs them and returns a `PassReport` (`passes.report`).
Each module's pass function has the module's name (`overlap_attention` for `overlap`).
"""
from passes.graph_utils import PatternError  # noqa: F401
from passes.pipeline import run_pipeline  # noqa: F401
from passes.report import PassReport  # noqa: F401
