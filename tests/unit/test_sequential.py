"""kvlab serve's own sequential loop (kvlab.serving.sequential) without a model: its logits
processors see the prompt tokens kvlab prefilled itself, as mlx-lm's sequential path shows them."""

import types

import mlx.core as mx
import pytest

from kvlab.serving.sequential import logits_processors


def _logits_args(**kw):
    fields = dict(logit_bias=None, repetition_penalty=None, repetition_context_size=20, presence_penalty=None,
                  presence_context_size=20, frequency_penalty=None, frequency_context_size=20)
    return types.SimpleNamespace(**{**fields, **kw})


def test_a_repetition_penalty_counts_the_prompt_kvlab_prefilled():
    # mutant: the processors given only what stream_generate passes them (the last prompt token
    # on): tokens 3 and 4 of the prompt, which kvlab prefilled, go unpenalised
    (penalty,) = logits_processors(_logits_args(repetition_penalty=1.5), [3, 4])
    out = penalty(mx.array([5]), mx.ones((1, 8)))[0].tolist()
    assert out == pytest.approx([1, 1, 1, 1 / 1.5, 1 / 1.5, 1 / 1.5, 1, 1])
    assert logits_processors(_logits_args(), [3, 4]) == []  # no penalty asked: none made
