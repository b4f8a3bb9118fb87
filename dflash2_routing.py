"""Which route a checked request takes: speculative, plain or refused, and why.

Speculative only where it gives plain decoding's answer. A server's decide(body, api) runs
the API's checks, then its route."""

import secrets
from dataclasses import dataclass

from dflash2_requests import PackLimits, Refusal, check_chat_request
from dflash2_messages_request import check_count_tokens_request, check_messages_request
from dflash2_responses_request import check_responses_request, response_items


REQUEST_CHECKS = {"chat": check_chat_request, "messages": check_messages_request,
                  "count_tokens": check_count_tokens_request, "responses": check_responses_request}


def decider(limits: PackLimits, route):
    """A server's decide(body, api): the API's checks, then route (plain_decision or a
    route_chat call) for requests that generate; count_tokens generates nothing."""
    def decide(body, api="chat"):
        checked = REQUEST_CHECKS[api](body, limits)
        return Decision("plain", None, checked) if api == "count_tokens" else route(checked)
    return decide


def has_images(body: dict) -> bool:
    """Whether a checked chat, Messages or Responses body holds an image (Messages: tool
    results' too; Responses: function call outputs' too)."""
    def parts(content):
        for part in content if isinstance(content, list) else ():
            yield part
            yield from parts(part.get("content"))
    items = body["messages"] if "messages" in body else response_items(body)
    return any(part["type"] in ("image_url", "image", "input_image") for item in items
               for part in (*parts(item.get("content")), *parts(item.get("output"))))


@dataclass
class Decision:
    """A chat body's route: speculative, fallback (with its reason) or plain, and the body
    to forward."""

    mode: str  # speculative | fallback | plain
    reason: str = None
    body: dict = None


def refuse_unsupported(body: dict) -> dict:
    """Refuses what neither server serves (mlx-vlm's structured output runs on Metal only,
    and it has no thinking budget); returns the body without a text response_format."""
    if "thinking_budget" in body:
        raise Refusal(400, "thinking-budget", "thinking budgets are not supported; use "
                                              "\"enable_thinking\" and max_tokens", "thinking_budget")
    if body.get("response_format", {}).get("type", "text") != "text":
        raise Refusal(400, "structured-output",
                      "structured output (response_format) is not supported", "response_format")
    body.pop("response_format", None)
    return body


def with_seed(body: dict) -> dict:
    """A request that may sample (any temperature but 0) and sent no seed gets a fresh one:
    every draw is keyed by (seed, position), so the seed, returned in the x-dflash2-seed
    header, reproduces the answer on either server and route."""
    if body.get("temperature") != 0 and body.get("seed") is None:
        body["seed"] = secrets.randbelow(1 << 32)
    return body


def acceptance_kind(body: dict) -> str:
    """The round policy's acceptance kind of a request (dflash2_policy.GREEDY, SAMPLED)."""
    return "greedy" if body.get("temperature") == 0 else "sampled"


def plain_decision(body: dict) -> Decision:
    """serve.py's route: plain, after the refusals both servers make."""
    return Decision("plain", None, with_seed(refuse_unsupported(body)))


# Penalty values that change nothing; a client sending them still gets speculation.
NEUTRAL_PENALTIES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


def route_chat(body: dict, *, server_reason=None, multimodal_plain=False, rounds_pay=lambda kind: True) -> Decision:
    """Refuses what the pack does not serve, then routes speculative or plain with a reason.

    rounds_pay(kind): asked only for a request that would go speculative, with its acceptance
    kind: whether it should (the server's round cost table as it is now has a block that
    beats plain decoding by dflash2_policy.PAY_MARGIN at that kind's acceptance, or the
    request probes a learning table); when not, it goes plain.
    The refusals hold with --no-dflash2 too, so the baseline answers the same requests.
    """
    refuse_unsupported(body)
    for name, neutral in NEUTRAL_PENALTIES.items():
        if body.get(name) == neutral:
            del body[name]
    if body.get("logit_bias") == {}:
        del body["logit_bias"]
    with_seed(body)
    reason = server_reason or fallback_reason(body, multimodal_plain)
    if reason is None and not rounds_pay(acceptance_kind(body)):
        reason = "rounds-cannot-pay"  # the round policy would serve it with plain steps only
    return Decision("fallback" if reason else "speculative", reason, body)


def fallback_reason(body: dict, multimodal_plain: bool):
    """Why speculation could not give this request plain decoding's answer, or None. Sampled
    requests (a temperature, or none: the pack's sampling defaults) draw by position on
    every route (dflash2_sampling), so sampling alone is no reason."""
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs"
    if any(name in body for name in NEUTRAL_PENALTIES):
        return "penalties"
    if "logit_bias" in body:
        return "logit-bias"
    if multimodal_plain and has_images(body):
        return "multimodal-plain"
    return None
