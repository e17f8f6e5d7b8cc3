
import pytest

import kvlab  # noqa: F401  (loads OpenBLAS before anything imports mlx)



@pytest.fixture(scope="session")
def tiny():
    """The deterministic random-weight Qwen3-tokenizer model, float32."""
    import kvlab as kv

    return kv.load("tiny")


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct (converted once into KVLAB_HOME)."""
    import kvlab as kv

    return kv.load()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """mlx-lm's TokenizerWrapper around the real Qwen3 tokenizer (no model weights)."""
    from kvlab.models import qwen_tokenizer

    return qwen_tokenizer()
