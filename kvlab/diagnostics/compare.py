"""compare(): the first structural change between two requests, in the providers' order (model,
then system, then tools, then cache-affecting settings, then messages), and what exactly changed.

Appending messages is not a change: a conversation that only grew is a hit (``type`` None).

Example:
    >>> from kvlab.diagnostics import FingerprintLog, shape_of
    >>> a = shape_of({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "chat")
    >>> b = shape_of({"model": "m", "messages": [{"role": "user", "content": "Hi"},
    ...     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]}, "chat")
    >>> compare(a, b).type is None, compare(b, a).type, compare(b, a).message_index
    (True, 'messages_changed', 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..primitives.display import summary_html, table_html
from ..primitives.tokens import common_prefix_len
from .shape import PromptShape

# kvlab's names, in the order the providers check; settings_changed has no Anthropic type of its
# own (Anthropic reports it as `unavailable`, OpenAI by the setting's own reason)
TYPES = ("model_changed", "system_changed", "tools_changed", "settings_changed", "messages_changed")


@dataclass(frozen=True)
class ToolsChange:
    """How the tool list changed: names added and removed, whether the tools both lists share
    are in another order, and which shared tools have another definition."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reordered: bool = False
    schema_changed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"added": list(self.added), "removed": list(self.removed), "reordered": self.reordered,
                "schema_changed": list(self.schema_changed)}

    def __str__(self) -> str:
        bits = [f"added {', '.join(self.added)}" if self.added else "",
                f"removed {', '.join(self.removed)}" if self.removed else "",
                "reordered" if self.reordered else "",
                f"definition of {', '.join(self.schema_changed)} changed" if self.schema_changed else ""]
        return "; ".join(b for b in bits if b)


@dataclass(frozen=True)
class Comparison:
    """What changed from ``previous`` to ``current``. ``type`` is the first change in ``TYPES``
    order (None: a hit); ``changed`` lists every part that changed, in that order.

    ``system_char``: the first character where the system prompts differ. ``message_index``: the
    first message that was edited (or, when messages were only removed, the first one missing);
    ``messages``: ``"edited"``, ``"removed"``, ``"appended"`` or ``"same"``."""

    type: str | None
    changed: tuple[str, ...] = ()
    previous_model: str | None = None
    current_model: str | None = None
    system_char: int | None = None
    tools: ToolsChange | None = None
    settings: tuple[str, ...] = ()
    message_index: int | None = None
    messages: str = "same"
    previous_messages: int = 0
    current_messages: int = 0
    compacted: bool = False  # a compaction item replaced the changed messages (OpenAI: context_compacted)

    @property
    def hit(self) -> bool:
        return self.type is None

    def describe(self) -> str:
        """One sentence: what changed, where."""
        if self.type is None:
            grew = self.current_messages - self.previous_messages
            return f"no change: {grew} message(s) appended" if grew else "no change"
        if self.type == "model_changed":
            return f"model changed from {self.previous_model!r} to {self.current_model!r}"
        if self.type == "system_changed":
            return f"system prompt changed at character {self.system_char}"
        if self.type == "tools_changed":
            return f"tools changed: {self.tools}"
        if self.type == "settings_changed":
            return f"cache-affecting settings changed: {', '.join(self.settings)}"
        how = "edited" if self.messages == "edited" else "removed"
        why = ": the conversation was compacted" if self.compacted else ""
        return f"message {self.message_index} {how} (not only appended){why}"

    def to_dict(self) -> dict:
        """JSON-ready: what the ``kvlab`` extension object carries."""
        out = {"type": self.type, "changed": list(self.changed), "description": self.describe(),
               "messages": self.messages, "message_index": self.message_index,
               "previous_messages": self.previous_messages, "current_messages": self.current_messages}
        if "model_changed" in self.changed:
            out["previous_model"], out["current_model"] = self.previous_model, self.current_model
        if "system_changed" in self.changed:
            out["system_char"] = self.system_char
        if self.tools is not None:
            out["tools"] = self.tools.to_dict()
        if self.settings:
            out["settings"] = list(self.settings)
        if self.compacted:
            out["compacted"] = True
        return out

    def __repr__(self) -> str:
        return f"Comparison({self.type or 'hit'}: {self.describe()})"

    def _repr_html_(self) -> str:
        rows = [(t, "changed" if t in self.changed else "same") for t in TYPES]
        return summary_html("Comparison", self.type or "hit", self.describe(),
                            body=table_html(["part", "previous → current"], rows))


def tools_change(previous: tuple, current: tuple) -> ToolsChange | None:
    """None when both tool lists are the same, else what differs.

    Example:
        >>> from kvlab.diagnostics.shape import ToolDef
        >>> a, b, c = ToolDef("a", "{}"), ToolDef("b", "{}"), ToolDef("c", "{}")
        >>> tools_change((a, b), (b, a, c))
        ToolsChange(added=('c',), removed=(), reordered=True, schema_changed=())
    """
    if previous == current:
        return None
    before = {t.name: t.definition for t in previous}
    after = {t.name: t.definition for t in current}
    shared_before = [t.name for t in previous if t.name in after]
    shared_after = [t.name for t in current if t.name in before]
    return ToolsChange(
        added=tuple(t.name for t in current if t.name not in before),
        removed=tuple(t.name for t in previous if t.name not in after),
        reordered=shared_before != shared_after,
        schema_changed=tuple(n for n in shared_after if before[n] != after[n]))


def compare(previous: PromptShape, current: PromptShape) -> Comparison:
    """The structural changes from ``previous`` to ``current`` (see ``Comparison``)."""
    changed = []
    if previous.model != current.model:
        changed.append("model_changed")
    system_char = None
    if previous.system != current.system:
        changed.append("system_changed")
        system_char = common_prefix_len(previous.system or "", current.system or "")
    tools = tools_change(previous.tools, current.tools)
    if tools is not None:
        changed.append("tools_changed")
    before, after = dict(previous.settings), dict(current.settings)
    settings = tuple(sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)))
    if settings:
        changed.append("settings_changed")
    pm, cm = previous.messages, current.messages
    first = common_prefix_len(pm, cm)
    if first < min(len(pm), len(cm)):
        how, index = "edited", first
    elif len(cm) < len(pm):
        how, index = "removed", len(cm)
    else:
        how, index = ("appended" if len(cm) > len(pm) else "same"), None
    compacted = False
    if how in ("edited", "removed"):
        changed.append("messages_changed")
        compacted = any(p[:2] == ("other", "compaction") for m in cm[index:] for p in m.parts)
    return Comparison(
        type=changed[0] if changed else None, changed=tuple(changed),
        previous_model=previous.model, current_model=current.model, system_char=system_char,
        tools=tools, settings=settings, message_index=index, messages=how,
        previous_messages=len(pm), current_messages=len(cm), compacted=compacted)


__all__ = ["Comparison", "TYPES", "ToolsChange", "compare", "tools_change"]
