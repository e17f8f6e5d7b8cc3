"""kvlab's exception types. Every message says what was wrong and what to do."""


class KvlabError(Exception):
    """Base class of every error kvlab raises on purpose."""


class ModelNotFoundError(KvlabError, FileNotFoundError):
    """A model name or folder that kvlab cannot load."""


class TemplateError(KvlabError, ValueError):
    """A conversation the chat template cannot render (empty, unknown role, no template)."""


class BoundaryError(KvlabError, ValueError):
    """A split point that does not exist in the conversation."""


class SnapshotError(KvlabError, ValueError):
    """A snapshot that cannot be used: wrong model, corrupt file, newer format."""


class SnapshotFileError(SnapshotError, OSError):
    """A snapshot file that cannot be written (missing folder, no space, no permission)."""


class NotTrimmableError(KvlabError, ValueError):
    """A cache layer that cannot drop tokens (SSM state, wrapped rotating cache)."""


class BlockSizeError(KvlabError, ValueError):
    """A block size that is not a positive integer."""


class RequestError(KvlabError, ValueError):
    """A request the engine cannot run (empty, too long for the model's context)."""


class GenerationError(KvlabError, RuntimeError):
    """mlx-lm's generation thread died; ``status`` is the HTTP status a served request gets."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class BudgetError(KvlabError, ValueError):
    """A store budget that cannot hold what is asked of it."""


class BufferLimitError(BudgetError):
    """A store that would keep more live buffers than the backend allows (Metal's resource limit)."""


class DeviceError(KvlabError, ValueError):
    """A backend name kvlab does not know (it knows cpu, metal, cuda)."""


class TraceError(KvlabError, ValueError):
    """A trace file that is missing or malformed."""


class ImageError(KvlabError, ValueError):
    """An image that cannot be read or does not fit the model or the prompt."""


class UnknownAlgoError(KvlabError, ValueError):
    """A hash algorithm name block_hashes does not know."""


class TokenIdError(KvlabError, ValueError):
    """Token ids, extra keys or a salt that cannot be hashed (not ints, out of range, bad spans)."""


class RuleError(KvlabError, ValueError):
    """A normalisation rule that cannot be built or applied (bad regex, non-str result)."""


class VizError(KvlabError, ValueError):
    """A figure or widget that cannot be drawn: missing notebook extras, or data of the wrong shape."""


class MissingExtraError(VizError, ImportError):
    """plotly / ipywidgets are not installed."""


class VLMUnavailableError(KvlabError, ImportError):
    """mlx-vlm is not installed."""


class QuantizationError(KvlabError, ValueError):
    """KV quantization settings mlx cannot use (bits, a group size that does not divide head_dim)."""


class DiagnosticsError(KvlabError, ValueError):
    """A cache-diagnostics request kvlab cannot read (a malformed ``diagnostics`` or
    ``prompt_cache_options`` object, a request body that is not a prompt); ``status`` is the HTTP
    status a served request gets."""

    status = 400


class ExportFileError(KvlabError, ValueError):
    """Another tool's export kvlab cannot read (an AIPerf ``profile_export_aiperf.json``/``.csv``
    that is missing, malformed or lacks a metric); the message names the file and what is missing."""


class PressError(KvlabError, ValueError):
    """A KV-cache press that cannot run as asked: a ratio outside [0, 1), an unknown press name, a
    press that needs queries a layer cannot give, a model with no full-attention layer."""


class PeerError(KvlabError, RuntimeError):
    """A peer kvlab compares against (vllm-mlx, mlx-vlm's server, kvpress) that cannot be installed,
    started, reached or run; the message says what to install or fix."""


class TenantError(KvlabError, ValueError):
    """A keys file, server secret or tenant setting kvlab cannot use (a malformed line, a key
    given twice, an unreadable secret); the message names the file and line."""
