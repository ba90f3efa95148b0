"""Paired statistics against hand computations (binomial sums, the normal approximation, a Wilson table)."""

from __future__ import annotations

import pytest

from npuport.runtime.validation.paired_stats import (
    compare_paired,
    mcnemar_exact,
    paired_bootstrap_interval,
    wilson_interval,
)


def _pairs(both: int, only_ref: int, only_cand: int, neither: int) -> tuple[list[bool], list[bool]]:
    """Reference and candidate correctness vectors with the given cell counts."""
    ref = [True] * both + [True] * only_ref + [False] * only_cand + [False] * neither
    cand = [True] * both + [False] * only_ref + [True] * only_cand + [False] * neither
    return ref, cand


@pytest.mark.parametrize("only_ref, only_cand, p", [
    (2, 10, 0.03857421875),  # 2 * (C(12,0)+C(12,1)+C(12,2)) / 2^12 = 2 * 79 / 4096
    (1, 6, 0.125),           # 2 * (1 + 7) / 128
    (0, 5, 0.0625),          # 2 * 1 / 32
    (5, 0, 0.0625),          # symmetric
    (3, 3, 1.0),             # 2 * 42 / 64 > 1, capped
    (0, 0, 1.0),             # no discordant pairs
])
def test_mcnemar_exact_matches_binomial_sums(only_ref, only_cand, p):
    ref, cand = _pairs(both=20, only_ref=only_ref, only_cand=only_cand, neither=4)
    result = mcnemar_exact(ref, cand)
    assert (result.only_reference, result.only_candidate) == (only_ref, only_cand)
    assert result.p_value == pytest.approx(p, rel=1e-12)


def test_mcnemar_on_many_discordant_pairs_stays_finite():
    # 1319 questions, 0 vs 319 discordant: p = 2 / 2^319
    ref, cand = _pairs(both=1000, only_ref=0, only_cand=319, neither=0)
    assert mcnemar_exact(ref, cand).p_value == pytest.approx(2.0 ** -318, rel=1e-9)


def test_bootstrap_interval_matches_the_normal_approximation():
    # 400 questions, candidate better on 40, worse on 20: mean difference 20/400 = 0.05,
    # var(d) = 60/400 - 0.05^2 = 0.1475, SE = sqrt(0.1475/400) = 0.019203, 1.96 SE = 0.03764
    ref, cand = _pairs(both=300, only_ref=20, only_cand=40, neither=40)
    low, high = paired_bootstrap_interval(ref, cand, resamples=4000, seed=3)
    assert low == pytest.approx(0.05 - 0.03764, abs=0.006)
    assert high == pytest.approx(0.05 + 0.03764, abs=0.006)


def test_bootstrap_is_seeded_and_degenerate_cases_are_exact():
    ref, cand = _pairs(both=50, only_ref=5, only_cand=9, neither=6)
    assert paired_bootstrap_interval(ref, cand, resamples=500, seed=7) == \
        paired_bootstrap_interval(ref, cand, resamples=500, seed=7)
    assert paired_bootstrap_interval(ref, cand, resamples=500, seed=7) != \
        paired_bootstrap_interval(ref, cand, resamples=500, seed=8)
    same, _ = _pairs(both=30, only_ref=0, only_cand=0, neither=10)
    assert paired_bootstrap_interval(same, same, resamples=200) == (0.0, 0.0)
    worse = [False] * 10
    assert paired_bootstrap_interval(worse, [True] * 10, resamples=200) == (1.0, 1.0)


def test_wilson_interval_matches_the_published_table():
    # 90 of 100: Wilson 95% interval (0.8256, 0.9448); 0 of 10: (0, 0.2775)
    low, high = wilson_interval([True] * 90 + [False] * 10)
    assert (low, high) == (pytest.approx(0.8256, abs=1e-4), pytest.approx(0.9448, abs=1e-4))
    low, high = wilson_interval([False] * 10)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.2775, abs=1e-4)


@pytest.mark.parametrize("n", [1, 7, 10, 200])
def test_wilson_interval_holds_its_accuracy_and_is_exact_at_none_and_all_correct(n):
    for k in range(n + 1):
        low, high = wilson_interval([True] * k + [False] * (n - k))
        assert 0.0 <= low <= k / n <= high <= 1.0, (k, n, low, high)
    assert wilson_interval([False] * n)[0] == 0.0 and wilson_interval([True] * n)[1] == 1.0


@pytest.mark.parametrize(("n", "confidence", "z"), [(10, 0.95, 1.959963984540054), (37, 0.90, 1.6448536269514722)])
def test_wilson_interval_is_the_closed_form_and_exact_at_none_and_all_correct(n, confidence, z):
    """Wilson's closed form with z written out (the normal quantile of 1 - alpha/2, from a table): bounds
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n); at 0 and at n correct the closed form gives 0 and 1
    exactly, which the floats must not miss."""
    for k in range(n + 1):
        p = k / n
        centre, spread = p + z * z / (2 * n), z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
        expected = ((centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n))
        low, high = wilson_interval([True] * k + [False] * (n - k), confidence)
        assert (low, high) == (pytest.approx(expected[0], abs=1e-12), pytest.approx(expected[1], abs=1e-12)), k
    assert wilson_interval([False] * n, confidence)[0] == 0.0  # closed form: (z^2/2n - z^2/2n) / ... = 0
    assert wilson_interval([True] * n, confidence)[1] == 1.0  # closed form: (1 + z^2/n) / (1 + z^2/n) = 1


def test_compare_paired_reports_candidate_minus_reference():
    ref, cand = _pairs(both=80, only_ref=2, only_cand=10, neither=8)
    c = compare_paired(ref, cand, seed=0, resamples=500)
    assert c.num_questions == 100
    assert c.reference_accuracy == 0.82 and c.candidate_accuracy == 0.90
    assert c.difference == pytest.approx(0.08)
    assert c.mcnemar_p == pytest.approx(0.03857421875)
    assert c.interval[0] < 0.08 < c.interval[1]


def test_unpaired_vectors_are_refused():
    with pytest.raises(ValueError, match="length"):
        mcnemar_exact([True, False], [True])
    with pytest.raises(ValueError):
        compare_paired([], [])
