"""The Anthropic Messages and count_tokens requests: their models, and chat's checks on them."""

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from dflash2_requests import (CONTEXT, IMAGE_URL, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_REQUEST_PIXELS,
                              MAX_STOP_SEQUENCES, NON_BLANK_TEXT, TEMPERATURE, TOOL_NAME, TOP_K, InvalidRequest,
                              PackLimits, Refusal, ServedModel, StopSequence, Strict, check_counts, check_sampling, context_refusal,
                              has_text, integer, json_object, load_checked_image, misplaced, number,
                              request_text_chars, served_model, validated, whole)


class CacheControl(Strict):
    """Accepted and ignored: the exact prefix cache (--prefix-cache-gb) needs no markers."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


class Base64ImageSource(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(Strict):
    """Checked as chat's image URLs are: remote ones refused, local files only from --allow-image-dir."""

    type: Literal["url"]
    url: Annotated[str, IMAGE_URL]


class ImageBlock(Strict):
    type: Literal["image"]
    source: Annotated[Union[Base64ImageSource, URLImageSource], Field(discriminator="type")]
    cache_control: Optional[CacheControl] = None


ToolResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    # The block counts towards MAX_CONTENT_PARTS with its parts (check_messages_sizes).
    content: Union[str, Annotated[list[ToolResultPart], Field(max_length=MAX_CONTENT_PARTS - 1)], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(Strict):
    """An earlier turn's thinking, sent back by agents: templates drop it."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


# Each role's blocks; another role's are recognised and refused naming the block.
MisplacedAssistantBlock = misplaced(("tool_use", "thinking", "redacted_thinking"),
                                    "{kind} blocks are accepted in assistant messages only")
MisplacedUserBlock = misplaced(("image", "tool_result"), "{kind} blocks are accepted in user messages only")
UserBlock = Annotated[Union[TextBlock, ImageBlock, ToolResultBlock, MisplacedAssistantBlock],
                      Field(discriminator="type")]
AssistantBlock = Annotated[Union[TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock, MisplacedUserBlock],
                           Field(discriminator="type")]


class AnthropicUserMessage(Strict):
    role: Literal["user"]
    content: Union[str, list[UserBlock]]


class AnthropicAssistantMessage(Strict):
    role: Literal["assistant"]
    content: Union[str, list[AssistantBlock]]


AnthropicMessage = Annotated[Union[AnthropicUserMessage, AnthropicAssistantMessage], Field(discriminator="role")]


class AnthropicTool(Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None


class AnthropicToolChoiceKind(Strict):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingEnabled(Strict):
    """budget_tokens is accepted, not enforced (as chat's thinking_budget is not served):
    max_tokens bounds the thinking and the answer together."""

    type: Literal["enabled"]
    budget_tokens: integer(1, 1 << 31)


class ThinkingToggle(Strict):
    type: Literal["disabled", "adaptive"]


class AnthropicMetadata(Strict):
    user_id: Optional[str] = None


def kept_in_the_prompt(message) -> bool:
    """Whether mlx-vlm keeps a user message as a user turn: it renders one whose blocks are all
    tool results (and text of white space only) as the tool messages alone."""
    content = message.content
    return isinstance(content, str) or not any(isinstance(block, ToolResultBlock) for block in content) or any(
        isinstance(block, TextBlock) and has_text(block.text) for block in content)


def with_a_place_for_images(messages: list) -> list:
    """mlx-vlm places a user message's image blocks in the last user turn it keeps, and fails
    (Text entry 0 contains 0 image placeholders) where it keeps none."""
    users = [message for message in messages if message.role == "user"]
    if any(isinstance(message.content, list) and any(isinstance(block, ImageBlock) for block in message.content)
           for message in users) and not any(kept_in_the_prompt(message) for message in users):
        raise PydanticCustomError("no_place_for_images", "images beside tool results need a user turn with text "
                                                         "(other than white space) or without tool results")
    return messages


# with_a_place_for_images, published: no user message has image blocks, or one is kept.
IMAGES_HAVE_A_PLACE = {"anyOf": [
    {"items": {"anyOf": [{"properties": {"role": {"const": "assistant"}}}, {"properties": {"content": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"properties": {"type": {"enum": ["text", "tool_result"]}}}}]}}}]}},
    {"contains": {"required": ["role", "content"], "properties": {"role": {"const": "user"}, "content": {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"properties": {"type": {"enum": ["text", "image"]}}}},
        {"type": "array", "contains": {"required": ["type", "text"],
                                       "properties": {"type": {"const": "text"}, "text": NON_BLANK_TEXT}}}]}}}}]}


class CountTokensRequest(Strict):
    """A Messages count_tokens request (Anthropic's fields this pack honours)."""

    # tool_choice {"type": "any"} needs tools (check_messages_request)
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "type": "object", "required": ["type"], "properties": {"type": {"const": "any"}}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}})

    model: ServedModel = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES,
                                                      json_schema_extra=IMAGES_HAVE_A_PLACE),
                        AfterValidator(with_a_place_for_images)]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Annotated[Union[AnthropicToolChoiceKind, AnthropicToolChoiceTool, None],
                           Field(discriminator="type")] = None
    thinking: Annotated[Union[ThinkingEnabled, ThinkingToggle, None], Field(discriminator="type")] = None
    cache_control: Optional[CacheControl] = None


class MessagesRequest(CountTokensRequest):
    """An Anthropic Messages request, as this pack serves it."""

    max_tokens: integer(1, 1 << 31, CONTEXT)
    temperature: number(0, 2, TEMPERATURE) = None
    top_p: number(0, 1) = None
    top_k: whole(0, 1 << 31, TOP_K) = None
    stop_sequences: Optional[Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)]] = None
    stream: Optional[bool] = None
    metadata: Optional[AnthropicMetadata] = None


def message_blocks(messages):
    """(message index, block's where, raw block) of every content block, tool results' parts too."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            continue
        for number_, block in enumerate(message["content"]):
            where = f"messages[{index}].content[{number_}]"
            yield index, where, block
            if isinstance(block, dict) and isinstance(block.get("content"), list):
                for part_index, part in enumerate(block["content"]):
                    yield index, f"{where}.content[{part_index}]", part


def check_messages_sizes(body: dict):
    """check_counts for a Messages body: messages, content blocks (tool results' parts
    included) and images."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    blocks = [block for _, _, block in message_blocks(messages)]
    check_counts("messages", messages, "messages", blocks, "content blocks", "image")


def messages_rendered_chars(request: CountTokensRequest) -> int:
    """rendered_text_chars for a Messages request: the system prompt's, user text's and tool results'."""
    def text(content):
        if isinstance(content, str):
            return len(content)
        return sum(len(block.text) if isinstance(block, TextBlock) else
                   text(block.content) if isinstance(block, ToolResultBlock) else 0 for block in content or ())
    return text(request.system) + sum(text(message.content) for message in request.messages
                                      if message.role == "user")


def check_messages_request(body, limits: PackLimits, request_model=MessagesRequest) -> dict:
    """Validates an Anthropic Messages (or, with CountTokensRequest, count_tokens) body with
    chat's rules and limits; returns it normalised for mlx-vlm's Messages endpoint: null
    fields dropped, model filled in, thinking turned into enable_thinking, image
    references checked."""
    body = json_object(body)
    check_messages_sizes(body)
    request = validated(body, request_model)
    served_model(body, limits)
    if body.get("max_tokens", 0) > limits.context_length:
        raise InvalidRequest("max_tokens", f"must be at most {limits.context_length}, the model's context length")
    check_sampling(request, limits)
    names = [tool.name for tool in request.tools or []]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidRequest(f"tools[{index}].name", f"{name!r} names two tools")
    if isinstance(request.tool_choice, AnthropicToolChoiceTool) and request.tool_choice.name not in names:
        raise InvalidRequest("tool_choice.name", f"{request.tool_choice.name!r} is not one of the request's tools")
    if isinstance(request.tool_choice, AnthropicToolChoiceKind) and request.tool_choice.type == "any" and not names:
        raise InvalidRequest("tool_choice", '{"type": "any"} needs at least one tool in tools')
    if limits.max_prompt_chars is not None and messages_rendered_chars(request) > limits.max_prompt_chars:
        raise context_refusal(f"the system prompt, user messages and tool results hold more than "
                              f"{limits.max_prompt_chars} characters, more than the model's context of "
                              f"{limits.context_length} tokens can take")
    chars = request_text_chars(body, ("system", "messages", "tools"), ("role", "type", "source", "cache_control"))
    if limits.prompt_chars_limit is not None and chars > limits.prompt_chars_limit:
        raise Refusal(400, "prompt-too-long", f"messages: the system prompt, messages and tools hold {chars} "
                      f"characters of text; this server takes at most {limits.prompt_chars_limit} "
                      "(its --max-prompt-chars)", "messages")
    pixels = 0
    for _, where, block in message_blocks(body["messages"]):
        if block["type"] == "image":
            source = block["source"]
            url = source["url"] if source["type"] == "url" else \
                f"data:{source['media_type']};base64,{source['data']}"
            reference, size = load_checked_image(url, f"{where}.source", limits.image_dir, MAX_REQUEST_PIXELS - pixels)
            pixels += size
            if source["type"] == "url":
                source["url"] = reference  # the checked file, resolved
    thinking = body.pop("thinking", None)
    if thinking is not None:
        body["enable_thinking"] = thinking["type"] != "disabled"
    return body


def check_count_tokens_request(body, limits: PackLimits) -> dict:
    return check_messages_request(body, limits, CountTokensRequest)
