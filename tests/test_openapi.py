"""/openapi.json says what the gateway validates: a body the gateway refuses is outside its
request's published schema, a body it accepts is inside it. In process (test_gateway's
stand-in in mlx-vlm's place, serve.py's decide function); schemathesis's search over the same
schema, against the gateway and against a real server: test_openapi_schemathesis.py.
"""

import base64
import json
import re

import pytest
from jsonschema import Draft202012Validator

from conftest import png
from dflash2_requests import token_id_pattern
from test_gateway import make_client

CHAT, MESSAGES, COUNT_TOKENS, RESPONSES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                           "/v1/responses")
USER = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png((2, 2))).decode()}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "t", "content": "x"}


@pytest.fixture(scope="module")
def client():
    return make_client(server_reason="serve.py")


def schema_allows(document, path, body) -> bool:
    """Whether body is valid against the path's published request schema."""
    reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**reference, "components": document["components"]})
    return validator.is_valid(body)


def chat(*messages, **fields):
    return {"messages": list(messages), **fields}


# (path, body, whether the gateway accepts it)
ROWS = [
    # Each role's message holds what its checks require (schemathesis: {"messages": [{"role": "tool"}]}).
    (CHAT, chat({"role": "tool"}), False),
    (CHAT, chat({"role": "tool", "content": "x"}), False),
    (CHAT, chat(USER, {"role": "tool", "content": "x", "tool_call_id": "call_1"}), True),
    (CHAT, chat({"role": "system"}, USER), False),
    (CHAT, chat({"role": "developer", "content": None}, USER), False),
    (CHAT, chat({"role": "user"}), False),
    (CHAT, chat(USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}), True),
    (CHAT, chat(USER, {"role": "assistant", "tool_calls": [CALL]}), True),
    (CHAT, chat({**USER, "tool_calls": [CALL]}), False),
    (CHAT, chat({**USER, "tool_calls": None}), True),
    (CHAT, chat(USER, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), False),
    (CHAT, chat({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}), False),
    # Each role's blocks (Messages) and parts (Responses): images in user turns only, tool uses in assistant turns only.
    (MESSAGES, {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, False),
    (MESSAGES, {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": ""}]}]},
     False),
    (COUNT_TOKENS, {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, False),
    (COUNT_TOKENS, {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, True),
    (RESPONSES, {"input": [USER, {"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]}, False),
    (RESPONSES, {"input": [USER, {"type": None, "role": "system", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, False),
    # JSON Schema's integers take 2.0 (schemathesis: "n": 1.0 refused as not a valid integer).
    (CHAT, chat(USER, n=1.0, max_tokens=4.0, seed=-3.0), True),
    (CHAT, chat(USER, max_tokens=4.5), False),
    (CHAT, chat(USER, max_tokens=0.0), False),
    (MESSAGES, {"max_tokens": 0, "messages": [USER]}, False),
    (MESSAGES, {"max_tokens": 1, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 0}}, False),
    (RESPONSES, {"input": "Hi", "top_k": -1.0}, False),
    (MESSAGES, {"max_tokens": 4.0, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 16.0}}, True),
    (RESPONSES, {"input": "Hi", "max_output_tokens": 4.0, "top_k": 2.0}, True),
    # Values recognised and refused by name (schemathesis: n 127, text.format {"type": ""}).
    (CHAT, chat(USER, n=2), False),
    (CHAT, chat(USER, n=1), True),
    (CHAT, chat(USER, thinking_budget=16), False),
    (CHAT, chat(USER, thinking_budget=None), True),
    (CHAT, chat(USER, response_format={"type": "json_object"}), False),
    (CHAT, chat(USER, response_format={"type": "text"}), True),
    (RESPONSES, {"input": "Hi", "text": {"format": {"type": ""}}}, False),
    (RESPONSES, {"input": "Hi", "text": {"format": {"type": "text"}}}, True),
    # The pack's and the server's bounds (make_client's: vocabulary 512, context 32768, --top-logprobs-k 5):
    # schemathesis sent top_k 2147483647, max_tokens 2147483647, a tool_choice naming no tool, ...
    (CHAT, chat(USER, top_k=511, max_tokens=32768, max_completion_tokens=32768), True),
    (CHAT, chat(USER, top_k=512), False),
    (CHAT, chat(USER, max_tokens=32769), False),
    (CHAT, chat(USER, max_completion_tokens=32769), False),
    (MESSAGES, {"max_tokens": 32769, "messages": [USER]}, False),
    (MESSAGES, {"max_tokens": 1, "messages": [USER], "top_k": 512}, False),
    (RESPONSES, {"input": "Hi", "max_output_tokens": 32769}, False),
    (RESPONSES, {"input": "Hi", "top_k": 512}, False),
    (CHAT, chat(USER, model="tiny-pack", temperature=0), True),
    (CHAT, chat(USER, model="other"), False),
    (COUNT_TOKENS, {"model": "other", "messages": [USER]}, False),
    (RESPONSES, {"model": "other", "input": "Hi"}, False),
    (CHAT, chat(USER, temperature=1e-9), False),
    (MESSAGES, {"max_tokens": 1, "messages": [USER], "temperature": 1e-9}, False),
    (RESPONSES, {"input": "Hi", "temperature": 1e-9}, False),
    (CHAT, chat(USER, temperature=0.1), True),
    (CHAT, chat(USER, top_logprobs=1), False),
    (CHAT, chat(USER, top_logprobs=1, logprobs=False), False),
    (CHAT, chat(USER, top_logprobs=0), True),
    (CHAT, chat(USER, top_logprobs=5, logprobs=True), True),
    (CHAT, chat(USER, top_logprobs=6, logprobs=True), False),
    (CHAT, chat(USER, logit_bias={"0": 1, "511": -1, "7": 100}), True),
    (CHAT, chat(USER, logit_bias={"512": 1}), False),
    (CHAT, chat(USER, logit_bias={"01": 1}), False),
    (CHAT, chat(USER, logit_bias={"x-schemathesis-additional": 99}), False),
    (CHAT, chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}),
     False),
    (MESSAGES, {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "ftp://x"}}]}]}, False),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]}, False),
    # Something to answer: text other than white space (Python's: \x1c is white space), an image, a tool call or
    # reasoning, as mlx-vlm requires (schemathesis: input "" refused by mlx-vlm, param null).
    (CHAT, chat({"role": "user", "content": ""}), False),
    (CHAT, chat({"role": "user", "content": " \n\x1c\u3000"}), False),
    (CHAT, chat({"role": "user", "content": [{"type": "text", "text": " "}]}), False),
    (CHAT, chat({"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "."}]}), True),
    (CHAT, chat({"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}), True),
    (CHAT, chat({"role": "user", "content": ""}, {"role": "assistant", "tool_calls": [CALL]}), True),
    (CHAT, chat({"role": "user", "content": ""}, {"role": "assistant", "tool_calls": []}), False),
    (CHAT, chat({"role": "user", "content": ""}, {"role": "assistant", "reasoning_content": "x"}), True),
    (CHAT, chat({"role": "user", "content": ""}, {"role": "assistant", "reasoning": "x"}), False),
    (CHAT, chat({"role": "system", "content": "", "reasoning_content": "0"}), False),  # mlx-vlm keeps system content only
    (CHAT, chat({"role": "tool", "content": "", "tool_call_id": "c", "reasoning_content": "0"}), True),
    (RESPONSES, {"input": ""}, False),
    (RESPONSES, {"input": " ", "instructions": "\t"}, False),
    (RESPONSES, {"input": "", "instructions": "Be brief."}, True),
    (RESPONSES, {"input": [{"role": "user", "content": []}, {"type": "reasoning", "summary": []}]}, False),
    (RESPONSES, {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]}, True),
    (RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c", "output": ""}]}, False),
    (RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "sunny"}]}]}, True),
    (RESPONSES, {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}]}, True),
    (MESSAGES, {"max_tokens": 1, "messages": [{"role": "user", "content": ""}]}, True),  # mlx-vlm's Messages takes it
    # A tool result counts with its parts (schemathesis: 4096 parts in one, 4097 blocks in all).
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                "content": [{"type": "text", "text": "x"}] * 4095}]}]},
     True),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                "content": [{"type": "text", "text": "x"}] * 4096}]}]},
     False),
    # A tool call's arguments (a real server: the chat template could not render these messages: Object of type
    # Undefined is not JSON serializable).
    (CHAT, chat(USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}), False),
    (CHAT, chat(USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}), True),
    # Images need a user turn mlx-vlm keeps (a real server: Text entry 0 contains 0 image placeholders, but 1 images
    # were supplied for it): a user message of tool results alone is rendered as tool messages.
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [IMAGE, TOOL_RESULT]}]}, False),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [IMAGE, TOOL_RESULT, {"type": "text", "text": " "}]}]},
     False),
    (MESSAGES, {"max_tokens": 1, "messages": [{"role": "user", "content": [IMAGE, TOOL_RESULT]}]}, False),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [IMAGE, TOOL_RESULT, {"type": "text", "text": "x"}]}]},
     True),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [IMAGE]}, {"role": "user", "content": [TOOL_RESULT]}]},
     True),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [{**TOOL_RESULT, "content": [IMAGE]}]}]}, True),
    # An earlier answer's message item, sent back as the SDK keeps it, with the fields mlx-vlm writes on it (a real
    # server through the openai client: 400 input[1].reasoning_content is not a known field).
    (RESPONSES, {"input": [USER, {"role": "assistant", "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
                                  "reasoning_content": None, "reasoning": None, "tool_calls": None, "tool_call_id": None,
                                  "name": None, "id": "msg_1", "type": "message", "status": "completed"}]}, True),
    (RESPONSES, {"input": [{"role": "assistant", "content": "", "reasoning": "Thought."}]}, True),
    (RESPONSES, {"input": [{"role": "assistant", "content": "", "reasoning_content": "", "reasoning": "x"}]}, False),
    (RESPONSES, {"input": [USER, {"role": "assistant", "content": "a", "tool_calls": []}]}, False),
    (RESPONSES, {"input": [{**USER, "reasoning": "x"}]}, False),
    # A tool choice that requires a call needs tools (a real server: 400 tool_choice 'required' requires at least one
    # tool., param null); Responses passes it to the template only, and takes it.
    (CHAT, chat(USER, tool_choice="required"), False),
    (CHAT, chat(USER, tool_choice="required", tools=None), False),
    (CHAT, chat(USER, tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]), True),
    (CHAT, chat(USER, tool_choice="auto"), True),
    (MESSAGES, {"max_tokens": 1, "messages": [USER], "tool_choice": {"type": "any"}}, False),
    (COUNT_TOKENS, {"messages": [USER], "tool_choice": {"type": "any"}, "tools": []}, False),
    (COUNT_TOKENS, {"messages": [USER], "tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {}}]},
     True),
    (COUNT_TOKENS, {"messages": [USER], "tool_choice": {"type": "auto"}}, True),
    (RESPONSES, {"input": "Hi", "tool_choice": "required"}, True),
    # A message item's type may be null, as any optional field may (schemathesis: refused as an unknown tag).
    (RESPONSES, {"input": [{"type": None, "role": "user", "content": "Hi"}]}, True),
]


@pytest.mark.parametrize("path, body, accepted", ROWS, ids=lambda v: json.dumps(v)[:80] if isinstance(v, dict) else None)
def test_the_published_schema_allows_what_the_gateway_accepts(client, path, body, accepted):
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert (response.status_code == 200) == accepted, response.text
    assert schema_allows(client.get("/openapi.json").json(), path, body) == accepted


def test_token_id_pattern_matches_the_ids_below_the_vocabulary_size():
    for vocab_size in (1, 2, 9, 10, 11, 100, 101, 512, 1000, 151936, 248320):
        pattern = re.compile(token_id_pattern(vocab_size))
        ids = {*range(0, min(vocab_size + 20, 2000)), *range(vocab_size - 2000, vocab_size + 2000)}
        for token_id in (i for i in ids if i >= 0):
            assert bool(pattern.fullmatch(str(token_id))) == (token_id < vocab_size), (vocab_size, token_id)
        assert not pattern.fullmatch("01") and not pattern.fullmatch("") and not pattern.fullmatch("-1")


def test_whole_numbers_sent_as_2_0_go_on_as_integers(client):
    """mlx-vlm takes them as they come: a float max_tokens would reach range() and the sampler."""
    for path, body, names in [(CHAT, chat(USER, n=1.0, max_tokens=4.0, seed=-3.0), ("max_tokens", "seed", "n")),
                              (MESSAGES, {"max_tokens": 4.0, "messages": [USER]}, ("max_tokens",)),
                              (RESPONSES, {"input": "Hi", "max_output_tokens": 4.0, "top_k": 2.0},
                               ("max_output_tokens", "top_k"))]:
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        forwarded = response.json()["forwarded"]
        assert all(type(forwarded[name]) is int and forwarded[name] == body[name] for name in names), forwarded


def test_a_stream_s_events_fit_the_published_event_schema(client):
    """OpenAPI 3.1 describes a text/event-stream response by its events: each an object with
    its data (and its event name, for Messages and Responses), as schemathesis reads them."""
    response = client.post(CHAT, content=json.dumps(chat(USER, stream=True)), headers={"content-type": "application/json"})
    events = [{"data": event.removeprefix("data: ")} for event in response.text.split("\n\n") if event]
    assert len(events) == 3
    document = client.get("/openapi.json").json()
    for path in (CHAT, MESSAGES, RESPONSES):
        stream = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        validator = Draft202012Validator(stream["schema"])
        assert all(validator.is_valid(event) for event in [*events, {"event": "message_start", "data": "{}"}])
        assert not validator.is_valid({"event": "message_start"})


def test_the_published_schema_speaks_json_schema_only(client):
    """No pydantic constraint names (ge, le: pydantic writes them when a validator hides the
    bound from it) and no PackLimit marker left unfilled."""
    text = json.dumps(client.get("/openapi.json").json())
    assert not re.findall(r'"(ge|le|gt|lt|min_length|max_length|x-pack-limit)":', text)
