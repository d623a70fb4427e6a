"""Every ```python block of README.md runs as written, in order and in one namespace, on the embedded model:
the first block defines `path` through the embedded-model loader. Blocks that talk to the server at
README_SERVER run against a live server on the model the earlier blocks built (on a free port, which is the only
text the test changes)."""
import os
import re

import pytest

pytestmark = pytest.mark.slow

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
README_SERVER = "http://127.0.0.1:8000"


def python_blocks():
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 2 and "path =" in blocks[0]


def test_readme_python_blocks_run_as_written(capsys):
    namespace = {"__name__": "__readme__"}
    server = None
    try:
        for i, block in enumerate(python_blocks()):
            if README_SERVER in block:
                if server is None:
                    from apex_compile.entrypoints.openai.api_server import EMBEDDED_MODEL_NAME, build_app
                    from tests.server.conftest import LiveServer

                    server = LiveServer(build_app(namespace["model"], model_name=EMBEDDED_MODEL_NAME))
                block = block.replace(README_SERVER, server.url)
            try:
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"README.md python block {i} failed: {error!r}\n{block}") from error
        out = capsys.readouterr().out
        assert "Paris" in out  # the chat example answers, and stops at EOS
        assert "<|im_start|>" not in out
    finally:
        if server is not None:
            server.stop()
        model = namespace.get("model")
        if model is not None and hasattr(model, "close"):
            model.close()
