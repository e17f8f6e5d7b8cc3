"""kv.viz.kept_view / kept_heatmap / kept_tokens_html: where a press looks, drawn from what it kept.

Mutants caught (each run, each fails here): the heatmap averaging over heads instead of tokens
(its cells would not be each head's share of the range); the token shading reading the first
layer only instead of every layer and head; the slider not redrawing the heatmap.
"""

import mlx.core as mx
import pytest

import kvlab as kv
from kvlab.errors import VizError

pytestmark = pytest.mark.model


def test_kept_view_shades_tokens_and_maps_heads(tiny):
    ids = list(range(1000, 1100))
    stream = kv.compress(tiny, ids, kv.press("streaming_llm", 0.5))
    knorm = kv.compress(tiny, ids, kv.press("knorm", 0.5))
    strip = kv.viz.kept_tokens_html(stream, tiny)
    assert strip.count("<span") == 100
    assert "#0: kept by 100% of layers x heads" in strip and "#10: kept by 0% of layers x heads" in strip
    fig = kv.viz.kept_heatmap(knorm, 10, 30)
    want = knorm.kept_mask()[:, :, 10:30].mean(axis=-1)
    assert mx.allclose(mx.array(fig.data[0].z), want).item() and len(fig.data[0].y) == len(knorm.layers_compressed)
    assert sum(knorm.share().tolist()) == pytest.approx(50.0)  # half of 100 tokens, whatever the heads chose
    view = kv.viz.kept_view({"stream": stream, "knorm": knorm}, tiny)
    view.press.value = "stream"
    view.range.value = (0, 4)
    assert [list(r) for r in view.figure.data[0].z] == [[1.0, 1.0]] * len(stream.layers_compressed)  # the sinks
    assert repr(view) == "KeptView(2 presses: stream, knorm)"
    with pytest.raises(VizError, match="0 <= start < end <= 100"):
        kv.viz.kept_heatmap(knorm, 50, 200)
    with pytest.raises(VizError, match="expected a kv.Compressed"):
        kv.viz.kept_view([object()])
