"""normalise(): canonicalisation rules applied to messages before caching, so per-request noise
(the seed-002 billing header) does not break prefix reuse. DEFAULT_RULES removes exactly the
`x-anthropic-billing-header: ...` line.

Example:
    >>> msgs = [{"role": "system",
    ...          "content": "x-anthropic-billing-header: cch=eb6c6;\\nToday is Monday.\\nBe brief."}]
    >>> kv.normalise(msgs)[0]["content"]                       # DEFAULT_RULES
    'Today is Monday.\\nBe brief.'
    >>> kv.normalise(msgs, [*kv.DEFAULT_RULES, kv.Rule("date", r"Today is .*\\n")])[0]["content"]
    'Be brief.'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import RuleError, TemplateError
from .tokens import Tokens
from .display import summary_html


@dataclass(frozen=True)
class Rule:
    """A canonicalisation: a regex substitution (or a function) over message text.

    ``roles=None`` applies to every role; otherwise only to messages whose role is listed.

    Example:
        >>> r = Rule("session_id", r"session=[0-9a-f]+", "session=<id>")
        >>> r.apply("a session=9f3e b")
        'a session=<id> b'
    """

    name: str
    pattern: str | None = None
    replacement: str = ""
    roles: tuple[str, ...] | None = None
    flags: int = 0
    fn: Callable[[str], str] | None = field(default=None, compare=False)

    def __post_init__(self):
        if isinstance(self.roles, str):
            object.__setattr__(self, "roles", (self.roles,))
        elif self.roles is not None:
            object.__setattr__(self, "roles", tuple(self.roles))
        if (self.pattern is None) == (self.fn is None):
            raise RuleError(f"rule {self.name!r} needs exactly one of a regex pattern or a function "
                            "(use Rule.from_function(name, fn) for functions)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern, self.flags)
            except re.error as e:
                raise RuleError(f"rule {self.name!r} has an invalid regex {self.pattern!r}: {e}") from e

    @classmethod
    def from_function(cls, name: str, fn: Callable[[str], str], roles=None) -> Rule:
        """A rule that calls ``fn(text) -> text``.

        Example:
            >>> Rule.from_function("strip", str.strip).apply("  hi ")
            'hi'
        """
        return cls(name, None, "", roles, 0, fn)

    def applies_to(self, role: str | None) -> bool:
        return self.roles is None or role is None or role in self.roles

    def apply(self, text: str, role: str | None = None) -> str:
        """``text`` with this rule applied (unchanged when ``role`` is not one of ``roles``)."""
        if not self.applies_to(role):
            return text
        if self.fn is None:
            return re.sub(self.pattern, self.replacement, text, flags=self.flags)
        out = self.fn(text)
        if not isinstance(out, str):
            raise RuleError(f"rule {self.name!r} returned {type(out).__name__}, not str; "
                            "a rule function must map text to text")
        return out

    def __repr__(self) -> str:
        what = f"/{self.pattern}/ -> {self.replacement!r}" if self.fn is None else \
            f"fn {getattr(self.fn, '__name__', 'function')}"
        roles = "" if self.roles is None else f" roles={','.join(self.roles)}"
        return f"Rule({self.name}: {what}{roles})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


BILLING_HEADER = Rule(
    "billing_header",
    # only this header: it carries cch=, a per-request hash; other x-anthropic-* lines may matter
    r"^x-anthropic-billing-header:[^\n]*(?:\n|\Z)",
    "", ("system", "developer"), re.MULTILINE)

DEFAULT_RULES: tuple[Rule, ...] = (BILLING_HEADER,)


def _resolve(rules) -> tuple[Rule, ...]:
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, Rule):
        return (rules,)
    if callable(rules):
        return (Rule.from_function(getattr(rules, "__name__", "function"), rules),)
    out = []
    for r in rules:
        if isinstance(r, Rule):
            out.append(r)
        elif callable(r):
            out.append(Rule.from_function(getattr(r, "__name__", "function"), r))
        else:
            raise RuleError(f"rules must be Rule objects or functions str -> str, got {r!r:.60}")
    return tuple(out)


def normalise_text(text: str, rules=None, role: str | None = None) -> str:
    """``text`` with ``rules`` (default ``DEFAULT_RULES``) applied; with ``role=None`` every rule
    applies, which suits a whole rendered prompt.

    Example:
        >>> normalise_text("x-anthropic-billing-header: cch=eb6c6;\\nYou are Claude.")
        'You are Claude.'
    """
    for rule in _resolve(rules):
        text = rule.apply(text, role)
    return text


def _normalise_content(content, rules, role):
    if isinstance(content, str):
        return normalise_text(content, rules, role)
    if not isinstance(content, (list, tuple)):
        return content
    parts = []
    for p in content:
        if isinstance(p, str):
            new = normalise_text(p, rules, role)
            if new or not p:
                parts.append(new)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            new = normalise_text(p["text"], rules, role)
            if new or not p["text"]:  # a part that was only the header goes entirely
                parts.append({**p, "text": new})
        else:
            parts.append(p)
    return parts


def normalise(messages: Sequence[dict], rules=None) -> list[dict]:
    """A new message list with ``rules`` (default ``DEFAULT_RULES``) applied to message text;
    ``messages`` is left untouched.

    Example:
        >>> kv.normalise([{"role": "system",
        ...                "content": "x-anthropic-billing-header: cch=eb6c6;\\nBe brief."}])
        [{'role': 'system', 'content': 'Be brief.'}]
    """
    if isinstance(messages, (str, Tokens)) or not all(isinstance(m, dict) for m in messages):
        raise TemplateError("normalise takes a list of message dicts like "
                            "{'role': 'user', 'content': '...'}; use normalise_text for a string")
    resolved = _resolve(rules)
    out = []
    for m in messages:
        new = dict(m)
        if "content" in m:
            new["content"] = _normalise_content(m["content"], resolved, m.get("role"))
        out.append(new)
    return out


__all__ = ["Rule", "RuleError", "BILLING_HEADER", "DEFAULT_RULES", "normalise", "normalise_text"]
