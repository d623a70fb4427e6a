"""The OpenAI-compatible server (issue 62) on the embedded SmolLM2, through the real `openai` client."""
import concurrent.futures
import json

import httpx
import pytest
import torch

from tests.server.conftest import MB, wait_until

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_and_health(client, live):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(live.url + "/health").status_code == 200


def test_chat_greedy_equals_hf_generate(client, smol):
    model, tokenizer = smol
    ids = chat_ids(tokenizer, QUESTION)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    answer = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS, temperature=0)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == out.shape[1] - len(ids)


def test_streamed_answer_equals_the_whole_one_and_ends_with_usage(client):
    whole = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]


def test_completions_with_stop_sequences(client):
    full = client.completions.create(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert text and full.choices[0].finish_reason in ("length", "stop")
    stop = text.strip()[:2] if len(text.strip()) >= 2 else text[:1]
    cut = client.completions.create(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_eight_concurrent_streams_equal_their_sequential_answers(client, apex):
    questions = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(8)]

    def ask(messages, stream):
        if not stream:
            return client.chat.completions.create(model="smol", messages=messages, max_tokens=10,
                                                  temperature=0).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smol", messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)

    sequential = [ask(q, False) for q in questions]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        concurrent_answers = list(pool.map(lambda q: ask(q, True), questions))
    assert concurrent_answers == sequential
    wait_until(lambda: apex.engine.blocks_in_use() == {"device": 0, "host": 0}, what="blocks back")


@pytest.mark.parametrize("body, status, param", [
    ({"messages": QUESTION, "n": 2}, 400, "n"),
    ({"messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": QUESTION, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"messages": "not a list"}, 400, "messages"),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "model"),
])
def test_bad_chat_requests_get_their_status(live, body, status, param):
    body = {"model": "smol", "max_tokens": 4, **body}
    response = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_a_prompt_past_the_context_length_gets_400(live, apex):
    ids = [1] * (apex.engine.max_model_len + 1)
    response = httpx.post(live.url + "/v1/completions", json={"model": "smol", "prompt": ids, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    response = httpx.post(live.url + "/v1/completions", json={"model": "smol", "prompt": [10 ** 7], "max_tokens": 1})
    assert response.status_code == 400


def test_a_full_queue_gets_429(live, apex):
    front = apex.engine.front
    held = apex.engine.stream([[1, 2, 3]])  # an in-thread run holds the engine: submissions wait in the queue
    next(held)
    previous, front.max_waiting = front.max_waiting, 2
    try:
        waiting = [front.submit([1, 2, 3]) for _ in range(2)]
        response = httpx.post(live.url + "/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
    finally:
        front.max_waiting = previous
        held.close()
    assert all(s.result(timeout=120).finish_reason for s in waiting)


def test_a_disconnect_mid_stream_frees_the_blocks_and_serving_goes_on(live, apex, client):
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        got = []
        for line in lines:
            if line.startswith("data: {"):
                got.append(line)
            if len(got) >= 3:
                break
        assert apex.engine.blocks_in_use() != {"device": 0, "host": 0}
    wait_until(lambda: apex.engine.blocks_in_use() == {"device": 0, "host": 0}, what="blocks back")
    assert client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=3).choices[0].message.content


def test_metrics(live, client):
    client.completions.create(model="smol", prompt="Hello", max_tokens=3)
    text = httpx.get(live.url + "/metrics", timeout=60).text
    for name in ("apex_num_requests_running", "apex_num_requests_waiting", 'apex_kv_blocks_used{pool="device"}',
                 'apex_kv_blocks_total{pool="host"}', 'apex_requests_per_pool_total{pool="device"}',
                 "apex_time_to_first_token_seconds_bucket", "apex_time_per_output_token_seconds_count",
                 "apex_prompt_tokens_total", "apex_generation_tokens_total"):
        assert name in text, name


def test_a_server_with_no_tokenizer_streams_each_token_id(smol):
    """Token-id prompts on a model served without a tokenizer (random weights of a real shape, as the HTTP
    benchmarks serve): every token goes out in a chunk of its own, as its id (vLLM's `token_ids`), so clients
    can time them; the non-streamed answer carries the same ids, and a text prompt is refused."""
    from apex_compile.config import ApexConfig
    from apex_compile.entrypoints.openai.api_server import build_app
    from apex_compile.model import optimize
    from apex_compile.runtime.request import SamplingParams
    from tests.server.conftest import LiveServer

    model, _ = smol
    bare = optimize(model, ApexConfig(offload="never", gpu_cache_size=16 * MB, cpu_cache_size=16 * MB))
    assert bare.engine.tokenizer is None
    prompt = [1000, 2000, 3000, 4000, 5000]
    expected = bare.engine.generate([prompt], SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))[0].token_ids
    server = LiveServer(build_app(bare, model_name="bare"))
    try:
        body = dict(model="bare", prompt=prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert whole["choices"][0]["token_ids"] == expected and whole["choices"][0]["text"] == ""
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in expected]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        refused = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "hello"}, timeout=120)
        assert refused.status_code == 400
    finally:
        server.stop()
        bare.close()
