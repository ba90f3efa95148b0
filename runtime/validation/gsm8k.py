"""GSM8K as the published harnesses run it (VALIDATION.md): records, gold answers, and per protocol the
prompts, stop strings, answer extraction and scoring, so that a number printed here means what theirs means. What
a run measured is a GSM8KResult (gsm8k_results.py)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

from npuport.chat_prompt import ChatTemplate, render_chat_prompt
from npuport.errors import NpuportError
from npuport.jsonfile import JSONFields, json_kind, parse_json
from npuport.runtime.completion import cut_at_stop
from npuport.runtime.validation.gsm8k_results import GSM8KResult, Score

PROTOCOLS = ("sglang", "sglang-classic", "lm-eval", "aisbench")
DEFAULT_PROTOCOL = "sglang"
DEFAULT_SHOTS = 5
MAX_NEW_TOKENS = 512  # sglang's script and AISBench
LM_EVAL_MAX_NEW_TOKENS = 256  # lm-eval's default max_gen_toks (its gsm8k task sets none)
LM_EVAL_SEED = 1234

SGLANG_STOP = ("Question", "Assistant:", "<|separator|>")
LM_EVAL_STOP = ("Question:", "</s>", "<|im_end|>")  # lm-eval gsm8k.yaml's generation_kwargs.until

# AISBench's GSM8K 0-shot chain-of-thought chat prompt (the one vllm-ascend and msModelSlim quote), verbatim:
# the missing space after "question." is part of it.
AISBENCH_INSTRUCTION = (
    'Answer the following question.The last line of the response should follow this format: "answer:$ANSWER" '
    "(without quotes), where ANSWER is a number. Let's think step by step.\n\nQuestion: {question}"
)


def gsm8k_path(split: str) -> Path:
    """The GSM8K split shipped with the package (MIT; notice in the same folder)."""
    return Path(str(resources.files("npuport.data") / "gsm8k" / f"{split}.jsonl"))


# ---------------------------------------------------------------------------------------------------------
# Records and gold answers


def gold_answer(solution: str) -> str:
    """The integer after the last `####` of a reference solution, commas removed, as text ("-10", "2125")."""
    if "####" not in solution:
        raise ValueError("the solution has no '####' line")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not re.fullmatch(r"-?\d+", gold):
        raise ValueError(f"the text after the last '####' is not an integer: {gold!r}")
    return gold


@dataclass(frozen=True)
class GSM8KRecord:
    """One problem: the question and the full reference solution (worked steps, then `#### <answer>`)."""

    question: str
    answer: str

    @property
    def gold(self) -> str:
        return gold_answer(self.answer)


def load_records(path: str | Path | None = None, split: str = "test") -> list[GSM8KRecord]:
    """GSM8K records in file order. `path`: None for the shipped copy, a folder holding `<split>.jsonl`, or a
    `.jsonl` file (then `split` is not used). Each line is `{"question", "answer"}` with a `#### <integer>`."""
    if path is None:
        file = gsm8k_path(split)
    else:
        file = Path(path)
        if file.is_dir():
            file = file / f"{split}.jsonl"
    if not file.is_file():
        raise NpuportError(f"{file}: no such GSM8K file")
    records = []
    try:
        with open(file, "rb") as f:  # decoded line by line, so that bytes that are not UTF-8 are named by line
            for number, raw in enumerate(f, start=1):
                records += _record(raw, file, number)
    except OSError as e:
        raise NpuportError(f"{file}: cannot be read: {e.strerror or e}") from None
    if not records:
        raise NpuportError(f"{file}: no GSM8K records")
    return records


def _record(raw: bytes, file: Path, number: int) -> list[GSM8KRecord]:
    """The record on line `number` of `file` (none for a blank line): a JSON object, each key once, whose
    "question" and "answer" are strings, the answer ending in `#### <integer>`; else one NpuportError naming the
    file, the line and the field."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NpuportError(f"{file}:{number}: not UTF-8 text (byte {e.object[e.start]:#04x} at column "
                           f"{e.start + 1})") from None
    if not line.strip():
        return []
    try:
        value = parse_json(line)
        if not isinstance(value, dict):
            raise NpuportError(f"{file}:{number}: not a GSM8K record (an object with a question and an answer), "
                               f"is {json_kind(value)}")
        row = JSONFields(value)
        record = GSM8KRecord(row.text("question"), row.text("answer"))
        gold_answer(record.answer)  # fail now, while the line number is at hand
    except json.JSONDecodeError as e:
        raise NpuportError(f"{file}:{number}: not a GSM8K record (JSONDecodeError: {e})") from None
    except ValueError as e:
        raise NpuportError(f"{file}:{number}: {e}") from None
    return [record]


def questions_name(data: str | Path | None) -> str:
    """What the questions of `data` (see `load_records`) are called in logs and reports: "GSM8K" for the shipped
    copy, else the folder's (or the file's) name with the format, e.g. "arithmetic (GSM8K format)"."""
    if data is None:
        return "GSM8K"
    path = Path(data)
    return f"{path.name if path.is_dir() else path.stem} (GSM8K format)"


# ---------------------------------------------------------------------------------------------------------
# Prompt pieces


def solved_example(record: GSM8KRecord) -> str:
    """`Question: <q>\\nAnswer: <solution>`: one shot of a few-shot prompt (and one record of training text)."""
    return f"Question: {record.question}\nAnswer: {record.answer}"


def few_shot_prompt(shots: Sequence[GSM8KRecord], question: str) -> str:
    """`Question: <q>\\nAnswer: <solution>` per shot, joined by a blank line, then `Question: <q>\\nAnswer:`."""
    examples = "".join(solved_example(s) + "\n\n" for s in shots)
    return f"{examples}Question: {question}\nAnswer:"


# ---------------------------------------------------------------------------------------------------------
# Answer extraction, one function per harness rule; None means no answer was found (invalid)

_SGLANG_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DIGIT_RUN = re.compile(r"\d+")
_LM_EVAL_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_LM_EVAL_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
# lm-eval's gsm8k `regexes_to_ignore`, applied in this order to prediction and reference alike
_LM_EVAL_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))
_AISBENCH_NUMBER = re.compile(r"-?\d+\.\d+|-?\d+")


def extract_sglang(completion: str) -> str | None:
    """sglang: commas removed, the last `-?\\d+(\\.\\d+)?`."""
    matches = _SGLANG_NUMBER.findall(completion.replace(",", ""))
    return matches[-1] if matches else None


def extract_sglang_classic(completion: str) -> int | None:
    """sglang's classic script: commas removed, the last run of digits as an integer (sign and decimals lost)."""
    runs = _DIGIT_RUN.findall(completion.replace(",", ""))
    return int(runs[-1]) if runs else None


def normalize_lm_eval(text: str) -> str:
    """lm-eval's gsm8k exact-match normalization: drop commas, `$`, everything up to `#### `, a final `.`;
    lower case."""
    for pattern in _LM_EVAL_IGNORE:
        text = pattern.sub("", text)
    return text.lower()


def extract_lm_eval_strict(completion: str) -> str | None:
    """lm-eval strict-match: the first `#### <number>`, normalized."""
    match = _LM_EVAL_STRICT.search(completion)
    return normalize_lm_eval(match.group(1)) if match else None


def extract_lm_eval_flexible(completion: str) -> str | None:
    """lm-eval flexible-extract: the last number-like token (`-?[$0-9.,]{2,}` or `-?[0-9]+`), normalized."""
    matches = _LM_EVAL_FLEXIBLE.findall(completion)
    if not matches:
        return None
    long_token, short_token = matches[-1]
    return normalize_lm_eval(long_token or short_token)


def extract_aisbench(completion: str) -> str | None:
    """AISBench: drop text up to the last `</think>`, cut at `Question:`, the last `-?\\d+\\.\\d+|-?\\d+`
    (commas are not removed: "1,000" reads as "000")."""
    text = completion.rsplit("</think>", 1)[-1]
    text = text.split("Question:", 1)[0]
    matches = _AISBENCH_NUMBER.findall(text)
    return matches[-1] if matches else None


def _numeric_equal(prediction: str, gold: str) -> bool:
    return Fraction(prediction) == Fraction(gold)


def _classic_equal(prediction: int, gold: str) -> bool:
    # The classic script reads the gold with the same rule as the prediction, so a negative gold counts
    # by its magnitude.
    return prediction == abs(int(gold))


def _aisbench_equal(prediction: str, gold: str) -> bool:
    return prediction == gold or abs(float(prediction) - int(gold)) < 1e-6


def _lm_eval_equal(prediction: str, gold_solution: str) -> bool:
    return prediction == normalize_lm_eval(gold_solution)


@dataclass(frozen=True)
class _Rule:
    """One score of a protocol: how to read an answer, and how to judge it against a record."""

    name: str
    extract: Callable[[str], Any]
    judge: Callable[[Any, GSM8KRecord], bool]


# ---------------------------------------------------------------------------------------------------------
# Protocols


class GSM8KProtocol:
    """A GSM8K protocol: which records are scored, the prompt of each, the stop strings, the scoring rules.

    `prompts(n)` gives the prompts of the first n scored questions; `score(completions)` scores the first
    len(completions) of them. Completions are cut at the stop strings first, as the servers do, so a
    generator that ignores `stop` scores the same."""

    name: str = ""
    stop: tuple[str, ...] = ()
    percent: bool = False
    seed: int | None = None
    rules: tuple[_Rule, ...] = ()

    def __init__(self, scored: Sequence[GSM8KRecord], shots: int, max_new_tokens: int = MAX_NEW_TOKENS):
        if not scored:
            raise NpuportError(f"{self.name}: no questions left to score")
        self._scored = list(scored)
        self.shots = shots
        self.max_new_tokens = max_new_tokens

    @property
    def num_available(self) -> int:
        """How many questions this protocol can score."""
        return len(self._scored)

    def questions(self, n: int | None = None) -> list[GSM8KRecord]:
        """The first n scored records (all when n is None)."""
        n = self.num_available if n is None else n
        if not 1 <= n <= self.num_available:
            raise NpuportError(f"{self.name}: asked for {n} questions; 1 to {self.num_available} are available")
        return self._scored[:n]

    def prompts(self, n: int | None = None) -> list[str]:
        """The prompts of the first n scored questions, in order."""
        return [self._prompt(i, r) for i, r in enumerate(self.questions(n))]

    def score(self, completions: Sequence[str], *, latency_s: float | None = None,
              completion_tokens: int | None = None) -> GSM8KResult:
        """Score completions of `prompts(len(completions))`, one per question, in order."""
        records = self.questions(len(completions))
        texts = [cut_at_stop(c, self.stop) for c in completions]
        scores = []
        for rule in self.rules:
            predictions = [rule.extract(t) for t in texts]
            scores.append(Score(
                name=rule.name,
                correct=[p is not None and rule.judge(p, r) for p, r in zip(predictions, records, strict=True)],
                invalid=[p is None for p in predictions],
                predictions=[None if p is None else str(p) for p in predictions],
            ))
        return GSM8KResult(protocol=self.name, shots=self.shots, golds=[r.gold for r in records], scores=scores,
                           percent=self.percent, seed=self.seed, latency_s=latency_s,
                           completion_tokens=completion_tokens)

    def _prompt(self, position: int, record: GSM8KRecord) -> str:
        raise NotImplementedError


class SGLangProtocol(GSM8KProtocol):
    """sglang's GSM8K benchmark: the first k test records are the shots. The newer script scores
    `records[k:k+N]` and compares the last signed decimal numerically; the classic one (`classic=True`)
    scores `records[:N]` (shots included) and compares the last run of digits as an integer."""

    stop = SGLANG_STOP

    def __init__(self, records: Sequence[GSM8KRecord], shots: int = DEFAULT_SHOTS, classic: bool = False,
                 max_new_tokens: int = MAX_NEW_TOKENS):
        if not 0 <= shots < len(records):
            raise NpuportError(f"sglang: {shots} shots need more than {shots} records; the data has {len(records)}")
        self.name = "sglang-classic" if classic else "sglang"
        self._shots = list(records[:shots])
        if classic:
            self.rules = (_Rule("accuracy", extract_sglang_classic, lambda p, r: _classic_equal(p, r.gold)),)
        else:
            self.rules = (_Rule("accuracy", extract_sglang, lambda p, r: _numeric_equal(p, r.gold)),)
        super().__init__(records if classic else records[shots:], shots, max_new_tokens)

    def _prompt(self, position: int, record: GSM8KRecord) -> str:
        return few_shot_prompt(self._shots, record.question)


class LMEvalProtocol(GSM8KProtocol):
    """lm-evaluation-harness `gsm8k`: k shots drawn at random from the train split for every question.

    Seeding, as lm-eval does it: one `random.Random(seed)` (seed 1234 by default) is consumed in question
    order, drawing `rnd.sample(train_records, k)` for each question in turn. The scored set is always
    `records[:N]`, so question i gets the same shots whatever N is. Two scores: strict-match (the first
    `#### <number>`) and flexible-extract (the last number-like token), compared as normalized strings.
    Generation as lm-eval's gsm8k task asks it: greedy, until LM_EVAL_STOP, LM_EVAL_MAX_NEW_TOKENS new tokens."""

    name = "lm-eval"
    stop = LM_EVAL_STOP
    rules = (
        _Rule("strict-match", extract_lm_eval_strict, lambda p, r: _lm_eval_equal(p, r.answer)),
        _Rule("flexible-extract", extract_lm_eval_flexible, lambda p, r: _lm_eval_equal(p, r.answer)),
    )

    def __init__(self, records: Sequence[GSM8KRecord], train_records: Sequence[GSM8KRecord],
                 shots: int = DEFAULT_SHOTS, seed: int = LM_EVAL_SEED,
                 max_new_tokens: int = LM_EVAL_MAX_NEW_TOKENS):
        if not 0 <= shots <= len(train_records):
            raise NpuportError(f"lm-eval: {shots} shots but the train split has {len(train_records)} records")
        self.seed = seed
        self._train = list(train_records)
        self._rnd = random.Random(seed)
        self._drawn: list[list[GSM8KRecord]] = []
        super().__init__(records, shots, max_new_tokens)

    def shots_for(self, position: int) -> list[GSM8KRecord]:
        """The shots of the scored question at `position` (draws for earlier questions happen first)."""
        while len(self._drawn) <= position:
            self._drawn.append(self._rnd.sample(self._train, self.shots))
        return self._drawn[position]

    def _prompt(self, position: int, record: GSM8KRecord) -> str:
        return few_shot_prompt(self.shots_for(position), record.question)


class AISBenchProtocol(GSM8KProtocol):
    """AISBench GSM8K, 0-shot chat: `AISBENCH_INSTRUCTION` as one user message, rendered by the artifact's
    own chat template when a tokenizer is given (else sent as plain text), within `render_chat_prompt`'s time
    and size bounds. Scores `records[:N]`; accuracy is printed as percent."""

    name = "aisbench"
    percent = True
    rules = (_Rule("accuracy", extract_aisbench, lambda p, r: _aisbench_equal(p, r.gold)),)

    def __init__(self, records: Sequence[GSM8KRecord], chat_template: ChatTemplate | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS, chat_template_kwargs: dict[str, Any] | None = None):
        self._chat_template = chat_template
        self._chat_template_kwargs = dict(chat_template_kwargs or {})  # e.g. {"enable_thinking": False}
        super().__init__(records, 0, max_new_tokens)

    def _prompt(self, position: int, record: GSM8KRecord) -> str:
        message = AISBENCH_INSTRUCTION.format(question=record.question)
        if self._chat_template is None:
            return message
        return render_chat_prompt(self._chat_template, [{"role": "user", "content": message}],
                                  self._chat_template_kwargs)


def default_max_new_tokens(name: str) -> int:
    """The new-token limit per question that protocol `name`'s harness uses when it is not told one."""
    return LM_EVAL_MAX_NEW_TOKENS if name == LMEvalProtocol.name else MAX_NEW_TOKENS


def make_protocol(name: str = DEFAULT_PROTOCOL, data: str | Path | None = None, *, shots: int | None = None,
                  chat_template: ChatTemplate | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                  seed: int = LM_EVAL_SEED, max_new_tokens: int | None = None) -> GSM8KProtocol:
    """The protocol `name` (one of PROTOCOLS) on the test split of `data` (see `load_records`; None: the
    shipped copy). lm-eval takes its shots from the train split next to `data` when `data` is a folder,
    else from the shipped train split. `shots` defaults to 5 (aisbench: 0, the only value it takes);
    `max_new_tokens` to the harness's own (`default_max_new_tokens`).
    `chat_template` (a tokenizer loaded from the artifact) and `chat_template_kwargs` serve aisbench only."""
    if name not in PROTOCOLS:
        raise NpuportError(f"unknown GSM8K protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(name)
    records = load_records(data, "test")
    if name == "aisbench":
        if shots not in (None, 0):
            raise NpuportError("aisbench is 0-shot; it takes no shots")
        return AISBenchProtocol(records, chat_template, max_new_tokens, chat_template_kwargs)
    k = DEFAULT_SHOTS if shots is None else shots
    if name == "lm-eval":
        train_source = data if data is not None and Path(data).is_dir() else None
        return LMEvalProtocol(records, load_records(train_source, "train"), k, seed, max_new_tokens)
    return SGLangProtocol(records, k, classic=name == "sglang-classic", max_new_tokens=max_new_tokens)

