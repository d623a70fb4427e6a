"""Every ```python block of README.md runs as written, in order and in one namespace, on the embedded model
(issue 63, item 3): the first block defines `path` through the embedded-model loader."""
import os
import re

import pytest

pytestmark = pytest.mark.slow

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def python_blocks():
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 2 and "path =" in blocks[0]


def test_readme_python_blocks_run_as_written(capsys):
    namespace = {"__name__": "__readme__"}
    try:
        for i, block in enumerate(python_blocks()):
            try:
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"README.md python block {i} failed: {error!r}\n{block}") from error
        out = capsys.readouterr().out
        assert "Paris" in out  # the chat example answers, and stops at EOS
        assert "<|im_start|>" not in out
    finally:
        model = namespace.get("model")
        if model is not None and hasattr(model, "close"):
            model.close()
