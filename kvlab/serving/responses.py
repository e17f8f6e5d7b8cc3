"""OpenAI's Responses API (``POST /v1/responses``) on mlx-lm's chat path, text and function tools.

``to_chat(body)`` turns a Responses request into the chat request mlx-lm's handler serves:
``instructions`` -> the system message; ``input`` (a string, or items: messages of role user /
assistant / system / developer with input_text / output_text parts, ``function_call`` items
(joining the assistant message before them, as one turn's output does), ``function_call_output``
items) -> chat messages; function ``tools`` -> chat functions; ``max_output_tokens`` ->
``max_tokens``. What kvlab serve cannot honour is a 400 naming the field (``previous_response_id``,
``store: true``, built-in tools, non-text parts, ...); fields that only tune OpenAI's service
(``include``, ``reasoning``, ``prompt_cache_key``, ``truncation``, ``metadata``, ...) are accepted
and ignored. A ``ResponsesWriter`` stands in for the
handler's output (kvlab.serving.response_writer) and answers in OpenAI's shape; the chat request
always streams with usage, so the writer sees every chunk and the prompt cache's count.

Example:
    >>> to_chat({"model": "m", "instructions": "Be brief.", "input": "Hi"})["messages"]
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
"""

from __future__ import annotations

import json

from ..errors import RequestError

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
REFUSED = {  # field -> why kvlab serve refuses it when set
    "previous_response_id": "kvlab serve keeps no responses to chain from: send the whole conversation in input",
    "conversation": "kvlab serve keeps no conversations: send the whole conversation in input",
    "background": "kvlab serve answers in the foreground only: leave background unset or false",
    "store": "kvlab serve does not store responses for retrieval: leave store unset or false",
    "prompt": "kvlab serve has no prompt templates: send instructions and input instead",
}


class ResponsesError(RequestError):
    """A Responses request kvlab cannot serve; ``param`` names the field, as OpenAI reports it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, "invalid_request_error"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error shape.

    Example:
        >>> error_body("input must not be empty", param="input")["error"]["param"]
        'input'
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _parts(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in TEXT_PARTS or not isinstance(p.get("text"), str):
            raise ResponsesError(f"{where}[{j}]: part type {kind!r} is not supported: kvlab serve takes text "
                                 "only ({'type': 'input_text' or 'output_text', 'text': ...})", f"{where}[{j}].type")
        texts.append(p["text"])
    return "".join(texts)


def _items(items) -> list[dict]:
    if not isinstance(items, (str, list)) or not items:
        raise ResponsesError("input must be a non-empty string or a non-empty list of input items", "input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise ResponsesError(f"{where} must be an object (an input item)", where)
        kind = it.get("type", "message")
        if kind == "message":
            role = ROLES.get(it.get("role"))
            if role is None:
                raise ResponsesError(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _parts(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            args = it.get("arguments", "")
            try:
                json.loads(args or "{}")
            except (TypeError, ValueError):
                raise ResponsesError(f"{where}.arguments must be a JSON object encoded as a string",
                                     f"{where}.arguments") from None
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise ResponsesError(f"{where} needs string 'name' and 'call_id'", where)
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": args or "{}"}}
            if out and out[-1]["role"] == "assistant":  # one turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise ResponsesError(f"{where} needs a string 'call_id'", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _parts(it.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # chat templates drop earlier reasoning from the history anyway
        else:
            raise ResponsesError(f"{where}: item type {kind!r} is not supported by kvlab serve (message, "
                                 "function_call, function_call_output, reasoning)", f"{where}.type")
    return out


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise ResponsesError("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise ResponsesError(f"tools[{i}]: tool type {kind!r} is not available in kvlab serve: only function "
                                 "tools ({'type': 'function', 'name': ..., 'parameters': ...})", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ResponsesError(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    return out


def to_chat(body) -> dict:
    """The OpenAI chat request (for mlx-lm's handler) equivalent to a Responses request; bad
    requests raise ResponsesError naming the field.

    Example:
        >>> chat = to_chat({"model": "m", "input": "Hi", "max_output_tokens": 8})
        >>> chat["messages"], chat["max_tokens"], chat["stream"]
        ([{'role': 'user', 'content': 'Hi'}], 8, True)
    """
    if not isinstance(body, dict):
        raise ResponsesError("the request body must be a JSON object")
    for field, why in REFUSED.items():
        if body.get(field) not in (None, False):
            raise ResponsesError(f"{field} is not supported: {why}", field)
    chat, instructions = [], body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ResponsesError("instructions must be a string", "instructions")
        chat.append({"role": "system", "content": instructions})
    chat.extend(_items(body.get("input")))
    out = {"model": body.get("model", "default_model"), "messages": chat, "stream": True,
           "stream_options": {"include_usage": True}}
    mt = body.get("max_output_tokens")
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ResponsesError(f"max_output_tokens must be an integer >= 1, got {mt!r}", "max_output_tokens")
        out["max_tokens"] = mt
    for key in ("temperature", "top_p"):
        if (v := body.get(key)) is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ResponsesError(f"{key} must be a number >= 0, got {v!r}", key)
            out[key] = v
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ResponsesError("text.format: only {'type': 'text'} is supported by kvlab serve", "text.format")
    if body.get("tool_choice") not in (None, "auto"):
        raise ResponsesError("tool_choice: only 'auto' is supported by kvlab serve", "tool_choice")
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    return out
