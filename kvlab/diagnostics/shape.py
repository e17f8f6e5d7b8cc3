"""PromptShape: the structure of one request (model, system, tools, messages, cache-affecting
settings) in a canonical form, so two requests that send the same prompt compare equal whichever
way the client spelled it, and any change the providers' diagnostics name shows up as a difference.

Canonical forms: tool definitions are JSON with sorted keys and without ``cache_control`` (a moved
breakpoint is not a changed prompt), kept in the order sent (order matters for caching); message
content is a tuple of parts ``("text", s)``, ``("tool_call", id, name, args_json)``,
``("tool_result", id, text)``, ``("thinking", s)``, ``("image", digest)`` or ``("other", type,
json)``, so ``"Hi"`` and ``[{"type": "text", "text": "Hi"}]`` are the same message.

Example:
    >>> a = shape_of({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "chat")
    >>> b = shape_of({"model": "m", "max_tokens": 8, "messages": [
    ...     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, "anthropic")
    >>> a == b
    True
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import DiagnosticsError
from ..primitives.display import summary_html, table_html

Part = tuple  # ("text", s) | ("tool_call", id, name, args) | ("tool_result", id, text) | ...
APIS = ("chat", "responses", "anthropic")
# request fields that change what is cached without being model/system/tools/messages; the
# providers name some of them (OpenAI: prompt_cache_key, service_tier, text.format,
# reasoning.effort, text.verbosity; Anthropic reports the rest as `unavailable`)
_SETTINGS = {
    "chat": {"prompt_cache_key": ("prompt_cache_key",), "service_tier": ("service_tier",),
             "reasoning_effort": ("reasoning_effort",), "text_format": ("response_format",),
             "verbosity": ("verbosity",), "tool_choice": ("tool_choice",)},
    "responses": {"prompt_cache_key": ("prompt_cache_key",), "service_tier": ("service_tier",),
                  "reasoning_effort": ("reasoning", "effort"), "text_format": ("text", "format"),
                  "verbosity": ("text", "verbosity"), "tool_choice": ("tool_choice",)},
    "anthropic": {"tool_choice": ("tool_choice",), "thinking": ("thinking",),
                  "context_management": ("context_management",), "output_config": ("output_config",),
                  "output_format": ("output_format",)},
}


def canonical_json(value) -> str:
    """JSON with sorted keys and no spaces, ``cache_control`` dropped at every level.

    Example:
        >>> canonical_json({"b": 1, "a": {"cache_control": {"type": "ephemeral"}, "x": [2]}})
        '{"a":{"x":[2]},"b":1}'
    """
    return json.dumps(_strip(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _digest(value) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:16]


def _args(arguments) -> str:
    """Tool-call arguments as canonical JSON (OpenAI sends a JSON string, Anthropic an object)."""
    if isinstance(arguments, str):
        try:
            return canonical_json(json.loads(arguments))
        except ValueError:
            return arguments  # not JSON: compare the text as sent
    return canonical_json(arguments if arguments is not None else {})


@dataclass(frozen=True)
class Message:
    """One message: its role and its content parts (see the module docstring)."""

    role: str
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return "\n".join(p[-1] if p[0] != "tool_call" else f"{p[2]}({p[3]})" for p in self.parts)

    def __repr__(self) -> str:
        return f"Message({self.role}, {len(self.parts)} parts)"


@dataclass(frozen=True)
class ToolDef:
    """One tool as the model sees it: its name and its whole definition as canonical JSON."""

    name: str
    definition: str

    def __repr__(self) -> str:
        return f"ToolDef({self.name})"


@dataclass(frozen=True)
class PromptShape:
    """The structure of one request. ``settings`` holds (name, canonical JSON) pairs for the
    cache-affecting request fields that are set (see ``_SETTINGS``), sorted by name."""

    model: str | None
    system: str | None
    tools: tuple[ToolDef, ...]
    messages: tuple[Message, ...]
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    def __repr__(self) -> str:
        system = "no system" if self.system is None else f"system {len(self.system)} chars"
        return (f"PromptShape({self.model!r}, {system}, {len(self.tools)} tools, "
                f"{len(self.messages)} messages)")

    def _repr_html_(self) -> str:
        rows = [("model", self.model), ("system", (self.system or "")[:200]),
                ("tools", ", ".join(self.tool_names) or None)]
        rows += [(f"setting {k}", v) for k, v in self.settings]
        rows += [(f"message {i} ({m.role})", m.text[:200]) for i, m in enumerate(self.messages)]
        return summary_html("PromptShape", self.model, f"{len(self.tools)} tools",
                            f"{len(self.messages)} messages", body=table_html(None, rows, row_headers=True))


def shape_of(body, api: str) -> PromptShape:
    """The PromptShape of a request body: ``api`` is ``"chat"`` (OpenAI chat completions),
    ``"responses"`` (OpenAI Responses) or ``"anthropic"`` (Anthropic Messages).

    Example:
        >>> shape_of({"model": "m", "instructions": "Be brief.", "input": "Hi"}, "responses").system
        'Be brief.'
    """
    if api not in APIS:
        raise DiagnosticsError(f"api must be one of {APIS}, got {api!r}")
    if not isinstance(body, dict):
        raise DiagnosticsError(f"a {api} request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    model = None if model is None else str(model)
    settings = _settings(body, api)
    if api == "chat":
        system, messages = _chat_messages(body.get("messages"))
        tools = _tools(body.get("tools"), api)
    elif api == "responses":
        system = _text(body.get("instructions"), "instructions") if body.get("instructions") is not None else None
        messages = _responses_input(body.get("input"))
        tools = _tools(body.get("tools"), api)
    else:
        system = _text(body.get("system"), "system") if body.get("system") is not None else None
        messages = _anthropic_messages(body.get("messages"))
        tools = _tools(body.get("tools"), api)
    return PromptShape(model, system, tools, messages, settings)


def _settings(body: dict, api: str) -> tuple[tuple[str, str], ...]:
    out = []
    for name, path in _SETTINGS[api].items():
        value = body
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            out.append((name, canonical_json(value)))
    return tuple(sorted(out))


def _text(value, where: str) -> str:
    """A string, or the text of a list of text blocks joined with newlines (as kvlab serve
    renders a block-list system prompt)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, b in enumerate(value):
            if not isinstance(b, dict) or not isinstance(b.get("text"), str):
                raise DiagnosticsError(f"{where}[{i}] must be a text block {{'type': 'text', 'text': ...}}")
            texts.append(b["text"])
        return "\n".join(texts)
    raise DiagnosticsError(f"{where} must be a string or a list of text blocks, got {type(value).__name__}")


def _tools(tools, api: str) -> tuple[ToolDef, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise DiagnosticsError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise DiagnosticsError(f"tools[{i}] must be an object (a tool definition)")
        inner = t["function"] if api == "chat" and isinstance(t.get("function"), dict) else t
        name = inner.get("name", t.get("type", f"tool_{i}"))
        out.append(ToolDef(str(name), canonical_json(t)))
    return tuple(out)


def _parts_openai(content, where: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise DiagnosticsError(f"{where} must be a string or a list of content parts")
    parts = []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(b.get("text"), str):
            parts.append(("text", b["text"]))
        elif kind in ("image_url", "input_image"):
            parts.append(("image", _digest(b.get("image_url", b))))
        else:
            parts.append(("other", str(kind), canonical_json(b)))
    return parts


def _chat_messages(msgs) -> tuple[str | None, tuple[Message, ...]]:
    if not isinstance(msgs, list):
        raise DiagnosticsError("messages must be a list of {'role', 'content'} objects")
    out, system = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DiagnosticsError(f"messages[{i}] must be an object with a string 'role'")
        role = m["role"]
        if role in ("system", "developer") and not out:
            system.append(_text(m.get("content") or "", f"messages[{i}].content"))
            continue  # the leading system messages are the system prompt
        if role == "tool":
            parts = [("tool_result", str(m.get("tool_call_id", "")),
                      _text(m.get("content") or "", f"messages[{i}].content"))]
        else:
            parts = _parts_openai(m.get("content"), f"messages[{i}].content")
        for c in m.get("tool_calls") or []:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            parts.append(("tool_call", str(c.get("id", "")), str(fn.get("name", "")), _args(fn.get("arguments"))))
        out.append(Message(role, tuple(parts)))
    return ("\n".join(system) if system else None), tuple(out)


def _responses_input(items) -> tuple[Message, ...]:
    if items is None:
        return ()
    if isinstance(items, str):
        return (Message("user", (("text", items),)),)
    if not isinstance(items, list):
        raise DiagnosticsError("input must be a string or a list of input items")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise DiagnosticsError(f"input[{i}] must be an object (an input item)")
        kind = it.get("type", "message")
        if kind == "message":
            out.append(Message(str(it.get("role", "user")), tuple(_parts_openai(it.get("content"), f"input[{i}].content"))))
        elif kind == "function_call":
            out.append(Message("assistant", (("tool_call", str(it.get("call_id", "")), str(it.get("name", "")),
                                              _args(it.get("arguments"))),)))
        elif kind == "function_call_output":
            output = it.get("output", "")
            out.append(Message("tool", (("tool_result", str(it.get("call_id", "")),
                                         output if isinstance(output, str) else canonical_json(output)),)))
        elif kind == "reasoning":
            summary = "\n".join(s.get("text", "") for s in it.get("summary") or [] if isinstance(s, dict))
            out.append(Message("assistant", (("thinking", summary or _digest(it)),)))
        else:
            out.append(Message(str(it.get("role", "user")), (("other", str(kind), canonical_json(it)),)))
    return tuple(out)


def _anthropic_messages(msgs) -> tuple[Message, ...]:
    if not isinstance(msgs, list):
        raise DiagnosticsError("messages must be a list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DiagnosticsError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            out.append(Message(m["role"], (("text", content),)))
            continue
        if not isinstance(content, list):
            raise DiagnosticsError(f"messages[{i}].content must be a string or a list of content blocks")
        parts = []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                parts.append(("text", str(b.get("text", ""))))
            elif kind == "tool_use":
                parts.append(("tool_call", str(b.get("id", "")), str(b.get("name", "")), _args(b.get("input"))))
            elif kind == "tool_result":
                body = b.get("content", "")
                text = body if isinstance(body, str) else canonical_json(body)
                parts.append(("tool_result", str(b.get("tool_use_id", "")), text))
            elif kind == "thinking":
                parts.append(("thinking", str(b.get("thinking", ""))))
            elif kind == "redacted_thinking":
                parts.append(("thinking", _digest(b)))
            elif kind == "image":
                parts.append(("image", _digest(b.get("source", b))))
            else:
                parts.append(("other", str(kind), canonical_json(b)))
        out.append(Message(m["role"], tuple(parts)))
    return tuple(out)


__all__ = ["APIS", "Message", "PromptShape", "ToolDef", "canonical_json", "shape_of"]
