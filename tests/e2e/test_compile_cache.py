"""The compile cache: a second process compiling the same graph with the apex backend and inductor loads it from
$APEX_COMPILE_CACHE_DIR instead of compiling it again (inductor's FX-graph cache counters tell which)."""
import json
import os
import subprocess
import sys

PROBE = r"""
import json, torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
import apex_compile  # noqa: F401  (registers the "apex" backend)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                     max_position_embeddings=64)).eval()
compiled = torch.compile(model, backend="apex", options={"inner": "inductor"})
with torch.no_grad():
    compiled(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps(dict(counters["inductor"])))
"""


ENGINE_PROBE = r"""
import json, torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
import apex_compile.runtime.model_step as step_module
from apex_compile.config import ApexConfig
from apex_compile.model import optimize
step_module.with_frozen_weights = lambda compiled: compiled  # not frozen, as on CUDA (freezing is not cached)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                     max_position_embeddings=64)).eval()
apex = optimize(model, ApexConfig(inner="inductor", offload="never", gpu_cache_size=1 << 22, cpu_cache_size=0))
apex.engine.warmup()
print(json.dumps(dict(counters["aot_autograd"])))
"""


def run_probe(cache_dir, probe=PROBE):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["APEX_COMPILE_CACHE_DIR"] = str(cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_graph_from_the_cache_dir(tmp_path):
    first = run_probe(tmp_path)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert os.path.isdir(tmp_path / "inductor") and os.listdir(tmp_path / "inductor")
    second = run_probe(tmp_path)
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0


def test_a_second_engine_process_traces_nothing_for_aot_autograd(tmp_path):
    """The engine's compiled step (dynamic shapes) in a second process: every AOT-autograd lookup hits, so no
    functionalisation trace runs; with the model's float constants symbolic, the first lookup missed in every
    process (dynamo restarted its analysis after it, and the restarted graph's entry was the one saved)."""
    first = run_probe(tmp_path, ENGINE_PROBE)
    assert first.get("autograd_cache_miss", 0) >= 1 and first.get("autograd_cache_saved", 0) >= 1
    second = run_probe(tmp_path, ENGINE_PROBE)
    assert second.get("autograd_cache_hit", 0) >= 1 and second.get("autograd_cache_miss", 0) == 0, second
