"""The gateway's Anthropic Messages checks in-process, as test_gateway.py checks chat's:
serve_dflash2.py's and serve.py's decide functions, with mlx-vlm replaced by a stub that
answers with the body it was forwarded. Over HTTP with the anthropic client: test_messages.py.
"""

import json

import pytest

from conftest import png
from test_gateway import MODEL_ID, VOCAB, CONTEXT, image_dir, last_named_event, make_client
from test_gateway import assert_refused as assert_chat_refusal  # noqa: F401 (image_dir: a fixture)

MESSAGES = [{"role": "user", "content": "Hi"}]
BODY = {"model": MODEL_ID, "max_tokens": 5, "messages": MESSAGES}
PNG = __import__("base64").b64encode(png((32, 32))).decode()


def image_block(data=PNG, media_type="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


@pytest.fixture(scope="module")
def client(image_dir):  # noqa: F811
    return make_client(image_dir)


def post(client, body, path="/v1/messages", **headers):
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **headers})


def assert_refused(response, status, reason, param=None, kind="invalid_request_error"):
    """Refused in Anthropic's error shape, with chat's reason and param beside."""
    error = assert_chat_refusal(response, status, reason, param, kind)
    assert response.json()["type"] == "error" and set(response.json()) == {"type", "error"}
    return error


@pytest.mark.parametrize("server_reason", [None, "no-dflash2", "serve.py"])
@pytest.mark.parametrize("path", ["/v1/messages", "/messages"])
def test_a_greedy_request_is_routed_like_chat(server_reason, path):
    response = post(make_client(server_reason=server_reason), {**BODY, "temperature": 0}, path)
    assert response.status_code == 200, response.text
    expected = {None: "speculative", "no-dflash2": "fallback; reason=no-dflash2", "serve.py": "plain"}[server_reason]
    assert response.headers["x-dflash2"] == expected
    assert "x-dflash2-seed" not in response.headers
    assert response.json()["forwarded"] == {**BODY, "temperature": 0}


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_a_sampled_request_gets_a_seed_mlx_vlm_reads(server_reason):
    """Anthropic's API has no seed: the gateway's goes in the forwarded body, which mlx-vlm's
    AnthropicRequest keeps as an extra field and _build_gen_args reads."""
    from mlx_vlm.server.request_normalization import _build_gen_args
    from mlx_vlm.server.schemas import AnthropicRequest

    response = post(make_client(server_reason=server_reason), BODY)
    assert response.status_code == 200
    seed = int(response.headers["x-dflash2-seed"])
    forwarded = response.json()["forwarded"]
    assert forwarded["seed"] == seed
    assert _build_gen_args(AnthropicRequest(**forwarded)).seed == seed


def test_stop_sequences_thinking_and_images_are_forwarded_as_mlx_vlm_reads_them(client):
    body = {**BODY, "temperature": 0.5, "stop_sequences": ["x"], "thinking": {"type": "enabled", "budget_tokens": 2048},
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, image_block()]}],
            "metadata": {"user_id": "u"}, "top_k": 5, "top_p": 0.9}
    response = post(client, body)
    assert response.status_code == 200, response.text
    forwarded = response.json()["forwarded"]
    assert "stop_sequences" not in forwarded  # ended by the gateway (RecordingTokens), not mlx-vlm
    assert "thinking" not in forwarded and forwarded["enable_thinking"] is True  # no thinking budget
    assert forwarded["messages"] == body["messages"]


def test_a_tool_conversation_passes(client):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "sunny"}, image_block()]}]}]
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "none"}):
        response = post(client, {**BODY, "messages": messages, "tools": tools, "tool_choice": choice})
        assert response.status_code == 200, response.text


def test_count_tokens_keeps_the_servers_mode_and_draws_no_seed(client):
    response = post(client, {"model": MODEL_ID, "messages": MESSAGES}, "/v1/messages/count_tokens")
    assert response.status_code == 200, response.text
    # what /v1/models carries: the server's mode (the stub gateway's default, plain)
    assert response.headers["x-dflash2"] == client.get("/v1/models").headers["x-dflash2"]
    assert "x-dflash2-seed" not in response.headers
    assert response.json()["forwarded"] == {"model": MODEL_ID, "messages": MESSAGES}
    assert_refused(post(client, {"messages": MESSAGES, "max_tokens": 5}, "/v1/messages/count_tokens"),
                   400, "unknown-field", "max_tokens")


def test_multimodal_plain_routes_images_plain():
    client = make_client(multimodal_plain=True)
    body = {**BODY, "temperature": 0, "messages": [{"role": "user", "content": [image_block()]}]}
    assert post(client, body).headers["x-dflash2"] == "fallback; reason=multimodal-plain"
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image_block()]}]}]
    assert post(client, {**body, "messages": result}).headers["x-dflash2"] == "fallback; reason=multimodal-plain"
    assert post(client, {**BODY, "temperature": 0}).headers["x-dflash2"] == "speculative"


@pytest.mark.parametrize("body, status, reason, param", [
    ({**BODY, "top_logprobs": 2}, 400, "unknown-field", "top_logprobs"),
    ({**BODY, "seed": 1}, 400, "unknown-field", "seed"),
    ({**BODY, "output_config": {"format": {"type": "json_schema"}}}, 400, "unknown-field", "output_config"),
    ({**BODY, "messages": [{"role": "user", "content": "Hi", "name": "x"}]}, 400, "unknown-field", "messages[0].name"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]}, 400,
     "unknown-field", "messages[0].content[0].x"),
    ({"model": MODEL_ID, "messages": MESSAGES}, 400, "invalid-request", "max_tokens"),
    ({**BODY, "messages": []}, 400, "invalid-request", "messages"),
    ({**BODY, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid-request", "messages[0].role"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "invalid-request",
     "messages[0].content[0].type"),
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid-request",
     "messages[0].content[0]"),
    ({**BODY, "messages": [{"role": "assistant", "content": [image_block()]}]}, 400, "invalid-request",
     "messages[0].content[0]"),
    ({**BODY, "temperature": "hot"}, 400, "invalid-request", "temperature"),
    ({**BODY, "temperature": 5}, 400, "invalid-request", "temperature"),
    ({**BODY, "top_k": VOCAB}, 400, "invalid-request", "top_k"),
    ({**BODY, "max_tokens": CONTEXT + 1}, 400, "invalid-request", "max_tokens"),
    ({**BODY, "stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "invalid-request", "stop_sequences"),
    ({**BODY, "stop_sequences": [""]}, 400, "invalid-request", "stop_sequences[0]"),
    ({**BODY, "thinking": {"type": "enabled"}}, 400, "invalid-request", "thinking.budget_tokens"),
    ({**BODY, "tools": [{"name": "f", "input_schema": {}}] * 2}, 400, "invalid-request", "tools[1].name"),
    ({**BODY, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}},
     400, "invalid-request", "tool_choice.name"),
    ({**BODY, "messages": [{"role": "user", "content": "Hi \ud800"}]}, 400, "invalid-request", "messages[0].content"),
    ({**BODY, "model": "other"}, 404, "unknown-model", "model"),
    ({**BODY, "messages": [{"role": "user", "content": [image_block("AAAA")]}]}, 400, "invalid-image",
     "messages[0].content[0].source"),
    ({**BODY, "messages": [{"role": "user", "content": [image_block("%%%")]}]}, 400, "invalid-image",
     "messages[0].content[0].source"),
    ({**BODY, "messages": [{"role": "user", "content": [image_block(media_type="image/tiff")]}]}, 400,
     "invalid-request", "messages[0].content[0].source.media_type"),
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, 400, "remote-image",
     "messages[0].content[0].source"),
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "/etc/hostname"}}]}]}, 400, "local-image",
     "messages[0].content[0].source"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refusals_in_anthropics_shape(client, body, status, reason, param):
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert_refused(post(client, body), status, reason, param, kind)


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_the_same_limits_as_chat(server_reason):
    client = make_client(server_reason=server_reason, max_prompt_chars=100, prompt_chars_limit=200)
    long_system = {**BODY, "system": "s" * 101}
    assert_refused(post(client, long_system), 400, "context-length-exceeded", "messages")
    # Assistant turns do not count towards what must fit; they count towards --max-prompt-chars.
    assistant = {**BODY, "messages": [*MESSAGES, {"role": "assistant", "content": "a" * 150}, *MESSAGES]}
    assert post(client, assistant).status_code == 200
    assistant["messages"][1]["content"] = "a" * 250
    assert_refused(post(client, assistant), 400, "prompt-too-long", "messages")
    result = {**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "r" * 101}]}]}
    assert_refused(post(client, result), 400, "context-length-exceeded", "messages")
    many = {**BODY, "messages": MESSAGES * 4097}
    assert_refused(post(client, many), 400, "invalid-request", "messages")
    blocks = {**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 4097}]}
    assert "4097 content blocks in all" in assert_refused(post(client, blocks), 400, "invalid-request",
                                                         "messages")["message"]
    images = {**BODY, "messages": [{"role": "user", "content": [image_block("AAAA")] * 65}]}
    assert "at most 64 a request" in assert_refused(post(client, images), 400, "invalid-request", "messages")["message"]


def test_transport_refusals_in_anthropics_shape(client):
    response = client.post("/v1/messages", content=json.dumps(BODY), headers={"content-type": "text/plain"})
    assert_refused(response, 415, "unsupported-media-type")
    assert_refused(client.get("/v1/messages"), 405, "method-not-allowed")
    assert client.get("/v1/messages").headers["allow"] == "POST"
    response = client.post("/v1/messages", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_refused(response, 400, "invalid-json")
    response = client.post("/v1/messages", content=json.dumps(BODY),
                           headers={"content-type": "application/json", "host": "evil.example"})
    assert_refused(response, 421, "invalid-host")


def test_mlx_vlm_context_budget_refusal_is_reshaped(client):
    body = {**BODY, "messages": [{"role": "user", "content": "over budget"}]}
    error = assert_refused(post(client, body), 400, "context-length-exceeded", "messages")
    assert "above the model's context length of 32768" in error["message"]


def test_request_timeout_answers_504_in_anthropics_shape(client):
    response = post(client, {**BODY, "messages": [{"role": "user", "content": "hang"}]})
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"


def test_request_timeout_ends_a_stream_with_an_error_event_in_anthropics_shape(client):
    response = post(client, {**BODY, "messages": [{"role": "user", "content": "hang"}], "stream": True})
    assert response.status_code == 200
    name, error = last_named_event(response)
    assert name == "event: error"
    assert error["type"] == "error" and error["error"]["type"] == "timeout_error", error


def test_count_tokens_is_served_without_v1_too(client):
    body = {key: value for key, value in BODY.items() if key != "max_tokens"}
    for path in ("/v1/messages/count_tokens", "/messages/count_tokens"):
        response = post(client, body, path=path)
        assert response.status_code == 200 and response.json()["forwarded"]["messages"] == MESSAGES, response.text


def test_the_batterys_messages_probes_get_no_server_error():
    """tools/battery.py's hostile Messages and count_tokens probes (--quick's), against both decide
    functions in process: 4xx or a forwarded body, never a 5xx."""
    import battery

    probes = battery.messages_probes(quick=True)  # the full set: python tools/battery.py
    assert len(probes) > 150
    for server_reason in (None, "serve.py"):
        client = make_client(server_reason=server_reason)
        for label, method, path, headers, body in probes:
            response = client.request(method, path, content=body, headers=headers)
            assert response.status_code < 500, (label, response.text)
            if response.status_code >= 400:
                assert response.json()["type"] == "error", label
