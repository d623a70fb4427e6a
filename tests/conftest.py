"""Shared fixtures: a tiny random Llama (CPU, fp32) for runtime and end-to-end tests."""
import pytest
import torch

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_llama():
    """A randomly initialised 2-layer LlamaForCausalLM (seed 0) of TINY_LLAMA's shape, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch and random seeds, so its inputs do not depend on which tests ran before."""
    import random

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module starts with an empty dynamo cache: nothing an earlier module compiled (its models' steps,
    the graphs of helper functions) is kept alive or counted against a recompile limit here."""
    torch._dynamo.reset()
