"""`python -m apex_compile serve` as a process: the API key (401), a full queue (429 with --max-waiting 1), and
SIGTERM, which lets the requests in flight finish and exits with status 0."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port, wait_until

pytestmark = pytest.mark.slow
KEY = "sk-test"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.Popen(
        [sys.executable, "-m", "apex_compile", "serve", "--port", str(port), "--api-key", KEY, "--max-waiting", "1",
         "--max-num-seqs", "1", "--offload", "never", "--gpu-cache-mb", "32", "--cpu-cache-mb", "8", "--no-warmup",
         "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=600, what="the server to start")
    yield process, url
    if process.poll() is None:
        process.kill()
        process.wait()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_the_api_key_is_checked(server):
    _, url = server
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    response = httpx.get(url + "/v1/models", headers=auth("wrong"), timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", headers=auth(), timeout=30).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def stream_in_thread(url, max_tokens, lines):
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def run():
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth(), timeout=600) as response:
            lines.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def waiting(url) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("apex_num_requests_waiting")))


def test_a_full_queue_gets_429_then_sigterm_drains_and_exits_0(server):
    process, url = server
    first, second = [], []
    threads = [stream_in_thread(url, 400, first)]
    wait_until(lambda: len(first) >= 2, timeout=300, what="the first token")  # running (max_num_seqs 1)
    threads.append(stream_in_thread(url, 8, second))
    wait_until(lambda: waiting(url) == 1, timeout=60, what="a waiting request")
    response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth(), timeout=60)
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 0
    for thread in threads:
        thread.join(60)
    for lines in (first, second):  # both finished: their last choice has a finish reason, then [DONE]
        assert lines[0] == 200 and lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    assert sum(1 for line in first[1:-1] if json.loads(line)["choices"][0]["text"] is not None) >= 1
