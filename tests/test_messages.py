"""Anthropic Messages over HTTP, through the official anthropic client, on the tiny pack
as tools/build_pack.py builds it:
  spec       serve_dflash2.py with a round cost table in which rounds pay (test_server's)
  plain      serve.py
  baseline   serve_dflash2.py --no-dflash2
One conversation gives the same tokens through chat completions and messages on all three.
The refusals that never reach generation are in test_messages_gateway.py (in process).
"""

import base64
import json

import anthropic
import pytest

from conftest import SEEN, per_server, png, request
from test_server import CONTEXT, PACK_NAME, ROUND_COSTS, client as openai_client

MAX_TOKENS = 5
SYSTEM = "Be brief."
QUESTION = "Hi"
PNG = base64.b64encode(png()).decode()
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
TOOLS = [{"name": "get_weather", "description": "Current weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic 2.x client has no temperature argument


@pytest.fixture(scope="module")
def servers(built_pack, start_server, tmp_path_factory):
    # One file for both agent APIs' tests: on one worker they share their servers.
    costs = tmp_path_factory.getbasetemp() / "agent-api-round-costs.json"
    costs.write_text(json.dumps(ROUND_COSTS))
    commands = {"spec": [built_pack / "serve_dflash2.py", "--dflash2-round-costs", costs],
                "plain": [built_pack / "serve.py"],
                "baseline": [built_pack / "serve_dflash2.py", "--no-dflash2"]}
    started = {name: start_server(f"messages-{name}", command) for name, command in commands.items()}
    for server in started.values():
        server.wait_ready()
    return started


def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def create(server, **fields):
    """(x-dflash2, x-dflash2-seed, message) of a non-streamed messages.create."""
    fields = {"model": PACK_NAME, "max_tokens": MAX_TOKENS, "system": SYSTEM,
              "messages": [{"role": "user", "content": QUESTION}], "thinking": {"type": "disabled"}, **fields}
    raw = client(server).messages.with_raw_response.create(**fields)
    SEEN.append((f"{server.name} anthropic", str(dict(raw.headers)) + raw.http_response.text))
    return raw.headers.get("x-dflash2"), raw.headers.get("x-dflash2-seed"), raw.parse()


def create_streamed(server, **fields):
    """(x-dflash2, the events) of a streamed messages.create."""
    fields = {"model": PACK_NAME, "max_tokens": MAX_TOKENS, "system": SYSTEM,
              "messages": [{"role": "user", "content": QUESTION}], "thinking": {"type": "disabled"}, **fields}
    with client(server).messages.with_streaming_response.create(stream=True, **fields) as response:
        events = list(response.parse())
        SEEN.append((f"{server.name} anthropic stream", str(dict(response.headers))))
        return response.headers.get("x-dflash2"), events


def chat(server, **fields):
    """(x-dflash2, completion) of the same conversation through chat completions."""
    raw = openai_client(server).chat.completions.with_raw_response.create(
        model=PACK_NAME, max_tokens=MAX_TOKENS, messages=[{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": QUESTION}],
        extra_body={"enable_thinking": False}, **fields)
    return raw.headers.get("x-dflash2"), raw.parse()


def text(message):
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.fixture(scope="module")
def answers(servers):
    """The greedy conversation through both APIs on each server."""
    def run(name):
        server = servers[name]
        return {"chat": chat(server, temperature=0), "messages": create(server, **GREEDY),
                "stream": create_streamed(server, **GREEDY)}

    return per_server(servers, run)


# ---------------------------------------------------------------------------------------
# One conversation, the same tokens through both APIs on every server


def test_the_same_tokens_through_chat_and_messages_on_every_server(answers):
    modes = {"spec": "speculative", "plain": None, "baseline": "fallback; reason=no-dflash2"}
    reference = answers["plain"]["chat"][1]
    expected = reference.choices[0].message.content or ""
    assert expected
    for name, answer in answers.items():
        chat_mode, completion = answer["chat"]
        mode, seed, message = answer["messages"]
        assert chat_mode == mode == modes[name] and seed is None, name
        assert (completion.choices[0].message.content or "") == text(message) == expected, name
        assert message.usage.output_tokens == completion.usage.completion_tokens == reference.usage.completion_tokens
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == completion.usage.prompt_tokens
        assert message.type == "message" and message.role == "assistant" and message.model == PACK_NAME
        assert message.stop_reason == "max_tokens"


def test_a_stream_sends_anthropics_event_sequence(answers):
    for name, answer in answers.items():
        mode, events = answer["stream"]
        assert mode == answer["messages"][0], name
        kinds = [event.type for event in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
        assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop", kinds
        assert set(kinds[2:-3]) == {"content_block_delta"}, kinds
        streamed = "".join(event.delta.text for event in events if event.type == "content_block_delta")
        assert streamed == text(answer["messages"][2]), name
        assert events[-2].delta.stop_reason == "max_tokens"
        assert events[-2].usage.output_tokens == MAX_TOKENS


# ---------------------------------------------------------------------------------------
# Sampling, stop sequences, tools, images, count_tokens


def test_a_sampled_request_is_speculative_and_its_seed_reproduces_it_through_chat(servers):
    mode, seed, message = create(servers["spec"])  # no temperature: the pack's sampling defaults
    assert mode == "speculative" and seed is not None
    chat_mode, completion = chat(servers["plain"], seed=int(seed))
    assert completion.choices[0].message.content == text(message)


def test_stop_sequences_end_the_answer_on_every_route(servers, answers):
    full = text(answers["plain"]["messages"][2])
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    for name in ("spec", "plain"):
        mode, _, message = create(servers[name], stop_sequences=[stop, "\u2603never"], **GREEDY)
        # the engine ends the text at the stop; mlx-vlm 0.7.2 strips the non-streamed text it is handed
        assert text(message) == full[:full.index(stop)].strip(), name
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop), name
    for name in ("spec", "plain"):  # streamed, the text up to the stop as generated
        _, events = create_streamed(servers[name], stop_sequences=[stop], **GREEDY)
        streamed = "".join(event.delta.text for event in events if event.type == "content_block_delta")
        assert streamed == full[:full.index(stop)], name
        assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop), name


def test_a_tool_conversation_and_an_image_are_served_speculative(servers):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}]}]
    mode, _, message = create(servers["spec"], messages=messages, tools=TOOLS, tool_choice={"type": "auto"}, **GREEDY)
    assert mode == "speculative" and message.stop_reason in ("max_tokens", "tool_use", "end_turn")
    # Asked again, the prompt's first 256-token snapshot comes from the prefix cache, and says so.
    _, _, again = create(servers["spec"], messages=messages, tools=TOOLS, tool_choice={"type": "auto"}, **GREEDY)
    assert text(again) == text(message) and again.usage.cache_read_input_tokens >= 256, again.usage
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == message.usage.input_tokens + message.usage.cache_read_input_tokens)
    image = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What?"}]}]
    mode, _, message = create(servers["spec"], messages=image, **GREEDY)
    _, _, plain = create(servers["plain"], messages=image, **GREEDY)
    assert mode == "speculative" and text(message) == text(plain)


def test_count_tokens_counts_the_prompt_the_answer_used(servers, answers):
    anthropic_client = client(servers["spec"])
    count = anthropic_client.messages.count_tokens(
        model=PACK_NAME, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        thinking={"type": "disabled"})
    usage = answers["spec"]["messages"][2].usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    with_tools = anthropic_client.messages.count_tokens(
        model=PACK_NAME, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
        thinking={"type": "disabled"})
    with_image = anthropic_client.messages.count_tokens(
        model=PACK_NAME, messages=[{"role": "user", "content": [IMAGE, {"type": "text", "text": QUESTION}]}])
    assert with_tools.input_tokens > count.input_tokens and with_image.input_tokens > 0
    response = request(servers["spec"], "POST", "/v1/messages/count_tokens",
                       {"model": PACK_NAME, "messages": [{"role": "user", "content": QUESTION}]})
    assert response.status == 200 and response.mode == "speculative" and "x-dflash2-seed" not in response.headers


# ---------------------------------------------------------------------------------------
# Refusals, in Anthropic's error format


@pytest.mark.parametrize("fields, reason", [
    ({"extra_body": {"temperature": 0, "logprobs": True}}, "unknown-field"),
    ({"messages": [{"role": "user", "content": [{**IMAGE, "source": {**IMAGE["source"], "data": "AAAA"}}]}]},
     "invalid-image"),
    ({"max_tokens": CONTEXT + 1}, "invalid-request"),
    ({"max_tokens": CONTEXT - 2}, "context-length-exceeded"),  # mlx-vlm's budget check, after tokenizing
], ids=["unknown-field", "bad-image", "max-tokens", "too-long"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_refusals_come_in_anthropics_format(servers, fields, reason, stream):
    for name in ("spec", "plain"):
        with pytest.raises(anthropic.BadRequestError) as raised:
            fetch = create_streamed if stream else create
            fetch(servers[name], **fields)
        error = raised.value
        assert error.status_code == 400
        assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
        assert error.body["error"]["code"] == reason, error.body
        assert error.response.headers.get("x-dflash2") == (f"refused; reason={reason}" if name == "spec" else None)
