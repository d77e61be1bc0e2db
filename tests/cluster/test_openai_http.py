"""The OpenAI-compatible HTTP API on a real disaggregated cluster, reached with the official
``openai`` client and raw HTTP over sockets: HF-identical greedy text, streaming equal to the
whole answer, seeded choices equal to gRPC's, errors with the right status and parameter,
admission's 429, and a client that disconnects freeing its request on every worker."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx2
import openai
import pytest

from router.client import collect, connect, make_request


@pytest.fixture(scope="module")
def cluster(make_cluster):
    # One decode worker with a small KV cache and one admission slot: the 429 test fills it.
    return make_cluster(decode__kv_cache_gb=0.05, router__max_queue=1)


@pytest.fixture(scope="module")
def stub(cluster):
    return connect(f"127.0.0.1:{cluster.port}")


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _cancelled(cluster) -> float:
    return cluster.router.metrics.requests.labels("cancelled")._value.get()


def test_models_lists_the_served_model(client, cluster):
    [m] = client.models.list().data
    assert m.id == cluster.router.served_model_name and m.owned_by == "pdserve"
    assert m.model_extra["max_model_len"] == cluster.router.limits.context_length


def test_completions_of_several_prompts_equal_hf_greedy(client, model, greedy_reference, tokenizer, stub, cluster,
                                                        wait_idle):
    prompts = [p for p, _ in greedy_reference]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=64, temperature=0)
    assert [c.index for c in out.choices] == list(range(len(prompts)))
    for choice, (_, ref) in zip(out.choices, greedy_reference):
        assert choice.text == tokenizer.decode(ref, skip_special_tokens=True)
        assert choice.finish_reason == ("length" if len(ref) == 64 else "stop")
    assert out.usage.completion_tokens == sum(len(r) for _, r in greedy_reference)
    assert out.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    # a prompt as token ids is the same request
    p, ref = greedy_reference[1]
    ids = client.completions.create(model=model, prompt=tokenizer(p)["input_ids"], max_tokens=64, temperature=0)
    assert ids.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    wait_idle(stub, cluster)


def test_a_streamed_chat_equals_the_whole_answer(client, model, stub, cluster, wait_idle):
    ask = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24,
               temperature=0, n=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens == 48
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens  # the prompt counted once for n=2
    for i in range(2):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
        assert mine[-1].finish_reason == whole.choices[i].finish_reason == "length"
        assert whole.choices[i].message.role == "assistant"
    wait_idle(stub, cluster)


def test_seeded_choices_repeat_and_equal_grpc_with_the_same_seed(client, model, stub, cluster, wait_idle):
    ask = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=123, n=3)
    a = [c.text for c in client.completions.create(**ask).choices]
    b = [c.text for c in client.completions.create(**ask).choices]
    assert a == b and len(set(a)) > 1  # choice k samples with seed + k
    grpc_out = collect(stub.Generate(make_request("Once upon a time", max_tokens=16, temperature=1.0, seed=124)))
    assert grpc_out["text"] == a[1]
    wait_idle(stub, cluster)


def test_errors_have_openais_shape_and_status(client, model, cluster):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", temperature=5)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens" and "context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found" and model in e.value.body["message"]
    base = f"http://127.0.0.1:{cluster.http_port}"
    r = httpx2.post(f"{base}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    huge = b'{"model": "m", "prompt": "' + b"a" * cluster.router.cfg.limits.message_bytes + b'"}'
    r = httpx2.post(f"{base}/v1/completions", content=huge, timeout=30)
    assert r.status_code == 413 and "limits.message_bytes" in r.json()["error"]["message"]
    r = httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": [-1, 5], "echo": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2**31}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx2.get(f"{base}/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx2.get(f"{base}/health", timeout=30).json() == {"status": "ok"}


def test_a_full_cluster_answers_429_and_a_closed_stream_frees_its_blocks(client, model, stub, cluster, wait_idle):
    ctx = cluster.router.limits.context_length
    cancelled = _cancelled(cluster)
    # This reserves (almost) the decode worker's whole KV cache: the next request must queue.
    big = client.completions.create(model=model, prompt="Count to a million:", max_tokens=ctx - 16, extra_body={"ignore_eos": True},
                                    temperature=0, stream=True)
    next(iter(big))
    queued: dict = {}
    t = threading.Thread(target=lambda: queued.update(out=client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0)))
    t.start()
    deadline = time.monotonic() + 120  # hang guard only (see test_colocated)
    while cluster.router.queued < 1:  # it waits in the admission queue (its one slot)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=4)
    assert e.value.status_code == 429 and "retry" in e.value.body["message"]
    big.close()  # the client goes away mid-stream: the request ends on every worker, room again
    t.join(timeout=300)
    assert queued["out"].choices[0].finish_reason == "length"
    wait_idle(stub, cluster)
    assert _cancelled(cluster) == cancelled + 1  # ended by the disconnect, not run out


def test_a_client_that_disconnects_while_waiting_for_a_whole_answer_frees_its_request(cluster, model, stub,
                                                                                     wait_idle):
    cancelled = _cancelled(cluster)
    ctx = cluster.router.limits.context_length  # (the decode worker's whole KV cache here)
    body = json.dumps({"model": model, "prompt": "Count to a million:", "max_tokens": ctx - 16, "ignore_eos": True,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", cluster.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120  # hang guard only
        while not any(j.generated for j in cluster.router.jobs.values()):  # it is decoding
            assert time.monotonic() < deadline
            time.sleep(0.01)
    wait_idle(stub, cluster)
    assert _cancelled(cluster) == cancelled + 1


def test_logprobs_across_prefill_and_decode_equal_hf(client, model, stub, cluster, hf_model, tokenizer,
                                                     greedy_reference, wait_idle):
    """The first token's log probability comes from the prefill worker, the rest from decode:
    all equal HF's log-softmax on the same sequence (tolerance: tests/engine/test_logprobs.py)."""
    import torch
    prompt, ref = greedy_reference[3]
    n = 8
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        want = torch.log_softmax(hf_model(torch.tensor([ids + ref[:n]])).logits[0, len(ids) - 1:-1].float(), -1)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref[:n]]
    assert lp.token_logprobs == pytest.approx([want[i, t].item() for i, t in enumerate(ref[:n])], abs=1e-3)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(v, abs=1e-6)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the sampled one is on top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    # gRPC gives the same, by token id
    out = list(stub.Generate(make_request(prompt, max_tokens=n, temperature=0, logprobs=2)))
    by_id = [x for r in out for x in r.logprobs]
    assert [x.token_id for x in by_id] == ref[:n] and all(len(x.top) == 2 for x in by_id)
    assert [x.logprob for x in by_id] == pytest.approx(lp.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    wait_idle(stub, cluster)


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(client, model, stub, cluster, hf_model, tokenizer,
                                                            wait_idle):
    """lm-eval's log-likelihood request: echo, logprobs 1, max_tokens 1. The prompt's log
    probabilities (computed on the prefill worker, the prompt taken whole even when its prefix
    is cached) equal HF's; the first prompt token has none."""
    import torch
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    for _ in range(2):  # the second time its blocks are in the prefix caches
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                        echo=True)
        c = out.choices[0]
        assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 1
        assert c.logprobs.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            [want[i, t].item() for i, t in enumerate(ids[1:])], abs=1e-3)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1
    wait_idle(stub, cluster)


def test_n_choices_share_one_prefill_of_their_prompt(client, model, stub, cluster, wait_idle):
    """The first choice runs alone until its first token; the others then start on the same
    workers and find the prompt's full blocks in the prefix cache: computed once, not n times."""
    from router.openai_api import CompletionRequest, parse, requests_for
    from router.openai_http import _merged
    prompt = "Share this prompt among all the choices: " + "a long enough tail of words " * 12
    req = parse(CompletionRequest, {"model": model, "prompt": prompt, "n": 3, "max_tokens": 4, "seed": 5})
    _, reqs = requests_for(req, "share", 16)

    async def run():
        finals = {}
        async for i, r in _merged(cluster.router, reqs, "", n=3):
            if r.finish_reason:
                finals[i] = r.usage
        return finals

    finals = cluster.call(run)
    prompt_tokens = finals[0].prompt_tokens
    full_blocks = (prompt_tokens - 1) // 16 * 16  # the last token is always computed
    assert finals[0].cached_prompt_tokens == 0  # a prompt nobody sent before
    assert [finals[k].cached_prompt_tokens for k in (1, 2)] == [full_blocks] * 2
    assert len({(u.prefill_worker, u.decode_worker) for u in finals.values()}) == 1
    wait_idle(stub, cluster)


def test_response_format_json_schema_survives_the_pd_hop(client, model, stub, cluster, wait_idle):
    """The constraint travels with the request: the first token is sampled on the prefill worker,
    the rest on the decode worker, each under the same grammar (issue 45)."""
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for temperature in (0, 0.9):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A person as JSON."}],
                                           max_tokens=48, temperature=temperature, seed=3, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=model, prompt="The answer:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    wait_idle(stub, cluster)
