"""Helpers of the end-to-end benchmark scripts that run without a GPU: HF generate as a baseline (its timing
bookkeeping, and a cache that cannot run here reported as an error instead of stopping the benchmark)."""
import os
import sys

import torch

from tests.helpers import tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import e2e_hybrid  # noqa: E402


def test_hf_generate_baseline_reports_tokens_per_s_and_decode_step():
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    prompts = torch.randint(3, 96, (4, 8)).tolist()
    row = e2e_hybrid.hf_generate(model, prompts, 8, 3, cache_implementation=None)
    assert row["batch"] == 3 and "error" not in row
    assert row["tokens_per_s"] > 0 and row["decode_step_s"] > 0
    assert row["decode_tokens_per_s"] == 3 / row["decode_step_s"]


def test_hf_generate_baseline_returns_an_error_it_cannot_run():
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(3, 96, (2, 8)).tolist()
    row = e2e_hybrid.hf_generate(model, prompts, 4, 2, cache_implementation="no-such-cache")
    assert row["cache"] == "no-such-cache" and row["error"] and "tokens_per_s" not in row
