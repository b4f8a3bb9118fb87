"""The OpenAI Responses request: its models, and chat's checks on the Responses shape."""

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from dflash2_requests import (CONTEXT, IMAGE_URL, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_REQUEST_PIXELS,
                              NON_BLANK_TEXT, TEMPERATURE, TEXT_FORMAT_ONLY, TOOL_NAME, TOP_K, InvalidRequest,
                              PackLimits, Refusal, ServedModel, Strict, check_counts, check_sampling, context_refusal, has_text,
                              json_object, load_checked_image, misplaced, nothing_to_answer, number,
                              request_text_chars, served_model, validated, whole)


class ResponseInputText(Strict):
    type: Literal["input_text"]
    text: str


class ResponseInputImage(Strict):
    """Checked as chat's image URLs are: a base64 data URL, or a file from --allow-image-dir."""

    type: Literal["input_image"]
    image_url: Annotated[str, IMAGE_URL]
    detail: Optional[Literal["auto", "low", "high"]] = None


class ResponseOutputText(Strict):
    """An earlier answer's text, sent back in an assistant message item."""

    type: Literal["output_text"]
    text: str
    annotations: Optional[list[dict[str, Any]]] = None
    logprobs: Optional[list[dict[str, Any]]] = None


ResponseUserPart = Annotated[Union[ResponseInputText, ResponseInputImage, ResponseOutputText],
                             Field(discriminator="type")]
MisplacedImage = misplaced("input_image", "images are accepted in user messages and function call outputs only")
ResponseTextPart = Annotated[Union[ResponseInputText, ResponseOutputText, MisplacedImage], Field(discriminator="type")]
ResponseToolOutputPart = Annotated[Union[ResponseInputText, ResponseInputImage], Field(discriminator="type")]


class ResponseMessageFields(Strict):
    """A message item's fields; type may be left out (the SDK's EasyInputMessage)."""

    type: Optional[Literal["message"]] = None
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ResponseMessageItem(ResponseMessageFields):
    """An assistant, system or developer message: text only. An earlier answer's message item
    comes back as the SDK keeps it, with the fields mlx-vlm writes on it (ChatMessage's):
    its reasoning is that turn's thinking; its tool calls come as function_call items, so
    those fields are null."""

    role: Literal["assistant", "system", "developer"]
    content: Union[str, Annotated[list[ResponseTextPart], Field(max_length=MAX_CONTENT_PARTS)]]
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: None = None
    tool_call_id: None = None
    name: None = None


class ResponseUserMessageItem(ResponseMessageFields):
    """A user message: text and images."""

    role: Literal["user"]
    content: Union[str, Annotated[list[ResponseUserPart], Field(max_length=MAX_CONTENT_PARTS)]]


class ResponseFunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    arguments: str
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ResponseFunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, Annotated[list[ResponseToolOutputPart], Field(max_length=MAX_CONTENT_PARTS)]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ResponseReasoningSummary(Strict):
    type: Literal["summary_text"]
    text: str


class ResponseReasoningItem(Strict):
    """An earlier answer's reasoning, sent back by agents: mlx-vlm leaves it out of the prompt."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[ResponseReasoningSummary]
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


def response_item_kind(item) -> str:
    """A Responses input item's type; message items may leave it out (or send null)."""
    if isinstance(item, dict):
        return item.get("type") or "message"
    return getattr(item, "type", None) or "message"


def response_item_tag(item) -> str:
    """response_item_kind, with user messages (which may hold images) apart."""
    kind = response_item_kind(item)
    role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
    return "user_message" if kind == "message" and role == "user" else kind


ResponseInputItem = Annotated[Union[
    Annotated[ResponseUserMessageItem, Tag("user_message")],
    Annotated[ResponseMessageItem, Tag("message")],
    Annotated[ResponseFunctionCallItem, Tag("function_call")],
    Annotated[ResponseFunctionCallOutputItem, Tag("function_call_output")],
    Annotated[ResponseReasoningItem, Tag("reasoning")],
], Discriminator(response_item_tag)]


class ResponseFunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponseToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str


class ResponseReasoning(Strict):
    """mlx-vlm turns effort into thinking on or off ("none": off; any other: on)."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None


class ResponseTextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Annotated[str, TEXT_FORMAT_ONLY]


class ResponseTextConfig(Strict):
    format: Optional[ResponseTextFormat] = None


def item_has_input(item) -> bool:
    """Whether mlx-vlm finds input in a Responses item (_response_items_to_chat, then
    _message_has_effective_input): a function call, text other than white space or an image
    in a message or a function call output, or an assistant message's reasoning."""
    if isinstance(item, ResponseFunctionCallItem):
        return True
    if isinstance(item, ResponseMessageItem) and item.role == "assistant" and has_text(
            item.reasoning if item.reasoning_content is None else item.reasoning_content):
        return True
    content = item.content if isinstance(item, ResponseMessageFields) else \
        item.output if isinstance(item, ResponseFunctionCallOutputItem) else ""
    if isinstance(content, str):
        return has_text(content)
    return any(isinstance(part, ResponseInputImage) or has_text(part.text) for part in content)


# item_has_input, published.
PARTS_WITH_INPUT = {"anyOf": [NON_BLANK_TEXT, {"type": "array", "contains": {"anyOf": [
    {"required": ["type", "text"], "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": NON_BLANK_TEXT}},
    {"required": ["type"], "properties": {"type": {"const": "input_image"}}}]}}]}
ITEM_WITH_INPUT = {"anyOf": [
    {"required": ["type"], "properties": {"type": {"const": "function_call"}}},
    {"required": ["content"], "properties": {"content": PARTS_WITH_INPUT}},  # message items
    {"required": ["role", "reasoning_content"],
     "properties": {"role": {"const": "assistant"}, "reasoning_content": NON_BLANK_TEXT}},
    {"required": ["role", "reasoning"], "properties": {"role": {"const": "assistant"}, "reasoning": NON_BLANK_TEXT,
                                                       "reasoning_content": {"type": "null"}}},
    {"required": ["type", "output"], "properties": {"type": {"const": "function_call_output"}, "output": PARTS_WITH_INPUT}}]}


class ResponsesRequest(Strict):
    """An OpenAI Responses request, as this pack serves it: stateless (no previous_response_id,
    nothing stored), function tools only."""

    # mlx-vlm refuses a request with no input: instructions or an input item must have some.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["instructions"], "properties": {"instructions": NON_BLANK_TEXT}},
        {"properties": {"input": {"anyOf": [NON_BLANK_TEXT, {"type": "array", "contains": ITEM_WITH_INPUT}]}}}]})

    model: ServedModel = None
    instructions: Optional[str] = None  # before input, which item_has_input checks with it
    input: Union[str, Annotated[list[ResponseInputItem], Field(min_length=1, max_length=MAX_MESSAGES)]]
    max_output_tokens: whole(1, 1 << 31, CONTEXT) = None
    temperature: number(0, 2, TEMPERATURE) = None
    top_p: number(0, 1) = None
    top_k: whole(0, 1 << 31, TOP_K) = None
    stream: Optional[bool] = None
    tools: Optional[list[ResponseFunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponseToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ResponseReasoning] = None
    enable_thinking: Optional[bool] = None
    text: Optional[ResponseTextConfig] = None
    metadata: Optional[Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]] = None
    store: Optional[bool] = None
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def with_input(cls, value, info: ValidationInfo):
        items = [value] if isinstance(value, str) else value
        if not has_text(info.data.get("instructions")) and not any(
                has_text(item) if isinstance(item, str) else item_has_input(item) for item in items):
            raise nothing_to_answer("the instructions and input")
        return value


def response_items(body: dict) -> list:
    """A Responses body's input items (a string input is one user message)."""
    value = body.get("input")
    return value if isinstance(value, list) else []


def response_parts(items):
    """(item index, part's where, raw part) of every message part and function call output part."""
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for key in ("content", "output"):
            if isinstance(item.get(key), list):
                for number_, part in enumerate(item[key]):
                    yield index, f"input[{index}].{key}[{number_}]", part


def check_responses_sizes(body: dict):
    """check_counts for a Responses body: input items, content parts and images."""
    items = response_items(body)
    check_counts("input", items, "items", [part for _, _, part in response_parts(items)], "content parts",
                 "input_image")


def responses_rendered_chars(request: ResponsesRequest) -> int:
    """rendered_text_chars for a Responses request: the instructions', system, developer and
    user messages' and function call outputs'."""
    def text(content):
        if isinstance(content, str):
            return len(content)
        return sum(len(part.text) for part in content if isinstance(part, (ResponseInputText, ResponseOutputText)))
    if isinstance(request.input, str):
        return len(request.instructions or "") + len(request.input)
    return len(request.instructions or "") + sum(
        text(item.content) if isinstance(item, ResponseMessageFields) and item.role != "assistant" else
        text(item.output) if isinstance(item, ResponseFunctionCallOutputItem) else 0 for item in request.input)


STATEFUL_RESPONSES = ("previous_response_id", "conversation")


def check_responses_request(body, limits: PackLimits) -> dict:
    """Validates an OpenAI Responses body with chat's rules and limits; returns it normalised
    for mlx-vlm's Responses endpoint: null fields dropped, model filled in, store off (this
    server serves no stored responses), a text format dropped, image references checked.

    previous_response_id is refused: mlx-vlm would prepend an earlier conversation from its
    in-process store (any client's, by id), which none of these checks would see."""
    body = json_object(body)
    for name in STATEFUL_RESPONSES:
        if name in body:
            raise Refusal(400, "stateful-response", f"{name}: this server keeps no responses or conversations; "
                                                    "send the whole conversation in input", name)
    check_responses_sizes(body)
    request = validated(body, ResponsesRequest)
    served_model(body, limits)
    if body.get("max_output_tokens", 0) > limits.context_length:
        raise InvalidRequest("max_output_tokens", f"must be at most {limits.context_length}, "
                                                  "the model's context length")
    check_sampling(request, limits)
    names = [tool.name for tool in request.tools or []]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidRequest(f"tools[{index}].name", f"{name!r} names two tools")
    if isinstance(request.tool_choice, ResponseToolChoiceFunction) and request.tool_choice.name not in names:
        raise InvalidRequest("tool_choice.name", f"{request.tool_choice.name!r} is not one of the request's tools")
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        raise Refusal(400, "structured-output", "structured output (text.format) is not supported", "text.format")
    body.pop("text", None)
    if limits.max_prompt_chars is not None and responses_rendered_chars(request) > limits.max_prompt_chars:
        raise context_refusal(f"the instructions, input messages and function call outputs hold more than "
                              f"{limits.max_prompt_chars} characters, more than the model's context of "
                              f"{limits.context_length} tokens can take", "responses")
    chars = request_text_chars(body, ("instructions", "input", "tools"), ("role", "type", "image_url"))
    if limits.prompt_chars_limit is not None and chars > limits.prompt_chars_limit:
        raise Refusal(400, "prompt-too-long", f"input: the instructions, input and tools hold {chars} "
                      f"characters of text; this server takes at most {limits.prompt_chars_limit} "
                      "(its --max-prompt-chars)", "input")
    pixels = 0
    for _, where, part in response_parts(response_items(body)):
        if part["type"] != "input_image":
            continue
        reference, size = load_checked_image(part["image_url"], f"{where}.image_url", limits.image_dir,
                                             MAX_REQUEST_PIXELS - pixels)
        pixels += size
        part["image_url"] = reference  # the checked file, resolved
    body["store"] = False  # nothing in mlx-vlm's response store: no endpoint here reads it
    return body
