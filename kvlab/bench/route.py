"""A real cluster beside the simulator: two `kvlab serve` processes (paged store, KV events) behind
`kvlab route` (llm-d's weighted rule on the precise view), all on loopback (``kv.cluster.up``), and
a prefix-sharing workload (three groups whose requests extend one another, interleaved) sent one
request at a time: send, wait for the instance's final insert and the router's view, send the next.
The simulator replays the same token ids over two instances with a ServiceModel calibrated on the
even-numbered requests (kvlab.cluster.realrun.beside). Reported: whether every routing decision
and every request's reused tokens equal the simulator's, and on the odd-numbered requests the
median relative error of the modelled TTFT (TTFT measured by the client: send -> first text chunk).

Example:
    >>> t = bench_route("tiny", per_group=3)
    >>> t.values["decisions_equal"]
    True
"""

from __future__ import annotations

from .settings import Settings
from .table import Table

NEEDS_MODEL = False
POLICY, VIEW, CAPACITY = "llmd_weighted", "precise", 65536


def bench_route(model: str = "smollm2", *, groups: int = 3, per_group: int = 8) -> Table:
    """Run the workload through a real two-instance cluster and through the simulator."""
    from ..cluster.launch import up
    from ..cluster.realrun import beside, prefix_texts, run_through
    from ..models.loading import load

    tok = load(model).tokenizer
    texts = prefix_texts(tok, groups, per_group)
    with up(2, model, "paged", policy=POLICY, view=VIEW, port=0,
            router_args=("--capacity-tokens", str(CAPACITY))) as cluster:
        real = run_through(cluster.url, texts, model=model, settle=cluster.settle)
    frame, s = beside(real, [tok.encode(t) for t in texts], POLICY, VIEW, instances=2, capacity_tokens=CAPACITY)
    rows = (("requests: calibration / held out / first on an instance (warm-up, left out)",
             f"{s['calibrated']} / {s['held_out']} / {s['requests'] - s['calibrated'] - s['held_out']}"),
            ("routing decisions equal to the simulator's", str(s["decisions_equal"])),
            ("reused tokens per request equal to the simulator's", str(s["reused_equal"])),
            ("reused tokens, real / simulated", f"{int(frame['reused_tokens'].sum())} / "
                                                f"{int(frame['sim_reused_tokens'].sum())}"),
            ("calibrated service model", repr(s["service"])),
            ("held-out TTFT median, measured / modelled (s)", f"{s['ttft_median_s']:.3f} / {s['modelled_ttft_median_s']:.3f}"),
            ("held-out TTFT median |modelled - measured| / measured", f"{s['ttft_median_abs_rel_error']:.1%}"))
    values = {k: v for k, v in s.items() if k != "service"}
    values.update(model=model, service=repr(s["service"]))
    return Table(f"a real 2-instance cluster ({model}, {POLICY}/{VIEW}) beside the simulator",
                 "kvlab bench --only route", ("figure", "value"), rows,
                 f"`kv.cluster.up(2, {model!r}, 'paged', policy={POLICY!r})`: two kvlab serve processes and "
                 "kvlab route on loopback; the workload is kvlab.cluster.realrun.prefix_texts "
                 f"({groups} groups x {per_group} requests), one request at a time, max_tokens=1. Target: "
                 "decisions and reused tokens equal to the simulator's; modelled TTFT within 25% of the "
                 "measured (median over held-out requests) after calibration.", values=values)


def table(s: Settings) -> Table:
    return bench_route(s.model_name)
