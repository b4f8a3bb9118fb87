"""Schemathesis hooks for tools/battery.py (SCHEMATHESIS_HOOKS): a chat request that
schemathesis generates asks for at most MAX_TOKENS tokens, so a valid one finishes in
seconds on a CPU. Values above the context length stay: the server refuses them."""

import schemathesis

MAX_TOKENS = 4
CONTEXT = 32768  # the tiny pack's


@schemathesis.hook
def map_body(context, body):
    if isinstance(body, dict) and "messages" in body:
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if type(value) is int and MAX_TOKENS < value <= CONTEXT:
                body[name] = MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    return body
