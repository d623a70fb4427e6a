"""End-to-end GPU benchmark (one CUDA GPU): hybrid decoding with part of the KV cache in host memory.

1. Correctness: a small random Llama config in fp32 (TF32 off): ApexModel.generate equals HF generate token for
   token with offload never / all / 0.5; in bf16 the forward logits are compared with HF's (max abs difference
   reported, tolerance documented below).
2. Throughput: a random Llama-2-7B-shaped model in bf16 with a device KV pool too small for the batch, so with
   offload "never" requests wait for device blocks, while "all" / fractions keep requests in the host pool and
   attend on the CPU. Tokens/s per offload mode.

    python benchmarks/e2e_gpu.py --out benchmarks/results/e2e_gpu/<date>_<machine>.json
    python benchmarks/e2e_gpu.py --requests 32 --prompt-len 256 --modes never,0.5 --skip-correctness
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apex_compile.config import ApexConfig  # noqa: E402
from apex_compile.model import optimize  # noqa: E402
from apex_compile.runtime.request import SamplingParams  # noqa: E402

BF16_LOGITS_ATOL = 0.25  # bf16 logits of a random 2-layer model: differences come from op order / fusion only


def random_llama(dtype, device, **shape):
    """A randomly initialised LlamaForCausalLM built directly on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def correctness(device):
    """fp32 token equality with HF generate per offload mode, and the bf16 logits difference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = random_llama(torch.float32, device, **SMALL)
    lengths = [5, 17, 33, 64, 9, 40]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, width - n:] = torch.randint(3, 1000, (n,))
        mask[i, width - n:] = 1
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    results = {}
    for offload in ("never", "all", 0.5):
        apex = optimize(model, ApexConfig(offload=offload, gpu_cache_size=64 << 20, cpu_cache_size=64 << 20))
        out = apex.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        rows_equal = int((out == ref).all(dim=1).sum())
        results[f"fp32_offload_{offload}"] = {"identical_rows": rows_equal, "rows": len(lengths)}
        print(f"fp32 offload={offload!s:6} identical rows vs HF generate: {rows_equal}/{len(lengths)}")
    model_bf16 = random_llama(torch.bfloat16, device, **SMALL)
    apex = optimize(model_bf16, ApexConfig(offload=0.5, gpu_cache_size=64 << 20, cpu_cache_size=64 << 20))
    ids = input_ids[:, -32:]
    with torch.no_grad():
        ref_logits = model_bf16(ids).logits.float()
    diff = float((apex(ids).logits.float() - ref_logits).abs().max())
    results["bf16_logits_max_abs_diff"] = diff
    results["bf16_logits_tolerance"] = BF16_LOGITS_ATOL
    print(f"bf16 forward logits max |apex - HF| = {diff:.4f} (tolerance {BF16_LOGITS_ATOL})")
    return results


def throughput(device, args):
    """Tokens/s of the 7B-shaped model per offload mode."""
    torch.manual_seed(0)
    model = random_llama(torch.bfloat16, device, **LLAMA2_7B)
    kv_bytes_per_token = 2 * LLAMA2_7B["num_hidden_layers"] * LLAMA2_7B["hidden_size"] * 2
    tokens_per_request = args.prompt_len + args.new_tokens
    gpu_pool = int(args.gpu_fraction * args.requests * tokens_per_request * kv_bytes_per_token)
    cpu_pool = int(1.1 * args.requests * tokens_per_request * kv_bytes_per_token)
    prompts = [torch.randint(3, LLAMA2_7B["vocab_size"], (args.prompt_len,)).tolist() for _ in range(args.requests)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens)  # no EOS: every request generates new_tokens
    rows = []
    for mode in args.modes.split(","):
        offload = float(mode) if mode[0].isdigit() else mode
        apex = optimize(model, ApexConfig(offload=offload, gpu_cache_size=gpu_pool, cpu_cache_size=cpu_pool,
                                          max_num_seqs=args.requests, max_num_batched_tokens=args.prefill_tokens))
        start = time.perf_counter()
        apex.engine.warmup()
        compile_seconds = time.perf_counter() - start
        steps_before = apex.engine.stats.steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        completions = apex.engine.generate(prompts, sampling)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        host_requests = sum(1 for c in completions if c.steps_per_pool["host"])
        row = {"offload": mode, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "steps": apex.engine.stats.steps - steps_before, "requests_on_host": host_requests,
               "compile_seconds": compile_seconds, "gpu_pool_blocks": apex.engine.kv.pools[0].num_blocks,
               "cpu_pool_blocks": apex.engine.kv.pools[1].num_blocks}
        rows.append(row)
        print(f"offload={mode:6} {tokens} tokens in {seconds:7.2f}s = {row['tokens_per_s']:8.1f} tok/s, "
              f"{row['steps']} steps, {host_requests}/{args.requests} requests on the host (compile "
              f"{compile_seconds:.0f}s)", flush=True)
        apex.close()  # its pools and threads go now, not at a later garbage collection
        del apex
        torch.cuda.empty_cache()
    return {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "gpu_pool_bytes": gpu_pool, "cpu_pool_bytes": cpu_pool, "modes": rows}


def main():
    """Runs both parts and prints / writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-fraction", type=float, default=0.25,
                        help="device KV pool as a fraction of what the whole batch needs (default 0.25)")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--modes", default="never,all,0.5,0.75")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("e2e_gpu.py needs a CUDA GPU")
    device = torch.device("cuda")
    result = {"benchmark": "e2e_gpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(device), "cpu_threads": torch.get_num_threads(),
                          "torch": torch.__version__, "python": platform.python_version()}}
    if not args.skip_correctness:
        result["correctness"] = correctness(device)
    if not args.skip_throughput:
        result["throughput"] = throughput(device, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
