import time, contextlib, torch
import apex_compile
from apex_compile import ApexConfig, optimize
from apex_compile.runtime.loader import load_model
from apex_compile.runtime.request import SamplingParams
from apex_compile.passes.pack_linear import packed_linear
import torch.nn.functional as F

class PackMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype == torch.float32 and w.dim() == 2:
                return packed_linear(x, w, b)
        return func(*args, **kwargs)

t0 = time.perf_counter()
model, tok = load_model()
print("load", time.perf_counter() - t0)
prompts = ["What is the capital of France?", "Why do cats purr?", "Write a haiku about autumn leaves.",
           "Give me three tips for learning to cook."] * 2
msgs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
msgs = [m if isinstance(m, list) else m["input_ids"] for m in msgs]
sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
res = {}
engines = {}
for name, cfg, mode in [("compiled", ApexConfig(offload=0.5), None), ("eager", ApexConfig(offload=0.5, compile=False), None),
                        ("eager+pack", ApexConfig(offload=0.5, compile=False), PackMode)]:
    t = time.perf_counter()
    apex = optimize(model, cfg, tok)
    with (mode() if mode else contextlib.nullcontext()):
        apex.engine.warmup()
        first = apex.engine.generate(msgs[:1], SamplingParams(max_new_tokens=2))
    print(name, "build+warmup", round(time.perf_counter() - t, 1), flush=True)
    engines[name] = (apex, mode)
for rep in range(2):
    for name, (apex, mode) in engines.items():
        with (mode() if mode else contextlib.nullcontext()):
            t = time.perf_counter()
            out = apex.engine.generate(msgs, sp)
            dt = time.perf_counter() - t
        res.setdefault(name, []).append(8 * 64 / dt)
        res.setdefault(name + "_tok", out[0].token_ids[:12])
for k, v in res.items(): print(k, v)
