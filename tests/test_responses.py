"""OpenAI Responses over HTTP, through the official openai client's responses.create, on
the tiny pack as tools/build_pack.py builds it:
  spec       serve_dflash2.py with a round cost table in which rounds pay (test_server's)
  plain      serve.py
  baseline   serve_dflash2.py --no-dflash2
One conversation gives the same tokens through chat completions and responses on all three.
A function tool conversation (the first answer's output items sent back as the SDK gives
them, a function call and its output) and an image as a data URL are answered alike on the
speculative and plain routes, streamed and not.
The refusals that never reach generation are in test_responses_gateway.py (in process).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall

from conftest import SEEN, per_server, data_url, png
from test_server import CONTEXT, PACK_NAME, ROUND_COSTS, client as openai_client

MAX_TOKENS = 5
INSTRUCTIONS = "Be brief."
QUESTION = "Hi"
GREEDY = {"temperature": 0, "extra_body": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def servers(built_pack, start_server, tmp_path_factory):
    # One file for both agent APIs' tests: on one worker they share their servers.
    costs = tmp_path_factory.getbasetemp() / "agent-api-round-costs.json"
    costs.write_text(json.dumps(ROUND_COSTS))
    commands = {"spec": [built_pack / "serve_dflash2.py", "--dflash2-round-costs", costs],
                "plain": [built_pack / "serve.py"],
                "baseline": [built_pack / "serve_dflash2.py", "--no-dflash2"]}
    started = {name: start_server(f"responses-{name}", command) for name, command in commands.items()}
    for server in started.values():
        server.wait_ready()
    return started


def create(server, **fields):
    """(x-dflash2, x-dflash2-seed, response) of a non-streamed responses.create."""
    fields = {"model": PACK_NAME, "max_output_tokens": MAX_TOKENS, "instructions": INSTRUCTIONS,
              "input": QUESTION, **GREEDY, **fields}
    raw = openai_client(server).responses.with_raw_response.create(**fields)
    SEEN.append((f"{server.name} responses", str(dict(raw.headers)) + raw.http_response.text))
    return raw.headers.get("x-dflash2"), raw.headers.get("x-dflash2-seed"), raw.parse()


def create_streamed(server, **fields):
    """(x-dflash2, the events) of a streamed responses.create."""
    fields = {"model": PACK_NAME, "max_output_tokens": MAX_TOKENS, "instructions": INSTRUCTIONS,
              "input": QUESTION, **GREEDY, **fields}
    with openai_client(server).responses.with_streaming_response.create(stream=True, **fields) as response:
        events = list(response.parse())
        SEEN.append((f"{server.name} responses stream", str(dict(response.headers))))
        return response.headers.get("x-dflash2"), events


def chat(server, **fields):
    """(x-dflash2, completion) of the same conversation through chat completions."""
    raw = openai_client(server).chat.completions.with_raw_response.create(
        model=PACK_NAME, max_tokens=MAX_TOKENS, messages=[{"role": "system", "content": INSTRUCTIONS},
                                                          {"role": "user", "content": QUESTION}],
        extra_body={"enable_thinking": False}, **fields)
    return raw.headers.get("x-dflash2"), raw.parse()


@pytest.fixture(scope="module")
def answers(servers):
    """The greedy conversation through both APIs on each server."""
    def run(name):
        server = servers[name]
        return {"chat": chat(server, temperature=0), "responses": create(server), "stream": create_streamed(server)}

    return per_server(servers, run)


def test_the_same_tokens_through_chat_and_responses_on_every_server(answers):
    modes = {"spec": "speculative", "plain": None, "baseline": "fallback; reason=no-dflash2"}
    reference = answers["plain"]["chat"][1]
    expected = reference.choices[0].message.content or ""
    assert expected
    for name, answer in answers.items():
        chat_mode, completion = answer["chat"]
        mode, seed, response = answer["responses"]
        assert chat_mode == mode == modes[name] and seed is None, name
        assert (completion.choices[0].message.content or "") == response.output_text == expected, name
        assert response.usage.output_tokens == completion.usage.completion_tokens == reference.usage.completion_tokens
        assert response.usage.input_tokens == completion.usage.prompt_tokens
        assert response.object == "response" and response.status == "completed" and response.model == PACK_NAME
        assert response.store is False


def test_a_stream_sends_the_typed_responses_events(answers):
    for name, answer in answers.items():
        mode, events = answer["stream"]
        assert mode == answer["responses"][0], name
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
        streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        assert streamed == answer["responses"][2].output_text, name
        assert events[-1].response.output_text == streamed and events[-1].response.usage.output_tokens == MAX_TOKENS


def test_a_sampled_request_is_speculative_and_its_seed_reproduces_it_through_chat(servers):
    mode, seed, response = create(servers["spec"], temperature=None)  # the pack's sampling defaults
    assert mode == "speculative" and seed is not None
    _, completion = chat(servers["plain"], seed=int(seed))
    assert completion.choices[0].message.content == response.output_text


TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
# A call as the SDK returns one: the tiny pack's random weights answer the question with text
# (and the trained pair's calls are malformed JSON), so the conversation brings its own.
CALL = ResponseFunctionToolCall(type="function_call", call_id="call_1", name="get_weather",
                                arguments='{"city": "Paris"}', id="fc_1", status="completed")


def streamed_text(events):
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


def on_both(*jobs):
    """The (function, server, fields) jobs at once: each server decodes on about one core."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [future.result() for future in [pool.submit(fetch, server, **fields) for fetch, server, fields in jobs]]


def test_a_function_tool_conversation_through_the_sdk(servers):
    """The question with a function tool; then the question, the first answer's output items as
    the SDK gave them, a function call and its output: served speculative, with plain
    decoding's tokens, streamed and not."""
    spec, plain = servers["spec"], servers["plain"]
    (mode, _, first), (_, first_events) = on_both((create, spec, {"input": WEATHER, "tools": TOOLS}),
                                                  (create_streamed, plain, {"input": WEATHER, "tools": TOOLS}))
    assert mode == "speculative" and first.status == "completed"
    assert {item.type for item in first.output} <= {"message", "function_call", "reasoning"}, first.output
    assert streamed_text(first_events) == first.output_text and first_events[-1].type == "response.completed"
    calls = [item for item in first.output if item.type == "function_call"]
    call = calls[0] if calls else CALL
    turn = [*WEATHER, *first.output, *([] if calls else [CALL]),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    fields = {"input": turn, "tools": TOOLS, "max_output_tokens": 8}
    (mode, _, answer), (plain_mode, _, expected), (streamed_mode, events) = on_both(
        (create, spec, fields), (create, plain, fields), (create_streamed, spec, fields))
    assert (mode, plain_mode, streamed_mode) == ("speculative", None, "speculative")
    assert answer.output_text == expected.output_text == streamed_text(events) and answer.output_text
    assert answer.usage.output_tokens == expected.usage.output_tokens
    assert answer.usage.input_tokens == expected.usage.input_tokens > first.usage.input_tokens
    # The first turn's tools preamble (over 256 tokens) came back from each server's prefix cache.
    assert answer.usage.input_tokens_details.cached_tokens >= 256, answer.usage
    assert expected.usage.input_tokens_details.cached_tokens >= 256, expected.usage
    assert [event.type for event in events][-1] == "response.completed"


def test_an_image_as_a_data_url_is_answered_alike_streamed_and_not(servers):
    image = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_image", "image_url": data_url(png())}]}]
    (mode, _, answer), (plain_mode, _, expected), (streamed_mode, events) = on_both(
        (create, servers["spec"], {"input": image}), (create, servers["plain"], {"input": image}),
        (create_streamed, servers["spec"], {"input": image}))
    assert (mode, plain_mode, streamed_mode) == ("speculative", None, "speculative")
    assert answer.output_text == expected.output_text == streamed_text(events) and answer.output_text
    _, _, text_only = create(servers["plain"], input=[{"role": "user", "content": "What is this?"}])
    assert answer.usage.input_tokens == expected.usage.input_tokens > text_only.usage.input_tokens  # the image's tokens


@pytest.mark.parametrize("fields, reason", [
    ({"previous_response_id": "resp_1"}, "stateful-response"),
    ({"max_output_tokens": CONTEXT + 1}, "invalid-request"),
    ({"max_output_tokens": CONTEXT - 2}, "context-length-exceeded"),  # mlx-vlm's budget check, after tokenizing
], ids=["previous-response", "max-tokens", "too-long"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_refusals_come_in_openais_format(servers, fields, reason, stream):
    for name in ("spec", "plain"):
        with pytest.raises(openai.BadRequestError) as raised:
            (create_streamed if stream else create)(servers[name], **fields)
        error = raised.value
        assert error.status_code == 400 and error.code == reason, error.body
        assert error.body["type"] == "invalid_request_error" and error.body["message"]
        if reason == "context-length-exceeded":  # named in the Responses API's fields
            assert error.body["param"] == "input" and "max_output_tokens" in error.body["message"], error.body
        assert error.response.headers.get("x-dflash2") == (f"refused; reason={reason}" if name == "spec" else None)
