"""Is a W8A8 artifact's accuracy different from its BF16 source's on the same questions? Exact McNemar test
and a seeded paired bootstrap interval of the difference; plus the Wilson interval of a single accuracy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import torch

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95
_BOOTSTRAP_CHUNK = 1_000  # resamples drawn at once: bounds memory at chunk x questions indices


def _check_pair(reference: Sequence[bool], candidate: Sequence[bool]) -> int:
    if len(reference) != len(candidate):
        raise ValueError(f"paired vectors differ in length: {len(reference)} vs {len(candidate)}")
    if not reference:
        raise ValueError("no questions to compare")
    return len(reference)


@dataclass(frozen=True)
class McNemarResult:
    """Discordant pairs and the exact two-sided p-value of 'neither model is better on them'."""

    only_reference: int  # questions the reference got right and the candidate wrong
    only_candidate: int  # questions the candidate got right and the reference wrong
    p_value: float


def mcnemar_exact(reference: Sequence[bool], candidate: Sequence[bool]) -> McNemarResult:
    """Exact McNemar test: with n discordant pairs of which b favour the rarer side, the two-sided
    binomial p-value is min(1, 2 * sum_{i<=b} C(n, i) / 2^n); 1 when there are no discordant pairs."""
    _check_pair(reference, candidate)
    only_ref = sum(bool(r) and not bool(c) for r, c in zip(reference, candidate, strict=True))
    only_cand = sum(bool(c) and not bool(r) for r, c in zip(reference, candidate, strict=True))
    n = only_ref + only_cand
    tail = sum(math.comb(n, i) for i in range(min(only_ref, only_cand) + 1))
    p = min(1.0, 2 * tail / 2**n) if n else 1.0
    return McNemarResult(only_ref, only_cand, p)


def paired_bootstrap_interval(reference: Sequence[bool], candidate: Sequence[bool], *,
                              resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                              seed: int = 0) -> tuple[float, float]:
    """Percentile interval of accuracy(candidate) - accuracy(reference): questions are resampled with
    replacement, the same questions for both (a torch.Generator seeded with `seed`), `resamples` times."""
    n = _check_pair(reference, candidate)
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError("need resamples >= 1 and 0 < confidence < 1")
    diff = torch.tensor([int(bool(c)) - int(bool(r)) for r, c in zip(reference, candidate, strict=True)],
                        dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    means = []
    for start in range(0, resamples, _BOOTSTRAP_CHUNK):
        rows = min(_BOOTSTRAP_CHUNK, resamples - start)
        index = torch.randint(0, n, (rows, n), generator=generator)
        means.append(diff[index].mean(dim=1))
    alpha = 1 - confidence
    q = torch.quantile(torch.cat(means), torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64))
    return float(q[0]), float(q[1])


def wilson_interval(correct: Sequence[bool], confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of the accuracy sum(correct)/len(correct). At none or all correct the bound on that
    side is exactly 0 or 1, as the formula says: computed in floats it lands a rounding off (2.8e-17 above an
    accuracy of 0), and an interval that does not hold its own accuracy breaks every error bar drawn from it."""
    n = len(correct)
    if not n:
        raise ValueError("no questions")
    k = sum(bool(c) for c in correct)
    p = k / n
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if k == 0 else min(p, max(0.0, center - half))
    high = 1.0 if k == n else max(p, min(1.0, center + half))
    return low, high


@dataclass(frozen=True)
class PairedComparison:
    """Candidate (W8A8) against reference (BF16) on the same questions; difference = candidate - reference."""

    num_questions: int
    reference_accuracy: float
    candidate_accuracy: float
    difference: float
    interval: tuple[float, float]  # paired bootstrap, at `confidence`
    only_reference: int
    only_candidate: int
    mcnemar_p: float
    confidence: float
    resamples: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "interval": list(self.interval)}


def compare_paired(reference: Sequence[bool], candidate: Sequence[bool], *, seed: int = 0,
                   resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE) -> PairedComparison:
    """McNemar and the paired bootstrap interval for two per-question correctness vectors."""
    n = _check_pair(reference, candidate)
    ref_acc = sum(map(bool, reference)) / n
    cand_acc = sum(map(bool, candidate)) / n
    test = mcnemar_exact(reference, candidate)
    interval = paired_bootstrap_interval(reference, candidate, resamples=resamples, confidence=confidence, seed=seed)
    return PairedComparison(n, ref_acc, cand_acc, cand_acc - ref_acc, interval, test.only_reference,
                            test.only_candidate, test.p_value, confidence, resamples, seed)
