"""The model's step function: `step(input_ids [1, T], position_ids [1, T], logits_indices [N]) -> logits [N, vocab]`,
compiled with the "apex" backend (its attention ops call the step's runner from the context) or run eagerly with
attention routed to that runner; and the check that a HF model is one the engine handles."""
import contextlib
from typing import Callable, Optional, Tuple

import torch

from apex_compile.config import ApexConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
EAGER_ATTENTION_NAME = "apex_paged"


def check_supported(hf_model: torch.nn.Module) -> None:
    """Raises a clear error unless `hf_model` is a decoder-only LLaMA-family HF causal LM the engine handles."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None:
        raise TypeError(f"apex_compile.optimize expects a HuggingFace causal LM (PreTrainedModel), got "
                        f"{type(hf_model).__name__}")
    get_head = getattr(hf_model, "get_output_embeddings", None)
    if get_head is None or get_head() is None or not hasattr(hf_model, "generation_config"):
        raise TypeError(f"{type(hf_model).__name__} has no language-model head: apex_compile.optimize needs the "
                        f"causal LM (e.g. LlamaForCausalLM), not the bare decoder")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {model_type!r} ({type(hf_model).__name__}): apex_compile "
                         f"supports the LLaMA-family decoders {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("unsupported model: encoder-decoder models are not LLaMA-family decoders")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ValueError(f"unsupported model: sliding-window attention (window {window}) is not implemented by "
                         f"the paged kernels")


def eager_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: routes a layer's attention to the step's runner (eager mode)."""
    from apex_compile.runtime.context import get_attention_runner

    out = get_attention_runner().attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                           value[0].transpose(0, 1), scaling)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def attn_implementation(config, name: str):
    """Sets config._attn_implementation for one forward and restores the user's setting afterwards."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def model_step(model: torch.nn.Module) -> Callable:
    """step(input_ids [1, T], position_ids [1, T], logits_indices [N]) -> logits [N, vocab] of `model`."""

    def step(input_ids, position_ids, logits_indices):
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_indices)
        return out.logits[0]

    # a code object of its own: dynamo keeps its graphs (and counts them against RECOMPILE_LIMIT) per code object,
    # which every closure of this function would otherwise share across models and engines
    step.__code__ = step.__code__.replace()
    return step


_COMPILED_ATTR = "_apex_compiled_steps"
RECOMPILE_LIMIT = 64  # graphs per step code object (one per model step): 0/1-size specialisations x options


def compiled_step(model: torch.nn.Module, overlap: bool, inner: Optional[str], stagger: bool = False):
    """(compiled step, list receiving its pass reports) for `model` with these apex backend options.

    On a CPU the fusions stay off: the fused ops' CPU implementations are the aten ops HF runs, behind a custom-op
    call that costs more than it saves (~60 such calls per step for a 30-layer model); an eagerly run graph's
    fp32 linears use oneDNN packed weights instead (`apex_compile.passes.pack_linear`).

    Kept on the model (a private attribute) and shared by every engine of that model: compiling costs far more
    than a step, and the graph reads no engine state (the runner comes from the context).
    """
    per_model = model.__dict__.setdefault(_COMPILED_ATTR, {})
    key = (overlap, inner, stagger)
    if key not in per_model:
        from apex_compile.backend import apex_backend

        reports: list = []
        on_cpu = next(model.parameters()).device.type == "cpu"
        if not on_cpu:  # one GEMM per layer for q/k/v (and gate/up): their weights back to back in one buffer
            from apex_compile.ops.linear import merge_projection_weights

            merge_projection_weights(model)
        options = {"attention": "paged", "overlap": overlap, "fuse": not on_cpu, "fuse_qkv": not on_cpu,
                   "pack_linear": on_cpu and inner in (None, "eager"), "stagger": stagger,
                   "on_report": reports.append}
        if inner is not None:
            options["inner"] = inner
        compiled = torch.compile(model_step(model), backend=apex_backend, dynamic=True, options=options)
        if inner == "inductor" and next(model.parameters()).device.type == "cpu":
            compiled = with_frozen_weights(compiled)
        per_model[key] = (compiled, reports)
    return per_model[key]


def with_frozen_weights(compiled: Callable) -> Callable:
    """Runs `compiled` with inductor's weight freezing on: on CPU, linear layers become oneDNN calls on
    pre-packed weights (about twice as fast as ATen's GEMM at decode batch sizes). The weights are read when
    a graph compiles: later changes to them are not seen."""
    from torch._inductor import config as inductor_config

    def run(*args):
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return run


def build_step(model: torch.nn.Module, device: torch.device, config: ApexConfig, overlap: bool,
               stagger: bool = False) -> Tuple[Callable, Optional[list]]:
    """(step, its pass reports or None) for `model`: compiled with the apex backend (`compiled_step`, the overlap
    or staggered variant), or with `config.compile` off the eager HF modules with attention routed to the step's
    runner (no reports)."""
    if not config.compile:
        from transformers import AttentionInterface

        from apex_compile.passes import pack_linear

        AttentionInterface.register(EAGER_ATTENTION_NAME, eager_paged_attention)
        forward = model_step(model)
        # on a CPU the fp32 linears run on oneDNN-packed weights, as in the compiled graph (no trace needed)
        packed = device.type == "cpu" and pack_linear.available()

        def eager_step(input_ids, position_ids, logits_indices):
            with (attn_implementation(model.config, EAGER_ATTENTION_NAME),
                  pack_linear.PackedLinears() if packed else contextlib.nullcontext()):
                return forward(input_ids, position_ids, logits_indices)

        return eager_step, None
    compiled, reports = compiled_step(model, overlap, config.inner, stagger)
    # Past dynamo's recompile limit it would run the unrewritten HF forward, which attends over the step's
    # tokens only: a silently wrong result. Each model step has its own code object (`model_step`), so the
    # limit counts one step's shapes; past it, an error instead of the fallback.
    # specialize_float: the model's float attributes (RMSNorm eps, attention scaling) are constants; as
    # symbolic inputs, SDPA's scale guard made AOT autograd restart dynamo's analysis after its cache lookup,
    # so every fresh process traced the graph twice and its first AOT trace was thrown away, never cached.
    dynamo_limits = {key: value for key, value in (("recompile_limit", RECOMPILE_LIMIT),
                                                   ("fail_on_recompile_limit_hit", True),
                                                   ("specialize_float", True))
                     if hasattr(torch._dynamo.config, key)}

    def run_compiled(input_ids, position_ids, logits_indices):
        with attn_implementation(model.config, "sdpa"), torch._dynamo.config.patch(**dynamo_limits):
            return compiled(input_ids, position_ids, logits_indices)

    return run_compiled, reports

