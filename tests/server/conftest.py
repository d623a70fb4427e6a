"""Server fixtures: one engine on the embedded SmolLM2 and one in-process server (a uvicorn thread on a free
localhost port) per module that asks for them."""
import socket
import threading
import time

import pytest
import torch

MB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A uvicorn server running `app` in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def smol():
    from apex_compile.runtime.loader import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="module")
def apex(smol):
    from apex_compile.config import ApexConfig
    from apex_compile.model import optimize

    model, tokenizer = smol
    apex = optimize(model, ApexConfig(offload=0.5, gpu_cache_size=32 * MB, cpu_cache_size=32 * MB), tokenizer)
    yield apex
    apex.close()


@pytest.fixture(scope="module")
def live(apex):
    from apex_compile.entrypoints.openai.api_server import build_app

    server = LiveServer(build_app(apex, model_name="smol"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_until(predicate, timeout=60.0, what="condition"):
    """Polls `predicate` (no timing is asserted: the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
