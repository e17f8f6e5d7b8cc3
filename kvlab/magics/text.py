"""Text the magics read and write: a ``%%kvlab chat`` cell body as messages, a prefix tree as
indented lines."""

from __future__ import annotations

import re

from IPython.core.error import UsageError

ROLE_LINE = re.compile(r"^(system|user|assistant|tool|developer)\s*:[ \t]?(.*)$", re.IGNORECASE)


def parse_chat(body: str) -> list[dict]:
    """``system: ...`` / ``user: ...`` lines -> messages; other lines continue the previous message.

    Example:
        >>> parse_chat("system: Be brief.\\nuser: Hi\\nthere")
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi\\nthere'}]
    """
    messages: list[dict] = []
    for n, line in enumerate((body or "").splitlines(), 1):
        m = ROLE_LINE.match(line)
        if m:
            messages.append({"role": m.group(1).lower(), "content": m.group(2)})
        elif messages:
            messages[-1]["content"] += "\n" + line
        elif line.strip():
            raise UsageError(f"chat line {n} ({line.strip()[:40]!r}) comes before any message: start "
                             "each message with 'system:', 'user:', 'assistant:' or 'tool:'")
    if not messages:
        raise UsageError("the chat cell is empty: write lines like 'system: Be brief.' and 'user: Hi'")
    for m in messages:
        m["content"] = m["content"].strip("\n")
    return messages


def tree_lines(frame, tokenizer, preview: int = 10) -> list[str]:
    """An indented text rendering of a store's tree_frame() (RadixStore's nodes, SharedRadixStore's,
    PagedStore's runs of blocks), one line per node.

    Example:
        >>> tree_lines(store.tree_frame(), model.tokenizer)[0]
        "root"
    """
    children: dict = {}
    by_id = {}
    for row in frame.iter_rows(named=True):
        by_id[row["id"]] = row
        children.setdefault(row["parent"], []).append(row["id"])
    roots = children.get(None, [])
    lines: list[str] = []

    def label(row) -> str:
        if row["parent"] is None:
            return "root"
        ids = list(row["edge_ids"] or [])
        try:
            text = tokenizer.decode(ids[:preview]) if tokenizer is not None else ""
        except Exception:  # a tokenizer that cannot decode these ids: show the ids
            text = " ".join(map(str, ids[:preview]))
        more = "…" if len(ids) > preview else ""
        entry = (f" ● entry {row['entry']} ({row['entry_kind']}, {row['bytes'] / 1024:.0f} KiB)"
                 if row["entry"] is not None else "")
        blocks = f" in {row['blocks']} blocks" if row.get("blocks") else ""
        span = "?" if row["start"] is None else f"{row['start']}:{row['depth']}"  # a chain whose head left
        return (f"[{span}) {row['tokens']} tok{blocks}, hits {row['hits']}{entry}  "
                f"{text[:60]!r}{more}")

    def walk(node_id, prefix: str, last: bool, top: bool) -> None:
        row = by_id[node_id]
        lines.append(label(row) if top else f"{prefix}{'└─ ' if last else '├─ '}{label(row)}")
        kids = children.get(node_id, [])
        nxt = "" if top else prefix + ("   " if last else "│  ")
        for j, kid in enumerate(kids):
            walk(kid, nxt, j == len(kids) - 1, False)

    for r in roots:
        walk(r, "", True, True)
    return lines

