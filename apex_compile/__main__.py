"""The main job: `python -m apex_compile` answers a batch of chat prompts with the apex engine (offload on),
then runs the same batch through HF `generate` and prints both speeds.

    python -m apex_compile                                  # embedded SmolLM2-135M-Instruct, 8 prompts, offload 0.5
    python -m apex_compile --model /path/to/hf_checkpoint --device cuda --offload staggered --batch-size 16
    python -m apex_compile --prompt "Why is the sky blue?" --prompt "Name a prime number." --no-hf
"""
import argparse
import sys
import time
from typing import List, Optional

import torch

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain gravity to a child in two sentences.",
    "Give me three tips for learning to cook.",
    "What is 12 times 12?",
    "Tell me a short joke about computers.",
    "Describe the ocean at night in one sentence.",
    "Why do cats purr?",
]


def parse_offload(text: str):
    """'auto' | 'never' | 'all' | 'staggered' | a fraction such as 0.5."""
    if text in ("auto", "never", "all", "staggered"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"offload must be auto, never, all, staggered or a fraction, got {text!r}")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"offload fraction must be in [0, 1], got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (a pool size in MiB)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of MiB, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 MiB, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the main job."""
    parser = argparse.ArgumentParser(prog="python -m apex_compile", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="local HF LLaMA-family checkpoint directory or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", action="append", default=None, help="a chat prompt (repeatable)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="number of default prompts in the batch (they are cycled to fill it; default 8); "
                             "with --prompt the batch is the prompts given, once each")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--offload", type=parse_offload, default=0.5,
                        help="auto | never | all | staggered | fraction of requests in the host pool (default 0.5)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--gpu-cache-mb", type=non_negative_int, default=None, help="device KV pool size in MiB")
    parser.add_argument("--cpu-cache-mb", type=non_negative_int, default=None, help="host KV pool size in MiB")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="run the step through torch.compile(backend='apex'): on with CUDA; auto = off on a CPU, "
                             "where the eager step (HF modules, paged attention, oneDNN-packed linears) answers a "
                             "one-shot batch sooner: dynamo's trace costs ~20-40 s per process on two cores for ~12%% "
                             "more tokens/s")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate comparison")
    parser.add_argument("--explain", action="store_true", help="print the pass report and pool layout")
    return parser


def chat_batch(tokenizer, prompts: List[str], batch_size: int) -> List[List[int]]:
    """Token ids of each prompt in the model's chat template, cycled to batch_size prompts."""
    if batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
    rows = []
    for prompt in chosen:
        if tokenizer.chat_template is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            rows.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            rows.append(tokenizer.encode(prompt))
    return rows


def run_hf(model, tokenizer, rows: List[List[int]], max_new_tokens: int, eos: List[int]):
    """HF generate (greedy, DynamicCache) on the left-padded batch; returns (new tokens per row, seconds)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
    seconds = time.perf_counter() - start
    rows_out = []
    for row in out[:, width:].tolist():
        tokens = []
        for token in row:
            tokens.append(token)
            if token in eos:
                break
        rows_out.append(tokens)
    return rows_out, seconds


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the main job; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":  # the OpenAI-compatible server (imported only when asked for)
        from apex_compile.entrypoints.openai.cli import main as serve_main

        return serve_main(argv[1:])
    process_start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size is not None and args.prompt:
        parser.error("--batch-size cycles the default prompts; with --prompt the batch is the prompts given")
    if args.device is not None:
        try:
            requested = torch.device(args.device)
        except RuntimeError as error:
            parser.error(f"--device: {error}")
        if requested.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
        if requested.type not in ("cpu", "cuda"):
            parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from apex_compile.config import ApexConfig
    from apex_compile.model import optimize
    from apex_compile.runtime.loader import load_model
    from apex_compile.runtime.request import SamplingParams

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    start = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: cannot load the model: {error}", file=sys.stderr)
        return 2
    load_seconds = time.perf_counter() - start
    print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {dtype}) "
          f"on {device} in {load_seconds:.1f}s")
    mib = 1 << 20
    compile_step = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    config = ApexConfig(offload=args.offload, compile=compile_step,
                        gpu_cache_size=None if args.gpu_cache_mb is None else args.gpu_cache_mb * mib,
                        cpu_cache_size=None if args.cpu_cache_mb is None else args.cpu_cache_mb * mib)
    try:
        apex = optimize(model, config, tokenizer)
    except ValueError as error:  # e.g. pools that do not fit
        print(f"error: {error}", file=sys.stderr)
        return 2
    prompts = args.prompt or [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(args.batch_size or 8)]
    rows = chat_batch(tokenizer, prompts, len(prompts))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)  # stops at the model's EOS (the default)

    if not compile_step:
        print("warming up the eager step (--compile on traces it with torch.compile: ~20 s per process on two "
              "cores)...", flush=True)
    elif device.type == "cpu":
        print("compiling the model for the CPU (~20 s on two cores, once per process: dynamo's trace is not "
              "cached)...", flush=True)
    else:
        print("compiling the model and capturing CUDA graphs (later processes reuse the compile cache)...",
              flush=True)
    start = time.perf_counter()
    apex.engine.warmup()
    warmup = time.perf_counter() - start
    print(f"{'compiled and warmed up' if compile_step else 'warmed up'} in {warmup:.1f}s", flush=True)
    stats_before = apex.engine.stats.requests_per_pool.copy()
    texts, tokens, first_token = [""] * len(rows), [[] for _ in rows], None
    start = time.perf_counter()
    for event in apex.engine.stream(rows, sampling):  # each answer is printed as soon as it is complete
        if first_token is None:
            first_token = time.perf_counter() - start
            print(f"first token after {first_token:.2f}s (model load {load_seconds:.1f}s, warm-up "
                  f"{warmup:.1f}s; {time.perf_counter() - process_start:.1f}s since start); answers follow as "
                  f"they finish", flush=True)
        texts[event.index] += event.text
        tokens[event.index].append(event.token_id)
        if event.finish_reason is not None:
            i = event.index
            answer = (texts[i] if event.finish_reason == "stop"
                      else tokenizer.decode(tokens[i], skip_special_tokens=True))
            print(f"\n[{i}] {prompts[i]}\n    -> {answer.strip()}\n    ({len(tokens[i])} tokens, "
                  f"{event.finish_reason}, {time.perf_counter() - start:.1f}s)", flush=True)
    apex_seconds = time.perf_counter() - start
    apex_tokens = sum(len(t) for t in tokens)
    per_pool = [a - b for a, b in zip(apex.engine.stats.requests_per_pool, stats_before)]
    apex_rate = apex_tokens / apex_seconds
    if device.type == "cpu":
        where = (f"CPU-only run: both KV pools are host RAM and all attention runs on the CPU (requests in the "
                 f"'device' pool: {per_pool[0]}, in the host pool: {per_pool[1]}; offload={args.offload!r})")
    else:
        where = (f"requests attended on {device}: {per_pool[0]}, on the CPU (host pool): {per_pool[1]} "
                 f"(offload={args.offload!r})")
    print(f"\napex: {apex_tokens} tokens in {apex_seconds:.2f}s = {apex_rate:.1f} tokens/s; {where}")
    if args.explain:
        apex.explain()
    if args.no_hf:
        return 0
    print("running HF generate on the same batch for comparison", flush=True)
    hf_rows, hf_seconds = run_hf(model, tokenizer, rows, args.max_new_tokens, list(apex.engine.model_eos_token_ids()))
    hf_tokens = sum(len(r) for r in hf_rows)
    hf_rate = hf_tokens / hf_seconds
    same = sum(a == b for a, b in zip(hf_rows, tokens))
    print(f"HF generate: {hf_tokens} tokens in {hf_seconds:.2f}s = {hf_rate:.1f} tokens/s")
    print(f"speed ratio apex / HF: {apex_rate / hf_rate:.2f}x; identical answers: {same}/{len(rows)}"
          + ("" if dtype == torch.float32 else " (reduced precision: small differences are expected)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
