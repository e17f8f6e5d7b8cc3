import os

import pytest

import kvlab  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# Under `make test` (KVLAB_STRICT=1) a tier that cannot run is a failure: a skipped browser,
# OpenBLAS or trace test is a tier a user cannot run. A skip stays a skip only for a missing
# platform feature, and then its reason must start with "platform:" (e.g. "platform: macOS only").
STRICT = os.environ.get("KVLAB_STRICT") == "1"
PLATFORM_SKIP = "platform:"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (STRICT and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.removeprefix("Skipped: ").startswith(PLATFORM_SKIP):
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} would be skipped under `make test` ({reason}). A tier that "
                       "cannot run is a failure here: fix the setup as the reason says (scripts/"
                       "setup.sh installs everything `make test` needs), then rerun.")


@pytest.fixture(scope="session")
def tiny():
    """The deterministic random-weight Qwen3-tokenizer model, float32."""
    import kvlab as kv

    return kv.load("tiny")


@pytest.fixture(scope="session")
def tiny_hybrid():
    """lfm2 with conv (ArraysCache) and attention layers: its cache cannot be cut back."""
    import kvlab as kv

    return kv.load("tiny-hybrid")


@pytest.fixture(scope="session")
def family():
    """family("llama4") -> kv.load("tiny:llama4"), each loaded once per session (a load reads the
    Qwen tokenizer: seconds, where the tiny model's requests take milliseconds)."""
    import functools

    import kvlab as kv

    return functools.cache(lambda model_type: kv.load(f"tiny:{model_type}"))


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct (converted once into KVLAB_HOME)."""
    import kvlab as kv

    return kv.load()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """mlx-lm's TokenizerWrapper around the real Qwen3 tokenizer (no model weights)."""
    from kvlab.models.loading import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture
def start(tiny):
    """start(store, model=tiny, **kw) -> a running kv.Server on loopback; all are stopped after
    the test."""
    import kvlab as kv

    servers = []

    def _start(store="radix", model=None, **kw):
        kw.setdefault("api_key", "")  # "" = no key, whatever $KVLAB_API_KEY says
        server = kv.serve(model or tiny, store, **kw)
        servers.append(server)
        return server

    yield _start
    for s in servers:
        s.stop()
        assert not s.running
