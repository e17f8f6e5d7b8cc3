"""The quality battery behind ``kvlab press``: one press at one ratio on one model, in one record.

``run`` returns exactly the keys ``KEYS`` (``kvlab press --json`` prints them): the context size
and what the press kept of it (``tokens``, ``kept_tokens`` per KV head, ``bytes_full``,
``bytes_kept``), the teacher-forced ``kl`` / ``top1`` / ``delta_nll`` over a continuation that
copies a passage of the context back (``kvlab.presses.quality``), task ``accuracy`` gated on the
uncompressed model (questions it answers) beside its ``baseline_accuracy``, and the times:
``prefill_s``, ``compress_s`` and greedy decode tokens per second on the full and the compressed
cache. Fields a task does not measure are None (``--task kl``: no accuracy; ``needle``/``vt``:
no divergence).

Example:
    >>> rec = run(kv.load(), kv.press("snapkv", 0.5), task="kl", tokens=512)
    >>> sorted(rec) == sorted(KEYS)
    True
"""

from __future__ import annotations

from ..primitives.snapshots import prefill, restore
from .compress import Prefilled
from .quality import answers, decode_speed, divergence, document, gated
from .tasks import suite

KEYS = ("press", "ratio", "tokens", "kept_tokens", "bytes_full", "bytes_kept", "kl", "top1", "delta_nll",
        "accuracy", "baseline_accuracy", "prefill_s", "compress_s", "decode_tok_s_full", "decode_tok_s_kept")
TASKS = ("kl", "needle", "vt", "all")


def task_list(task: str, n: int, words: int, seed: int) -> list:
    """The tasks ``kvlab press --task`` runs (``all``: needles, multi-key and variable tracking)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "kl":
        return []
    if task in ("needle", "vt"):
        return suite(task, n, words=words, seed=seed)
    return (suite("needle", n, words=words, seed=seed) + suite("multikey", max(1, n // 3), words=words, seed=seed)
            + suite("vt", n, words=words, seed=seed))


def run(model, press, *, task: str = "all", tokens: int = 1024, n: int = 6, seed: int = 0,
        continuation: int = 64, decode: int = 32) -> dict:
    """One record of ``KEYS`` for ``press`` on ``model`` (module docstring)."""
    tasks = task_list(task, n, int(tokens * 0.7), seed)
    context, cont = document(model, tokens, continuation=continuation, seed=seed)
    pre = Prefilled(model, context, [press])
    c = pre.compress(press)
    first = cont[0]
    record = {"press": press.key, "ratio": press.ratio, "tokens": len(context), "kept_tokens": c.kept_tokens,
              "bytes_full": c.bytes_full, "bytes_kept": c.bytes_kept, "kl": None, "top1": None,
              "delta_nll": None, "accuracy": None, "baseline_accuracy": None, "prefill_s": pre.prefill_s,
              "compress_s": c.compress_s,
              "decode_tok_s_full": decode_speed(model, restore(pre.snapshot), first, decode),
              "decode_tok_s_kept": decode_speed(model, c.cache, first, decode)}
    if task in ("kl", "all"):
        full = prefill(model, cont, restore(pre.snapshot), all_logits=True)[0]
        record.update(divergence(model, pre, press, cont, full_logits=full))
    if tasks:
        got = answers(model, tasks, [press])
        record["accuracy"], record["baseline_accuracy"] = gated(got[None], got[press.key])
    return record
