"""What a GSM8K run measured: per scoring rule, each question's correctness, invalidity and prediction, and the
run's headline accuracy, latency and throughput (gsm8k.py's protocols make them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Score:
    """One scoring rule applied to every question: per-question correctness, invalidity and prediction."""

    name: str
    correct: list[bool]
    invalid: list[bool]
    predictions: list[str | None]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    @property
    def invalid_rate(self) -> float:
        return sum(self.invalid) / len(self.invalid)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "accuracy": self.accuracy, "invalid_rate": self.invalid_rate,
                "correct": list(self.correct), "invalid": list(self.invalid), "predictions": list(self.predictions)}


@dataclass
class GSM8KResult:
    """What one protocol measured on N questions. `scores[0]` is the headline score (lm-eval: strict-match,
    then flexible-extract). Accuracies are fractions; `percent` says the harness prints them as percent.
    `latency_s` and `completion_tokens` are filled by whoever ran the generation."""

    protocol: str
    shots: int
    golds: list[str]
    scores: list[Score]
    percent: bool = False
    seed: int | None = None
    latency_s: float | None = None
    completion_tokens: int | None = None

    @property
    def num_questions(self) -> int:
        return len(self.golds)

    @property
    def accuracy(self) -> float:
        return self.scores[0].accuracy

    @property
    def invalid_rate(self) -> float:
        return self.scores[0].invalid_rate

    @property
    def correct(self) -> list[bool]:
        return self.scores[0].correct

    @property
    def reported_accuracy(self) -> float:
        """The headline accuracy as the harness prints it (0.945, or 94.5 for a percent harness)."""
        return self.accuracy * 100 if self.percent else self.accuracy

    @property
    def output_throughput(self) -> float | None:
        """Completion tokens per wall second of the batch, when both were recorded."""
        if self.latency_s is None or self.completion_tokens is None or self.latency_s <= 0:
            return None
        return self.completion_tokens / self.latency_s

    def score(self, name: str) -> Score:
        for s in self.scores:
            if s.name == name:
                return s
        raise KeyError(f"{self.protocol} has no score {name!r}; it has {[s.name for s in self.scores]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol, "shots": self.shots, "num_questions": self.num_questions,
            "seed": self.seed, "accuracy": self.accuracy, "invalid_rate": self.invalid_rate,
            "percent": self.percent, "reported_accuracy": self.reported_accuracy,
            "latency_s": self.latency_s, "completion_tokens": self.completion_tokens,
            "output_throughput": self.output_throughput, "golds": list(self.golds),
            "scores": [s.to_dict() for s in self.scores],
        }
