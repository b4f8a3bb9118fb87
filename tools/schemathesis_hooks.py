"""Schemathesis hooks (SCHEMATHESIS_HOOKS) for tools/battery.py and
tests/test_openapi_schemathesis.py, which run schemathesis against the pack's servers.

Short answers: a generated request asks for at most MAX_TOKENS tokens (max_tokens,
max_completion_tokens and max_output_tokens within the context come down; chat and Responses
requests without one get one), so one that generates finishes in seconds on a CPU. Values
past the context and non-integers stay for the server to refuse.

What JSON Schema cannot say, made true in the bodies the schema calls valid (positive
cases) as the server checks it: an image is one that decodes (a 2x2 PNG in place of each
generated one), tool names are unique (later tools of a name dropped) and a named
tool_choice names one of them (the first; none left: tool_choice dropped). Everything else
is sent as generated, so the schema answers for it.

SCHEMATHESIS_MAX_PROMPT_BYTES (unset: no limit), for a model on a slow CPU: valid requests to
the endpoints that generate whose JSON body is longer are not sent (a long prompt's prefill
takes minutes there); invalid ones all are.
"""

import copy
import json
import os

import schemathesis

MAX_TOKENS = 4
CONTEXT = 32768  # the tiny packs' (fixtures/tiny-pair, tests' make_synthetic_pack)
TOKEN_LIMITS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/messages": ("max_tokens",),
                "/v1/responses": ("max_output_tokens",)}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGM8oaHBwMDAxMDAwMDAAAAN6gEcJJUQNAAAAABJRU5ErkJggg=="
PNG_URL = f"data:image/png;base64,{PNG}"


def is_whole(value) -> bool:
    return type(value) in (int, float) and float(value).is_integer()


def short(path: str, body):
    """body asking for at most MAX_TOKENS tokens, where it asks for a number within the context."""
    names = TOKEN_LIMITS.get(path, ())
    if not isinstance(body, dict) or not names:
        return body
    for name in names:
        if is_whole(body.get(name)) and MAX_TOKENS < body[name] <= CONTEXT:
            body[name] = MAX_TOKENS
    if path != "/v1/messages" and all(body.get(name) is None for name in names):  # Messages requires max_tokens
        body[names[0]] = MAX_TOKENS  # null means unset: the server's default, hundreds of tokens
    return body


def parts(items, keys=("content", "output")):
    """The dict parts in items' content (and output) lists, tool results' parts too."""
    for item in items if isinstance(items, list) else ():
        for key in keys:
            for part in item.get(key) if isinstance(item, dict) and isinstance(item.get(key), list) else ():
                if isinstance(part, dict):
                    yield part
                    yield from parts([part], ("content",))


def with_real_images(body: dict):
    for part in parts(body.get("messages", body.get("input"))):
        kind = part.get("type")
        if kind == "image_url" and isinstance(part.get("image_url"), dict):
            part["image_url"]["url"] = PNG_URL
        elif kind == "input_image":
            part["image_url"] = PNG_URL
        elif kind == "image":
            part["source"] = {"type": "base64", "media_type": "image/png", "data": PNG}


def with_named_tools(body: dict):
    def name_of(tool):
        holder = tool.get("function", tool) if isinstance(tool, dict) else {}
        return holder.get("name") if isinstance(holder, dict) else None

    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    names = [name_of(tool) for tool in tools]
    if tools:
        body["tools"] = [tool for index, tool in enumerate(tools) if names[index] not in names[:index]]
    choice = body.get("tool_choice")
    holder = choice.get("function", choice) if isinstance(choice, dict) else None
    if isinstance(holder, dict) and "name" in holder and holder["name"] not in names:
        if names:
            holder["name"] = names[0]
        else:
            del body["tool_choice"]


def made_valid(body):
    """A positive case's body with its images real and its tool names unique and named."""
    if isinstance(body, dict):
        with_real_images(body)
        with_named_tools(body)
    return body


@schemathesis.hook
def filter_case(context, case):
    limit = os.environ.get("SCHEMATHESIS_MAX_PROMPT_BYTES")
    meta = case.meta
    if not limit or meta is None or not meta.generation.mode.is_positive or case.operation.path not in TOKEN_LIMITS:
        return True
    return len(json.dumps(case.body)) <= int(limit)


@schemathesis.hook
def map_case(context, case):
    if not isinstance(case.body, dict):
        return case
    # A copy: hypothesis may hold on to the generated body (changing it in place broke later draws).
    case.body = short(case.operation.path, copy.deepcopy(case.body))
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive:
        case.body = made_valid(case.body)
    return case
