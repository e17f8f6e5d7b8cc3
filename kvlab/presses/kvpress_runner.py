"""Runs inside the kvpress venv (``.venv-kvpress``), never inside kvlab: it imports neither kvlab
nor MLX. kvlab's ``kvlab.presses.kvpress_peer`` writes a request and runs

    <venv>/bin/python kvpress_runner.py request.json out.npz

Request: ``{"model": <transformers-loadable folder>, "cases": [{"ids": [...], "press":
"KnormPress", "ratio": 0.5, "options": {...}, "attn": "sdpa", "verify": false}, ...]}``.
The model is loaded once in float32; each distinct (ids, attn) runs one prefill forward, and a
forward hook on every attention layer (registered as kvpress's own ``BasePress.__call__`` does)
calls each case's ``press.compress`` on that layer's full keys, values, hidden states and
attention output, exactly the call kvpress's hook makes. The press's ``score`` is observed (not
changed) and the kept indices are its top-k, the same ``topk`` call ``ScorerPress.compress``
makes; the rows compress returned must equal the full rows at those indices, or the run fails.
With ``verify`` kvpress's real ``with press(model)`` hook runs in the same forward, after ours,
and the cache it compressed must hold exactly those rows.

Out: ``c{i}.kept.{layer}`` int32 [kv_heads, n_kept] (ascending original positions) and
``c{i}.scores.{layer}`` float32 [kv_heads, T] (None-layers absent), ``meta`` (a JSON string:
versions, timings, per case the layers compressed and the verification).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

T0 = time.perf_counter()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import kvpress  # noqa: E402
from kvpress.presses.scorer_press import ScorerPress  # noqa: E402
from kvpress.utils import compute_n_kept, extract_keys_and_values  # noqa: E402

IMPORT_S = time.perf_counter() - T0


class RunnerError(Exception):
    """What kvlab reports back to its caller (exit code 2, the message on stderr)."""


def make_press(case: dict):
    cls = getattr(kvpress, case["press"], None)
    if cls is None or not issubclass(cls, ScorerPress):
        raise RunnerError(f"{case['press']} is not a kvpress ScorerPress in kvpress {kvpress_version()}")
    if cls.compress is not ScorerPress.compress:
        raise RunnerError(f"{case['press']} overrides ScorerPress.compress: its kept rows are not a "
                          "per-head top-k of its scores, so they cannot be read this way")
    return cls(compression_ratio=case["ratio"], **case.get("options", {}))


def kvpress_version() -> str:
    from importlib import metadata

    return metadata.version("kvpress")


def observe(press, module, hidden, keys, values, attentions, kwargs):
    """Call kvpress's own ``press.compress`` once; return (top-k indices [1, H, n] in kvpress's
    order, its scores [1, H, T] or None at ratio 0). Fails if the rows compress returned are not
    the full rows at those indices."""
    seen = {}
    score = press.score

    def spy(*args, **kw):
        seen["scores"] = score(*args, **kw)
        return seen["scores"]

    press.score = spy  # an instance attribute: removed below, the class's method is untouched
    try:
        k_out, _ = press.compress(module, hidden, keys, values, attentions, kwargs)
    finally:
        del press.score
    T = keys.shape[2]
    if "scores" not in seen:  # ratio 0: compress keeps everything without scoring
        return torch.arange(T).expand(1, keys.shape[1], T), None
    n = compute_n_kept(T, press.compression_ratio)
    idx = seen["scores"].topk(n, dim=-1).indices  # the same call ScorerPress.compress makes
    rows = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    if not torch.equal(rows, k_out):
        raise RunnerError(f"layer {module.layer_idx}: the rows {type(press).__name__}.compress kept "
                          "are not the full rows at its top-k indices")
    return idx, seen["scores"]


def attention_layers(model):
    """The attention modules kvpress's ``BasePress.__call__`` hooks, prepared as it prepares them."""
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    for layer in language_model.layers:
        if isinstance(model, transformers.Gemma3ForConditionalGeneration) and layer.self_attn.is_sliding:
            continue  # kvpress leaves Gemma3's sliding-window layers alone
        # presses read module.rotary_emb (ExpectedAttention)
        layer.self_attn.rotary_emb = language_model.rotary_emb
        yield layer.self_attn


def n_layers(model) -> int:
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return len(language_model.layers)


def hooked_forward(model, ids, presses, real=None):
    """One prefill of ``ids``; per press and layer (top-k indices, scores, full keys). With ``real``
    (one of ``presses``) kvpress's own hook runs too, registered after ours (hooks run in that
    order: ours reads the full keys, then kvpress compresses the cache in place), and its
    compressed cache must hold exactly the full rows at our indices: the real path, checked in
    the same forward (a layer's compressed cache is not read again within the forward)."""
    found = [{} for _ in presses]

    def hook(module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for press, per_layer in zip(presses, found):
            idx, scores = observe(press, module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            per_layer[module.layer_idx] = (idx, scores, keys)
        return output

    for press in presses:
        press.post_init_from_model(model)
    hooks = [attn.register_forward_hook(hook, with_kwargs=True) for attn in attention_layers(model)]
    try:
        with torch.inference_mode(), (real(model) if real is not None else contextlib.nullcontext()):
            cache = model.model(input_ids=ids, use_cache=True).past_key_values
    finally:
        for h in hooks:
            h.remove()
    if real is not None:
        for layer, (idx, _, keys) in found[presses.index(real)].items():
            rows = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
            if not torch.equal(cache.layers[layer].keys, rows):
                raise RunnerError(f"layer {layer}: kvpress's own `with press(model)` cache does not "
                                  f"hold the rows observed for {type(real).__name__}")
    return found


def groups(cases: list) -> dict:
    """Case indices per forward: one per (ids, attention implementation), with at most one
    verified case each (a further one gets a forward of its own)."""
    out: dict = {}
    for i, case in enumerate(cases):
        base, k = (tuple(case["ids"]), case.get("attn", "sdpa")), 0
        while case.get("verify") and any(cases[j].get("verify") for j in out.get((*base, k), [])):
            k += 1
        out.setdefault((*base, k), []).append(i)
    return out


def main(request_path: str, out_path: str) -> None:
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    request = json.load(open(request_path))
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        request["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    meta = {"versions": {"kvpress": kvpress_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "dtype": "float32", "layers": n_layers(model), "import_s": IMPORT_S, "load_s": time.perf_counter() - t,
            "forwards": [], "cases": [{} for _ in request["cases"]]}
    arrays = {}
    for (ids, attn, _), members in groups(request["cases"]).items():
        model.set_attn_implementation(attn)
        presses = [make_press(request["cases"][i]) for i in members]
        real = next((p for i, p in zip(members, presses) if request["cases"][i].get("verify")), None)
        t = time.perf_counter()
        found = hooked_forward(model, torch.tensor([ids], dtype=torch.long), presses, real)
        meta["forwards"].append({"tokens": len(ids), "attn": attn, "cases": len(members),
                                 "seconds": time.perf_counter() - t})
        for i, press, per_layer in zip(members, presses, found):
            for layer, (idx, scores, _) in per_layer.items():
                arrays[f"c{i}.kept.{layer}"] = idx[0].sort(dim=-1).values.numpy().astype(np.int32)
                if scores is not None:
                    arrays[f"c{i}.scores.{layer}"] = scores[0].float().numpy()
            meta["cases"][i] = {"layers": sorted(per_layer), "verified": True if press is real else None}
    np.savez(out_path, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except RunnerError as e:
        print(f"kvpress runner: {e}", file=sys.stderr)
        sys.exit(2)
