"""volatile_fields(): the spans of a prompt that change from request to request (e.g. the
billing header's cch= value), found by diffing renderings (``volatile_fields`` shows it on chat
requests).

Example:
    >>> f = kv.volatile_fields(["session=abc1; hi", "session=xyz2; hi"])[0]
    >>> f.name, f.examples
    ('session', ('abc1', 'xyz2'))
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Sequence

from .display import Html, summary_html, table_html
from .divergence import clipped, piece_html
from ..errors import TemplateError
from .tokens import Tokens, tokenise


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
        ex = ", ".join(clipped(v, 16) for v in self.examples[:3])
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
        rows = [(Html(f"<b>{html.escape(f.name or '?')}</b>"), f.message_index, f.role,
                 f"{f.char_start}:{f.char_end}",
                 "" if f.token_start is None else f"{f.token_start}:{f.token_end}",
                 Html(f'<span style="font-family:monospace">'
                      f"{' · '.join(piece_html(v) for v in f.examples[:5])}</span>")) for f in self]
        table = table_html(("field", "message", "role", "chars", "tokens", "values"), rows)
        return summary_html(f"{len(self)} volatile field(s)", body=table)


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
        >>> requests = [[{"role": "system", "content": kv.workloads.BILLING_HEADER.format(cch=c)
        ...               + "\\nBe brief."}, {"role": "user", "content": "Hi"}]
        ...             for c in ("eb6c6", "1f2a9", "03d41")]
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
