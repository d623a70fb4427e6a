"""ApexConfig and engine settings that used to slip through or fail cryptically (issue 63, item 5)."""
import pytest

from apex_compile.config import ApexConfig
from apex_compile.model import optimize
from apex_compile.runtime import engine as engine_module
from tests.helpers import tiny_model


@pytest.mark.parametrize("field, value, message", [
    ("max_num_seqs", 2.5, "max_num_seqs must be an int"),
    ("max_num_batched_tokens", "512", "max_num_batched_tokens must be an int"),
    ("max_model_len", 100.0, "max_model_len must be an int"),
    ("compile", "yes", "compile must be True or False"),
    ("cuda_graphs", 1, "cuda_graphs must be True or False"),
    ("mixed_graphs", None, "mixed_graphs must be True or False"),
    ("cpu_cache_size", 1.5e9, "must be an int number of bytes"),
    ("gpu_cache_size", 2.0 ** 30, "must be an int number of bytes"),
    ("cpu_cache_size", -1, "non-negative"),
    ("preemption", ["swap"], "preemption must be a string"),
])
def test_type_slips_are_clear_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        ApexConfig(**{field: value})


def test_max_model_len_beyond_the_models_positions():
    model = tiny_model()  # max_position_embeddings=128
    with pytest.raises(ValueError, match="beyond the model's max_position_embeddings=128"):
        optimize(model, ApexConfig(max_model_len=1000, compile=False))
    optimize(model, ApexConfig(max_model_len=128, compile=False)).close()


def test_host_pool_beyond_available_memory_says_what_fits(monkeypatch):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"only .* GiB .* of host memory is available"):
        optimize(model, ApexConfig(cpu_cache_size=1 << 50, compile=False))
    monkeypatch.setattr(engine_module, "host_memory_available", lambda: 3 << 20)
    with pytest.raises(ValueError, match="both pools are host RAM"):
        optimize(model, ApexConfig(gpu_cache_size=2 << 20, cpu_cache_size=2 << 20, compile=False))
    optimize(model, ApexConfig(gpu_cache_size=1 << 20, cpu_cache_size=1 << 20, compile=False)).close()
