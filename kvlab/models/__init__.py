"""Loading models: the embedded SmolLM2 (from its GGUF), tiny random-weight models, local mlx-lm
folders and Hugging Face cache repo ids (``loading``); the tiny models' configs and builders
(``tiny``), the GGUF conversion (``gguf``) and the model folders kvlab writes (``folders``). VLMs
are in ``kvlab.vlm``.

Example:
    >>> from kvlab.models import load
    >>> m = load("tiny")
"""

from .loading import (DTYPES, NAMES, Model, default_dtype, fingerprint, load, prepare,  # noqa: F401
                      qwen_tokenizer, qwen_tokenizer_dir)
