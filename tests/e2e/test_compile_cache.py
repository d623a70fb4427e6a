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


def run_probe(cache_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["APEX_COMPILE_CACHE_DIR"] = str(cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_graph_from_the_cache_dir(tmp_path):
    first = run_probe(tmp_path)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert os.path.isdir(tmp_path / "inductor") and os.listdir(tmp_path / "inductor")
    second = run_probe(tmp_path)
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0
