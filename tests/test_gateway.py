"""The gateway's request checks in-process: serve.py's Gateway, with serve_dflash2.py's
routing and the checks in dflash2_requests.py, in front of a stub in mlx-vlm's place.

No model and no server process: starlette's TestClient calls the ASGI app directly, so
each case takes milliseconds. What needs generation or a real server (crashes,
disconnects, timeouts of real generation, SIGTERM, stop sequences, CORS over the wire)
is in test_server.py.
"""

import asyncio
import json
import math
import os

import pytest
from starlette.testclient import TestClient

from conftest import data_url, png
from dflash2_gateway import Gateway, PathScrubber, local_paths, with_loopback_cors
from dflash2_record import current_request
from dflash2_requests import MAX_CONTENT_PARTS, MAX_IMAGES, MAX_MESSAGES, PackLimits, lowest_temperature
from dflash2_openapi import openapi_schema
from dflash2_routing import decider, plain_decision, route_chat

MODEL_ID = "tiny-pack"
VOCAB = 512
CONTEXT = 32768
MESSAGES = [{"role": "user", "content": "Hi"}]
TIMEOUT_S = 0.3


async def stub_mlx_vlm(scope, receive, send):
    """In mlx-vlm's place: answers with the body it was forwarded; streams two chunks the
    way mlx-vlm does (role in every delta, a new created time each); content "hang"
    generates until the request is cancelled, as a real token stream would end."""
    if scope["type"] != "http":
        return
    body = json.loads((await receive())["body"])
    first = first_content(body)
    if first == "over budget":  # mlx-vlm's own context-budget refusal
        detail = "Request needs 32800 context tokens (32700 prompt + 100 max generation), but MAX_KV_SIZE is 32768."
        payload = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})
        return
    if body.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for created, text in ((100, "a"), (101, "b")):
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": created,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
    if body.get("stream") and first == "stream failure":  # mlx-vlm's Responses stream failing: an untyped error event
        error = json.dumps({"error": f"Generation failed: {os.path.expanduser('~')}/model/x.py"})
        await send({"type": "http.response.body", "body": f"data: {error}\n\n".encode(), "more_body": False})
        return
    while first == "hang" and not current_request.get().cancelled:
        await asyncio.sleep(0.01)
    if body.get("stream"):
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return
    payload = json.dumps({"forwarded": body}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def first_content(body):
    """The first message's content: chat's and Messages' messages, or Responses' input."""
    if "messages" in body:
        return body["messages"][0].get("content")
    return body["input"] if isinstance(body["input"], str) else body["input"][0].get("content")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("allowed")
    (folder / "red.png").write_bytes(png((32, 32)))
    os.symlink("/etc/hostname", folder / "escape.png")
    return folder


def make_client(image_dir=None, top_logprobs_k=5, server_reason=None, max_prompt_chars=None, multimodal_plain=False,
                rounds_pay=lambda kind: True, prompt_chars_limit=None):
    """serve_dflash2.py's gateway; server_reason "serve.py" decides as serve.py does."""
    return TestClient(make_gateway(image_dir, top_logprobs_k, server_reason, max_prompt_chars, multimodal_plain,
                                   rounds_pay, prompt_chars_limit=prompt_chars_limit), base_url="http://127.0.0.1:8080")


def make_gateway(image_dir=None, top_logprobs_k=5, server_reason=None, max_prompt_chars=None, multimodal_plain=False,
                 rounds_pay=lambda kind: True, checking=lambda: None, prompt_chars_limit=None):
    """The ASGI app make_client serves; checking() runs as each chat body's check starts."""
    limits = PackLimits(MODEL_ID, VOCAB, CONTEXT, top_logprobs_k, image_dir and image_dir.resolve(), max_prompt_chars,
                        prompt_chars_limit)

    if server_reason == "serve.py":
        route = plain_decision
    else:
        def route(body):
            return route_chat(body, server_reason=server_reason, multimodal_plain=multimodal_plain,
                              rounds_pay=rounds_pay)
    checked = decider(limits, route)

    def decide(body, api="chat"):
        checking()
        return checked(body, api)

    gateway = Gateway(stub_mlx_vlm, limits=limits, scrubber=PathScrubber(local_paths([], MODEL_ID)),
                      decide=decide, header="x-dflash2", request_timeout=TIMEOUT_S)
    return with_loopback_cors(gateway)


@pytest.fixture(scope="module")
def client(image_dir):
    return make_client(image_dir)


def post(client, body, **headers):
    return client.post("/v1/chat/completions", content=json.dumps(body),
                       headers={"content-type": "application/json", **headers})


def assert_refused(response, status, reason, param=None, kind="invalid_request_error"):
    """Refused with its reason in x-dflash2 and the error's code (OpenAI's error shape, which
    Anthropic's shares inside its envelope), a message, and param where given."""
    assert response.status_code == status, response.text
    assert response.headers["x-dflash2"] == f"refused; reason={reason}"
    error = response.json()["error"]
    assert error["code"] == reason and error["type"] == kind and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in response.text
    return error


def image_body(url):
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            "temperature": 0}


# ---------------------------------------------------------------------------------------
# Refusals: 4xx in OpenAI's error shape, never a 500 or a traceback


@pytest.mark.parametrize("method, path, body, status, reason", [
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "thinking_budget": 16}, 400, "thinking-budget"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400, "structured-output"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}},
     400, "structured-output"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, "n-above-1"),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "model": "mlx-community/other"}, 404, "unknown-model"),
    ("GET", "/v1/settings", None, 404, "unsupported-endpoint"),
    ("PATCH", "/v1/settings", {"kv_bits": 4}, 404, "unsupported-endpoint"),
    ("POST", "/unload", None, 404, "unsupported-endpoint"),
    ("GET", "/v1/cache/stats", None, 404, "unsupported-endpoint"),
    ("POST", "/v1/cache/reset", None, 404, "unsupported-endpoint"),
    ("GET", "/metrics", None, 404, "unsupported-endpoint"),
    ("POST", "/v1/responses/input_tokens", {"input": "Hi"}, 404, "unsupported-endpoint"),
    ("POST", "/v1/completions", {"prompt": "Hi"}, 404, "unsupported-endpoint"),
    ("POST", "/v1/embeddings", {"input": "Hi"}, 404, "unsupported-endpoint"),
    ("POST", "/v1/audio/speech", {"input": "Hi"}, 404, "unsupported-endpoint"),
    ("POST", "/v1/images/generations", {"prompt": "Hi"}, 404, "unsupported-endpoint"),
    ("GET", "/v1/models/other-model", None, 404, "unknown-model"),
    ("GET", "/v1/chat/completions", None, 405, "method-not-allowed"),
    ("DELETE", "/v1/models", None, 405, "method-not-allowed"),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("server_reason", [None, "no-dflash2", "serve.py"])
def test_refused_rows(server_reason, method, path, body, status, reason):
    """The same refusals with the drafter, without it (--no-dflash2) and from serve.py."""
    client = make_client(server_reason=server_reason)
    response = client.request(method, path, content=None if body is None else json.dumps(body),
                              headers={"content-type": "application/json"})
    assert assert_refused(response, status, reason)["message"]


@pytest.mark.parametrize("raw", [b'{"messages": [', b"\xff\xfe{}", b"NaN", b"", b'{"messages": [], "temperature": NaN}'])
def test_malformed_json(client, raw):
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_refused(response, 400, "invalid-json")


@pytest.mark.parametrize("body, param", [
    ([], "body"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES, "temperature": True}, "temperature"),
    ({"messages": MESSAGES, "temperature": 5}, "temperature"),
    ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": MESSAGES, "stream": "yes"}, "stream"),
    ({"messages": MESSAGES, "model": 7}, "model"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MESSAGES, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MESSAGES, "logit_bias": {"token": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": " "}]}, "messages"),  # nothing to answer
], ids=lambda v: v if isinstance(v, str) else None)
def test_wrong_types(client, body, param):
    assert_refused(post(client, body), 400, "invalid-request", param)


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "adapter_path": "/tmp/adapter"}, "adapter_path"),
    ({"messages": MESSAGES, "kv_bits": 4}, "kv_bits"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "Hi", "mood": "happy"}]}, "messages[0].mood"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unknown_fields(client, body, param):
    assert_refused(post(client, body), 400, "unknown-field", param)


# ---------------------------------------------------------------------------------------
# Values checked against the pack (each of these crashed or 500ed a server before)


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"999999999": 100}, "temperature": 0}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 5}, "temperature": 0.5}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"\u0661": 5}}, "logit_bias"),  # a non-ASCII digit int() would accept
    ({"logit_bias": {"7": 101}}, "logit_bias.7"),
    ({"top_k": VOCAB}, "top_k"),
    ({"top_k": 100000}, "top_k"),
    ({"max_tokens": CONTEXT + 1}, "max_tokens"),
    ({"max_tokens": 2 ** 31}, "max_tokens"),
    ({"max_completion_tokens": CONTEXT + 1}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without "logprobs": true
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),  # above --top-logprobs-k 5
    ({"messages": [{"role": {}, "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": [], "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "Hi \ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    ({"user": "\ud83d"}, "user"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": 5}, "stop"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_out_of_range_values_name_the_field(client, fields, param):
    assert_refused(post(client, {"messages": MESSAGES, **fields}), 400, "invalid-request", param)


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_a_temperature_too_small_to_sample_is_refused(server_reason):
    client = make_client(server_reason=server_reason)
    lowest = lowest_temperature(VOCAB)
    error = assert_refused(post(client, {"messages": MESSAGES, "temperature": lowest * 0.99}),
                           400, "invalid-request", "temperature")
    assert f"at least {lowest:g}" in error["message"]
    response = post(client, {"messages": MESSAGES, "temperature": lowest})
    assert response.status_code == 200 and response.json()["forwarded"]["temperature"] == lowest


def test_the_lowest_temperature_is_where_mlx_vlms_sampler_overflows():
    """mlx-vlm's server sampler (0.7.2's _PositionedTargetSampler, with and without top_p) on
    float16 log-probabilities whose likeliest is -log(vocab), the least it can be: at
    lowest_temperature it samples the whole vocabulary; 5% below it, only token 0."""
    import mlx.core as mx
    from mlx_vlm.server.generation import _PositionedTargetSampler

    logprobs = mx.full((1, VOCAB), -math.log(VOCAB), dtype=mx.float16)
    for temperature, distinct in ((lowest_temperature(VOCAB), 10), (lowest_temperature(VOCAB) / 1.05, 1)):
        for top_p in (1.0, 0.9):
            sampler = _PositionedTargetSampler(temperature=temperature, top_p=top_p, seed=0)
            tokens = {sampler.sample_target(logprobs, row_ids=[0], positions=[p]).item() for p in range(24)}
            assert (len(tokens) >= distinct) if distinct > 1 else tokens == {0}, (temperature, top_p, tokens)


def test_values_at_the_limits_pass(client):
    body = {"messages": MESSAGES, "temperature": 0.5, "top_k": VOCAB - 1, "max_tokens": CONTEXT,
            "logit_bias": {str(VOCAB - 1): -100}, "logprobs": True, "top_logprobs": 5, "stop": "x",
            "tools": [{"type": "function", "function": {"name": "get.weather_2"}}],
            "tool_choice": {"type": "function", "function": {"name": "get.weather_2"}}}
    response = post(client, body)
    assert response.status_code == 200, response.text
    forwarded = response.json()["forwarded"]
    assert "stop" not in forwarded  # applied by the gateway, not mlx-vlm
    assert forwarded["logit_bias"] == body["logit_bias"] and forwarded["model"] == MODEL_ID


def test_text_beyond_any_prompt_that_fits_is_refused_untokenized():
    client = make_client(max_prompt_chars=100)
    parts = [{"type": "text", "text": "a" * 40}, {"type": "text", "text": "b" * 40}]
    # An assistant turn's text does not count (templates may drop its thinking).
    fits = [{"role": "system", "content": "s" * 19}, {"role": "user", "content": parts},
            {"role": "assistant", "content": "t" * 500}, {"role": "user", "content": "c"}]
    assert post(client, {"messages": fits}).status_code == 200
    for role in ("system", "user", "tool"):
        message = {"role": role, "content": "d", **({"tool_call_id": "call_1"} if role == "tool" else {})}
        error = assert_refused(post(client, {"messages": [*fits, message]}), 400, "context-length-exceeded",
                               "messages")
        assert "more than 100 characters" in error["message"]


def test_the_prompt_limit_counts_text_in_every_role_and_field():
    """--max-prompt-chars bounds what reaches the tokenizer: assistant turns, tool calls'
    arguments and tool schemas count too (a review sent 5 MB in each past a 1000 limit);
    image URLs do not (their own limits bound them)."""
    client = make_client(prompt_chars_limit=100)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    image = {"type": "image_url", "image_url": {"url": data_url(png((32, 32)))}}
    fits = {"messages": [{"role": "user", "content": [{"type": "text", "text": "u" * 40}, image]}]}
    assert post(client, fits).status_code == 200
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for extra in ({"messages": [{"role": "assistant", "content": "a" * 70}]},
                  {"messages": [{"role": "assistant", "content": None,
                                 "tool_calls": [{**call, "function": {"name": "f", "arguments": "x" * 70}}]}]},
                  {"tools": [{**tool, "function": {**tool["function"], "description": "d" * 70}}]}):
        body = {**fits, **extra, "messages": fits["messages"] + extra.get("messages", [])}
        error = assert_refused(post(client, body), 400, "prompt-too-long", "messages")
        assert "at most 100 (its --max-prompt-chars)" in error["message"]


def test_counts_that_bound_a_requests_checking_are_refused_before_it_is_read(client):
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    assert "at most 4096" in assert_refused(post(client, {"messages": many}), 400, "invalid-request",
                                            "messages")["message"]
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    assert_refused(post(client, {"messages": [{"role": "user", "content": parts}]}), 400, "invalid-request", "messages")
    # Images are counted before any is decoded: these are not images at all.
    images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * (MAX_IMAGES + 1)
    error = assert_refused(post(client, {"messages": [{"role": "user", "content": images}]}), 400,
                           "invalid-request", "messages")
    assert f"at most {MAX_IMAGES} a request" in error["message"]
    fits = {"messages": [{"role": "user", "content": "a"}] * MAX_MESSAGES}
    assert post(client, fits).status_code == 200


def test_a_requests_images_share_one_pixel_budget(client, monkeypatch):
    import dflash2_requests

    monkeypatch.setattr(dflash2_requests, "MAX_REQUEST_PIXELS", 3 * 32 * 32)
    three = [{"type": "image_url", "image_url": {"url": data_url(png((32, 32)))}}] * 3
    assert post(client, {"messages": [{"role": "user", "content": three}]}).status_code == 200
    error = assert_refused(post(client, {"messages": [{"role": "user", "content": [*three, three[0]]}]}),
                           400, "invalid-image", "messages[0].content[3].image_url.url")
    assert "pixels in all" in error["message"]


def test_mlx_vlm_context_budget_refusal_is_reshaped(client):
    body = {"messages": [{"role": "user", "content": "over budget"}], "max_tokens": 100}
    for stream in (False, True):
        error = assert_refused(post(client, {**body, "stream": stream}), 400, "context-length-exceeded", "messages")
        assert error["message"] == ("messages: the prompt is 32700 tokens and max_tokens is 100: 32800 in all, above "
                                    "the model's context length of 32768; shorten the messages or lower max_tokens")


def test_max_prompt_chars_from_the_tokenizer(tmp_path):
    from dflash2_options import max_prompt_chars

    tokenizer = {"normalizer": {"type": "NFC"}, "model": {"type": "BPE", "vocab": {"a": 0, "abcd": 1}},
                 "added_tokens": [{"content": "<|im_start|>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert max_prompt_chars(tmp_path, 1000) == 4 * len("<|im_start|>") * 1000
    (tmp_path / "tokenizer.json").write_text(json.dumps({**tokenizer, "normalizer": {"type": "Lowercase"}}))
    assert max_prompt_chars(tmp_path, 1000) is None  # another normalizer: no bound is known
    (tmp_path / "tokenizer.json").unlink()
    assert max_prompt_chars(tmp_path, 1000) is None


@pytest.mark.parametrize(("longest", "option", "limit"), [
    ("<|im_start|>", None, 16 * 1000),  # the default, 16 characters a token: below what never fits (48 a token)
    ("<|im_start|>", 5000, 5000),  # --max-prompt-chars
    ("<|im_start|>", 48_000, None),  # at or above what never fits: that refusal alone
    ("ab", None, None),  # a vocabulary whose tokens are short: nothing fits beyond 8 a token anyway
])
def test_the_servers_prompt_limit_is_its_option_or_16_characters_a_context_token(tmp_path, longest, option, limit):
    import argparse

    from dflash2_options import pack_limits

    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"content": longest}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1000,
                                                                      "vocab_size": 8}}))
    args = argparse.Namespace(max_tokens=None, allow_image_dir=None, top_logprobs_k=None, max_prompt_chars=option)
    limits = pack_limits(tmp_path, MODEL_ID, args)
    assert limits.max_prompt_chars == 4 * len(longest) * 1000
    assert limits.prompt_chars_limit == limit


def test_unknown_fields_deep_in_the_request(client):
    body = {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "color": 1}}]}
    assert_refused(post(client, body), 400, "unknown-field", "tools[0].function.color")


def test_deeply_nested_json(client):
    deep = "[" * 100000 + "]" * 100000
    response = client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    assert_refused(response, 400, "invalid-json")


# ---------------------------------------------------------------------------------------
# Images: base64 data URLs, or files inside --allow-image-dir; sizes checked


@pytest.mark.parametrize("size", [(3000, 1), (1, 3000), (201, 1)])
def test_extreme_aspect_ratios_are_refused(client, size):
    error = assert_refused(post(client, image_body(data_url(png(size)))), 400, "invalid-image")
    assert "aspect ratio" in error["message"]


@pytest.mark.parametrize("url, reason", [
    ("data:image/png;base64,###", "invalid-image"),
    (data_url(b"not an image at all"), "invalid-image"),
    (data_url(png()[:40]), "invalid-image"),
    ("data:text/plain;base64,aGk=", "invalid-image"),
    ("https://example.com/picture.png", "remote-image"),
], ids=["bad-base64", "not-an-image", "truncated", "not-image-type", "remote"])
def test_invalid_images(client, url, reason):
    assert_refused(post(client, image_body(url)), 400, reason, "messages[0].content[0].image_url.url")


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}])
def test_audio_and_video_parts_are_refused(client, part):
    assert_refused(post(client, {"messages": [{"role": "user", "content": [part]}]}), 400, "unsupported-input")


def test_local_paths_are_refused_alike_whether_they_exist_or_not(client, image_dir):
    messages = set()
    for url in ("/etc/passwd", "/nonexistent/x.png", "file:///etc/shadow", "file:///proc/self/environ",
                str(image_dir / ".." / "outside.png"), str(image_dir / "escape.png"),
                str(image_dir / "missing.png"), "red.png"):
        error = assert_refused(post(client, image_body(url)), 400, "local-image",
                               "messages[0].content[0].image_url.url")
        messages.add(error["message"])
    assert len(messages) == 1, messages


def test_without_an_image_folder_every_path_is_refused(image_dir):
    response = post(make_client(None), image_body(str(image_dir / "red.png")))
    assert_refused(response, 400, "local-image")


@pytest.mark.parametrize("form", [str, lambda p: f"file://{p}"])
def test_a_file_inside_the_image_folder_is_accepted(client, image_dir, form):
    response = post(client, image_body(form(image_dir / "red.png")))
    assert response.status_code == 200, response.text
    part = response.json()["forwarded"]["messages"][0]["content"][0]
    assert part["image_url"]["url"] == str((image_dir / "red.png").resolve())


@pytest.mark.parametrize("multimodal_plain", [False, True])
def test_multimodal_plain_routes_only_images_plain(multimodal_plain):
    client = make_client(multimodal_plain=multimodal_plain)
    with_image = post(client, image_body(data_url(png())))
    text = post(client, {"messages": MESSAGES, "temperature": 0})
    assert with_image.headers["x-dflash2"] == (
        "fallback; reason=multimodal-plain" if multimodal_plain else "speculative")
    assert text.headers["x-dflash2"] == "speculative"


def test_while_no_round_can_pay_requests_go_plain_and_other_reasons_stay_first():
    asked = []  # the server's answer is asked only for a request that would go speculative

    def rounds_pay(kind):
        asked.append(kind)
        return False

    client = make_client(multimodal_plain=True, rounds_pay=rounds_pay)
    modes = [post(client, body).headers["x-dflash2"] for body in (
        {"messages": MESSAGES, "temperature": 0}, {"messages": MESSAGES, "temperature": 0.5},
        {"messages": MESSAGES, "temperature": 0, "logprobs": True}, image_body(data_url(png())))]
    assert modes == ["fallback; reason=rounds-cannot-pay", "fallback; reason=rounds-cannot-pay",
                     "fallback; reason=logprobs", "fallback; reason=multimodal-plain"]
    assert asked == ["greedy", "sampled"]  # each kind's acceptance decides its own route
    server_wide = make_client(server_reason="no-dflash2", rounds_pay=rounds_pay)
    assert post(server_wide, {"messages": MESSAGES, "temperature": 0}).headers["x-dflash2"] == \
        "fallback; reason=no-dflash2"


# ---------------------------------------------------------------------------------------
# Headers, methods, documents


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_chat_needs_json_content_type(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/chat/completions", content=json.dumps({"messages": MESSAGES}), headers=headers)
    assert_refused(response, 415, "unsupported-media-type")


def test_json_content_type_with_charset_is_accepted(client):
    response = post(client, {"messages": MESSAGES}, **{"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL_ID}", "/openapi.json"])
def test_head_answers_like_get_without_a_body(client, path):
    head, get = client.head(path), client.get(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and int(head.headers["content-length"]) == len(get.content)


def test_openapi_describes_the_served_endpoints(client, image_dir):
    document = client.get("/openapi.json").json()
    limits = PackLimits(MODEL_ID, VOCAB, CONTEXT, 5, image_dir.resolve())  # make_client's
    assert document == json.loads(json.dumps(openapi_schema(limits)))
    assert "x-pack-limit" not in json.dumps(document)
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                      "/v1/responses", "/v1/models", "/v1/models/{model}", "/health"}
    schemas = document["components"]["schemas"]
    for name, field in (("ChatRequest", "stop"), ("MessagesRequest", "stop_sequences"), ("CountTokensRequest", "tools"),
                        ("ResponsesRequest", "input")):
        assert schemas[name]["additionalProperties"] is False and field in schemas[name]["properties"]
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert "max_tokens" not in schemas["CountTokensRequest"]["properties"]
    error = document["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/AnthropicError"}


def test_cross_origin_preflight(client):
    # The CORS layer answers a preflight before the gateway reads its path: one path shows it.
    foreign = client.options("/v1/chat/completions", headers={
        "origin": "https://attacker.example", "access-control-request-method": "POST"})
    assert foreign.status_code == 400 and "access-control-allow-origin" not in foreign.headers
    # The headers OpenAI's JavaScript SDK sends from a browser page, its own among them.
    sdk_headers = "authorization, content-type, x-stainless-lang, x-stainless-os, x-stainless-retry-count"
    local = client.options("/v1/chat/completions", headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST",
        "access-control-request-headers": sdk_headers})
    assert local.status_code == 200, local.text
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-stainless-lang" in local.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in local.headers


def test_host_names_are_matched_whatever_their_case(client):
    assert client.get("/health", headers={"host": "LocalHost:8080"}).status_code == 200
    assert_refused(client.get("/health", headers={"host": "LocalHost.evil:8080"}), 421, "invalid-host")


def test_a_decoded_newline_in_the_path_cannot_start_a_log_line(client, caplog):
    forged = "2026-12-03 18:00:00,000 INFO dflash2.server: request 999 finished in 0.01s: status=200"
    with caplog.at_level("INFO", logger="dflash2.server"):
        response = client.get("/x%0A" + forged.replace(" ", "%20"))
    assert_refused(response, 404, "unsupported-endpoint")
    arrivals = [record.getMessage() for record in caplog.records if "GET /x" in record.getMessage()]
    assert arrivals and all("\n" not in line for line in arrivals), arrivals
    assert "/x\\n2026-12-03" in arrivals[0]


# ---------------------------------------------------------------------------------------
# Streams and time limits


def test_streamed_role_once_and_one_created_time(client):
    response = post(client, {"messages": MESSAGES, "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    assert [chunk["choices"][0]["delta"].get("role") for chunk in chunks] == ["assistant", None]
    assert {chunk["created"] for chunk in chunks} == {100}


def test_other_clients_are_served_while_a_chat_body_is_checked():
    """Checking a chat body (up to 32 MiB of JSON, its images decoded) runs off the event
    loop: while one is being checked, the server answers /health (served by uvicorn, as the
    servers run it, since TestClient gives each request a loop of its own)."""
    import http.client
    import threading

    import uvicorn
    from server_process import free_port

    started, release = threading.Event(), threading.Event()

    def checking():
        started.set()
        release.wait(60)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_gateway(checking=checking), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def send(method, path, body=None):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        connection.request(method, path, body=body, headers={"content-type": "application/json"})
        status = connection.getresponse().status
        connection.close()
        return status

    statuses = []
    try:
        while not server.started:
            release.wait(0.01)
        chat = threading.Thread(target=lambda: statuses.append(send("POST", "/v1/chat/completions",
                                                                    json.dumps({"messages": MESSAGES}))))
        chat.start()
        assert started.wait(30)
        assert send("GET", "/health") == 200 and chat.is_alive()  # the chat body is still being checked
        release.set()
        chat.join(30)
        assert statuses == [200]
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_request_timeout_answers_504(client):
    response = post(client, {"messages": [{"role": "user", "content": "hang"}]})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request-timeout"


def last_named_event(response) -> tuple:
    """(the event line, the data as JSON) of a Messages or Responses stream's last event."""
    name, data = response.text.strip().split("\n\n")[-1].split("\n", 1)
    return name, json.loads(data.removeprefix("data: "))


def test_request_timeout_ends_a_stream_with_an_error_event(client):
    response = post(client, {"messages": [{"role": "user", "content": "hang"}], "stream": True})
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line]
    assert json.loads(events[-1][len("data: "):])["error"]["code"] == "request-timeout"
    assert "data: [DONE]" not in events


# ---------------------------------------------------------------------------------------
# Scrubbing


def test_scrubber_names_each_kind_of_local_path(tmp_path, monkeypatch):
    import sys

    pack = tmp_path / "pack"
    monkeypatch.chdir(tmp_path)
    scrub = PathScrubber(local_paths([pack], MODEL_ID))
    text = (f'File "{sys.prefix}/lib/python3.11/asyncio/tasks.py", line 1\n'
            f"{pack}/serve.py {os.path.expanduser('~')}/.cache {tmp_path}/notes.txt "
            "<_io.BytesIO object at 0x7f3a2c1d9e40>")
    scrubbed = scrub(text)
    assert scrubbed == ('File "<python>/lib/python3.11/asyncio/tasks.py", line 1\n'
                        f"{MODEL_ID}/serve.py ~/.cache <cwd>/notes.txt <_io.BytesIO object>")


@pytest.mark.parametrize("server_reason", [None, "serve.py"])
def test_a_request_that_may_sample_gets_a_seed_it_can_send_again(server_reason):
    """Draws are keyed by (seed, position): an unseeded sampled request gets a fresh seed,
    forwarded and returned in x-dflash2-seed; a sent seed is kept; greedy requests get none."""
    client = make_client(server_reason=server_reason)
    picked = [post(client, {"messages": MESSAGES, **fields}) for fields in ({"temperature": 0.7}, {}, {})]
    seeds = [response.json()["forwarded"]["seed"] for response in picked]
    assert [int(response.headers["x-dflash2-seed"]) for response in picked] == seeds
    assert len(set(seeds)) == 3 and all(0 <= seed < 1 << 32 for seed in seeds)
    sent = post(client, {"messages": MESSAGES, "temperature": 0.7, "seed": -5})
    assert sent.json()["forwarded"]["seed"] == -5 and sent.headers["x-dflash2-seed"] == "-5"
    greedy = post(client, {"messages": MESSAGES, "temperature": 0})
    assert "seed" not in greedy.json()["forwarded"] and "x-dflash2-seed" not in greedy.headers
