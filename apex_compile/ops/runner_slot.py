"""The slot through which the apex attention ops reach the runner of the step in progress.

The ops know nothing of the runtime: the engine installs its runner here for each step
(`apex_compile.runtime.context.attention_runner`), and the ops call whatever is installed.
"""
from typing import Any, Optional

_runner: Optional[Any] = None


def install(runner: Optional[Any]) -> Optional[Any]:
    """Makes `runner` the current one (None: none); returns the previous one."""
    global _runner
    previous, _runner = _runner, runner
    return previous


def current() -> Any:
    """The installed runner; a clear error when a paged graph runs outside an engine step."""
    if _runner is None:
        raise RuntimeError(
            "apex attention op called outside an engine step: graphs rewritten by partition_attention need the "
            "paged KV cache of an ApexModel (use apex_compile.optimize(model)); a plain "
            "torch.compile(model, backend='apex') keeps dense attention"
        )
    return _runner
