"""The pack's servers over real HTTP, on the tiny pack as tools/build_pack.py builds it.

One module-wide set of real server processes (uvicorn on 127.0.0.1, free ports, from
conftest's start_server), each run from inside the flat pack folder the way a user runs
it, with its own HOME and working directory so that path scrubbing can be checked:
  spec       serve_dflash2.py                            greedy requests speculative
             (with a fixed round cost table instead of measuring one)
  plain      serve.py                                    the reference answers
  baseline   serve_dflash2.py --no-dflash2
  no_kernel  serve_dflash2.py --enable-thinking --host localhost --request-timeout 6,
             whose kernel self-test reports a failure
spec reads images from the module's images/ folder (--allow-image-dir). The last tests
stop plain and baseline with SIGTERM. Routing with --dflash2-multimodal plain and every
refusal that never reaches generation run in process (test_gateway.py).
Requests go through the official openai client and raw HTTP (http.client, sockets).
The CPU is slow, so prompts are short and max_tokens small.
"""

import http.client
import json
import os
import re
import signal
import site
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SEEN, Response, data_url, png, request

PACK_NAME = "tiny-dflash2-pack"  # conftest's built_pack folder
MAX_TOKENS = 5
CONTEXT = 32768  # the tiny pack's max_position_embeddings
REQUEST_TIMEOUT_S = 6  # no_kernel's: its other requests take a few tokens (well under 1 s), even on a busy CPU
LONG = 30000  # max_tokens no request here reaches: it ends by cancellation
# Rounds pay at good acceptance; the pack's random drafter accepts nothing, so after the
# first round a speculative request continues with plain steps.
ROUND_COSTS = {"decode_step_ms": 100.0,
               "verify_steps_by_block": {str(b): 1.0 + 0.25 * (b - 1) for b in range(2, 9)},
               "draft_steps_by_block": {str(b): 0.2 for b in range(2, 9)}, "refill_steps": 0.0}

# serve_dflash2.py whose runtime reports a failed kernel self-test (run from the pack folder).
FAILING_SELF_TEST = """
import runpy, sys
import dflash2_runtime

def install(model=None, verdicts=None):
    return dflash2_runtime.RuntimeStatus(False, "kernel-self-test-failed: forced by the test", "cpu")

dflash2_runtime.install = install
sys.argv = ["serve_dflash2.py", *sys.argv[1:]]
runpy.run_path("serve_dflash2.py", run_name="__main__")
"""


# ---------------------------------------------------------------------------------------
# Server processes


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def servers(built_pack, images, start_server, tmp_path_factory):
    costs = tmp_path_factory.mktemp("costs") / "round-costs.json"
    costs.write_text(json.dumps(ROUND_COSTS))
    commands = {
        "spec": [built_pack / "serve_dflash2.py", "--top-logprobs-k", "5", "--allow-image-dir", images,
                 "--dflash2-round-costs", costs],
        "plain": [built_pack / "serve.py"],
        "baseline": [built_pack / "serve_dflash2.py", "--no-dflash2"],
        "no_kernel": ["-c", FAILING_SELF_TEST, "--enable-thinking", "--host", "localhost",
                      "--request-timeout", str(REQUEST_TIMEOUT_S)],
    }
    started = {name: start_server(name, command, cwd=built_pack if command[0] == "-c" else None)
               for name, command in commands.items()}
    for server in started.values():
        server.wait_ready()
    return started


# ---------------------------------------------------------------------------------------
# Clients


def chat(server, messages, **fields):
    return request(server, "POST", "/v1/chat/completions", {"messages": messages, **fields})


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def openai_arguments(body):
    """enable_thinking is the pack's own field: the client sends it through extra_body."""
    body = dict(body)
    if "enable_thinking" in body:
        body["extra_body"] = {"enable_thinking": body.pop("enable_thinking")}
    return {"model": PACK_NAME, **body}


def create(server, body):
    """Non-streamed completion through the openai client: (mode header, completion)."""
    raw = client(server).chat.completions.with_raw_response.create(**openai_arguments(body))
    SEEN.append((f"{server.name} openai", str(dict(raw.headers)) + raw.http_response.text))
    return raw.headers.get("x-dflash2"), raw.parse()


def create_streamed(server, body):
    """Streamed completion through the openai client: (mode header, content, reasoning, chunks)."""
    with client(server).chat.completions.with_streaming_response.create(
            stream=True, stream_options={"include_usage": True}, **openai_arguments(body)) as response:
        chunks = list(response.parse())
        SEEN.append((f"{server.name} openai stream", str(dict(response.headers))))
        mode = response.headers.get("x-dflash2")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    return mode, content, reasoning, chunks


IMAGE_BYTES = png()
IMAGE_URL = data_url(IMAGE_BYTES)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Hi"}]
CASES = {
    "text": {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": False},
    "thinking": {"messages": [{"role": "user", "content": "Why?"}], "enable_thinking": True},
    "tool": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    "image": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]},
}


# Every case, the tools preamble's (the longest prompt, about 370 tokens of the tiny
# tokenizer: under a second of prefill on the fp32 pack, 20 s on the fp16 one it once was)
# included: plain and baseline answer them all too.
COMPARED_CASES = ["text", "thinking", "image", "tool"]


def greedy(case, max_tokens=MAX_TOKENS):
    body = json.loads(json.dumps(CASES[case]))
    return {**body, "temperature": 0, "max_tokens": max_tokens}


def answer(completion):
    message = completion.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content, getattr(message, "reasoning", None), calls


@pytest.fixture(scope="module")
def answers(servers, images):
    """Every greedy answer the equality tests compare, fetched at once: one thread per
    server (each server decodes one request at a time, on about one core).
    Returns {server: {label: create()'s or create_streamed()'s result}}."""
    image_file = images / "red.png"
    image_file.write_bytes(IMAGE_BYTES)
    from_file = greedy("image")
    from_file["messages"][0]["content"][1]["image_url"]["url"] = str(image_file)
    every_case = [(case, create, greedy(case)) for case in CASES]
    jobs = {
        "plain": [job for job in every_case if job[0] in COMPARED_CASES],
        "spec": every_case + [("stream text", create_streamed, greedy("text")),
                              ("stream thinking", create_streamed, greedy("thinking")),
                              ("image file", create, from_file)],
        "baseline": [job for job in every_case if job[0] in COMPARED_CASES],
        "no_kernel": [("text", create, greedy("text")),
                      ("default thinking", create, {"messages": MESSAGES, "temperature": 0, "max_tokens": 3})],
    }

    def run(name):
        return {label: fetch(servers[name], body) for label, fetch, body in jobs[name]}

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


# ---------------------------------------------------------------------------------------
# Routing: speculative, identical answers


def assert_speculative(mode, completion):
    assert mode == "speculative"
    timings = completion.model_extra["timings"]
    assert timings["draft_rounds"] >= 1 and timings["draft_n"] >= timings["draft_n_accepted"] >= 0
    # Every token after the prefill's came from a round or a plain step.
    assert timings["tokens_from_rounds"] >= timings["draft_rounds"]
    assert timings["tokens_from_rounds"] + timings["tokens_from_plain_steps"] == timings["predicted_n"] - 1


@pytest.mark.parametrize("case", COMPARED_CASES)
def test_speculative_answer_equals_plain(answers, case):
    mode, completion = answers["spec"][case]
    assert_speculative(mode, completion)
    assert answer(completion) == answer(answers["plain"][case][1])


def test_a_tool_request_runs_speculative_with_the_tools_in_its_prompt(answers, built_pack):
    from transformers import AutoTokenizer

    mode, completion = answers["spec"]["tool"]
    assert_speculative(mode, completion)
    tokenizer = AutoTokenizer.from_pretrained(built_pack)
    prompt = tokenizer.apply_chat_template(CASES["tool"]["messages"], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("case", COMPARED_CASES)
def test_no_dflash2_answer_equals_plain(answers, case):
    mode, completion = answers["baseline"][case]
    assert mode == "fallback; reason=no-dflash2"
    assert answer(completion) == answer(answers["plain"][case][1])
    timings = completion.model_extra["timings"]
    assert timings["draft_rounds"] is None
    assert timings["tokens_from_rounds"] is None and timings["tokens_from_plain_steps"] is None


@pytest.mark.parametrize("case", ["text", "thinking"])
def test_streamed_equals_non_streamed(answers, case):
    completion = answers["spec"][case][1]
    content, reasoning, _ = answer(completion)
    mode, streamed_content, streamed_reasoning, chunks = answers["spec"][f"stream {case}"]
    assert mode == "speculative"
    # mlx-vlm strips a non-streamed answer's reasoning and content (server/responses_state.py
    # split_thinking) and streams the deltas as they come, on serve.py too.
    streamed = [(text or "").strip() or None for text in (streamed_content, streamed_reasoning)]
    assert streamed == [content, reasoning]
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens <= MAX_TOKENS
    timings = chunks[-1].model_extra["timings"]
    assert timings["draft_rounds"] >= 1
    assert timings["tokens_from_rounds"] + timings["tokens_from_plain_steps"] == timings["predicted_n"] - 1
    # As OpenAI streams: the role in the first delta only, one created time.
    roles = [chunk.choices[0].delta.role for chunk in chunks if chunk.choices]
    assert roles[0] == "assistant" and set(roles[1:]) == {None}
    assert len({chunk.created for chunk in chunks}) == 1


def test_local_image_file_equals_data_url(answers):
    mode, completion = answers["spec"]["image file"]
    assert mode == "speculative" and answer(completion) == answer(answers["plain"]["image"][1])


def test_failed_kernel_self_test_serves_plain(servers, answers):
    mode, completion = answers["no_kernel"]["text"]
    assert mode == "fallback; reason=kernel-self-test-failed"
    assert answer(completion) == answer(answers["plain"]["text"][1])
    health = request(servers["no_kernel"], "GET", "/health")
    assert health.json()["reason"] == "kernel-self-test-failed"


def test_enable_thinking_is_the_default_a_request_can_turn_off(answers):
    # no_kernel runs with --enable-thinking: without the field the answer is reasoning.
    content, reasoning, _ = answer(answers["no_kernel"]["default thinking"][1])
    assert content is None and reasoning
    assert answer(answers["no_kernel"]["text"][1])[0]  # "enable_thinking": false


def test_arrival_and_finish_log_lines(servers):
    response = chat(servers["spec"], CASES["text"]["messages"], temperature=0, max_tokens=3)
    assert response.status == 200 and response.mode == "speculative"
    log = servers["spec"].log().splitlines()
    arrivals = [line for line in log if "POST /v1/chat/completions: speculative" in line]
    request_id = arrivals[-1].split("request ")[1].split()[0]
    finish = servers["spec"].wait_for_lines(0, f"request {request_id} finished", 1, timeout=60)
    assert len(finish) == 1
    for field in ("status=200", "tokens=3", "rounds=", "accepted=", "tokens_from_rounds=",
                  "tokens_from_plain_steps=", "peak_memory="):
        assert field in finish[0], finish[0]
    # The launch check says what it hashed: the weights now or, the run's servers sharing one
    # cache folder, an earlier server's hashes of them unchanged.
    hashed = re.search(r"weights hashed now: (\d+), unchanged since an earlier start hashed them: (\d+)",
                       servers["spec"].log())
    assert hashed and sum(map(int, hashed.groups())) == 2 and " passed" not in servers["spec"].log()


def test_both_servers_prefill_with_the_row_appending_inverse(servers):
    for name in ("spec", "plain"):
        assert "prefill inverse: row-appending, bitwise mlx-vlm's at start-up" in servers[name].log()
        assert "exact prefix cache: 8 GB, snapshots at multiples of 256 prompt tokens" in servers[name].log()
    # A table given on the command line stays as given: no acceptance carried across requests.
    assert "acceptance estimate starts from the drafter's recent rounds" not in servers["spec"].log()


# ---------------------------------------------------------------------------------------
# Routing: fallbacks and refusals


@pytest.mark.parametrize("fields, reason", [
    ({}, None),  # the pack's sampling defaults, drawn by position as plain decoding draws them
    ({"temperature": 0.7, "seed": 3}, None),
    ({"temperature": 0, "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"temperature": 0, "presence_penalty": 0.5}, "penalties"),
    ({"temperature": 0, "repetition_penalty": 1.3}, "penalties"),
    ({"temperature": 0, "logit_bias": {"7": 5}}, "logit-bias"),
    ({"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}, None),
], ids=lambda v: str(v))
def test_fallback_rows(servers, fields, reason):
    response = chat(servers["spec"], CASES["text"]["messages"], max_tokens=2, **fields)
    assert response.status == 200
    assert response.mode == (f"fallback; reason={reason}" if reason else "speculative")
    body = response.json()
    assert body["usage"]["completion_tokens"] >= 1
    # With one token left after the prefill's, a plain step is cheaper than any round.
    assert (body["timings"]["tokens_from_plain_steps"] is None) == (reason is not None)
    if reason is not None:
        assert body["timings"]["draft_rounds"] is None
    else:
        assert body["timings"]["tokens_from_plain_steps"] == body["usage"]["completion_tokens"] - 1
    if reason == "logprobs":
        logprobs = body["choices"][0]["logprobs"]["content"]
        assert logprobs and any(item["logprob"] != 0.0 for item in logprobs)
        assert all(len(item["top_logprobs"]) == 2 for item in logprobs)


def test_refusals_through_the_openai_client(servers):
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client(servers["spec"]).chat.completions.create(model=PACK_NAME, messages=MESSAGES, n=2)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(servers["spec"]).chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_models_and_health(servers):
    models = client(servers["spec"]).models.list()
    assert [m.id for m in models.data] == [PACK_NAME]
    assert client(servers["spec"]).models.retrieve(PACK_NAME).id == PACK_NAME
    for name, mode, costs in (("spec", "speculative", ROUND_COSTS),
                              ("baseline", "fallback; reason=no-dflash2", None)):
        response = request(servers[name], "GET", "/health")
        assert response.status == 200 and response.mode == mode
        assert response.json()["model"] == PACK_NAME
        assert response.json()["round_costs"] == costs
    plain = request(servers["plain"], "GET", "/v1/models")
    assert plain.json()["data"][0]["id"] == PACK_NAME and "x-dflash2" not in plain.headers
    head = request(servers["plain"], "HEAD", "/health")
    assert head.status == 200 and head.body == b""


# ---------------------------------------------------------------------------------------
# Hardening: bad requests get 4xx in OpenAI's error shape, never a 500 or a traceback


def assert_refused(response, status, reason, param=None):
    assert response.status == status, response.body
    assert response.mode == f"refused; reason={reason}"
    error = response.json()["error"]
    assert error["code"] == reason
    if param is not None:
        assert error["param"] == param
    assert b"Traceback" not in response.body
    return error


def test_what_mlx_vlm_refuses_is_refused_first_in_openais_shape(servers):
    # mlx-vlm answers this with its own 400 ({"detail": ...}, no param); the pack refuses it
    # before forwarding, in OpenAI's error shape, naming the field.
    since = len(servers["spec"].log())
    response = request(servers["spec"], "POST", "/v1/chat/completions",
                       {"messages": MESSAGES, "tool_choice": "required", "temperature": 0})
    error = assert_refused(response, 400, "invalid-request", "tool_choice")
    assert error["message"] == 'tool_choice: "required" needs at least one tool in tools'
    # Logged once, as refused: never as speculative first.
    arrivals = [line for line in servers["spec"].log()[since:].splitlines() if "POST /v1/chat" in line]
    assert len(arrivals) == 1 and arrivals[0].endswith("refused; reason=invalid-request"), arrivals


def test_stop_sequences_end_the_answer_on_every_route(servers, answers):
    reference = answer(answers["plain"]["text"][1])[0]
    stop = reference.rstrip()[-3:]
    expected = reference[:reference.find(stop)].strip()
    assert expected, reference  # the stop ends the answer early
    body = {**greedy("text"), "stop": [stop, "never generated"]}
    jobs = [("spec", create), ("spec", lambda server, body: create_streamed(server, body)),
            ("plain", create), ("baseline", create)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: job[1](servers[job[0]], body), jobs))
    (spec_mode, spec), (stream_mode, content, _, chunks), (_, plain), (baseline_mode, baseline) = results
    assert (spec_mode, stream_mode, baseline_mode) == ("speculative", "speculative", "fallback; reason=no-dflash2")
    for completion in (spec, plain, baseline):
        assert completion.choices[0].message.content == expected
        assert completion.choices[0].finish_reason == "stop"
    assert content.strip() == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("name", ["spec", "plain"])
def test_what_no_server_answers_right_is_refused_on_both(servers, name):
    """serve.py answered structured output with a 500 (mlx-vlm runs it on Metal only), and
    both servers answered a temperature of 1e-7 with token 0 at every step (float16 overflow)."""
    server = servers[name]
    for fields, reason, param in (({"response_format": {"type": "json_object"}}, "structured-output", "response_format"),
                                  ({"thinking_budget": 8}, "thinking-budget", "thinking_budget"),
                                  ({"temperature": 1e-7}, "invalid-request", "temperature")):
        response = chat(server, MESSAGES, max_tokens=2, **fields)
        assert response.status == 400, response.body
        assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (reason, param)


@pytest.mark.parametrize("name", ["spec", "plain"])
def test_values_that_crashed_the_server_are_refused(servers, name):
    server = servers[name]
    cases = [
        ({"logit_bias": {"999999999": 100}, "temperature": 0}, "logit_bias"),
        ({"logit_bias": {"512": 100}, "temperature": 0.5}, "logit_bias"),  # one past the vocabulary
        ({"top_k": 513, "temperature": 0.5}, "top_k"),
        ({"max_tokens": 2 ** 31 - 1}, "max_tokens"),
        ({"messages": [{"role": {}, "content": "Hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        (image_message(data_url(png((3000, 1)))),
         "messages[0].content[0].image_url.url"),
    ]
    for fields, param in cases:
        response = request(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, **fields})
        assert 400 <= response.status < 500 and response.json()["error"]["param"] == param, response.body
    assert server.process.poll() is None
    assert chat(server, MESSAGES, temperature=0, max_tokens=1).status == 200


@pytest.mark.parametrize("name", ["spec", "plain"])
def test_prompts_beyond_the_context_are_refused_before_generation(servers, name):
    server = servers[name]
    since = len(server.log())
    long_text = "hello world the quick brown fox " * 2100  # 33,600 tokens of the tiny pack's tokenizer
    cases = [
        ({"messages": MESSAGES, "max_tokens": CONTEXT}, "max_tokens is 32768"),  # the prompt's tokens on top
        ({"messages": [{"role": "user", "content": long_text}], "max_tokens": 1}, "the prompt is 336"),
        ({"messages": [{"role": "user", "content": long_text}], "max_tokens": 1, "stream": True}, "the prompt is 336"),
        ({"messages": [{"role": "user", "content": "a" * 2_700_000}]}, "more than 2621440 characters"),  # untokenized
    ]
    for body, detail in cases:
        response = request(server, "POST", "/v1/chat/completions", {**body, "temperature": 0})
        assert response.status == 400, response.body
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context-length-exceeded", "messages")
        assert detail in error["message"] and f"{CONTEXT}" in error["message"]
        assert "MAX_KV_SIZE" not in error["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens is 2048") as refused:  # the default max_tokens
        create_streamed(server, {"messages": [{"role": "user", "content": long_text}], "temperature": 0})
    assert (refused.value.code, refused.value.param) == ("context-length-exceeded", "messages")
    # Logged as refused, never as generating; the server answers as before.
    arrivals = [line for line in server.log()[since:].splitlines() if "POST /v1/chat/completions:" in line]
    assert len(arrivals) == len(cases) + 1, arrivals
    assert all(line.endswith(": refused; reason=context-length-exceeded") for line in arrivals), arrivals
    assert chat(server, MESSAGES, temperature=0, max_tokens=1).status == 200


@pytest.mark.parametrize("name", ["spec", "plain"])
def test_text_far_beyond_the_context_s_usual_length_is_refused_untokenized(servers, name):
    """Text averaging more than 16 characters a context token (the default --max-prompt-chars:
    524288 characters at the tiny pack's 32768 tokens, below the 2621440 no tokenization
    fits) is refused before the tokenizer sees it, naming the option; one character less is
    tokenized and then measured."""
    server = servers[name]
    limit = 16 * CONTEXT
    since = len(server.log())
    text = ("hello world the quick brown fox " * (limit // 32 + 1))[: limit - 1]  # about 2 characters a token
    too_long = [{"role": "system", "content": text}, {"role": "user", "content": "uu"}]
    with pytest.raises(openai.BadRequestError, match=f"at most {limit} \\(its --max-prompt-chars\\)") as refused:
        client(server).chat.completions.create(model=PACK_NAME, messages=too_long, temperature=0, max_tokens=1)
    assert (refused.value.code, refused.value.param) == ("prompt-too-long", "messages")
    with pytest.raises(openai.BadRequestError, match="the prompt is") as measured:  # tokenized: over the context
        client(server).chat.completions.create(model=PACK_NAME, messages=too_long[:1] + [{"role": "user", "content": "u"}],
                                               temperature=0, max_tokens=1)
    assert measured.value.code == "context-length-exceeded"
    arrivals = [line for line in server.log()[since:].splitlines() if "POST /v1/chat/completions:" in line]
    assert arrivals[0].endswith(": refused; reason=prompt-too-long"), arrivals


def test_cross_origin_use_from_loopback_pages_only(servers):
    server = servers["spec"]

    def preflight(origin):
        return request(server, "OPTIONS", "/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})

    foreign = preflight("https://attacker.example")
    assert foreign.status == 400 and "access-control-allow-origin" not in foreign.headers
    local = preflight("http://127.0.0.1:5173")
    assert local.status == 200 and local.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
    assert "access-control-allow-credentials" not in local.headers
    # What a page can send without a preflight is refused, and no answer is readable.
    simple = request(server, "POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode(),
                     headers={"content-type": "text/plain", "origin": "https://attacker.example"})
    assert_refused(simple, 415, "unsupported-media-type")
    models = request(server, "GET", "/v1/models", headers={"origin": "https://attacker.example"})
    for response in (simple, models):
        assert "access-control-allow-origin" not in response.headers


def test_a_chat_reply_varies_by_origin_once(servers):
    """mlx-vlm's own CORS layer and the pack's each named Origin in Vary: "Origin, Origin"."""
    for origin in ({}, {"origin": "http://127.0.0.1:5173"}):
        reply = request(servers["spec"], "POST", "/v1/chat/completions",
                        {"messages": MESSAGES, "temperature": 0, "max_tokens": 1}, headers=origin)
        assert reply.status == 200 and reply.headers["vary"] == "Origin", reply.headers


def test_a_stream_without_usage_ends_with_its_draft_counts(servers):
    """The finish chunk's timings carry the draft counts and token sources whether or not the
    client asked for a usage chunk (without one they were missing)."""
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 4, "stream": True}).encode()
    reply = request(servers["spec"], "POST", "/v1/chat/completions", body)
    chunks = [json.loads(line[6:]) for line in reply.body.decode().splitlines() if line.startswith("data: {")]
    timings = next(chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"])["timings"]
    assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0 and timings["draft_rounds"] >= 1, timings
    assert timings["tokens_from_rounds"] + timings["tokens_from_plain_steps"] == 3, timings


def image_message(url):
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            "temperature": 0}


def test_oversized_body_by_content_length(servers):
    connection = http.client.HTTPConnection("127.0.0.1", servers["spec"].port, timeout=60)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(64 * 1024 * 1024))
    connection.endheaders(b'{"messages": ')
    reply = connection.getresponse()
    response = Response(reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read())
    connection.close()
    assert_refused(response, 413, "body-too-large")


def test_oversized_chunked_body(servers):
    chunk = b" " * (1024 * 1024)
    body = (chunk for _ in range(33))  # 33 MiB of JSON whitespace, no Content-Length
    connection = http.client.HTTPConnection("127.0.0.1", servers["spec"].port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=body, encode_chunked=True,
                       headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    reply = connection.getresponse()
    response = Response(reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read())
    connection.close()
    assert_refused(response, 413, "body-too-large")


def test_foreign_host_header_is_refused(servers):
    # A web page reaching loopback through DNS rebinding carries its own host name.
    response = request(servers["spec"], "GET", "/v1/models", host="attacker.example:8080")
    assert_refused(response, 421, "invalid-host")


# ---------------------------------------------------------------------------------------
# Disconnects, time limits and concurrency


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": LONG}),
    ("/v1/messages", {"model": PACK_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": LONG}),
    ("/v1/responses", {"model": PACK_NAME, "input": "Hi", "temperature": 0, "max_output_tokens": LONG}),
], ids=["chat", "messages", "responses"])
def test_disconnect_stops_a_non_streamed_generation(servers, path, body):
    server = servers["spec"]
    since = len(server.log())
    body = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n" % path.encode()
                     + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        arrival = server.wait_for_log(since, f"POST {path}: speculative")
    request_id = arrival.split("request ")[1].split()[0]
    finish = server.wait_for_log(since, f"request {request_id} finished")
    assert "status=disconnected" in finish, finish
    generated = re.search(r"tokens=(\d+)", finish)  # absent when it ended before its first token
    assert generated is None or int(generated.group(1)) < LONG
    assert chat(server, MESSAGES, temperature=0, max_tokens=1).status == 200


def test_a_request_whose_client_left_while_it_waited_is_not_started(servers):
    """One sequence at a time: a request queued behind a running one whose client leaves is
    dropped at its turn, never prefilled for nobody (a queue of gone clients held up every
    request behind it)."""
    server = servers["spec"]
    since = len(server.log())

    def post(sock, body):
        body = json.dumps(body).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as running:
        post(running, {"messages": MESSAGES, "temperature": 0, "max_tokens": LONG})
        server.wait_for_log(since, "POST /v1/chat/completions: speculative")
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as waiting:
            post(waiting, {"messages": [{"role": "user", "content": "Queued"}], "temperature": 0, "max_tokens": 4})
        left = server.wait_for_log(since, "its client left before its generation started", timeout=120)
    request_id = left.split("request ")[1].split(":")[0]
    assert "cancelled (disconnected) while it waited" in server.wait_for_log(
        since, f"request {request_id} not started", timeout=120)
    finish = server.wait_for_log(since, f"request {request_id} finished")
    assert "status=disconnected" in finish and "tokens=" not in finish, finish
    after = chat(server, MESSAGES, temperature=0, max_tokens=1)
    assert after.status == 200
    assert "server" not in after.headers  # mlx-vlm's names it and its version


def test_request_timeout_cancels_with_504(servers):
    server = servers["no_kernel"]
    since = len(server.log())
    response = chat(server, MESSAGES, temperature=0, max_tokens=LONG)
    assert response.status == 504, response.body
    error = response.json()["error"]
    assert error["code"] == "request-timeout" and error["type"] == "server_error"
    assert "cancelled=timeout" in server.wait_for_log(since, " finished in ")
    assert chat(server, MESSAGES, temperature=0, max_tokens=1).status == 200


def test_disconnect_mid_stream_then_a_normal_request(servers, answers):
    server = servers["spec"]
    body = json.dumps({**greedy("text", max_tokens=24), "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    assert b"x-dflash2: speculative" in received
    # The next request is plain (a fresh batch without the drafter) and gets its own answer.
    mode, completion = create(server, {**greedy("text"), "logprobs": True})
    assert mode == "fallback; reason=logprobs"
    assert answer(completion) == answer(answers["plain"]["text"][1])
    assert completion.model_extra["timings"]["draft_rounds"] is None
    assert server.process.poll() is None


def test_concurrent_clients_get_their_own_answers(servers):
    # Different prompts and lengths, so a crossed answer cannot go unnoticed.
    bodies = [{"messages": [{"role": "user", "content": f"Item {i}"}], "temperature": 0,
               "max_tokens": 1 + i} for i in range(4)]

    def run_all(server):
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda body: create(server, body), bodies))

    with ThreadPoolExecutor(2) as pool:
        speculative, plain = pool.map(run_all, [servers["spec"], servers["plain"]])
    for body, (mode, completion), (_, expected) in zip(bodies, speculative, plain):
        assert mode == "speculative"
        assert answer(completion) == answer(expected)
        assert completion.usage.completion_tokens == body["max_tokens"] or completion.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------
# The hostile-input battery's quick subset (tools/battery.py runs the whole one)


def test_battery_quick_subset(servers, built_pack):
    from battery import run_batches

    server = servers["spec"]
    server.local_paths = {str(p) for p in (built_pack, server.home, server.cwd, sys.prefix, *site.getsitepackages())}
    tally = run_batches(server, quick=True)
    assert tally.sent >= 300 and tally.by_class.get("4xx", 0) > tally.by_class.get("2xx", 0)
    assert tally.client_5xx == [] and tally.path_leaks == []
    assert (tally.crashes, tally.answers_changed) == (0, 0)


# ---------------------------------------------------------------------------------------
# Local paths: never in a response or a log line (runs last: it scans what came before)


def test_local_paths_never_leak(servers, built_pack, float32_pack):
    server = servers["spec"]
    # Requests whose errors would echo local paths.
    chat(server, MESSAGES, model=str(built_pack))
    chat(server, MESSAGES, model=str(server.home))
    request(server, "POST", "/v1/chat/completions", image_message(str(server.home / "missing.png")))
    request(server, "POST", "/v1/chat/completions", image_message(str(server.cwd / "missing.png")))
    request(server, "POST", "/v1/chat/completions", image_message(str(built_pack / "drafter" / "config.json")))
    local_paths = {str(p) for p in (built_pack, built_pack / "drafter", server.home, server.cwd,
                                    float32_pack["target"], float32_pack["drafter"], sys.prefix, *site.getsitepackages())}
    local_paths |= {os.path.realpath(p) for p in local_paths}
    texts = list(SEEN) + [(f"{s.name} log", s.log()) for s in servers.values()]
    leaks = [(where, path) for where, text in texts for path in local_paths if path in text]
    assert not leaks, leaks[:10]
    assert PACK_NAME in server.log()  # the paths were replaced, not dropped


# ---------------------------------------------------------------------------------------
# Shutdown (runs after everything else: it stops plain and baseline)


@pytest.mark.parametrize("name", ["plain", "baseline"])
def test_sigterm_cancels_the_request_in_flight_and_exits(servers, name):
    server = servers[name]
    since = len(server.log())
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(chat, server, MESSAGES, temperature=0, max_tokens=LONG)
        server.wait_for_log(since, "POST /v1/chat/completions:")
        server.process.send_signal(signal.SIGTERM)
        returncode = server.process.wait(60)  # it used to keep generating past 60 s
        response = pending.result()
    assert returncode == -signal.SIGTERM  # uvicorn ends by re-raising the signal it handled
    assert response.status == 503 and response.json()["error"]["code"] == "shutting-down"
    assert "Traceback" not in server.log()[since:]
