"""Packaging (issue 20 §2): every mlx-lm / mlx-vlm name kvlab imports exists in the installed
packages, which are inside pyproject's pinned ranges; and the MLX backend is an extra on Linux
(kvlab[cpu] or kvlab[cuda]), never a base dependency: mlx-cpu and mlx-cuda both ship
mlx/lib/libmlx.so, so a base mlx[cpu] overwrites a CUDA install."""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from kvlab.serving import peers

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LINUX = {"sys_platform": "linux", "platform_system": "Linux"}
DARWIN = {"sys_platform": "darwin", "platform_system": "Darwin"}
BACKEND_WHEELS = {"mlx-cpu", "mlx-cuda", "mlx-cuda-12", "mlx-cuda-13"}
# modules kvlab imports that appeared in a later release than the previous floor: (first release
# with it, the release before it). Read from the wheels on PyPI: mlx_lm/processors/ is absent from
# mlx_lm-0.32.0-py3-none-any.whl and present in 0.32.1.
FIRST_RELEASE = {"mlx_lm.processors": ("0.32.1", "0.32.0")}


def kvlab_imports() -> list[tuple[str, str, str | None]]:
    """(file:line, module, name or None) for every mlx_lm / mlx_vlm import in kvlab's sources,
    module level or inside functions."""
    found = []
    for path in sorted((ROOT / "kvlab").rglob("*.py")):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [(f"{where}:{node.lineno}", a.name, None) for a in node.names
                          if a.name.split(".")[0] in ("mlx_lm", "mlx_vlm")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in ("mlx_lm", "mlx_vlm"):
                found += [(f"{where}:{node.lineno}", node.module, a.name) for a in node.names]
    return found


IMPORTS = kvlab_imports()


def requirement(dist: str) -> Requirement:
    """pyproject's requirement on ``dist`` (base dependencies first, then the extras)."""
    lists = [PYPROJECT["dependencies"], *PYPROJECT["optional-dependencies"].values()]
    for req in (Requirement(r) for reqs in lists for r in reqs):
        if req.name == dist:
            return req
    raise AssertionError(f"pyproject.toml does not name {dist}")


def test_the_scan_finds_what_kvlab_imports():
    # mutant: the scan misses ImportFrom or function-level imports (ast walked only at module level)
    # -> these known imports (generator.py's is inside a function body) go missing
    pairs = {(m, n) for _, m, n in IMPORTS}
    assert ("mlx_lm.processors", "load_processor") in pairs
    assert ("mlx_lm.generate", "generate_step") in pairs
    assert ("mlx_vlm.utils", "get_model_and_args") in pairs
    assert len(IMPORTS) >= 20


@pytest.mark.parametrize("where,module,name", IMPORTS, ids=[f"{w}:{m}.{n or ''}" for w, m, n in IMPORTS])
def test_every_imported_name_exists(where, module, name):
    # mutant: kvlab imports a name the pinned mlx-lm does not have (e.g. a renamed server class)
    dist = module.split(".")[0].replace("_", "-")
    missing = f"{where}: kvlab imports {module}{'.' + name if name else ''}, which {dist} {metadata.version(dist)} lacks"
    try:
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            importlib.import_module(f"{module}.{name}")  # `from pkg import submodule`
    except ImportError as e:
        raise AssertionError(missing) from e


@pytest.mark.parametrize("dist", ["mlx", "mlx-lm", "mlx-vlm"])
def test_installed_versions_are_inside_the_pins(dist):
    # mutant: pin mlx-lm to ">=0.28,<0.32" (or mlx-vlm to "<0.7.10") -> the tested version is outside it
    req = requirement(dist)
    installed = metadata.version(dist)
    assert req.specifier.contains(installed, prereleases=True), (dist, installed, str(req.specifier))


def test_pins_exclude_releases_without_the_modules_kvlab_imports():
    # mutant: mlx-lm's floor lowered back to ">=0.28" (or to ">=0.32.0") while kvlab/serving/
    # generator.py imports mlx_lm.processors -> 0.32.0 is allowed and kvlab fails at import there
    modules = {m for _, m, _ in IMPORTS}
    checked = 0
    for module, (first, before) in FIRST_RELEASE.items():
        if module not in modules:
            continue
        spec = requirement(module.split(".")[0].replace("_", "-")).specifier
        assert not spec.contains(before, prereleases=True), (module, before, str(spec))
        checked += 1
    assert checked == 1
    # and the pin has an upper bound: kvlab uses mlx_lm.server internals that change between minors
    assert not requirement("mlx-lm").specifier.contains("0.33.0")


def test_linux_base_dependencies_carry_no_mlx_backend():
    # mutant: "mlx[cpu]>=0.32.2; sys_platform == 'linux'" back in the base dependencies -> a CUDA
    # machine's libmlx.so is overwritten by installing kvlab
    linux = [Requirement(r) for r in PYPROJECT["dependencies"]]
    linux = [r for r in linux if r.marker is None or r.marker.evaluate(LINUX)]
    assert [r.name for r in linux if r.name in BACKEND_WHEELS] == []
    assert [(r.name, sorted(r.extras)) for r in linux if r.name == "mlx"] == [("mlx", [])]
    darwin = [Requirement(r) for r in PYPROJECT["dependencies"]]
    darwin = [r for r in darwin if r.marker is not None and r.marker.evaluate(DARWIN)
              and not r.marker.evaluate(LINUX)]
    assert [(r.name, sorted(r.extras)) for r in darwin] == [("mlx", [])]


def test_backend_extras_name_real_mlx_extras():
    # mutant: kvlab[cuda] = "mlx[cuda12x]" (or the cpu extra dropped) -> not an extra mlx provides
    mlx_extras = set(metadata.metadata("mlx").get_all("Provides-Extra"))
    for extra in ("cpu", "cuda"):
        reqs = [Requirement(r) for r in PYPROJECT["optional-dependencies"][extra]]
        assert [(r.name, sorted(r.extras)) for r in reqs] == [("mlx", [extra])]
        assert reqs[0].marker.evaluate(LINUX) and not reqs[0].marker.evaluate(DARWIN)
        assert extra in mlx_extras


def test_environment_yml_mirrors_the_pins():
    # mutant: environment.yml keeps "mlx[cpu]" or the old "mlx-lm>=0.28" after pyproject moved on
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    reqs = {Requirement(r).name: Requirement(r) for r in pip if not r.startswith("-")}
    assert not any(name in BACKEND_WHEELS for name in reqs)
    assert [str(Requirement(r)) for r in pip if r.startswith("mlx")] == [
        str(Requirement(r)) for r in PYPROJECT["dependencies"] if r.startswith("mlx")] + [
        str(requirement("mlx-vlm"))]


def _installed(dist: str) -> bool:
    try:
        return bool(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return False


def test_peer_venv_follows_the_backend(monkeypatch):
    # mutant: the peers' venv hard-codes mlx-lm[cpu] -> a CUDA machine gets mlx-cpu there too
    monkeypatch.delenv("KVLAB_BACKEND", raising=False)
    if sys.platform == "darwin":  # plain mlx is Metal: no extra whatever is asked
        assert peers.peer_mlx_lm_requirement() == "mlx-lm==0.31.3"
        return
    installed = {d for d in ("mlx-cpu", "mlx-cuda-12") if _installed(d)}
    assert peers.peer_mlx_lm_requirement() == (
        "mlx-lm[cuda12]==0.31.3" if "mlx-cuda-12" in installed else "mlx-lm[cpu]==0.31.3")
    monkeypatch.setenv("KVLAB_BACKEND", "cuda")
    assert peers.peer_mlx_lm_requirement() == "mlx-lm[cuda12]==0.31.3"
    monkeypatch.setenv("KVLAB_BACKEND", "rocm")
    with pytest.raises(peers.PeerError, match="KVLAB_BACKEND='rocm': on Linux the MLX backend is 'cpu' or 'cuda'"):
        peers.peer_mlx_lm_requirement()
