"""The exact prefix cache over HTTP, on the tiny pack and the GPU-like CPU backend.

Three real servers (uvicorn on 127.0.0.1), each with a prefill step of STEP tokens and
tests/gpu_rounding.py's swaps installed before it starts:
  cached_spec   serve_dflash2.py, prefix cache on
  cached_plain  serve.py, prefix cache on
  cold          serve_dflash2.py --no-prefix-cache with a round cost table under which no
                block pays: the reference answers, greedy ones routed plain
  window_spec   serve_dflash2.py --dflash2-sliding-window, prefix cache on (greedy only)
Conversations run turn by turn through the openai client: text and a tool call answered
by the tool's result greedy on the speculative route, thinking and an image with
top_logprobs on the plain route (test_prefix_cache.py runs every conversation on both
routes in process, bit for bit); cached answers and log-probabilities must equal the cold
server's exactly, and later turns must report the reused prefix in usage and in the log.
"""

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import assert_verify_self_check_sees_rounding, png
from test_server import ROUND_COSTS, client

STEP = 8
MAX_TOKENS = 4
TOP_LOGPROBS = 3
TESTS = str(__import__("pathlib").Path(__file__).resolve().parent)
# Runs a server script (argv[1]) from the pack folder with the GPU-like rounding installed.
WITH_GPU_ROUNDING = f"""
import runpy, sys
sys.path.insert(0, {TESTS!r})
import pytest
from gpu_rounding import swap_row_variant_ops
swap_row_variant_ops(pytest.MonkeyPatch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
SYSTEM = {"role": "system", "content": "Answer in one word."}
# Past the tiny drafter's sliding window (256 positions) in tokens (324 of the tiny
# tokenizer's; prefilled cold four times here): with the window, the prefill keeps only the
# taps the drafter reads.
LONG = " ".join(["alpha beta gamma delta"] * 18)


def image_url(color):
    return "data:image/png;base64," + base64.b64encode(png(color=color)).decode()


IMAGE_URL = image_url((30, 120, 200))
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
CONVERSATIONS = {  # name -> (enable_thinking, the messages of each turn)
    "text": (False, [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
         {"role": "user", "content": "Bye"}],
    ]),
    "thinking": (True, [
        [{"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."},
         {"role": "user", "content": "Ok"}],
    ]),
    "tool-call": (False, [
        [{"role": "user", "content": "Weather?"}],
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    ]),
    "long": (False, [
        [{"role": "user", "content": LONG}],
        [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Fine."},
         {"role": "user", "content": "Again?"}],
    ]),
    # mlx-vlm's chat endpoint attaches a request's images to its last user message, so the
    # history before that message (here the system prompt) is what a later turn reuses.
    "image": (False, [
        [SYSTEM, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                              {"type": "text", "text": "What?"}]}],
        [SYSTEM, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                              {"type": "text", "text": "What?"}]},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"}],
    ]),
}
# Every round costs at least its block in decode steps: not even full acceptance beats plain.
NEVER_PAYS = {**ROUND_COSTS, "verify_steps_by_block": {str(b): float(b) for b in range(2, 9)}}
ROUTES = {"speculative": {}, "plain": {"logprobs": True, "top_logprobs": TOP_LOGPROBS}}
ON_ROUTE = {"speculative": ("text", "tool-call", "long"), "plain": ("thinking", "image")}
SERVED = {"cached_spec": ROUTES, "cached_plain": {"plain": ROUTES["plain"]}, "cold": ROUTES,
          "window_spec": {"speculative": ROUTES["speculative"]}}


@pytest.fixture(scope="module")
def servers(built_pack, start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix_servers")
    (folder / "pays.json").write_text(json.dumps(ROUND_COSTS))
    (folder / "never-pays.json").write_text(json.dumps(NEVER_PAYS))
    common = ["serve_dflash2.py", "--prefill-step-size", str(STEP), "--top-logprobs-k", str(TOP_LOGPROBS)]
    commands = {"cached_spec": [*common, "--dflash2-round-costs", str(folder / "pays.json")],
                "cached_plain": ["serve.py", *common[1:]],
                "cold": [*common, "--dflash2-round-costs", str(folder / "never-pays.json"), "--no-prefix-cache"],
                "window_spec": [*common, "--dflash2-round-costs", str(folder / "pays.json"), "--dflash2-sliding-window"]}
    started = {name: start_server(name, ["-c", WITH_GPU_ROUNDING, *command], cwd=built_pack)
               for name, command in commands.items()}
    for server in started.values():
        server.wait_ready()
    for name in ("cached_spec", "window_spec"):  # built_pack is fp32
        assert_verify_self_check_sees_rounding(started[name])
    return started


def turn(server, messages, thinking, route_fields):
    """One greedy request: (mode header, answer, log-probabilities, prompt tokens, cached tokens)."""
    raw = client(server).chat.completions.with_raw_response.create(
        model="tiny-dflash2-pack", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"enable_thinking": thinking}, **route_fields)
    completion = raw.parse()
    choice = completion.choices[0]
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    logprobs = choice.logprobs and [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                    for t in choice.logprobs.content]
    usage = completion.usage
    return (raw.headers.get("x-dflash2"), (message.content, getattr(message, "reasoning", None), calls), logprobs,
            usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def results(servers):
    """{server: {(conversation, route, turn): turn()}}: each server runs its conversations
    in order, the servers side by side."""
    def run(name):
        answers = {}
        for route, fields in SERVED[name].items():
            for conversation in ON_ROUTE[route]:
                thinking, turns = CONVERSATIONS[conversation]
                for index, messages in enumerate(turns):
                    answers[(conversation, route, index)] = turn(servers[name], messages, thinking, fields)
        return answers

    with ThreadPoolExecutor(len(SERVED)) as pool:
        return dict(zip(SERVED, pool.map(run, SERVED)))


@pytest.mark.parametrize("name", ["cached_spec", "cached_plain", "window_spec"])
def test_cached_answers_equal_cold_answers(results, name):
    for key, (mode, answer, logprobs, _, _) in results[name].items():
        cold_mode, cold_answer, cold_logprobs, _, cold_cached = results["cold"][key]
        assert cold_cached == 0, key
        assert (answer, logprobs) == (cold_answer, cold_logprobs), key
        if name != "cached_plain":
            assert mode == ("speculative" if key[1] == "speculative" else "fallback; reason=logprobs")


def test_greedy_requests_go_plain_where_no_block_pays_and_say_why(results, servers):
    modes = {route: {mode for (_, r, _), (mode, *_) in results["cold"].items() if r == route} for route in ROUTES}
    assert modes == {"speculative": {"fallback; reason=rounds-cannot-pay"}, "plain": {"fallback; reason=logprobs"}}
    greedy = sum(key[1] == "speculative" for key in results["cold"])
    finished = servers["cold"].wait_for_lines(0, "status=200 reason=rounds-cannot-pay", greedy, timeout=60)
    arrived = [line for line in servers["cold"].log().splitlines()
               if "/v1/chat/completions: fallback; reason=rounds-cannot-pay" in line]
    assert len(arrived) == len(finished) == greedy
    assert all("status=200" in line and "rounds=" not in line for line in finished), finished
    assert "greedy requests are routed plain" in servers["cold"].log()


@pytest.mark.parametrize("name", ["cached_spec", "cached_plain", "window_spec"])
def test_later_turns_reuse_the_history_and_say_so(results, servers, name):
    log = servers[name].log()
    for (conversation, route, index), (_, _, _, prompt_tokens, cached) in results[name].items():
        if index:
            assert 0 < cached < prompt_tokens and cached % STEP == 0, (conversation, route, cached)
            assert f"prompt_tokens={prompt_tokens} cached_tokens={cached}" in log


def test_the_drafter_s_window_restores_a_long_history_where_the_whole_context_does(results):
    """The sliding-window server keeps only the taps its drafter reads and those before the
    last aligned boundaries: the long conversation's next turn reuses as much history as on
    the whole-context server, and its prompt is past the window."""
    window, whole = (results[name][("long", "speculative", 1)] for name in ("window_spec", "cached_spec"))
    assert window[3] == whole[3] > 256 and window[4] == whole[4] > 0


def test_a_repeated_prompt_restores_all_but_its_last_token(results, servers):
    thinking, turns = CONVERSATIONS["text"]
    again = turn(servers["cached_spec"], turns[1], thinking, ROUTES["speculative"])
    first = results["cached_spec"][("text", "speculative", 1)]
    assert again[1] == first[1] and again[4] == again[3] - 1


def test_images_are_keyed_by_their_content(results, servers):
    """The image turn again restores all but its last token; the same tokens with another
    image restore only what comes before the image."""
    thinking, turns = CONVERSATIONS["image"]
    server = servers["cached_plain"]
    same = turn(server, turns[0], thinking, ROUTES["plain"])
    other_image = json.loads(json.dumps(turns[0]).replace(IMAGE_URL, image_url((200, 40, 40))))
    other = turn(server, other_image, thinking, ROUTES["plain"])
    assert same[4] == same[3] - 1 and same[1:3] == results["cached_plain"][("image", "plain", 0)][1:3]
    assert other[3] == same[3] and 0 < other[4] < same[4] - 1 and other[4] % STEP == 0
