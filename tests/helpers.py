"""Test helpers for the pass/backend tests: dynamo graph capture, tiny HF models, a dense test runner."""
import math
from typing import List, Tuple

import torch
import torch.fx as fx


def capture(fn, *args, dynamic=False) -> Tuple[fx.GraphModule, List]:
    """The (single) torch-IR graph and example inputs dynamo hands a backend for `fn(*args)`."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)(*args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def compile_with(fn, rewrite, dynamic=False):
    """`fn` compiled by a backend that applies `rewrite(gm, report)` and runs the graph eagerly.

    Returns (compiled fn, records) where records collects (graph module, PassReport) per compiled graph.
    """
    from apex_compile.passes import PassReport

    records = []

    def backend(gm, example_inputs):
        report = PassReport()
        rewrite(gm, report)
        records.append((gm, report))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True), records


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error ||actual - expected|| / ||expected|| in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()

def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str) -> None:
    """max |out - ref| <= rel * max |ref|, in float64 on the CPU (CUDA outputs may meet CPU references)."""
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    out, ref = out.double().cpu(), ref.double().cpu()
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * max(scale, 1e-30), f"{what}: max error {err:.3g} > {rel:g} * {scale:.3g}"


def count_calls(gm: fx.GraphModule, target) -> int:
    """Number of call_function nodes of `gm` whose target is `target`."""
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def tiny_config(kind: str = "llama", layers: int = 2, **overrides):
    """A small random config: hidden 64, 4 query heads of 16 dims, 2 KV heads (GQA), fp32."""
    import transformers

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base.update(overrides)
    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}
    return configs[kind](**base)


def tiny_model(kind: str = "llama", layers: int = 2, seed: int = 0, **overrides):
    """A random tiny *ForCausalLM in eval mode (SDPA attention)."""
    import transformers

    classes = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM}
    torch.manual_seed(seed)
    model = classes[kind](tiny_config(kind, layers, **overrides)).eval()
    return model


def engine_step(model):
    """The engine-shaped step: flattened tokens [1, T] in, logits of the selected rows out."""

    def step(input_ids, position_ids, logits_indices):
        hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return model.lm_head(hidden[0, logits_indices])

    return step


def runner_for(model, **kwargs) -> "DenseCausalRunner":
    """A DenseCausalRunner sized for `model`'s config."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DenseCausalRunner(config.num_hidden_layers, config.num_key_value_heads, head_dim, **kwargs)


class DenseCausalRunner:
    """Test AttentionRunner: every step's T tokens continue ONE sequence, attended densely and causally.

    K/V are appended to preallocated per-layer caches (NaN where unwritten). The offload ops compute the same
    thing split in two: `offload_launch` appends K/V and attends the first half of the rows ("host rows"),
    `device_attention` the rest (host rows left NaN), `offload_wait` fills the host rows in. The order of
    calls is checked.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int = 64,
                 dtype=torch.float32, device="cpu"):
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.lengths = [0] * num_layers
        self.calls: List[Tuple[str, int]] = []
        self._pending = {}

    def _append(self, layer_idx, key, value):
        start = self.lengths[layer_idx]
        self.key_cache[layer_idx, start:start + key.shape[0]] = key
        self.value_cache[layer_idx, start:start + key.shape[0]] = value
        self.lengths[layer_idx] += key.shape[0]
        return start

    def _attend(self, layer_idx, query, start, rows, scale):
        """Rows `rows` of the step's queries (sequence positions start + row) over the cached prefix."""
        end = start + query.shape[0]
        keys, values = self.key_cache[layer_idx, :end], self.value_cache[layer_idx, :end]
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        q = query[rows]
        scores = torch.einsum("thd,shd->hts", q, keys) * scale
        positions = torch.arange(start, end, device=query.device)[rows]
        visible = torch.arange(end, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, -math.inf)
        return torch.einsum("hts,shd->thd", scores.softmax(-1), values)

    def attention(self, layer_idx, query, key, value, scale, out=None):
        self.calls.append(("attention", layer_idx))
        start = self._append(layer_idx, key, value)
        result = self._attend(layer_idx, query, start, slice(None), scale)
        return result if out is None else out.copy_(result)

    def offload_launch(self, layer_idx, query, key, value, scale):
        self.calls.append(("offload_launch", layer_idx))
        start = self._append(layer_idx, key, value)
        host = slice(0, query.shape[0] // 2)
        self._pending[layer_idx] = (start, self._attend(layer_idx, query, start, host, scale))
        return query.new_zeros(1)

    def device_attention(self, layer_idx, query, key, value, scale, token):
        self.calls.append(("device_attention", layer_idx))
        start, _ = self._pending[layer_idx]
        out = torch.full_like(query, float("nan"))
        device = slice(query.shape[0] // 2, None)
        out[device] = self._attend(layer_idx, query, start, device, scale)
        return out

    def offload_wait(self, layer_idx, token, device_out):
        self.calls.append(("offload_wait", layer_idx))
        _, host_out = self._pending.pop(layer_idx)
        out = device_out.clone()
        out[:host_out.shape[0]] = host_out
        return out


class DeferredSwap:
    """A CPU stand-in for the KV manager's swap stream (`KVManager._swap`) under overlapped moves: a move's copy
    runs only when its event lands (in issue order, as on a stream): when the manager waits for it on the host
    (`synchronize`) or orders the compute after it (`order_compute`), or after `delay` queries of it. A block
    reused before its move landed would change what the copy reads, or be read before it is written, so a test's
    tokens show a missing wait or hold."""

    class Event:
        def __init__(self, swap, delay):
            self.swap, self.left, self.done = swap, delay, False

        def query(self):
            self.left -= 1
            if not self.done and self.left < 0:
                self.swap.land(self)
            return self.done

        def synchronize(self):
            self.swap.land(self)

    def __init__(self, delay: int = 3):
        self.delay = delay
        self.pending = []  # (event, copy) in issue order
        self.issued = 0
        self.ordered = 0  # order_compute calls
        self.stream = self  # KVManager.sync_moves calls _swap.stream.synchronize()

    def run(self, copy):
        event = DeferredSwap.Event(self, self.delay)
        self.pending.append((event, copy))
        self.issued += 1
        return event

    def land(self, event=None):
        """Runs the copies up to `event` (all with None)."""
        while self.pending and not (event is not None and event.done):
            first, copy = self.pending.pop(0)
            copy()
            first.done = True

    def order_compute(self, event):
        self.ordered += 1
        self.land(event)

    def synchronize(self):
        self.land()
