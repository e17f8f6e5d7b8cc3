"""Docstring examples are run (issue 9 §4), so the Examples a reader copies stay true.

Every example of the pure modules runs here with ``kv`` (the package) in its namespace; the ones
that use the tiny model ``m`` (or load a model) run under the ``model`` marker, the VLM's under
``vlm``. Mutant caught: change an example's expected output (or the code it documents, e.g.
``fmt_bytes`` printing "KB") and its item here fails with doctest's report.
"""

from __future__ import annotations

import doctest
import importlib
import re

import pytest

import kvlab as kv

PURE = ["kvlab.primitives.tokens", "kvlab.primitives.chat_template", "kvlab.primitives.display", "kvlab.primitives.boundary", "kvlab.primitives.blocks", "kvlab.primitives.timing", "kvlab.primitives.divergence", "kvlab.primitives.volatile",
        "kvlab.primitives.normalisation", "kvlab.request", "kvlab.keys", "kvlab.primitives.units", "kvlab.workloads",
        "kvlab.workloads.generators", "kvlab.workloads.multimodal", "kvlab.workloads.text", "kvlab.workloads.fit", "kvlab.workloads.fixed",
        "kvlab.serving.workload_params", "kvlab.audit.ks"]
VLM = ["kvlab.vlm", "kvlab.vlm.images", "kvlab.vlm.model", "kvlab.vlm.net", "kvlab.vlm.build",
       "kvlab.vlm.load", "kvlab.vlm.archs", "kvlab.vlm.tiny_archs", "kvlab.loader"]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
NEEDS_MODEL = re.compile(r"\bm\b|kv\.load\(|\bload_vlm\(|ensure_tiny_vlm\(")


def _collect():
    finder = doctest.DocTestFinder(exclude_empty=True)
    params = []
    for name in PURE + VLM:
        try:
            module = importlib.import_module(name)
        except ImportError as e:  # kvlab.vlm needs nothing at import; a broken module must fail
            raise AssertionError(f"{name} does not import: {e}") from e
        for test in finder.find(module, name):
            if not test.examples:
                continue
            vlm = name in VLM
            model = vlm or any(NEEDS_MODEL.search(ex.source) for ex in test.examples)
            marks = ([pytest.mark.model] if model else []) + ([pytest.mark.vlm] if vlm else [])
            params.append(pytest.param(test, id=test.name, marks=marks))
    return params


TESTS = _collect()


@pytest.fixture(scope="module")
def namespace(request):
    """What every example may use: ``kv``, and ``m`` = the tiny model for examples that use it."""
    return {"kv": kv}


@pytest.mark.parametrize("test", TESTS)
def test_docstring_examples(test, namespace, request):
    globs = {**test.globs, **namespace}
    if "model" in request.node.keywords:
        globs["m"] = request.getfixturevalue("tiny")
    test = doctest.DocTest(test.examples, globs, test.name, test.filename, test.lineno, test.docstring)
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    result = runner.run(test, out=out.append, clear_globs=False)
    assert result.failed == 0, "".join(out)


def test_every_listed_module_has_examples():
    names = {p.values[0].name for p in TESTS}
    for module in PURE + VLM:
        assert any(n == module or n.startswith(module + ".") for n in names), f"{module} has no examples"
