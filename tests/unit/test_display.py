"""kvlab.primitives.display: the summary line and the table every ``_repr_html_`` is made of.
Text is escaped (a prompt holding ``<script>`` shows as text), ``Html`` goes in as it is, and a
long table stops at its row limit and says how many rows it left out."""

from __future__ import annotations

from kvlab.primitives.display import Html, summary_html, table_html


def test_summary_line_escapes_its_title_and_facts_and_skips_empty_ones():
    got = summary_html("A<B", "3 requests", "", None, "x & y", note="why <not>")
    assert got == "<div><b>A&lt;B</b> 3 requests · x &amp; y<br><i>why &lt;not&gt;</i></div>"
    assert summary_html("Bare") == "<div><b>Bare</b></div>"
    assert summary_html("T", Html("<span>ok</span>"), body="<table></table>") == \
        "<div><b>T</b> <span>ok</span><table></table></div>"
    assert summary_html("LRU(3 units, <1>)", code=True) == "<code>LRU(3 units, &lt;1&gt;)</code>"
    assert isinstance(summary_html("T"), Html)  # so it nests without being escaped again


def test_table_escapes_cells_formats_numbers_and_keeps_html():
    got = table_html(["name", "n", "x"], [("<b>", 3, 0.1234567891), (Html("<i>i</i>"), None, 2.0)])
    assert got == ("<table><tr><th>name</th><th>n</th><th>x</th></tr>"
                   "<tr><td>&lt;b&gt;</td><td>3</td><td>0.123457</td></tr>"
                   "<tr><td><i>i</i></td><td>—</td><td>2</td></tr></table>")


def test_table_stops_at_its_limit_and_counts_the_rest():
    got = table_html(["i"], ([i] for i in range(1234)), limit=2)
    assert got.count("<tr>") == 4 and "<td>1</td>" in got and "<td>2</td>" not in got
    assert got.endswith("<tr><td colspan=1>… 1,232 more</td></tr></table>")
    assert table_html(["i"], [[0], [1]], limit=None).count("<tr>") == 3
    assert "more" not in table_html(["i"], [[0], [1]], limit=2)
    # only the first rows at hand (a frame's head) and the total given
    assert table_html(["i"], [[0], [1]], limit=2, total=10).endswith("… 8 more</td></tr></table>")


def test_name_value_tables_caption_and_class():
    got = table_html(None, [("layers", 2), ("dtype", "float32")], row_headers=True, caption="kvlab Model",
                     css_class="kv-fields")
    assert got == ("<table class='kv-fields'><caption>kvlab Model</caption>"
                   "<tr><th style='text-align:left'>layers</th><td>2</td></tr>"
                   "<tr><th style='text-align:left'>dtype</th><td>float32</td></tr></table>")
    assert table_html(None, []) == "<table></table>"
