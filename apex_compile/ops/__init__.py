"""Public op entry points; each is also registered as `torch.ops.apex.<name>` with a fake implementation."""
from apex_compile.ops import attention  # noqa: F401  (registers the runner-backed attention ops)
from apex_compile.ops.cpu_attention import (  # noqa: F401
    allocate_kv_cache_cpu,
    cache_append_cpu,
    cpu_attention_work_split,
    cpu_isa,
    paged_attention_cpu,
)
from apex_compile.ops.kv_layout import copy_blocks, gather_kv  # noqa: F401
from apex_compile.kernels.paged_attention import (  # noqa: F401
    allocate_kv_cache_gpu,
    cache_append_gpu,
    paged_attention_gpu,
)
from apex_compile.kernels.prefill_attention import paged_prefill_attention_gpu  # noqa: F401
from apex_compile.ops.mlp import silu_mul, swiglu  # noqa: F401
from apex_compile.ops.norm import rms_norm  # noqa: F401
