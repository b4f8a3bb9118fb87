"""The OpenAPI description of the endpoints the gateway serves (its /openapi.json).

Request bodies are described by the request models' own JSON schemas, with the bounds
that the pack and the server's options set (PackLimit) filled in."""

from dflash2_requests import PACK_LIMITS, ChatRequest, PackLimits
from dflash2_messages_request import CountTokensRequest, MessagesRequest
from dflash2_responses_request import ResponsesRequest


def error_responses(*statuses, schema="Error"):
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    return {str(status): {"description": "error", **error} for status in statuses}


def request_schemas(*models) -> dict:
    """The models' JSON schemas and their shared definitions, as OpenAPI components."""
    components = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            assert components.setdefault(name, definition) == definition, name
        components[model.__name__] = schema
    return components


def with_pack_limits(schema, limits: PackLimits):
    """schema with each PackLimit marker ("x-pack-limit") replaced by the bound it names."""
    if isinstance(schema, list):
        return [with_pack_limits(item, limits) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: with_pack_limits(value, limits) for key, value in schema.items()}
    name = schema.pop("x-pack-limit", None)
    return {**schema, **PACK_LIMITS[name](limits)} if name else schema


def json_body(model):
    return {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}


# One server-sent event, as OpenAPI 3.1 describes a text/event-stream response: by its events.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def json_response(schema, description="OK"):
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_schema(limits: PackLimits) -> dict:
    """OpenAPI 3.1 for the endpoints the gateway serves (aliases without /v1 left out), as
    this server's pack and options bound them."""
    model_id = limits.model_id
    components = with_pack_limits(request_schemas(ChatRequest, MessagesRequest, CountTokensRequest,
                                                  ResponsesRequest), limits)
    components["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
    components["AnthropicError"] = {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}
    message = {"type": "object", "required": ["type", "content", "stop_reason", "usage"],
               "properties": {"type": {"const": "message"}, "content": {"type": "array"}}}
    response = {"type": "object", "required": ["id", "object", "output", "status"],
                "properties": {"object": {"const": "response"}, "output": {"type": "array"}}}
    model_card = {"type": "object", "required": ["id", "object"],
                  "properties": {"id": {"const": model_id}, "object": {"const": "model"}}}
    completion = {"type": "object", "required": ["choices"], "properties": {"choices": {"type": "array"}}}
    health = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
    get_only = error_responses(404, 405, 421)
    return {
        "openapi": "3.1.0",
        "info": {"title": f"{model_id} (DFlash2 pack)", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}},
                "responses": {
                    "200": {"description": "a completion, or server-sent events when stream is true",
                            "content": {"application/json": {"schema": completion},
                                        "text/event-stream": {"schema": SSE_EVENT}}},
                    **error_responses(400, 404, 405, 413, 415, 421, 503, 504)}}},
            "/v1/messages": {"post": {
                "operationId": "createMessage",
                "requestBody": json_body(MessagesRequest),
                "responses": {
                    "200": {"description": "a message, or server-sent events when stream is true",
                            "content": {"application/json": {"schema": message},
                                        "text/event-stream": {"schema": SSE_EVENT}}},
                    **error_responses(400, 404, 405, 413, 415, 421, 503, 504, schema="AnthropicError")}}},
            "/v1/messages/count_tokens": {"post": {
                "operationId": "countMessageTokens",
                "requestBody": json_body(CountTokensRequest),
                "responses": {
                    "200": json_response({"type": "object", "required": ["input_tokens"],
                                          "properties": {"input_tokens": {"type": "integer"}}}),
                    **error_responses(400, 404, 405, 413, 415, 421, 503, 504, schema="AnthropicError")}}},
            "/v1/responses": {"post": {
                "operationId": "createResponse",
                "requestBody": json_body(ResponsesRequest),
                "responses": {
                    "200": {"description": "a response, or its typed server-sent events when stream is true",
                            "content": {"application/json": {"schema": response},
                                        "text/event-stream": {"schema": SSE_EVENT}}},
                    **error_responses(400, 404, 405, 413, 415, 421, 503, 504)}}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": json_response({"type": "object", "properties": {"data": {
                    "type": "array", "items": model_card}}}), **get_only}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": json_response(model_card), **get_only}}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": json_response(health), **get_only}}},
        },
        "components": {"schemas": components},
    }
