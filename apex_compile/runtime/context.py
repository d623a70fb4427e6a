"""The per-step bridge between compiled graphs and the runtime.

Compiled graphs call the opaque `apex::attention` family of ops (see `apex_compile.ops.attention`). Those
ops carry no KV cache or metadata arguments: they look up the `AttentionRunner` that the engine installed
for the current step. The caches therefore never pass through the graph, so functionalization can never
clone them, and one compiled graph serves every step whatever its batch composition.
"""
import contextlib
from typing import Iterator, Optional, Protocol

import torch

from apex_compile.ops import runner_slot


class AttentionRunner(Protocol):
    """What the engine provides to the attention ops for one forward step.

    All tensors are for the step's T flattened tokens; RoPE is already applied to query and key.
    query: [T, num_heads, head_dim]; key, value: [T, num_kv_heads, head_dim]; outputs [T, num_heads, head_dim].
    """

    def attention(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Appends key/value to each token's request cache and returns the attention output for all rows (written
        into `out` when given, a contiguous tensor shaped like query)."""

    def offload_launch(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Starts the host-pool rows (async D2H, CPU append + attention submitted); returns a token tensor."""

    def device_attention(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float, token: torch.Tensor) -> torch.Tensor:
        """Appends and attends the device-pool rows; rows of host-pool requests in the result are unspecified."""

    def offload_wait(self, layer_idx: int, token: torch.Tensor, device_out: torch.Tensor) -> torch.Tensor:
        """Waits for the host part started by `offload_launch` and returns device_out with its rows filled in."""


@contextlib.contextmanager
def attention_runner(runner: AttentionRunner) -> Iterator[AttentionRunner]:
    """Installs `runner` for the forward steps run inside the `with` block."""
    previous = runner_slot.install(runner)
    try:
        yield runner
    finally:
        runner_slot.install(previous)


def get_attention_runner() -> AttentionRunner:
    """The runner of the step in progress; a clear error when a paged graph runs outside an engine step."""
    return runner_slot.current()
