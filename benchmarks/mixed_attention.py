"""One layer's attention in a mixed step (decode rows beside a prompt chunk), GPU time per launch plan on one
CUDA GPU, Llama-3-8B layout (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks):

  one prefill    the paged prefill kernel over every row (a decode row is a query tile of its own)
  decode+prefill the decode kernel on the decode rows, the prefill kernel on the chunk (the runner's plan)
  chunk cfg ...  the chunk alone under each prefill tile config (the launcher's default first)

Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), so launch overhead is excluded.

    python benchmarks/mixed_attention.py
"""
import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apex_compile.kernels.paged_attention import paged_decode_launch  # noqa: E402
from apex_compile.kernels.prefill_attention import default_prefill_config, paged_prefill_launch  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def case(num_decode, decode_ctx, chunk, prefix, device="cuda"):
    """Caches and metadata of `num_decode` decode rows at `decode_ctx` and one `chunk`-token chunk after
    `prefix` cached tokens (all of them already in the cache, as after the step's append)."""
    contexts = [decode_ctx] * num_decode + [prefix + chunk]
    width = -(-max(contexts) // BS)
    blocks = width * len(contexts)
    cache = [torch.randn(blocks, HKV, BS, D, dtype=torch.bfloat16, device=device) for _ in range(2)]
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(len(contexts), width)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    rows = num_decode + chunk
    query = torch.randn(rows, HQ, D, dtype=torch.bfloat16, device=device)
    qstart_all = torch.tensor(list(range(num_decode + 1)) + [rows], dtype=torch.int32, device=device)
    qstart_chunk = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    return query, cache, tables, ctx, qstart_all, qstart_chunk


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", default="24")
    parser.add_argument("--decode-ctx", type=int, default=600)
    parser.add_argument("--chunks", default="256:0,256:256")
    args = parser.parse_args()
    scale = D ** -0.5
    swept = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
             for m, n, w, s in itertools.product((16, 32, 64, 128), (32, 64), (4, 8), (2, 3))]
    print(f"{'decode rows':>11} {'chunk':>5} {'prefix':>6} | {'one prefill':>11} {'dec+prefill':>11} | best chunk "
          f"config (us; the launcher's default first)")
    for num_decode, spec in itertools.product((int(x) for x in args.decode.split(",")), args.chunks.split(",")):
        chunk, prefix = (int(x) for x in spec.split(":"))
        configs = [default_prefill_config(D, torch.device("cuda"), HQ * -(-chunk // 128))] + swept
        query, (kc, vc), tables, ctx, qstart_all, qstart_chunk = case(num_decode, args.decode_ctx, chunk, prefix)
        n = num_decode
        out = torch.empty_like(query)

        def one():
            paged_prefill_launch(query, kc, vc, tables, qstart_all, ctx, scale, 1 if not chunk else chunk, out=out)

        def split(config=None):
            def run():
                paged_decode_launch(query[:n], kc, vc, tables[:n], ctx[:n], scale, max(args.decode_ctx, prefix + chunk),
                                    out=out[:n])
                paged_prefill_launch(query[n:], kc, vc, tables[n:], qstart_chunk, ctx[n:], scale, chunk,
                                     config=config, out=out[n:])
            return run

        def chunk_only(config):
            return lambda: paged_prefill_launch(query[n:], kc, vc, tables[n:], qstart_chunk, ctx[n:], scale, chunk,
                                                config=config, out=out[n:])

        # the plans agree (bf16 inputs, fp32 accumulation)
        one()
        reference = out.clone()
        split()()
        torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)
        t_one = triton.testing.do_bench_cudagraph(one) * 1e3
        t_split = triton.testing.do_bench_cudagraph(split()) * 1e3
        timed = []
        for config in configs:
            try:
                timed.append((triton.testing.do_bench_cudagraph(chunk_only(config)) * 1e3, config))
            except Exception as error:  # noqa: BLE001 (a config the GPU cannot run: out of shared memory)
                print(f"   {config}: {type(error).__name__}")
        best = sorted(timed, key=lambda t: t[0])[:3]
        print(f"{n:11d} {chunk:5d} {prefix:6d} | {t_one:9.1f}us {t_split:9.1f}us | default {timed[0][0]:.1f}; "
              + "; ".join(f"{t:.1f} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
                          for t, c in best), flush=True)


if __name__ == "__main__":
    main()
