"""`python -m apex_compile serve`: the OpenAI-compatible server on the apex engine.

    python -m apex_compile serve                                   # the embedded SmolLM2-135M-Instruct
    python -m apex_compile serve --model /path/to/checkpoint --device cuda --port 8000 --api-key sk-local

SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish, drains the engine front
and exits with status 0.
"""
import argparse
import signal
import sys
import time
from typing import List, Optional


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m apex_compile serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF checkpoint directory or .gguf file (default: the "
                                                      "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                                  "checkpoint directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 routes")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="most requests waiting to run; beyond it requests get 429 (default 1024)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--offload", type=parse_offload, default="auto",
                        help="auto | never | all | staggered | fraction of requests in the host pool (default auto)")
    parser.add_argument("--gpu-cache-mb", type=int, default=None, help="device KV pool size in MiB")
    parser.add_argument("--cpu-cache-mb", type=int, default=None, help="host KV pool size in MiB")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + generation")
    parser.add_argument("--no-warmup", action="store_true", help="skip compiling the step before listening")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Loads the model, serves it until SIGTERM/SIGINT; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_waiting < 0:
        parser.error(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    import torch

    from apex_compile.config import ApexConfig
    from apex_compile.entrypoints.openai.api_server import EMBEDDED_MODEL_NAME
    from apex_compile.model import optimize
    from apex_compile.runtime.loader import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    mib = 1 << 20
    options = dict(offload=args.offload,
                   gpu_cache_size=None if args.gpu_cache_mb is None else args.gpu_cache_mb * mib,
                   cpu_cache_size=None if args.cpu_cache_mb is None else args.cpu_cache_mb * mib,
                   max_model_len=args.max_model_len)
    if args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    try:
        config = ApexConfig(**options)
    except ValueError as error:
        parser.error(str(error))
    start = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: cannot load the model: {error}", file=sys.stderr)
        return 2
    print(f"loaded {type(model).__name__} ({dtype}) on {device} in {time.perf_counter() - start:.1f}s", flush=True)
    apex = optimize(model, config, tokenizer)
    name = args.served_model_name or (EMBEDDED_MODEL_NAME if args.model is None else None)
    return serve(apex, model_name=name, host=args.host, port=args.port, api_key=args.api_key,
                 max_waiting=args.max_waiting, log_level=args.log_level, warmup=not args.no_warmup)


def serve(apex, model_name: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: Optional[str] = None, max_waiting: int = 1024, log_level: str = "info",
          warmup: bool = True) -> int:
    """Serves an optimized model (`apex_compile.optimize`'s result) until SIGTERM/SIGINT, then drains its
    requests and closes it; returns the exit status (0 once the server had started)."""
    import uvicorn

    from apex_compile.entrypoints.openai.api_server import build_app

    if warmup:
        start = time.perf_counter()
        apex.engine.warmup()
        print(f"compiled the apex step in {time.perf_counter() - start:.1f}s", flush=True)
    app = build_app(apex, model_name=model_name, api_key=api_key, max_waiting=max_waiting)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=None))
    # uvicorn handles SIGTERM/SIGINT while it runs (graceful shutdown: in-flight requests finish) and raises the
    # signal again once it is done; this handler takes that one, so that the process exits with status 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        app.state.front.shutdown(drain=True)
        apex.close()
    print("server stopped", flush=True)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
