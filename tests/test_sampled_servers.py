"""Seeded sampled requests give the same tokens on all three servers, over HTTP.

serve.py, serve_dflash2.py --no-dflash2 and serve_dflash2.py (a fixed block of 4, so every
request runs rounds) serve the trained tiny pair under the GPU-like rounding of
tests/gpu_rounding.py. Through the openai client, streamed and not, with tools and an image,
at temperatures 0.6 to 1.0 with top_p, top_k and min_p: the same answer everywhere, the
speculative server's with accepted drafts. An unseeded request's returned seed reproduces
its answer on another server.
"""

import itertools

import pytest

from acceptance import PAIR
from conftest import assert_verify_self_check_sees_rounding, data_url, png
from test_prefix_cache_server import WITH_GPU_ROUNDING
from test_server import TOOLS, client

MAX_TOKENS = 10
SETTINGS = [dict(temperature=0.6, top_p=0.95, extra_body={"top_k": 20}),
            dict(temperature=1.0),
            dict(temperature=0.8, extra_body={"min_p": 0.05}),
            dict(temperature=0.7, top_p=0.9, extra_body={"top_k": 40, "min_p": 0.02})]
IMAGE = [{"type": "image_url", "image_url": {"url": data_url(png(color=(20, 160, 90)))}},
         {"type": "text", "text": "What is this?"}]
PROMPTS = {
    "code": ([{"role": "user", "content": "Write a function that sorts a list."}], {}),
    "prose": ([{"role": "user", "content": "Tell me about the csv module."}], {}),
    "tools": ([{"role": "user", "content": "What is the weather in Paris?"}], {"tools": TOOLS}),
    "image": ([{"role": "user", "content": IMAGE}], {}),
    "history": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "Write a class."}], {}),
}
# 20 requests: every prompt at every setting, a seed each, every other one streamed.
CASES = [(name, index, seed, seed % 2 == 1) for seed, (name, index) in
         enumerate(itertools.product(PROMPTS, range(len(SETTINGS))))]
SERVERS = {"plain": ["serve.py"], "baseline": ["serve_dflash2.py", "--no-dflash2"],
           "spec": ["serve_dflash2.py", "--dflash2-block-size", "4"]}


@pytest.fixture(scope="module")
def servers(start_server):
    started = {name: start_server(f"sampled-{name}", ["-c", WITH_GPU_ROUNDING, str(PAIR.parents[1] / command[0]),
                                                      "--pack", str(PAIR), *command[1:]])
               for name, command in SERVERS.items()}
    for server in started.values():
        server.wait_ready()
    assert_verify_self_check_sees_rounding(started["spec"])  # the pair runs fp32 here
    return started


def ask(server, name, index, seed, stream):
    """(x-dflash2, x-dflash2-seed, text, tool calls, timings) of one request."""
    messages, extra = PROMPTS[name]
    settings = dict(SETTINGS[index])
    body = dict(model=client(server).models.list().data[0].id, messages=messages,
                max_tokens=MAX_TOKENS, extra_body={"enable_thinking": False, **settings.pop("extra_body", {})},
                **settings, **extra)
    if seed is not None:
        body["seed"] = seed
    if stream:
        with client(server).chat.completions.with_streaming_response.create(
                stream=True, stream_options={"include_usage": True}, **body) as response:
            chunks = list(response.parse())
            headers = response.headers
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        text = "".join(d.content or "" for d in deltas)
        calls = [(c.function.name, c.function.arguments) for d in deltas for c in d.tool_calls or []]
        timings = (chunks[-1].model_extra or {}).get("timings") or {}
    else:
        raw = client(server).chat.completions.with_raw_response.create(**body)
        headers, completion = raw.headers, raw.parse()
        message = completion.choices[0].message
        text = message.content or ""
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        timings = raw.http_response.json().get("timings") or {}
    return headers.get("x-dflash2"), headers.get("x-dflash2-seed"), text, calls, timings


@pytest.fixture(scope="module")
def answers(servers):
    return {name: [ask(server, *case) for case in CASES] for name, server in servers.items()}


def test_twenty_seeded_sampled_requests_answer_alike_on_all_three_servers(answers):
    assert len(CASES) >= 20
    for index, case in enumerate(CASES):
        spec, baseline, plain = (answers[name][index] for name in ("spec", "baseline", "plain"))
        assert spec[2:4] == baseline[2:4] == plain[2:4], case
        assert spec[1] == baseline[1] == plain[1] == str(case[2])
        assert spec[0] == "speculative" and baseline[0] == "fallback; reason=no-dflash2", case
    texts = {answer[2] + repr(answer[3]) for answer in answers["plain"]}
    assert len(texts) >= len(CASES) // 2  # prompts, settings and seeds change the answer


def test_the_speculative_server_accepted_drafts_for_sampled_requests(answers):
    accepted = [answer[4].get("draft_n_accepted") for answer in answers["spec"]]
    assert all(count is not None for count in accepted) and sum(accepted) > 0, accepted


def test_an_unseeded_request_s_seed_reproduces_it_on_another_server(servers):
    mode, seed, text, calls, _ = ask(servers["spec"], "code", 1, None, False)
    assert mode == "speculative" and seed is not None
    # Not streamed either: mlx-vlm takes a non-streamed answer's text up to a first </think> as
    # reasoning (server/responses_state.py split_thinking) and streams the text as it comes.
    assert ask(servers["plain"], "code", 1, int(seed), False)[2:4] == (text, calls)
    assert ask(servers["spec"], "code", 1, None, False)[1] != seed  # a fresh seed each time
