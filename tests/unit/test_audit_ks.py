"""kvlab.audit.ks: the exact one-sided two-sample KS p-value, checked three ways: against brute
force (every interleaving of small samples enumerated), against closed forms (D+ = 1 has
p = 1 / C(m+n, m)), and against values scipy 1.17.1 gives for ``stats.ks_2samp(hit, miss,
alternative="greater", method="exact")`` on the same data (copied here: scipy is not one of
kvlab's dependencies).

Mutants caught: the p-value counted as ``1 - below/total`` in floats (every p under 1e-16 becomes
0); D+ evaluated between tied values (ties read as an ordering); the one-sided statistic taken two-
sided (|F - G|: a faster *miss* sample set would count as evidence of caching)."""

import itertools
import math
import statistics

import pytest

from kvlab.audit.ks import critical_d, ks_less, paths_below
from kvlab.audit.procedure import smallest_shared
from kvlab.errors import KvlabError

SCIPY = {  # (hit, miss): (D+, p) from scipy 1.17.1, exact method, alternative="greater"
    "a": (([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), (1.0, 0.003968253968253967)),
    "b": (([1, 3, 5, 7, 9, 11, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18]), (0.3333333333333333, 0.3333916083916084)),
    "c": (([0.5 * i for i in range(30)], [0.5 * i + 4.1 for i in range(30)]), (0.3, 0.06751358369255105)),
    "d": (([float(i) for i in range(250)], [i + 60.5 for i in range(250)]), (0.244, 3.044759143982733e-07)),
    "e": (([3, 1, 4, 1.5, 9, 2.6], [5, 3.5, 8, 9.7, 9.3, 2.3, 8.4]), (0.5476190476190477, 0.10606060606060606)),
}


@pytest.mark.parametrize("case", sorted(SCIPY))
def test_matches_scipy_exact(case):
    (hit, miss), (d, p) = SCIPY[case]
    r = ks_less(hit, miss)
    assert r.d == pytest.approx(d, abs=1e-12) and r.p == pytest.approx(p, rel=1e-9, abs=0)


def brute(m, n, h) -> float:
    """P(D+ >= h/(mn)) by enumerating every placement of the m hits among m+n ranks."""
    hits = 0
    for places in itertools.combinations(range(m + n), m):
        i = j = best = 0
        chosen = set(places)
        for k in range(m + n):
            i, j = (i + 1, j) if k in chosen else (i, j + 1)
            best = max(best, i * n - j * m)
        hits += best >= h
    return hits / math.comb(m + n, m)


@pytest.mark.parametrize("m, n", [(1, 1), (2, 3), (4, 4), (5, 3), (3, 6)])
def test_matches_brute_force_for_every_threshold(m, n):
    total = math.comb(m + n, m)
    for h in range(1, m * n + 1):
        assert (total - paths_below(m, n, h)) / total == pytest.approx(brute(m, n, h), abs=1e-15)


def test_closed_forms_and_tiny_p_values():
    for m, n in [(5, 5), (30, 30), (250, 250)]:
        r = ks_less(list(range(m)), [x + m for x in range(n)])
        assert r.d == 1.0 and r.p == pytest.approx(1 / math.comb(m + n, m), rel=1e-12, abs=0)
    assert 0 < ks_less(list(range(250)), [x + 250 for x in range(250)]).p < 1e-148  # no float cancellation to 0
    assert ks_less([10, 11], [1, 2]).p == 1.0  # hits slower: no evidence, one-sided
    assert ks_less([1.0, 1.0], [1.0, 1.0]).d == 0.0  # ties are one value, not an ordering


def test_critical_d_is_the_tests_power():
    assert critical_d(30, 30, 5e-9) == pytest.approx(0.7344, abs=1e-3)
    assert critical_d(250, 250, 5e-9) < 0.3
    assert critical_d(5, 5, 1e-8) == math.inf
    # at the critical D+ the test rejects, one step below it does not
    total = math.comb(60, 30)
    h = round(critical_d(30, 30, 5e-9) * 900)
    assert (total - paths_below(30, 30, h)) / total < 5e-9 <= (total - paths_below(30, 30, h - 1)) / total


def test_smallest_shared_and_bad_input():
    miss = [0.25 + 0.001 * i for i in range(30)]
    hit = [0.05 + 0.0005 * i for i in range(30)]
    k = smallest_shared(hit, miss, 500, 5e-9)
    assert 1 < k < 500
    saved = (statistics.median(miss) - statistics.median(hit)) / 500
    assert ks_less([h + (500 - k) * saved for h in hit], miss).p < 5e-9  # k shared: still detected
    assert ks_less([h + (500 - k + 1) * saved for h in hit], miss).p >= 5e-9  # one fewer: not
    assert smallest_shared(miss, hit, 500, 5e-9) is None  # "hits" slower: nothing to detect
    with pytest.raises(KvlabError, match="samples on both sides"):
        ks_less([], [1.0])
