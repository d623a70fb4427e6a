"""Every `apex::` op: schema, fake implementation and per-device kernels (Triton launches from
apex_compile.kernels, C++ from csrc/openmp), all registered on import; plus the public Python entry points.

    cpu_attention   cache_append_cpu(_multi), paged_attention_cpu(_multi), stagger_cpu_job, stagger_layer_job,
                    StaggerRunner (stagger_runner_*: the layered jobs' C++ thread), ExportLander (kv_export_*:
                    the prompt K/V exports' C++ thread), wait_host_flags,
                    cpu_isa_code, cpu_attention_work_split (C++)
    gpu_attention   cache_append_gpu, paged_attention_gpu, paged_decode_append_gpu, paged_prefill_attention_gpu
                    (Triton)
    norm            rms_norm (Triton)
    mlp             silu_mul, swiglu (Triton)
    linear          qkv_linear (one GEMM over merged q/k/v weights), linear (decode-sized GEMMs on the skinny
                    Triton kernel where measured faster)
    attention       attention, offload_launch, device_attention, offload_wait (the engine's runner)
"""
from apex_compile.kernels.paged_attention import allocate_kv_cache_gpu
from apex_compile.ops import attention
from apex_compile.ops.cpu_attention import (
    ExportLander,
    StaggerRunner,
    allocate_kv_cache_cpu,
    cache_append_cpu,
    cache_append_cpu_multi,
    cpu_attention_work_split,
    cpu_isa,
    paged_attention_cpu,
    paged_attention_cpu_multi,
    stagger_cpu_job,
    stagger_layer_job,
    wait_host_flags,
)
from apex_compile.ops.gpu_attention import (
    cache_append_gpu,
    paged_attention_gpu,
    paged_decode_append_gpu,
    paged_prefill_attention_gpu,
)
from apex_compile.ops.kv_layout import copy_blocks, copy_blocks_layers, gather_kv
from apex_compile.ops.linear import qkv_linear
from apex_compile.ops.mlp import silu_mul, swiglu
from apex_compile.ops.norm import rms_norm

__all__ = [
    "ExportLander", "StaggerRunner", "allocate_kv_cache_cpu", "allocate_kv_cache_gpu", "attention", "cache_append_cpu", "cache_append_cpu_multi",
    "cache_append_gpu", "copy_blocks", "copy_blocks_layers", "cpu_attention_work_split", "cpu_isa", "gather_kv",
    "paged_attention_cpu", "paged_attention_cpu_multi", "paged_attention_gpu", "paged_decode_append_gpu",
    "paged_prefill_attention_gpu", "stagger_cpu_job", "stagger_layer_job",
    "wait_host_flags",
    "qkv_linear", "rms_norm", "silu_mul", "swiglu",
]
