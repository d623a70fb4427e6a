"""The main job's command line (issue 63, item 6): mistakes are one-line argparse errors (exit 2), not tracebacks;
`--offload staggered` is accepted; `--prompt` makes the batch, each prompt once; `serve` is dispatched first."""
import subprocess
import sys

import pytest
import torch

from apex_compile import __main__ as cli


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "apex_compile", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_one_line_error():
    result = run_cli("--device", "cuda", "--no-hf")
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--gpu-cache-mb", "-5"], "must be >= 0 MiB"),
    (["--cpu-cache-mb", "1.5"], "whole number of MiB"),
    (["--device", "tpu"], "--device"),
    (["--offload", "sometimes"], "staggered or a fraction"),
    (["--prompt", "hi", "--batch-size", "4"], "--batch-size cycles the default prompts"),
])
def test_bad_options_exit_2_without_traceback(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_offload_staggered_is_accepted():
    assert cli.build_parser().parse_args(["--offload", "staggered"]).offload == "staggered"


def test_one_prompt_is_one_request(monkeypatch):
    seen = {}

    def fake_chat_batch(tokenizer, prompts, batch_size):
        seen["prompts"] = list(prompts)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "chat_batch", fake_chat_batch)
    monkeypatch.setattr("apex_compile.runtime.loader.load_model",
                        lambda *a, **k: (__import__("tests.helpers", fromlist=["x"]).tiny_model(), None))
    with pytest.raises(SystemExit):
        cli.main(["--prompt", "Why is the sky blue?", "--no-hf", "--device", "cpu"])
    assert seen["prompts"] == ["Why is the sky blue?"]


def test_serve_is_dispatched_first(monkeypatch):
    import types

    module = types.ModuleType("apex_compile.entrypoints.openai.cli")
    module.main = lambda argv: ("served", argv)
    for name in ("apex_compile.entrypoints", "apex_compile.entrypoints.openai"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "apex_compile.entrypoints.openai.cli", module)
    assert cli.main(["serve", "--port", "8000"]) == ("served", ["--port", "8000"])
