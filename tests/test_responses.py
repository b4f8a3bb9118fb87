"""OpenAI Responses over HTTP, through the official openai client's responses.create, on
the tiny pack as tools/build_pack.py builds it:
  spec       serve_dflash2.py with a round cost table in which rounds pay (test_server's)
  plain      serve.py
  baseline   serve_dflash2.py --no-dflash2
One conversation gives the same tokens through chat completions and responses on all three.
The refusals that never reach generation are in test_responses_gateway.py (in process).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SEEN
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
    """The greedy conversation through both APIs on each server, one thread per server."""
    def run(name):
        server = servers[name]
        return {"chat": chat(server, temperature=0), "responses": create(server), "stream": create_streamed(server)}

    with ThreadPoolExecutor(len(servers)) as pool:
        return dict(zip(servers, pool.map(run, servers)))


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
        assert error.response.headers.get("x-dflash2") == (f"refused; reason={reason}" if name == "spec" else None)
