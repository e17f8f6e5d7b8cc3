"""Two prompts as token strips, coloured by message role, with the first differing token, the
part no prefix cache can reuse, and the volatile fields that caused it.

Example:
    >>> fig = kv.viz.divergence(kv.tokenise(m, req_a), kv.tokenise(m, req_b))
    >>> fig.layout.meta["token_index"]
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from ..primitives.divergence import diverge
from ..errors import KvlabError, TemplateError, TokenIdError, VizError
from ..primitives.tokens import Tokens, as_tokens
from ..primitives.volatile import volatile_fields
from .common import COLORS, ROLE_FILL, ROLES, discrete, tokenizer_from, visible


def prompt_tokens(x, tokenizer, name: str) -> Tokens:
    """A divergence side as Tokens: Tokens, an engine Result (its prompt ids), token ids, text or
    messages (tokenised with ``tokenizer``, a model or tokenizer). Raw ids get ChatML message
    spans when the tokenizer has ``<|im_start|>``. An empty sequence is an empty side."""
    from ..result import Result

    if isinstance(x, Result):
        x = x.prompt_ids
    try:
        return as_tokens(x, tokenizer, name=name, chatml_spans=True, allow_empty=True)
    except (TemplateError, TokenIdError) as e:
        hint = (" (kv.viz.divergence takes the model as its third argument: divergence(a, b, model))"
                if tokenizer is None and isinstance(e, TemplateError) else "")
        raise VizError(f"{e}{hint}") from e


def volatile_spans(ta: Tokens, tb: Tokens) -> list[tuple[int, int, str]]:
    """(token_start, token_end, name) of the volatile fields, in ``ta``'s coordinates."""
    if not (ta.text and tb.text and ta.offsets):
        return []
    try:
        fields = volatile_fields([ta, tb])
    except KvlabError:
        return []
    return [(f.token_start, f.token_end, f.name or "?") for f in fields
            if f.token_start is not None and f.token_end is not None and f.token_end > f.token_start]


def divergence(a, b, tokenizer=None, *, volatile=True, window: int = 400,
               max_tokens: int = 20_000) -> go.Figure:
    """Two prompts as token strips (rows a and b), coloured by message role, with message
    boundaries, the first differing token boxed in red, the part no prefix cache can reuse shaded,
    and volatile fields (ids, hashes, the billing header's cch=) boxed in orange. Hover shows
    each token's decoded text.

    ``a``, ``b``: Tokens, engine Results or token ids; ``tokenizer``: a tokenizer or model (for ids;
    Tokens carry their own). ``volatile``: True (find them with kv.volatile_fields), False, or a list
    of ``(token_start, token_end, name)`` in a's coordinates. The x range opens ``window`` tokens
    around the difference; prompts longer than ``max_tokens`` are cut around it.

    Example:
        >>> fig = kv.viz.divergence(kv.tokenise(m, req_a), kv.tokenise(m, req_b))
        >>> fig.layout.meta["token_index"]
        35
    """
    if tokenizer is None:
        carrier = a if isinstance(a, Tokens) else b if isinstance(b, Tokens) else None
        tokenizer = tokenizer_from(carrier)
    ta, tb = prompt_tokens(a, tokenizer, "a"), prompt_tokens(b, tokenizer, "b")
    d = diverge(ta, tb)
    idx, common = d.token_index, d.common
    length = max(len(ta), len(tb))
    lo, hi = 0, length
    if length > max_tokens:
        centre = common
        lo = max(0, min(centre - max_tokens // 2, length - max_tokens))
        hi = lo + max_tokens
    xs = list(range(lo, hi))
    code = {r: k for k, r in enumerate(ROLES)}
    z, text = [], []
    for t in (ta, tb):
        ps = [t.piece(i) for i in range(lo, min(hi, len(t)))]
        row_z, row_t = [], []
        for i in xs:
            if i >= len(t):
                row_z.append(None), row_t.append("")
                continue
            span = t.span_at(i)
            role = span.role if span else "template"
            row_z.append(code.get(role, 0))
            row_t.append(f"#{i} id {t.ids[i]} · {role}<br>{visible(repr(ps[i - lo])[1:-1], 80)}")
        z.append(row_z), text.append(row_t)
    fig = go.Figure(go.Heatmap(
        x=xs, y=[0, 1], z=z, text=text, hovertemplate="%{text}<extra></extra>", zmin=-0.5,
        zmax=len(ROLES) - 0.5, colorscale=discrete([ROLE_FILL[r] for r in ROLES]),
        xgap=1 if len(xs) <= 400 else 0, ygap=4, name="tokens",
        colorbar=dict(tickvals=list(range(len(ROLES))), ticktext=list(ROLES), thickness=10, len=1.0)))
    shapes = []
    row_y = {0: (-0.5, 0.5), 1: (0.5, 1.5)}
    for r, t in enumerate((ta, tb)):
        y0, y1 = row_y[r]
        for s in t.spans:
            if lo < s.token_start < hi and s.role != "text":
                shapes.append(dict(type="line", x0=s.token_start - 0.5, x1=s.token_start - 0.5,
                                   y0=y0, y1=y1, line=dict(color="#555", width=2)))
    if common < length:
        shapes.append(dict(type="rect", x0=max(common, lo) - 0.5, x1=hi - 0.5, y0=-0.5, y1=1.5,
                           fillcolor="rgba(0,0,0,0.10)", line_width=0, layer="above"))
    fields = []
    if volatile is True:
        fields = [(s, e, n, 0) for s, e, n in volatile_spans(ta, tb)] + \
                 [(s, e, n, 1) for s, e, n in volatile_spans(tb, ta)]
    elif volatile:
        fields = [(int(s), int(e), str(n), 0) for s, e, n in volatile]
    for s, e, name, r in fields:
        y0, y1 = row_y[r]
        shapes.append(dict(type="rect", x0=s - 0.5, x1=e - 0.5, y0=y0, y1=y1, layer="above",
                           line=dict(color=COLORS["volatile"], width=2), fillcolor="rgba(0,0,0,0)"))
    if fields:
        fig.add_trace(go.Scatter(
            x=[(s + e - 1) / 2 for s, e, _, _ in fields], y=[r for *_, r in fields], mode="markers",
            marker=dict(symbol="square-open", color=COLORS["volatile"], size=10),
            name="volatile fields", text=[f"volatile field {html.escape(n)}: tokens {s}:{e}"
                                          for s, e, n, _ in fields],
            hovertemplate="%{text}<extra></extra>"))
    if idx is not None:
        shapes.append(dict(type="rect", x0=idx - 0.5, x1=idx + 0.5, y0=-0.5, y1=1.5, layer="above",
                           line=dict(color=COLORS["diverge"], width=3), fillcolor="rgba(0,0,0,0)"))
        fig.add_trace(go.Scatter(
            x=[idx, idx], y=[0, 1], mode="markers", name="first difference",
            marker=dict(symbol="diamond", color=COLORS["diverge"], size=9),
            text=[visible(repr(d.token_a), 60), visible(repr(d.token_b), 60)],
            hovertemplate=f"first difference, token {idx}: %{{text}}<extra></extra>"))
        where = f" in message {d.message_index} ({d.role})" if d.message_index is not None else ""
        title = (f"first difference at token {idx}{where}: {visible(repr(d.token_a), 30)} vs "
                 f"{visible(repr(d.token_b), 30)} · {common} tokens reusable")
    elif d.identical:
        title = f"identical: {len(ta)} tokens"
    else:
        title = f"{'a' if len(ta) < len(tb) else 'b'} is a prefix of the other: {common} tokens shared"
    if idx is not None and length > window:
        x_range = [max(lo, idx - window // 2) - 0.5, min(hi, max(lo, idx - window // 2) + window) - 0.5]
    else:
        x_range = [lo - 0.5, hi - 0.5]
    fig.update_layout(
        title=dict(text=title, font_size=13), shapes=shapes, height=260,
        margin=dict(t=40, l=40, r=10, b=40), showlegend=False,
        xaxis=dict(title="token index", range=x_range),
        yaxis=dict(tickvals=[0, 1], ticktext=["a", "b"], autorange="reversed", range=[1.5, -0.5]),
        meta={"token_index": idx, "common": common, "len_a": len(ta), "len_b": len(tb),
              "volatile": [[s, e, n, r] for s, e, n, r in fields]})
    return fig
