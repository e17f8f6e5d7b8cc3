"""Why two requests stop sharing a prefix: diverge(), volatile_fields(), normalise() + rules.

Example:
    >>> d = kv.diverge(kv.tokenise(m, req_a), kv.tokenise(m, req_b))
    >>> d.token_index, d.role         # the seed-002 billing header's cch= value
    (35, 'system')
    >>> kv.diverge(kv.tokenise(m, kv.normalise(req_a)), kv.tokenise(m, kv.normalise(req_b))).identical
    True
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Callable, Sequence

import numpy as np

from .blocks import TokenIdError
from .errors import RuleError, TemplateError
from .tokens import Tokens, common_prefix_len, tokenise


# ---------------------------------------------------------------------------------------- diverge

@dataclass(frozen=True)
class Divergence:
    """Where two prompts' token ids first differ; ``token_index`` is None when one is a prefix of
    the other (or they are equal). ``char_a``/``char_b`` are where that token starts in each text."""

    token_index: int | None
    common: int
    len_a: int
    len_b: int
    message_index: int | None = None
    role: str | None = None
    char_a: int | None = None
    char_b: int | None = None
    before: tuple[str, ...] = ()   # shared pieces just before the split
    token_a: str = ""              # the first differing token's text ('' past the end)
    token_b: str = ""
    after_a: tuple[str, ...] = ()  # pieces after it
    after_b: tuple[str, ...] = ()
    has_messages: bool = field(default=False, compare=False)  # False for raw ids and plain text

    @property
    def identical(self) -> bool:
        return self.token_index is None and self.len_a == self.len_b

    @property
    def is_prefix(self) -> bool:
        """One prompt is a strict prefix of the other: a cache can reuse all of the shorter one."""
        return self.token_index is None and self.len_a != self.len_b

    @property
    def context_a(self) -> str:
        return "".join(self.before) + self.token_a + "".join(self.after_a)

    @property
    def context_b(self) -> str:
        return "".join(self.before) + self.token_b + "".join(self.after_b)

    def reusable_blocks(self, block_size: int = 16) -> int:
        """Full blocks of the common prefix: what a block-hashing prefix cache can reuse."""
        return self.common // block_size

    def _where(self) -> str:
        if not self.has_messages:
            return ""
        if self.message_index is None:
            return " outside any message (template tokens)"
        return f" in message {self.message_index} ({self.role})"

    def __repr__(self) -> str:
        if self.identical:
            return f"Divergence(identical, {self.len_a} tokens)"
        if self.is_prefix:
            short, long_ = ("a", "b") if self.len_a < self.len_b else ("b", "a")
            return (f"Divergence(none: {short} is a prefix of {long_}, "
                    f"{self.common} of {max(self.len_a, self.len_b)} tokens shared)")
        side_a = _side(self.before, self.token_a, self.after_a, self.token_index)
        side_b = _side(self.before, self.token_b, self.after_b, self.token_index)
        return f"Divergence(at token {self.token_index}{self._where()}: {side_a} vs {side_b})"

    def _repr_html_(self) -> str:
        if self.token_index is None:
            return f"<div><b>{html.escape(repr(self))}</b></div>"
        grey = "color:#999"
        rows = []
        for name, tok, after, char in (("a", self.token_a, self.after_a, self.char_a),
                                       ("b", self.token_b, self.after_b, self.char_b)):
            shared = "".join(f'<span style="{grey}">{_cell(p)}</span>' for p in self.before)
            rest = "".join(f"<span>{_cell(p)}</span>" for p in after)
            rows.append(
                f"<tr><td><b>{name}</b></td><td style=\"font-family:monospace;white-space:pre\">"
                f'{shared}<span style="background:#ffb3b3;font-weight:bold">{_cell(tok) or "∅"}</span>'
                f"{rest}</td><td style=\"{grey}\">{'' if char is None else f'char {char}'}</td></tr>")
        return (f"<div><b>Divergence</b> at token {self.token_index}{html.escape(self._where())} · "
                f"{self.common} tokens shared of {self.len_a} / {self.len_b} · "
                f"{self.reusable_blocks()} blocks of 16 reusable"
                f"<table>{''.join(rows)}</table></div>")


def _side(before: tuple[str, ...], token: str, after: tuple[str, ...], index: int) -> str:
    """A few characters either side of the differing token (kept whole up to 16 characters)."""
    left = "".join(before)
    dots = "..." if len(left) > 10 or index > len(before) else ""
    return repr(dots + left[-10:] + token[:16] + "".join(after)[:10])


def _clip(s: str, n: int = 24) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def _cell(piece: str) -> str:
    return html.escape(piece).replace("\n", "↵")


def _as_tokens(x, model, name: str) -> Tokens:
    if isinstance(x, Tokens):
        return x
    if isinstance(x, str) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], dict)):
        if model is None:
            raise TemplateError(f"{name} is text or messages; diverge compares token ids. Pass "
                                f"model=... (or a tokenizer) or tokenise first with kv.tokenise")
        return tokenise(model, x)
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TokenIdError(f"{name} must hold integer token ids, got dtype {x.dtype}")
        ids = tuple(x.tolist())
    else:
        try:
            ids = tuple(x)
        except TypeError:
            raise TokenIdError(f"{name} must be Tokens or a sequence of token ids, "
                               f"got {type(x).__name__}") from None
        if not all(type(v) is int for v in ids):  # the common case stays a cheap C-speed scan
            bad = next((v for v in ids
                        if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None)
            if bad is not None:
                raise TokenIdError(f"{name} holds {bad!r} ({type(bad).__name__}); "
                                   "token ids must be ints")
            ids = tuple(int(v) for v in ids)
    return Tokens(ids, "", (), (), None, (), None)


def diverge(a, b, *, context: int = 4, model=None) -> Divergence:
    """The first token where two prompts differ, the message it falls in, and the text around it.

    ``a`` and ``b`` are ``Tokens`` or token id sequences (or text / messages with ``model=``).

    Example:
        >>> kv.diverge([1, 2, 3, 4], [1, 2, 9])
        Divergence(at token 2: '<1><2><3><4>' vs '<1><2><9>')
    """
    ta, tb = _as_tokens(a, model, "a"), _as_tokens(b, model, "b")
    common = common_prefix_len(ta.ids, tb.ids)
    differ = common < len(ta) and common < len(tb)
    i = common
    before = tuple(ta.piece(j) for j in range(max(0, i - context), i))
    token_a = ta.piece(i) if i < len(ta) else ""
    token_b = tb.piece(i) if i < len(tb) else ""
    after_a = tuple(ta.piece(j) for j in range(i + 1, min(len(ta), i + 1 + context)))
    after_b = tuple(tb.piece(j) for j in range(i + 1, min(len(tb), i + 1 + context)))
    span = ta.span_at(i) if differ else None
    if span is not None and span.role == "text":
        span = None  # plain text or raw ids: there are no messages to name
    return Divergence(
        token_index=i if differ else None, common=common, len_a=len(ta), len_b=len(tb),
        message_index=span.index if span else None, role=span.role if span else None,
        char_a=ta.offsets[i][0] if differ and ta.offsets else None,
        char_b=tb.offsets[i][0] if differ and tb.offsets else None,
        before=before, token_a=token_a, token_b=token_b, after_a=after_a, after_b=after_b,
        has_messages=any(s.role != "text" for s in ta.spans))


# -------------------------------------------------------------------------------- volatile fields

@dataclass(frozen=True)
class VolatileField:
    """A span of the first prompt whose text changes between requests.

    ``char_start``/``char_end`` index the first prompt's rendering (Tokens, text) or, for message
    lists without a model, that message's content. ``values`` has one entry per prompt (None when
    that prompt lacks the message)."""

    name: str | None
    message_index: int | None
    role: str | None
    char_start: int
    char_end: int
    values: tuple[str | None, ...]
    token_start: int | None = None
    token_end: int | None = None

    @property
    def examples(self) -> tuple[str, ...]:
        """The distinct values, in first-seen order."""
        return tuple(dict.fromkeys(v for v in self.values if v is not None))

    def __repr__(self) -> str:
        where = (f"message {self.message_index} ({self.role})" if self.message_index is not None
                 else "text")
        toks = f" tokens {self.token_start}:{self.token_end}" if self.token_start is not None else ""
        ex = ", ".join(_clip(v, 16) for v in self.examples[:3])
        more = ", ..." if len(self.examples) > 3 else ""
        return (f"VolatileField({self.name or '?'} in {where} chars {self.char_start}:{self.char_end}"
                f"{toks}, {len(self.examples)} distinct: {ex}{more})")

    def _repr_html_(self) -> str:
        return VolatileFields([self])._repr_html_()


class VolatileFields(list):
    """The list volatile_fields() returns, with a table view for notebooks."""

    def __repr__(self) -> str:
        names = ", ".join(f"{f.name or '?'}@{f.message_index}" for f in self)
        return f"VolatileFields({len(self)}: {names})"

    def _repr_html_(self) -> str:
        head = ("<tr><th>field</th><th>message</th><th>role</th><th>chars</th><th>tokens</th>"
                "<th>values</th></tr>")
        rows = "".join(
            f"<tr><td><b>{html.escape(f.name or '?')}</b></td><td>{f.message_index}</td>"
            f"<td>{html.escape(str(f.role))}</td><td>{f.char_start}:{f.char_end}</td>"
            f"<td>{'' if f.token_start is None else f'{f.token_start}:{f.token_end}'}</td>"
            f"<td style=\"font-family:monospace\">"
            f"{' · '.join(_cell(v) for v in f.examples[:5])}</td></tr>" for f in self)
        return f"<div><b>{len(self)} volatile field(s)</b><table>{head}{rows}</table></div>"


# characters that end a value: `cch=eb6c6;` -> the value is `eb6c6`
_SEPARATORS = frozenset(" \t\r\n;,=:&\"'<>()[]{}|`")
_KEY_BEFORE = re.compile(r"""["']?([A-Za-z_][\w.\-]*)["']?\s*[=:]\s*["']?$""")
_REFINE_LIMIT = 20_000  # char-level diff above this is quadratic; report the whole region instead


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", ""))
                         for p in content if isinstance(p, str)
                         or (isinstance(p, dict) and p.get("type") == "text"))
    return "" if content is None else str(content)


def _segments(prompt, model) -> tuple[dict, Tokens | None]:
    """{message index or None: (role, text, offset of text in the prompt's coordinates)}."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict) and model:
        prompt = tokenise(model, prompt)
    if isinstance(prompt, Tokens):
        spans = [s for s in prompt.spans if s.role != "text"]
        if not spans:
            return {None: (None, prompt.text, 0)}, prompt
        return {s.index: (s.role, prompt.text[s.char_start:s.char_end], s.char_start)
                for s in spans}, prompt
    if isinstance(prompt, str):
        return {None: (None, prompt, 0)}, None
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return {i: (m.get("role"), _content_text(m.get("content")), 0)
                for i, m in enumerate(prompt)}, None
    raise TemplateError(f"volatile_fields takes Tokens, strings or message lists; got {prompt!r:.60}")


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _refine(a: str, b: str, c1: int, c2: int, d1: int, d2: int) -> list[tuple]:
    sa, sb = a[c1:c2], b[d1:d2]
    p = 0
    while p < min(len(sa), len(sb)) and sa[p] == sb[p]:
        p += 1
    s = _common_suffix(sa, sb, min(len(sa), len(sb)) - p)
    ops = [("equal", c1, c1 + p, d1, d1 + p)] if p else []
    ma, mb = sa[p:len(sa) - s], sb[p:len(sb) - s]
    if ma and mb and len(ma) + len(mb) <= _REFINE_LIMIT:
        for tag, i1, i2, j1, j2 in SequenceMatcher(None, ma, mb, autojunk=False).get_opcodes():
            ops.append((tag, c1 + p + i1, c1 + p + i2, d1 + p + j1, d1 + p + j2))
    else:
        ops.append(("replace", c1 + p, c2 - s, d1 + p, d2 - s))
    if s:
        ops.append(("equal", c2 - s, c2, d2 - s, d2))
    return ops


def _char_opcodes(a: str, b: str) -> list[tuple]:
    """difflib opcodes over characters, via a line diff first (char diffs of long texts are slow)."""
    if a == b:
        return [("equal", 0, len(a), 0, len(b))]
    la, lb = a.splitlines(keepends=True), b.splitlines(keepends=True)
    pa, pb = [0], [0]
    for line in la:
        pa.append(pa[-1] + len(line))
    for line in lb:
        pb.append(pb[-1] + len(line))
    ops = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, la, lb, autojunk=False).get_opcodes():
        if tag == "equal":
            ops.append(("equal", pa[i1], pa[i2], pb[j1], pb[j2]))
        else:
            ops.extend(_refine(a, b, pa[i1], pa[i2], pb[j1], pb[j2]))
    return ops


def _expand(text: str, s: int, e: int) -> tuple[int, int]:
    while s > 0 and text[s - 1] not in _SEPARATORS:
        s -= 1
    while e < len(text) and text[e] not in _SEPARATORS:
        e += 1
    return s, e


def _merge(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(regions):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _map_region(ops: list[tuple], s: int, e: int) -> tuple[int, int]:
    """Where first-prompt chars [s, e) sit in the other prompt (insertions at the edges included)."""
    js = je = None
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            if js is None and i1 <= s < i2:
                js = j1 + s - i1
            if i1 < e <= i2:
                je = j1 + e - i1
        else:
            if js is None and i1 <= s <= i2:
                js = j1
            if i1 <= e <= i2:
                je = j2
    js = 0 if js is None else js
    return js, max(js, je if je is not None else js)


def _token_range(tokens: Tokens | None, c0: int, c1: int) -> tuple[int | None, int | None]:
    if tokens is None or not tokens.offsets:
        return None, None
    offs = tokens.offsets
    t0 = next((i for i, (a, b) in enumerate(offs) if b > c0), len(offs))
    t1 = next((i for i in range(t0, len(offs)) if offs[i][0] >= c1 and offs[i][1] > offs[i][0]),
              len(offs))
    return t0, max(t0, t1)


def volatile_fields(prompts: Sequence, *, model=None) -> VolatileFields:
    """Spans that change from request to request (ids, hashes, timestamps), found by diffing each
    request's text against the first, message by message (messages the first request lacks are
    not compared).

    ``prompts``: two or more ``Tokens``, strings or message lists (rendered with ``model=`` if given,
    so the result has token indices).

    Example:
        >>> kv.volatile_fields([kv.tokenise(m, r) for r in requests])[0]
        VolatileField(cch in message 0 (system) chars 94:99 tokens 35:39, 3 distinct: 'eb6c6', ...)
    """
    if isinstance(prompts, (str, Tokens)) or len(prompts) < 2:
        raise TemplateError("volatile_fields needs a list of at least two requests to compare")
    docs = [_segments(p, model) for p in prompts]
    first, first_tokens = docs[0]
    found = []
    for key, (role, text0, base) in first.items():
        others = [d[0].get(key) for d in docs[1:]]
        opcodes = [None if o is None else _char_opcodes(text0, o[1]) for o in others]
        regions = [_expand(text0, i1, i2) for ops in opcodes if ops
                   for tag, i1, i2, j1, j2 in ops if tag != "equal"]
        for s, e in _merge(regions):
            values = [text0[s:e]]
            for o, ops in zip(others, opcodes):
                if ops is None:
                    values.append(None)
                else:
                    js, je = _map_region(ops, s, e)
                    values.append(o[1][js:je])
            if len(set(values)) < 2:
                continue
            m = _KEY_BEFORE.search(text0, max(0, s - 80), s)
            t0, t1 = _token_range(first_tokens, base + s, base + e)
            found.append(VolatileField(m.group(1) if m else None, key, role, base + s, base + e,
                                       tuple(values), t0, t1))
    return VolatileFields(sorted(found, key=lambda f: (f.message_index or 0, f.char_start)))


# ------------------------------------------------------------------------------------- normalise

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
        return f"<code>{html.escape(repr(self))}</code>"


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


__all__ = ["Divergence", "diverge", "VolatileField", "VolatileFields", "volatile_fields", "Rule",
           "RuleError", "BILLING_HEADER", "DEFAULT_RULES", "normalise", "normalise_text"]
