"""Launch-parameter sweeps behind the defaults of the Triton kernels (H200; results under benchmarks/results/).

    python benchmarks/triton_sweep.py --out sweep.json [--sections timing,rms_norm,rms_copy,rms_store,rms_order,decode]
    python benchmarks/triton_sweep.py --sections decode_append

Sections:
  timing    a few rows timed both ways: steady-state CUDA-graph replay (what benchmarks/triton_kernels.py and
            its family scripts report) and do_bench with its L2-clearing write before every replay (what runs
            before 2026-11-30 reported), to show the size of the difference.
  rms_norm  num_warps of `apex::rms_norm` (bf16, +residual) -> `rms_norm_num_warps`.
  rms_copy  at 4096 tokens, the rms_norm kernel beside a copy of the same bytes in the same kernel shape (x ->
            y, residual -> residual_out, no math), per num_warps, each twice: the speed of light of this
            traffic at this size.
  rms_store the store policy of the rms_norm kernel (default write-back, evict-first, streaming ".cs"), on a
            copy of its single-pass body defined here, 4096 tokens, each variant timed twice
            -> the ".cs" stores of apex_compile/kernels/rms_norm.py.
  rms_order at 4096 tokens, the order of the rms_norm body's memory accesses (weight loaded first or after the
            reduction; residual_out stored right after the add or with y), masked or unmasked rows, with and
            without PDL, per num_warps, all timed in interleaved rounds beside the shipped kernel, the copy of
            the same bytes in the same shape and torch's copy_ of the same bytes (another kernel shape).
  decode    chunk / warps / stages x resident programs per SM of the split-K plan of `paged_attention_gpu`
            over small and large decode shapes, with torch SDPA on contiguous K/V as the reference
            -> DECODE_* defaults and PROGRAMS_PER_SM in apex_compile/kernels/paged_attention.py.
  decode_append (only when named) one layer of a CUDA-graph decode step, Llama-3-8B bf16, batch 1/16/64 at
            context 192 with splits planned for a 320-token block table: append kernel + decode + merge kernel
            (the separate launches) vs append + decode with the in-kernel merge vs the fused decode + append,
            timed in interleaved rounds.
Each variant's output is checked against the torch reference before it is timed.
"""
import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_bench import (  # noqa: E402
    ATTENTION_LAYOUTS, DEVICE, Bench, check_close, interleaved_medians, sdpa_function,
)
from triton_decode import decode_kv_bytes, decode_sets  # noqa: E402
from triton_rms_norm import EPS, copy_rows_calls, memcpy_calls, rms_calls, rms_norm_sets, torch_rms_norm  # noqa: E402

from apex_compile.kernels._common import next_pow2, pdl_available  # noqa: E402
from apex_compile.kernels.paged_attention import (  # noqa: E402
    cache_append_launch, decode_chunk, decode_split_plan, paged_decode_append_launch, paged_decode_launch,
    reserve_decode_counters,
)

RMS_SHAPES = [(h, t) for h in (2048, 4096, 8192) for t in (4096, 16384)]
RMS_WARPS = [2, 4, 8, 16]
DECODE_SHAPES = [("llama3-8b", 32, 2048), ("llama3-8b", 32, 512), ("llama3-8b", 8, 2048), ("llama3-8b", 8, 8192),
                 ("llama3-8b", 8, 32768), ("llama3-8b", 1, 512), ("llama3-8b", 1, 2048), ("llama3-8b", 1, 32768),
                 ("llama2-7b", 1, 2048), ("llama2-7b", 1, 32768), ("llama2-7b", 8, 512), ("llama2-7b", 32, 512)]
DECODE_LAUNCHES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 3),
                   (32, 2, 4)]
"""(block_t, num_warps, num_stages)"""
PROGRAMS_PER_SM = [2, 4, 8, 16]
FORCED_SPLIT_TOKENS = [64, 128]
APPEND_SHAPES = ("llama3-8b", [1, 16, 64], 192, 320)
"""decode_append section: layout, batches, context, block-table capacity (tokens)."""


def sweep_rms_norm(bench, results):
    """Times rms_norm per hidden size, token count and num_warps against the unfused torch ops."""
    for hidden, tokens in RMS_SHAPES:
        sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
        ref_y, ref_hidden = torch_rms_norm(sets[0][0], sets[0][2], sets[0][1])
        base = bench.graph_ms([lambda s=s: torch_rms_norm(s[0], s[2], s[1]) for s in sets])
        for warps in RMS_WARPS:
            if not 4 <= next_pow2(hidden) // (32 * warps) <= 128:
                continue
            calls = rms_calls(sets, warps)
            calls[0]()
            check_close(f"rms_norm warps={warps}", sets[0][3], ref_y)
            check_close(f"rms_norm residual warps={warps}", sets[0][4], ref_hidden)
            ms = bench.graph_ms(calls)
            row = {"section": "rms_norm", "hidden": hidden, "tokens": tokens, "num_warps": warps,
                   "us": ms * 1e3, "pct_hbm": 100 * bytes_moved / ms / 1e6 / bench.hbm_gbps, "speedup": base / ms}
            results.append(row)
            print(f"rms_norm H={hidden:5d} tokens={tokens:5d} warps={warps:2d} {row['us']:8.1f} us "
                  f"{row['pct_hbm']:5.1f} %HBM x{row['speedup']:.2f}", flush=True)
        del sets
        torch.cuda.empty_cache()


def time_row(bench, results, calls, bytes_moved, **fields):
    """Times `calls` (graph replay), appends {**fields, us, pct_hbm} to `results` and prints it."""
    ms = bench.graph_ms(calls)
    row = {**fields, "us": ms * 1e3, "pct_hbm": 100 * bytes_moved / ms / 1e6 / bench.hbm_gbps}
    results.append(row)
    print(" ".join(f"{key}={value}" for key, value in fields.items()) + f" {row['us']:.2f} us {row['pct_hbm']:.1f}%",
          flush=True)


@triton.jit
def _store_row(ptr, value, mask, STORE: tl.constexpr):
    """Stores one row with store policy STORE: 0 write-back, 1 evict_first, 2 cache_modifier ".cs"."""
    if STORE == 0:
        tl.store(ptr, value, mask=mask)
    elif STORE == 1:
        tl.store(ptr, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptr, value, mask=mask, cache_modifier=".cs")


@triton.jit
def _rms_norm_probe(x_ptr, r_ptr, w_ptr, y_ptr, r_out_ptr, hidden, eps, BLOCK_H: tl.constexpr,
                    STORE: tl.constexpr, WEIGHT_LATE: tl.constexpr, STORE_LATE: tl.constexpr, MASKED: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """The rms_norm kernel's single-pass body (contiguous rows, with residual, evict-first loads) with a choice of
    store policy (STORE, as in _store_row) and of access order: WEIGHT_LATE loads the weight after the reduction
    instead of first, STORE_LATE stores residual_out together with y instead of right after the add;
    MASKED=False drops the column mask (hidden == BLOCK_H)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (cols < hidden) if MASKED else None
    other = 0.0 if MASKED else None
    if not WEIGHT_LATE:
        w = tl.load(w_ptr + cols, mask=mask, other=other, eviction_policy="evict_last")
    h = tl.load(x_ptr + row * hidden + cols, mask=mask, other=other, eviction_policy="evict_first")
    r = tl.load(r_ptr + row * hidden + cols, mask=mask, other=other, eviction_policy="evict_first")
    h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if not STORE_LATE:
        _store_row(r_out_ptr + row * hidden + cols, h, mask, STORE)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    if WEIGHT_LATE:
        w = tl.load(w_ptr + cols, mask=mask, other=other, eviction_policy="evict_last")
    y = (w.to(tl.float32) * (hf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
    if STORE_LATE:
        _store_row(r_out_ptr + row * hidden + cols, h, mask, STORE)
    _store_row(y_ptr + row * hidden + cols, y, mask, STORE)


def sweep_rms_store(bench, results):
    """Times the three store policies of _rms_norm_probe (weight loaded and both rows stored after the reduction)
    at 4096 tokens, each twice."""
    tokens = 4096
    for hidden in (2048, 4096):
        sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
        ref_y, ref_hidden = torch_rms_norm(sets[0][0], sets[0][2], sets[0][1])
        for store in (0, 1, 2):
            for warps in (2, 4, 8):
                calls = [lambda s=s: _rms_norm_probe[(tokens,)](
                    s[0], s[1], s[2], s[3], s[4], hidden, EPS, BLOCK_H=hidden, STORE=store, WEIGHT_LATE=True,
                    STORE_LATE=True, MASKED=True, USE_PDL=False, num_warps=warps) for s in sets]
                calls[0]()
                check_close(f"rms_store {store} y", sets[0][3], ref_y)
                check_close(f"rms_store {store} residual", sets[0][4], ref_hidden)
                for repeat in range(2):
                    time_row(bench, results, calls, bytes_moved, section="rms_store", hidden=hidden, tokens=tokens,
                             store=store, num_warps=warps, repeat=repeat)
        del sets
        torch.cuda.empty_cache()


def sweep_rms_copy(bench, results):
    """At 4096 tokens, times `apex::rms_norm`'s kernel and copy_rows_kernel (the same bytes, no math) over
    num_warps, interleaved, each twice: how far the kernel is from the speed of light of its traffic."""
    tokens = 4096
    for hidden in (2048, 4096):
        sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
        ref_y, ref_hidden = torch_rms_norm(sets[0][0], sets[0][2], sets[0][1])
        for warps in (2, 4, 8):
            copy_calls = copy_rows_calls(sets, hidden, tokens, warps)
            copy_calls[0]()
            torch.testing.assert_close(sets[0][3], sets[0][0], rtol=0, atol=0)
            torch.testing.assert_close(sets[0][4], sets[0][1], rtol=0, atol=0)
            norm_calls = rms_calls(sets, warps)
            norm_calls[0]()
            check_close(f"rms_copy norm warps={warps} y", sets[0][3], ref_y)
            check_close(f"rms_copy norm warps={warps} residual", sets[0][4], ref_hidden)
            for repeat in range(2):
                for kind, calls in (("rms_norm", norm_calls), ("copy", copy_calls)):
                    time_row(bench, results, calls, bytes_moved, section="rms_copy", kernel=kind, hidden=hidden,
                             tokens=tokens, num_warps=warps, repeat=repeat)
        del sets
        torch.cuda.empty_cache()


def sweep_rms_order(bench, results):
    """Times every access order x mask x PDL x num_warps of _rms_norm_probe (".cs" stores) at 4096 tokens in
    interleaved rounds with the shipped kernel, copy_rows_kernel and torch's copy_ of the same bytes."""
    tokens = 4096
    with_pdl = pdl_available(torch.device("cuda"))
    for hidden in (2048, 4096):
        sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
        ref_y, ref_hidden = torch_rms_norm(sets[0][0], sets[0][2], sets[0][1])
        graphs = {}
        for warps in ((1, 2, 4, 8) if hidden == 2048 else (2, 4, 8)):
            for pdl in ((False, True) if with_pdl else (False,)):
                graphs[f"shipped warps={warps} pdl={int(pdl)}"] = rms_calls(sets, warps, pdl=pdl)
                for weight_late, store_late, masked in itertools.product((False, True), repeat=3):
                    label = (f"probe warps={warps} pdl={int(pdl)} weight_late={int(weight_late)} "
                             f"store_late={int(store_late)} masked={int(masked)}")
                    graphs[label] = [lambda s=s, w=warps, p=pdl, wl=weight_late, sl=store_late, m=masked:
                                     _rms_norm_probe[(tokens,)](
                                         s[0], s[1], s[2], s[3], s[4], hidden, EPS, BLOCK_H=hidden, STORE=2,
                                         WEIGHT_LATE=wl, STORE_LATE=sl, MASKED=m, USE_PDL=p,
                                         num_warps=w, launch_pdl=p) for s in sets]
        for label, calls in graphs.items():
            for s in sets:
                s[3].fill_(float("nan"))
                s[4].fill_(float("nan"))
            calls[0]()
            check_close(f"rms_order {label} y", sets[0][3], ref_y)
            check_close(f"rms_order {label} residual", sets[0][4], ref_hidden)
        graphs["copy_rows warps=4"] = copy_rows_calls(sets, hidden, tokens, 4)
        graphs["torch copy_"] = memcpy_calls(sets)
        medians = interleaved_medians({label: bench.capture(calls) for label, calls in graphs.items()}, len(sets))
        for label, ms in sorted(medians.items(), key=lambda item: item[1]):
            row = {"section": "rms_order", "hidden": hidden, "tokens": tokens, "variant": label, "us": ms * 1e3,
                   "pct_hbm": 100 * bytes_moved / ms / 1e6 / bench.hbm_gbps}
            results.append(row)
            print(f"rms_order H={hidden} {label:<62} {row['us']:6.2f} us {row['pct_hbm']:5.1f}%", flush=True)
        del sets, graphs
        torch.cuda.empty_cache()


def sweep_decode(bench, results, block_size, shapes=None):
    """Times every (chunk, warps, stages, programs per SM) launch of each decode shape against SDPA."""
    for model, batch, ctx in shapes or DECODE_SHAPES:
        num_kv_heads = ATTENTION_LAYOUTS[model][1]
        sets, kv_bytes = decode_sets(bench, model, batch, ctx, block_size), decode_kv_bytes(model, batch, ctx)
        q, k, v, paged = sets[0]
        sdpa, backend = sdpa_function(q[:, :, None], k, v, causal=False)
        ref = sdpa()[:, :, 0]
        base = bench.graph_ms([sdpa_function(s[0][:, :, None], s[1], s[2], causal=False)[0] for s in sets])
        seen = set()
        # the plan's splits per programs-per-SM target, then splits forced below MIN_TOKENS_PER_SPLIT (short
        # contexts of a full grid: more, shorter programs against one wave of long ones)
        plans = [(pps, None) for pps in PROGRAMS_PER_SM] + [(0, tps) for tps in FORCED_SPLIT_TOKENS if tps < ctx]
        for pps, forced in plans:
            for block_t, warps, stages in DECODE_LAUNCHES:
                if forced is not None and forced % block_t:
                    continue
                splits, tokens_per_split = (decode_split_plan(batch, num_kv_heads, ctx, q.device, block_t, pps)
                                            if forced is None else (-(-ctx // forced), forced))
                key = (block_t, warps, stages, tokens_per_split)
                if key in seen:
                    continue
                seen.add(key)
                launch = dict(max_context_len=ctx, tokens_per_split=tokens_per_split, block_t=block_t,
                              num_warps=warps, num_stages=stages)
                check_close(f"decode {model} {launch}", paged_decode_launch(q, *paged, **launch), ref)
                ms = bench.graph_ms([lambda s=s: paged_decode_launch(s[0], *s[3], **launch) for s in sets])
                row = {"section": "decode", "model": model, "batch": batch, "ctx": ctx, "block_t": block_t,
                       "warps": warps, "stages": stages, "programs_per_sm": pps, "splits": splits,
                       "forced_split_tokens": forced,
                       "us": ms * 1e3, "sdpa_us": base * 1e3, "sdpa_backend": backend,
                       "pct_hbm": 100 * kv_bytes / ms / 1e6 / bench.hbm_gbps, "vs_sdpa": base / ms}
                results.append(row)
                print(f"decode {model} b={batch:3d} ctx={ctx:5d} T{block_t}/w{warps}/s{stages} pps={pps:2d} "
                      f"splits={splits:3d} {row['us']:8.1f} us {row['pct_hbm']:5.1f} %HBM x{row['vs_sdpa']:.2f} SDPA",
                      flush=True)
        del sets, paged
        torch.cuda.empty_cache()


def decode_append_set(batch, ctx, capacity, block_size, num_kv_heads, num_heads, head_dim):
    """Random caches of batch * capacity tokens, shuffled block tables, and each row's current token as strided
    views of one QKV output with its slot (position ctx - 1)."""
    blocks_per_seq = capacity // block_size
    key_cache = torch.randn(batch * blocks_per_seq, num_kv_heads, block_size, head_dim, dtype=torch.bfloat16,
                            device=DEVICE)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(batch * blocks_per_seq, device=DEVICE).to(torch.int32).view(batch, -1)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    slots = block_tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v, key_cache, value_cache, slots, block_tables, context_lens


def sweep_decode_append(bench, results, block_size):
    """Per layer: the append + decode (+ merge) launches a CUDA-graph decode step ran before, append + decode
    with the in-kernel merge, and the fused launch, at APPEND_SHAPES (splits planned for the table's capacity)."""
    model, batches, ctx, capacity = APPEND_SHAPES
    num_heads, num_kv_heads, head_dim = ATTENTION_LAYOUTS[model]
    for batch in batches:
        kv_bytes = 2 * batch * capacity * num_kv_heads * head_dim * 2
        sets = [decode_append_set(batch, ctx, capacity, block_size, num_kv_heads, num_heads, head_dim)
                for _ in range(bench.rotation(kv_bytes))]
        reserve_decode_counters(DEVICE, batch * num_kv_heads)

        def separate(s, merge_kernel):
            q, k, v, key_cache, value_cache, slots, block_tables, context_lens = s
            cache_append_launch(k, v, key_cache, value_cache, slots)
            return paged_decode_launch(q, key_cache, value_cache, block_tables, context_lens,
                                       merge_kernel=merge_kernel)

        variants = {"append+decode+merge kernel": lambda s: separate(s, True),
                    "append+decode": lambda s: separate(s, False),
                    "fused": lambda s: paged_decode_append_launch(*s)}
        ref = variants["append+decode+merge kernel"](sets[0])
        for label, call in variants.items():
            check_close(f"decode_append {label} b={batch}", call(sets[0]), ref)
        graphs = {label: bench.capture([lambda s=s, call=call: call(s) for s in sets])
                  for label, call in variants.items()}
        medians = interleaved_medians(graphs, len(sets))
        block_t, programs_per_sm = decode_chunk(batch, num_kv_heads, head_dim, 2, torch.device(DEVICE))
        splits, _ = decode_split_plan(batch, num_kv_heads, capacity, torch.device(DEVICE), block_t, programs_per_sm)
        for label, ms in medians.items():
            results.append({"section": "decode_append", "model": model, "batch": batch, "ctx": ctx,
                            "capacity": capacity, "splits": splits, "variant": label, "us": ms * 1e3})
        print(f"decode_append {model} b={batch:3d} ctx={ctx} capacity={capacity} splits={splits:2d} "
              + "  ".join(f"{label} {ms * 1e3:6.2f} us" for label, ms in medians.items()), flush=True)
        del sets, graphs
        torch.cuda.empty_cache()


def sweep_timing(bench, results, block_size):
    """The same calls timed in steady state and with do_bench's L2 clearing."""
    cases = []
    for hidden, tokens in ((2048, 4096), (4096, 4096), (8192, 16384)):
        sets, bytes_moved = rms_norm_sets(bench, hidden, tokens)
        cases.append((f"rms_norm H={hidden} tokens={tokens}", rms_calls(sets), bytes_moved, sets))
    for model, batch, ctx in (("llama3-8b", 32, 2048), ("llama2-7b", 32, 8192)):
        sets, kv_bytes = decode_sets(bench, model, batch, ctx, block_size), decode_kv_bytes(model, batch, ctx)
        calls = [lambda s=s: paged_decode_launch(s[0], *s[3], max_context_len=ctx) for s in sets]
        cases.append((f"decode {model} b={batch} ctx={ctx}", calls, kv_bytes, sets))
    for name, calls, bytes_moved, _ in cases:
        steady, flushed = bench.graph_ms(calls), bench.flushed_graph_ms(calls)
        row = {"section": "timing", "name": name, "steady_us": steady * 1e3, "flushed_us": flushed * 1e3,
               "steady_pct_hbm": 100 * bytes_moved / steady / 1e6 / bench.hbm_gbps,
               "flushed_pct_hbm": 100 * bytes_moved / flushed / 1e6 / bench.hbm_gbps}
        results.append(row)
        print(f"timing {name:<36} steady {row['steady_us']:8.1f} us ({row['steady_pct_hbm']:5.1f} %HBM)  "
              f"flushed {row['flushed_us']:8.1f} us ({row['flushed_pct_hbm']:5.1f} %HBM)", flush=True)
    del cases
    torch.cuda.empty_cache()


def main():
    """Runs the chosen sections; prints rows and writes them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--sections", default="timing,rms_norm,rms_copy,rms_store,rms_order,decode")
    parser.add_argument("--hbm-gbps", type=float, default=4200.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-shapes", default=None,
                        help="decode section's shapes as model:batch:ctx,... (default: DECODE_SHAPES)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("triton_sweep.py needs a CUDA GPU")
    bench = Bench(args.hbm_gbps)
    results = []
    sections = args.sections.split(",")
    with torch.inference_mode():
        if "timing" in sections:
            sweep_timing(bench, results, args.block_size)
        if "rms_norm" in sections:
            sweep_rms_norm(bench, results)
        if "rms_copy" in sections:
            sweep_rms_copy(bench, results)
        if "rms_store" in sections:
            sweep_rms_store(bench, results)
        if "rms_order" in sections:
            sweep_rms_order(bench, results)
        if "decode" in sections:
            shapes = None if args.decode_shapes is None else [
                (m, int(b), int(c)) for m, b, c in (item.split(":") for item in args.decode_shapes.split(","))]
            sweep_decode(bench, results, args.block_size, shapes)
        if "decode_append" in sections:
            sweep_decode_append(bench, results, args.block_size)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(DEVICE), "torch": torch.__version__,
                       "hbm_gbps_reference": args.hbm_gbps, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
