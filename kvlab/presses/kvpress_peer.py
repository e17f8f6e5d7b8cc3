"""kvpress (NVIDIA's KV-cache compression toolkit, PyTorch + transformers) as the peer of kvlab's
presses: which positions kvpress keeps, per layer and KV head, on exactly kvlab's weights.

kvpress pins transformers below 5.3 and needs PyTorch, so it runs in its own venv
(``.venv-kvpress``, CPU torch; ``kvlab peer kvpress --install`` or ``make test``'s setup makes it)
as a subprocess (``kvpress_runner.py``): one call loads the model once and runs one prefill per
prompt for every press and ratio asked about it (torch's start-up is the slow part). transformers
loads kvlab's own model folder (``kv.load().path``: HF llama names, safetensors) in float32; for
SmolLM2 on Linux that folder is float32 dequantised from the GGUF and equals, tensor for tensor,
what transformers' own GGUF loader gives. Press options use kvpress's field names.

Example:
    >>> from kvlab.presses import kvpress_peer
    >>> kept = kvpress_peer.kept_positions(ids, "knorm", 0.5)      # [layer] -> [kv_heads, n_kept]
    >>> runs = kvpress_peer.run([kvpress_peer.Case(ids, "snapkv", r) for r in (0.25, 0.5, 0.75)])
    >>> kvpress_peer.agreement(kv.compress(m, ids, kv.press("snapkv", 0.5)).kept, runs[1])
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl

from ..errors import KvlabError, PeerError
from ..primitives.display import summary_html, table_html
from ..venvs import ensure_side_venv, pip_install, side_venv_path

KVPRESS = "kvpress==0.5.5"
TORCH_VERSION = "2.13.0"
RUNNER = Path(__file__).with_name("kvpress_runner.py")
NEAR_TIE = 1e-4  # a swap whose score gap is below this share of the head's typical |score|


@dataclasses.dataclass(frozen=True)
class PeerPress:
    """How a kvlab press name maps onto kvpress: its class, the settings kvlab's press uses, the
    options (kvpress field names) it accepts, and the attention implementation it needs."""

    cls: str
    defaults: tuple = ()
    options: tuple = ()
    attn: str = "sdpa"


PRESSES = {
    "streaming_llm": PeerPress("StreamingLLMPress", (("n_sink", 4),), ("n_sink",)),
    "knorm": PeerPress("KnormPress"),
    "snapkv": PeerPress("SnapKVPress", (("window_size", 64), ("kernel_size", 5)),
                        ("window_size", "kernel_size")),
    "expected_attention": PeerPress("ExpectedAttentionPress", (), (
        "n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")),
    "tova": PeerPress("TOVAPress"),
    "observed_attention": PeerPress("ObservedAttentionPress", attn="eager"),  # needs the weights
    "keydiff": PeerPress("KeyDiffPress"),
    "lagkv": PeerPress("LagKVPress", (), ("n_sink", "lag_size", "cross_scoring")),
}


def names() -> tuple[str, ...]:
    """The kvlab press names kvpress has a peer for."""
    return tuple(PRESSES)


# -- the venv --------------------------------------------------------------------------------------

def kvpress_venv() -> Path:
    """Where kvpress's venv lives: ``$KVLAB_KVPRESS_VENV``, else ``.venv-kvpress`` in the checkout,
    else ``$KVLAB_HOME/venv-kvpress``."""
    return side_venv_path(".venv-kvpress", "KVLAB_KVPRESS_VENV", "venv-kvpress")


def cpu_torch_problem(version: str, platform: str = sys.platform) -> str:
    """Why the torch pip would install (``version``, e.g. "2.13.0+cpu") is not the CPU build kvlab
    wants, or "" when it is: on Linux PyPI's plain build brings CUDA libraries (gigabytes); a CPU
    wheel carries the local label ``+cpu``. macOS wheels are CPU (and MPS) builds.

    Example:
        >>> cpu_torch_problem("2.13.0+cpu", "linux"), cpu_torch_problem("2.13.0", "darwin")
        ('', '')
    """
    if platform == "darwin" or version.endswith("+cpu"):
        return ""
    return f"pip would install torch {version}, not a CPU build (+cpu): on Linux that is the CUDA build"


def _torch_to_install(path: Path) -> str:
    """The torch version for the venv: the one it has, else the one pip would pick (resolved
    without installing it), refused with what to install when it is not a CPU build."""
    py = str(path / "bin" / "python")
    have = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                          capture_output=True, text=True)
    version, why = (have.stdout.strip() if have.returncode == 0 else ""), ""
    if not version:
        with tempfile.TemporaryDirectory(prefix="kvlab-torch-pick-") as tmp:
            report = Path(tmp) / "report.json"
            pick = subprocess.run(pip_install(path, "--dry-run", "--no-deps", "--ignore-installed",
                                              "--report", str(report), f"torch=={TORCH_VERSION}"),
                                  capture_output=True, text=True)
            picked = json.loads(report.read_text())["install"] if report.is_file() else []
        version = picked[0]["metadata"]["version"] if picked else ""
        why = "" if version else f"pip finds no torch {TORCH_VERSION} ({pick.stderr.strip()[-300:]})"
    why = why or cpu_torch_problem(version) or (
        "" if version.startswith(TORCH_VERSION) else f"the venv has torch {version}")
    if why:
        raise PeerError(f"kvpress's venv {path} needs a CPU build of torch {TORCH_VERSION}: {why}. "
                        "Install it yourself from PyTorch's CPU-only wheel index (PyTorch's install "
                        f"page, compute platform CPU): `{py} -m pip install torch=={TORCH_VERSION} "
                        "--index-url <that index>`, then rerun `kvlab peer kvpress --install`")
    return version


def ensure_kvpress_venv(path=None, *, quiet: bool = True) -> Path:
    """Create kvpress's venv: a CPU torch first (so kvpress cannot pull a CUDA build), then
    ``kvpress==0.5.5`` with torch held; idempotent (a stamp) and safe from several processes.

    Example:
        >>> ensure_kvpress_venv()
        PosixPath('/work/kvlab/.venv-kvpress')
    """
    path = Path(path) if path is not None else kvpress_venv()

    def steps(p: Path) -> list:
        torch = f"torch=={_torch_to_install(p)}"
        return [pip_install(p, torch), pip_install(p, KVPRESS, torch)]

    return ensure_side_venv(path, f"{KVPRESS} torch=={TORCH_VERSION}", steps, what=KVPRESS, quiet=quiet)


# -- running kvpress -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One question for kvpress: the positions ``press`` (a kvlab name) keeps at ``ratio`` on the
    prompt ``ids`` (the whole prompt is compressed, as ``with press(model): model(ids)``; for a
    context_end, pass ``ids[:context_end]``). ``options`` are kvpress field names over kvlab's
    defaults; ``verify`` also runs kvpress's own hook in the same forward and checks its cache."""

    ids: tuple
    press: str
    ratio: float
    options: tuple = ()
    verify: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))
        spec = PRESSES.get(self.press)
        if spec is None:
            raise KvlabError(f"kvpress has no peer for press {self.press!r}; known: {', '.join(PRESSES)}")
        if not 0 <= self.ratio < 1:
            raise KvlabError(f"compression ratio {self.ratio} is outside [0, 1): it is the fraction removed")
        bad = sorted(set(dict(self.options)) - set(spec.options))
        if bad:
            raise KvlabError(f"{spec.cls} has no option {', '.join(bad)}; it takes "
                             f"{', '.join(spec.options) or 'none'} (kvpress's field names)")
        if len(self.ids) < 2:
            raise KvlabError("a kvpress case needs a prompt of at least 2 token ids")

    def request(self) -> dict:
        spec = PRESSES[self.press]
        return {"ids": list(self.ids), "press": spec.cls, "ratio": float(self.ratio),
                "options": {**dict(spec.defaults), **dict(self.options)}, "attn": spec.attn,
                "verify": self.verify}


@dataclasses.dataclass(frozen=True, eq=False)
class PeerKept:
    """What kvpress kept for one Case: ``kept[layer]`` the ascending original positions per KV head
    (int32 [kv_heads, n_kept]), ``scores[layer]`` its scores (float32 [kv_heads, T]; None at ratio
    0, where it keeps all without scoring); None for a layer it left alone. ``verified``: kvpress's
    own hook, run in the same forward, kept exactly these rows."""

    case: Case
    kept: list
    scores: list
    verified: bool | None
    meta: dict

    @property
    def press(self) -> str:
        return self.case.press

    @property
    def ratio(self) -> float:
        return self.case.ratio

    @property
    def tokens(self) -> int:
        return len(self.case.ids)

    def _facts(self) -> list[str]:
        done = [k for k in self.kept if k is not None]
        return [f"{self.tokens} tokens -> {done[0].shape[1] if done else '-'} per head",
                f"{len(done)} of {len(self.kept)} layers x {done[0].shape[0] if done else 0} KV heads",
                f"kvpress {self.meta['versions']['kvpress']}, {self.meta['dtype']}"
                + (", verified" if self.verified else "")]

    def __repr__(self) -> str:
        return (f"PeerKept({PRESSES[self.press].cls} {self.press} ratio {self.ratio:g}: "
                + ", ".join(self._facts()) + ")")

    def _repr_html_(self) -> str:
        margins = self.margins()
        return summary_html(f"kvpress {PRESSES[self.press].cls}", f"ratio {self.ratio:g}", *self._facts(),
                            body=table_html(margins.columns, margins.head(12).rows(), total=margins.height))

    def margins(self) -> pl.DataFrame:
        """Per layer and head, the score margin at kvpress's cut: the last kept score minus the
        first dropped one, also relative to the head's median |score| (a tiny margin is a near-tie
        that float noise in another stack can flip)."""
        rows = []
        for layer, (kept, scores) in enumerate(zip(self.kept, self.scores)):
            if kept is None or scores is None:
                continue
            for head in range(kept.shape[0]):
                cut = _cut(scores[head], kept.shape[1])
                rows.append({"layer": layer, "head": head, "n_kept": kept.shape[1], **cut})
        return pl.DataFrame(rows, schema={"layer": pl.Int64, "head": pl.Int64, "n_kept": pl.Int64,
                                          "margin": pl.Float64, "rel_margin": pl.Float64})


def _cut(scores: np.ndarray, n: int) -> dict:
    ordered = np.sort(scores.astype(np.float64))[::-1]
    if n >= len(ordered):
        return {"margin": None, "rel_margin": None}
    margin = float(ordered[n - 1] - ordered[n])
    return {"margin": margin, "rel_margin": margin / _scale(scores)}


def _scale(scores: np.ndarray) -> float:
    return float(np.median(np.abs(scores))) or 1.0


def run(cases, model="smollm2", *, timeout: float = 1800.0) -> list[PeerKept]:
    """Ask kvpress about every Case in one subprocess (one model load, one prefill per distinct
    prompt and attention implementation); ``model`` is a kvlab model, name or folder that
    transformers can load (a llama, qwen2/3, mistral, phi3 or gemma3 folder).

    Example:
        >>> a, b = run([Case(ids, "knorm", 0.5), Case(ids, "streaming_llm", 0.5)])
        >>> a.kept[0].shape
        (3, 298)
    """
    from ..loader import model_folder

    cases = [c if isinstance(c, Case) else Case(*c) for c in cases]
    if not cases:
        return []
    folder = model_folder(model)
    venv = ensure_kvpress_venv()
    with tempfile.TemporaryDirectory(prefix="kvlab-kvpress-") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.npz"
        request.write_text(json.dumps({"model": str(folder), "cases": [c.request() for c in cases]}))
        # offline, and nothing written outside the temporary folder (transformers' caches)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": tmp,
               "TOKENIZERS_PARALLELISM": "false", "PYTHONNOUSERSITE": "1"}
        proc = subprocess.run([str(venv / "bin" / "python"), str(RUNNER), str(request), str(out)],
                              capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            raise PeerError(f"kvpress on {folder.name} failed (exit {proc.returncode}): "
                            f"{(proc.stderr or proc.stdout)[-1200:]}")
        with np.load(out) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in z.files if k != "meta"}
    layers, shared = range(meta["layers"]), {k: v for k, v in meta.items() if k != "cases"}
    return [PeerKept(c, [arrays.get(f"c{i}.kept.{n}") for n in layers],
                     [arrays.get(f"c{i}.scores.{n}") for n in layers], meta["cases"][i]["verified"], shared)
            for i, c in enumerate(cases)]


def kept_positions(ids, press: str, ratio: float, *, model="smollm2", **options) -> list:
    """kvpress's kept positions for one press: per layer int32 [kv_heads, n_kept], ascending (None
    for a layer it left alone). Several presses or ratios: ``run`` (one subprocess for all).

    Example:
        >>> kept_positions(ids, "streaming_llm", 0.5)[0][0, :6]
        array([  0,   1,   2,   3, 302, 303], dtype=int32)
    """
    return run([Case(ids, press, ratio, tuple(options.items()))], model)[0].kept


# -- agreement -------------------------------------------------------------------------------------

def _layers(kept) -> list:
    """Per layer, per head, the set of positions kept (-1 pads a head that keeps fewer: dropped)."""
    kept = getattr(kept, "kept", kept)
    return [None if k is None else [set(int(p) for p in row if p >= 0) for row in np.asarray(k)]
            for k in kept]


def agreement(ours, theirs) -> pl.DataFrame:
    """Per layer and KV head: how many positions each side kept, whether the sets are equal, their
    Jaccard overlap and how many only one side kept. ``ours``/``theirs``: a list per layer of
    [kv_heads, n_kept] positions (mx or numpy; -1 pads ignored) or None, or an object with
    ``.kept`` (kv.compress's result, a PeerKept). A layer one side compressed and the other did not has
    null counts on that side and ``exact`` False.

    Example:
        >>> summary(agreement(compressed.kept, peer))
        'agreement: 90 of 90 heads exact over 30 layers; Jaccard min 1.000, mean 1.000'
    """
    a, b = _layers(ours), _layers(theirs)
    if len(a) != len(b):
        raise KvlabError(f"ours has {len(a)} layers and theirs {len(b)}: not the same model")
    rows = []
    for layer, (x, y) in enumerate(zip(a, b)):
        if x is None and y is None:
            continue
        for head in range(len(x if x is not None else y)):
            sx = x[head] if x is not None else None
            sy = y[head] if y is not None else None
            both = None if sx is None or sy is None else len(sx & sy)
            rows.append({"layer": layer, "head": head, "n_ours": None if sx is None else len(sx),
                         "n_theirs": None if sy is None else len(sy), "exact": sx == sy,
                         "jaccard": None if both is None else both / max(len(sx | sy), 1),
                         "only_ours": None if both is None else len(sx) - both,
                         "only_theirs": None if both is None else len(sy) - both})
    return pl.DataFrame(rows, schema={"layer": pl.Int64, "head": pl.Int64, "n_ours": pl.Int64,
                                      "n_theirs": pl.Int64, "exact": pl.Boolean, "jaccard": pl.Float64,
                                      "only_ours": pl.Int64, "only_theirs": pl.Int64})


def summary(frame: pl.DataFrame) -> str:
    """One line for an ``agreement`` frame."""
    if frame.height == 0:
        return "agreement: no compressed layer on either side"
    j = frame["jaccard"].drop_nulls()
    return (f"agreement: {int(frame['exact'].sum())} of {frame.height} heads exact over "
            f"{frame['layer'].n_unique()} layers; Jaccard min {j.min() if len(j) else 0:.3f}, "
            f"mean {j.mean() if len(j) else 0:.3f}")


def explain(ours, theirs: PeerKept, our_scores=None) -> pl.DataFrame:
    """One row per head where the two sides kept different positions: which positions, and how far
    the swapped positions sit from each side's cut in its own scores (``gap``: the largest distance,
    ``rel_gap``: over the head's median |score|). ``near_tie`` when the gap is under NEAR_TIE on
    kvpress's side (and on ours, given ``our_scores``: per layer [kv_heads, T]); else ``differs``;
    ``n_kept differs`` when the counts do.

    Example:
        >>> explain(compressed.kept, peer).select("layer", "head", "verdict")
    """
    a, b = _layers(ours), _layers(theirs)
    rows = []
    for layer, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None or theirs.scores[layer] is None:
            continue
        for head, (sx, sy) in enumerate(zip(x, y)):
            if sx == sy:
                continue
            row = {"layer": layer, "head": head, "only_ours": sorted(sx - sy), "only_theirs": sorted(sy - sx),
                   **_gap(theirs.scores[layer][head], sy, sx, "theirs")}
            if our_scores is not None and our_scores[layer] is not None:
                row.update(_gap(np.asarray(our_scores[layer])[head], sx, sy, "ours"))
            ties = [v <= NEAR_TIE for k, v in row.items() if k.startswith("rel_gap")]
            row["verdict"] = ("n_kept differs" if len(sx) != len(sy) else
                              "near_tie" if all(ties) else "differs")
            rows.append(row)
    return pl.DataFrame(rows) if rows else pl.DataFrame(
        schema={"layer": pl.Int64, "head": pl.Int64, "verdict": pl.String})


def _gap(scores: np.ndarray, kept: set, other: set, side: str) -> dict:
    """How far the positions one side swapped sit from its own cut: for a position it kept and the
    other did not, its score minus the best it dropped; for one it dropped, the worst it kept minus
    its score. Largest over the swapped positions."""
    s = scores.astype(np.float64)
    dropped = [p for p in range(len(s)) if p not in kept]
    best_dropped = max((s[p] for p in dropped), default=-np.inf)
    worst_kept = min(s[p] for p in kept)
    gaps = [s[p] - best_dropped for p in kept - other] + [worst_kept - s[p] for p in other - kept]
    gap = float(max(gaps)) if gaps else 0.0
    return {f"gap_{side}": gap, f"rel_gap_{side}": gap / _scale(scores)}
