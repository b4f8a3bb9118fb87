"""The gateway's OpenAI Responses checks in-process, as test_messages_gateway.py checks
Messages': serve_dflash2.py's and serve.py's decide functions, with mlx-vlm replaced by a
stub that answers with the body it was forwarded. Over HTTP with the openai client:
test_responses.py.
"""

import json
import os

import pytest

from conftest import data_url, png
from test_gateway import MODEL_ID, VOCAB, CONTEXT, assert_refused, image_dir, make_client  # noqa: F401 (image_dir: a fixture)
from test_gateway import last_named_event

BODY = {"model": MODEL_ID, "max_output_tokens": 5, "input": "Hi"}
IMAGE = {"type": "input_image", "image_url": data_url(png((32, 32)))}


@pytest.fixture(scope="module")
def client(image_dir):  # noqa: F811
    return make_client(image_dir)


def post(client, body, path="/v1/responses", **headers):
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("server_reason", [None, "no-dflash2", "serve.py"])
@pytest.mark.parametrize("path", ["/v1/responses", "/responses"])
def test_a_greedy_request_is_routed_like_chat(server_reason, path):
    response = post(make_client(server_reason=server_reason), {**BODY, "temperature": 0}, path)
    assert response.status_code == 200, response.text
    expected = {None: "speculative", "no-dflash2": "fallback; reason=no-dflash2", "serve.py": "plain"}[server_reason]
    assert response.headers["x-dflash2"] == expected
    assert "x-dflash2-seed" not in response.headers
    # store off: mlx-vlm keeps nothing, as no endpoint here reads its store
    assert response.json()["forwarded"] == {**BODY, "temperature": 0, "store": False}


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_a_sampled_request_gets_a_seed_mlx_vlm_reads(server_reason):
    """The Responses API has no seed: the gateway's goes in the forwarded body, which mlx-vlm's
    OpenAIRequest keeps as an extra field and _build_gen_args reads."""
    from mlx_vlm.server.request_normalization import _build_gen_args
    from mlx_vlm.server.schemas import OpenAIRequest

    response = post(make_client(server_reason=server_reason), {**BODY, "store": True})
    assert response.status_code == 200
    seed = int(response.headers["x-dflash2-seed"])
    forwarded = response.json()["forwarded"]
    assert forwarded["seed"] == seed and forwarded["store"] is False
    assert _build_gen_args(OpenAIRequest(**forwarded)).seed == seed


def test_a_tool_conversation_with_images_passes_as_mlx_vlm_reads_it(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather here?"}, IMAGE]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "call it"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": [
                 {"type": "input_text", "text": "sunny"}, IMAGE]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
             {"role": "user", "content": "Thanks"}]
    for choice in ("auto", "none", "required", {"type": "function", "name": "get_weather"}):
        body = {**BODY, "input": items, "instructions": "Answer.", "tools": tools, "tool_choice": choice,
                "reasoning": {"effort": "none"}, "text": {"format": {"type": "text"}}, "metadata": {"k": "v"},
                "parallel_tool_calls": False, "top_p": 0.9, "top_k": 5, "temperature": 0.5, "user": "u"}
        response = post(client, body)
        assert response.status_code == 200, response.text
        forwarded = response.json()["forwarded"]
        assert forwarded["input"] == items and forwarded["reasoning"] == {"effort": "none"}
        assert "text" not in forwarded  # a text format is plain text: nothing for mlx-vlm to do


def test_a_local_image_is_forwarded_resolved(client, image_dir):  # noqa: F811
    body = {**BODY, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": f"file://{image_dir}/red.png"}]}]}
    response = post(client, body)
    assert response.status_code == 200, response.text
    assert response.json()["forwarded"]["input"][0]["content"][0]["image_url"] == str((image_dir / "red.png").resolve())


def test_multimodal_plain_routes_images_plain():
    client = make_client(multimodal_plain=True)
    body = {**BODY, "temperature": 0, "input": [{"role": "user", "content": [IMAGE]}]}
    assert post(client, body).headers["x-dflash2"] == "fallback; reason=multimodal-plain"
    output = [{"type": "function_call_output", "call_id": "c", "output": [IMAGE]}]
    assert post(client, {**body, "input": output}).headers["x-dflash2"] == "fallback; reason=multimodal-plain"
    assert post(client, {**BODY, "temperature": 0}).headers["x-dflash2"] == "speculative"


@pytest.mark.parametrize("body, status, reason, param", [
    ({**BODY, "previous_response_id": "resp_1"}, 400, "stateful-response", "previous_response_id"),
    ({**BODY, "conversation": "conv_1"}, 400, "stateful-response", "conversation"),
    ({**BODY, "seed": 1}, 400, "unknown-field", "seed"),
    ({**BODY, "logprobs": True}, 400, "unknown-field", "logprobs"),
    ({**BODY, "adapter_path": "/tmp/x"}, 400, "unknown-field", "adapter_path"),
    ({**BODY, "tool_parser": "qwen"}, 400, "unknown-field", "tool_parser"),
    ({**BODY, "input": [{"role": "user", "content": "Hi", "name": "x"}]}, 400, "unknown-field", "input[0].name"),
    ({**BODY, "input": [{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}]}, 400,
     "unknown-field", "input[0].content[0].x"),
    ({**BODY, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, 400,
     "unknown-field", "input[0].content[0].file_id"),
    ({**BODY, "tools": [{"type": "web_search"}]}, 400, "invalid-request", "tools[0].type"),
    ({"model": MODEL_ID}, 400, "invalid-request", "input"),
    ({**BODY, "input": []}, 400, "invalid-request", "input"),
    ({**BODY, "input": "", "instructions": " "}, 400, "invalid-request", "input"),  # nothing to answer
    ({**BODY, "input": [{"role": "tool", "content": "Hi"}]}, 400, "invalid-request", "input[0].role"),
    ({**BODY, "input": [{"type": "hologram"}]}, 400, "invalid-request", "input[0].type"),
    ({**BODY, "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "invalid-request",
     "input[0].arguments"),
    ({**BODY, "input": [{"role": "assistant", "content": [IMAGE]}]}, 400, "invalid-request", "input[0].content[0]"),
    ({**BODY, "input": [{"type": None, "role": "assistant", "content": [IMAGE]}]}, 400, "invalid-request",
     "input[0].content[0]"),
    ({**BODY, "temperature": "hot"}, 400, "invalid-request", "temperature"),
    ({**BODY, "temperature": 5}, 400, "invalid-request", "temperature"),
    ({**BODY, "top_k": VOCAB}, 400, "invalid-request", "top_k"),
    ({**BODY, "max_output_tokens": CONTEXT + 1}, 400, "invalid-request", "max_output_tokens"),
    ({**BODY, "max_output_tokens": 0}, 400, "invalid-request", "max_output_tokens"),
    ({**BODY, "reasoning": {"effort": "maximal"}}, 400, "invalid-request", "reasoning.effort"),
    ({**BODY, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "structured-output",
     "text.format"),
    ({**BODY, "tools": [{"type": "function", "name": "f"}] * 2}, 400, "invalid-request", "tools[1].name"),
    ({**BODY, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     400, "invalid-request", "tool_choice.name"),
    ({**BODY, "input": "Hi \ud800"}, 400, "invalid-request", "input"),
    ({**BODY, "model": "other"}, 404, "unknown-model", "model"),
    ({**BODY, "input": [{"role": "user", "content": [{**IMAGE, "image_url": "data:image/png;base64,AAAA"}]}]},
     400, "invalid-image", "input[0].content[0].image_url"),
    ({**BODY, "input": [{"role": "user", "content": [{**IMAGE, "image_url": "https://example.com/a.png"}]}]},
     400, "remote-image", "input[0].content[0].image_url"),
    ({**BODY, "input": [{"type": "function_call_output", "call_id": "c", "output": [
        {**IMAGE, "image_url": "/etc/hostname"}]}]}, 400, "local-image", "input[0].output[0].image_url"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refusals_in_openais_shape(client, body, status, reason, param):
    assert_refused(post(client, body), status, reason, param)


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_the_same_limits_as_chat(server_reason):
    client = make_client(server_reason=server_reason, max_prompt_chars=100, prompt_chars_limit=200)
    # Named in the Responses API's own fields, not chat's.
    error = assert_refused(post(client, {**BODY, "instructions": "s" * 101}), 400, "context-length-exceeded", "input")
    assert error["message"].startswith("input: ") and "lower max_output_tokens" in error["message"], error
    # Assistant turns do not count towards what must fit; they count towards --max-prompt-chars.
    assistant = {**BODY, "input": ["Hi", {"role": "assistant", "content": "a" * 150}, "Hi"]}
    assistant["input"] = [{"role": "user", "content": "Hi"}, assistant["input"][1], {"role": "user", "content": "Hi"}]
    assert post(client, assistant).status_code == 200
    assistant["input"][1]["content"] = "a" * 250
    assert_refused(post(client, assistant), 400, "prompt-too-long", "input")
    output = {**BODY, "input": [{"type": "function_call_output", "call_id": "c", "output": "r" * 101}]}
    assert_refused(post(client, output), 400, "context-length-exceeded", "input")
    many = {**BODY, "input": [{"role": "user", "content": "Hi"}] * 4097}
    assert_refused(post(client, many), 400, "invalid-request", "input")
    parts = {**BODY, "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 4097}]}
    assert "4097 content parts in all" in assert_refused(post(client, parts), 400, "invalid-request",
                                                        "input")["message"]
    images = {**BODY, "input": [{"role": "user", "content": [IMAGE] * 65}]}
    assert "at most 64 a request" in assert_refused(post(client, images), 400, "invalid-request", "input")["message"]


def test_transport_refusals_in_openais_shape(client):
    response = client.post("/v1/responses", content=json.dumps(BODY), headers={"content-type": "text/plain"})
    assert_refused(response, 415, "unsupported-media-type")
    assert_refused(client.get("/v1/responses"), 405, "method-not-allowed")
    assert client.get("/v1/responses").headers["allow"] == "POST"
    response = client.post("/v1/responses", content=b'{"input": [', headers={"content-type": "application/json"})
    assert_refused(response, 400, "invalid-json")
    response = client.post("/v1/responses", content=json.dumps(BODY),
                           headers={"content-type": "application/json", "host": "evil.example"})
    assert_refused(response, 421, "invalid-host")
    # mlx-vlm's stored-response endpoints are not served: nothing is stored
    for path in ("/v1/responses/resp_1", "/v1/responses/input_tokens", "/responses/resp_1/input_items"):
        assert client.get(path).status_code == 404
        assert client.post(path, content=b"{}", headers={"content-type": "application/json"}).status_code in (404, 405)


def test_mlx_vlm_context_budget_refusal_is_reshaped(client):
    error = assert_refused(post(client, {**BODY, "input": "over budget"}), 400, "context-length-exceeded", "input")
    assert "above the model's context length of 32768" in error["message"]
    assert "max_output_tokens is" in error["message"] and "max_tokens" not in error["message"], error


def test_request_timeout_answers_504_in_openais_shape(client):
    response = post(client, {**BODY, "input": "hang"})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request-timeout"


def test_a_failing_stream_ends_with_an_openai_error_event_without_paths(client):
    response = post(client, {**BODY, "input": "stream failure", "stream": True})
    assert response.status_code == 200 and response.headers["x-dflash2"]
    name, data = last_named_event(response)
    assert name == "event: error"
    error = data["error"]
    assert error["code"] == "server-error" and "Generation failed" in error["message"]
    assert os.path.expanduser("~") not in response.text


def test_request_timeout_ends_a_stream_with_an_error_event_in_openais_shape(client):
    response = post(client, {**BODY, "input": "hang", "stream": True})
    assert response.status_code == 200
    name, data = last_named_event(response)
    assert name == "event: error"
    assert data["error"]["code"] == "request-timeout"


def test_the_batterys_responses_probes_get_no_server_error():
    """tools/battery.py's hostile Responses probes (--quick's), against both decide functions
    in process: 4xx or a forwarded body, never a 5xx."""
    import battery

    probes = battery.responses_probes(quick=True)  # the full set: python tools/battery.py
    assert len(probes) > 100
    for server_reason in (None, "serve.py"):
        client = make_client(server_reason=server_reason)
        for label, method, path, headers, body in probes:
            response = client.request(method, path, content=body, headers=headers)
            assert response.status_code < 500, (label, response.text)
            if response.status_code >= 400:
                assert set(response.json()) == {"error"}, label
