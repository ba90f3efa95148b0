"""GSM8K protocols: every expected value below was derived by hand from VALIDATION.md's rules."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from npuport.cli import main
from npuport.errors import NpuportError
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.validation.gsm8k import (
    AISBENCH_INSTRUCTION,
    AISBenchProtocol,
    GSM8KRecord,
    LMEvalProtocol,
    SGLangProtocol,
    extract_aisbench,
    extract_lm_eval_flexible,
    extract_lm_eval_strict,
    extract_sglang,
    extract_sglang_classic,
    few_shot_prompt,
    gold_answer,
    load_records,
    make_protocol,
)
from npuport.runtime.validation.validate import ValidateOptions

# Hand-written records: (question, solution); golds 18, 1000, -3, 5, 18, 7
RECORDS = [
    GSM8KRecord("Q0?", "Work 0.\n#### 18"),
    GSM8KRecord("Q1?", "Work 1.\n#### 1,000"),
    GSM8KRecord("Q2?", "Work 2.\n#### -3"),
    GSM8KRecord("Q3?", "Work 3.\n#### 5"),
    GSM8KRecord("Q4?", "Work 4.\n#### 18"),
    GSM8KRecord("Q5?", "Work 5.\n#### 7"),
]


# --- gold answers and data -------------------------------------------------------------------------------

@pytest.mark.parametrize("solution, gold", [
    ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
    ("#### 1,000", "1000"),
    ("#### -3", "-3"),
    ("a #### 5 then\n#### 6", "6"),
])
def test_gold_is_the_integer_after_the_last_hashes(solution, gold):
    assert gold_answer(solution) == gold


@pytest.mark.parametrize("solution", ["no hashes, 18", "#### eighteen", "#### 1.5"])
def test_gold_that_is_not_an_integer_is_refused(solution):
    with pytest.raises(ValueError):
        gold_answer(solution)


def test_shipped_test_split_loads_with_its_first_gold():
    records = load_records()
    assert len(records) == 1319
    assert records[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert records[0].gold == "18"
    assert len(load_records(split="train")) == 7473


def test_data_path_may_be_a_file_or_a_folder(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "A?", "answer": "x\\n#### 2,5"}\n\n', encoding="utf-8")
    assert load_records(tmp_path / "test.jsonl") == [GSM8KRecord("A?", "x\n#### 2,5")]
    assert load_records(tmp_path)[0].gold == "25"


@pytest.mark.parametrize("line, needle", [
    ("not json", "line.jsonl:2"),
    ('{"question": "A?"}', "line.jsonl:2"),
    ('{"question": "A?", "answer": "no answer line"}', "line.jsonl:2"),
])
def test_bad_record_names_file_and_line(tmp_path, line, needle):
    path = tmp_path / "line.jsonl"
    path.write_text('{"question": "A?", "answer": "#### 1"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(NpuportError, match=needle):
        load_records(path)


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(NpuportError, match="nothere.jsonl"):
        load_records(tmp_path / "nothere.jsonl")


# --- extraction, one rule per harness ----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("The total is 1,000 dollars.", "1000"),
    ("She lost -5 points", "-5"),
    ("It costs $18.00.", "18.00"),
    ("no number here", None),
    ("First 3 apples, then 4, so 7 in total.", "7"),
    ("Steps...\n#### 42", "42"),
    ("<think>maybe 12</think> so 15", "15"),
    ("between 3-5", "-5"),
    ("1,000.50 in the bank", "1000.50"),
])
def test_sglang_takes_the_last_signed_decimal_after_removing_commas(text, expected):
    assert extract_sglang(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("The total is 1,000 dollars.", 1000),
    ("She lost -5 points", 5),
    ("It costs $18.00.", 0),  # the last run of digits is "00"
    ("no number here", None),
    ("Steps...\n#### 42", 42),
])
def test_sglang_classic_takes_the_last_run_of_digits(text, expected):
    assert extract_sglang_classic(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("So the answer is 18.\n#### 18", "18"),
    ("#### 1,000.", "1000"),
    ("#### $5", None),  # `$` may not follow `#### `
    ("#### 7\n#### 8", "7"),
    ("The answer is 18", None),
    ("#### -3", "-3"),
])
def test_lm_eval_strict_match_takes_the_first_hashes_number(text, expected):
    assert extract_lm_eval_strict(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("She pays $18.00.", "18.00"),
    ("1,000 apples", "1000"),
    ("x is 5", "5"),
    ("no number here", None),
    ("-7 degrees", "-7"),
    ("#### 12", "12"),
    ("Answer: 3. Then 4.", "4"),
])
def test_lm_eval_flexible_extract_takes_the_last_number_like_token(text, expected):
    assert extract_lm_eval_flexible(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>the answer is 99</think>\nanswer:42", "42"),
    ("<think>a</think> first <think>b 7</think> 8", "8"),
    ("answer: 12\nQuestion: what is 5+5? 10", "12"),
    ("answer:1,000", "000"),  # commas are not removed
    ("answer:-3.50", "-3.50"),
    ("<think>5</think>I cannot tell", None),
    ("nothing", None),
])
def test_aisbench_drops_thinking_cuts_at_question_and_takes_the_last_number(text, expected):
    assert extract_aisbench(text) == expected


# --- prompts ---------------------------------------------------------------------------------------------

def test_few_shot_prompt_layout():
    assert few_shot_prompt(RECORDS[:2], "Why?") == (
        "Question: Q0?\nAnswer: Work 0.\n#### 18\n\n"
        "Question: Q1?\nAnswer: Work 1.\n#### 1,000\n\n"
        "Question: Why?\nAnswer:"
    )
    assert few_shot_prompt([], "Why?") == "Question: Why?\nAnswer:"


def test_sglang_shots_are_the_first_records_and_newer_scores_after_them():
    protocol = SGLangProtocol(RECORDS, shots=2)
    assert protocol.num_available == 4
    assert protocol.questions(1) == [RECORDS[2]]
    assert protocol.prompts(1) == [
        "Question: Q0?\nAnswer: Work 0.\n#### 18\n\nQuestion: Q1?\nAnswer: Work 1.\n#### 1,000\n\n"
        "Question: Q2?\nAnswer:"
    ]
    assert protocol.stop == ("Question", "Assistant:", "<|separator|>")
    assert protocol.max_new_tokens == 512
    classic = SGLangProtocol(RECORDS, shots=2, classic=True)
    assert classic.num_available == 6
    assert classic.questions(1) == [RECORDS[0]]


def test_asking_for_more_questions_than_available_is_an_error():
    with pytest.raises(NpuportError, match="1 to 4"):
        SGLangProtocol(RECORDS, shots=2).prompts(5)


def test_lm_eval_shots_come_from_train_with_one_generator_seeded_1234():
    train = [GSM8KRecord(f"T{i}?", f"t{i}\n#### {i}") for i in range(50)]
    protocol = LMEvalProtocol(RECORDS, train)
    prompts = protocol.prompts(4)
    rnd = random.Random(1234)  # lm-eval: one Random(1234), rnd.sample(train, 5) per question in order
    for record, prompt in zip(RECORDS[:4], prompts, strict=True):
        assert prompt == few_shot_prompt(rnd.sample(train, 5), record.question)
    assert prompt.count("Question:") == 6
    # question i gets the same shots whatever N is
    assert LMEvalProtocol(RECORDS, train).prompts(2) == prompts[:2]
    assert LMEvalProtocol(RECORDS, train, seed=1235).prompts(2) != prompts[:2]
    assert protocol.stop == ("Question:", "</s>", "<|im_end|>")  # lm-eval gsm8k.yaml's `until`


def test_aisbench_prompt_without_and_with_the_artifacts_chat_template(tmp_path):
    message = (
        'Answer the following question.The last line of the response should follow this format: '
        '"answer:$ANSWER" (without quotes), where ANSWER is a number. Let\'s think step by step.\n\n'
        "Question: Q0?"
    )
    assert AISBENCH_INSTRUCTION.format(question="Q0?") == message
    assert AISBenchProtocol(RECORDS).prompts(1) == [message]

    from transformers import AutoTokenizer

    from npuport.fixtures.tiny_tokenizer import write_tokenizer

    write_tokenizer(tmp_path, 600)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert AISBenchProtocol(RECORDS, tokenizer).prompts(1) == [
        f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    ]


def test_aisbench_passes_template_options_through():
    class RecordingTemplate:
        def apply_chat_template(self, conversation, **kwargs):
            self.seen = (conversation, kwargs)
            return "rendered"

    template = RecordingTemplate()
    assert AISBenchProtocol(RECORDS, template, chat_template_kwargs={"enable_thinking": False}).prompts(1) == [
        "rendered"]
    conversation, kwargs = template.seen
    assert conversation == [{"role": "user", "content": AISBENCH_INSTRUCTION.format(question="Q0?")}]
    assert kwargs == {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


def test_make_protocol_on_shipped_data():
    assert make_protocol().name == "sglang"
    assert make_protocol("sglang").num_available == 1314
    assert make_protocol("sglang-classic", shots=3).num_available == 1319
    assert make_protocol("aisbench").shots == 0
    lm_eval = make_protocol("lm-eval")
    assert (lm_eval.shots, lm_eval.seed) == (5, 1234)
    with pytest.raises(NpuportError, match="unknown GSM8K protocol"):
        make_protocol("mmlu")
    with pytest.raises(NpuportError, match="0-shot"):
        make_protocol("aisbench", shots=5)


# --- scoring ---------------------------------------------------------------------------------------------

def test_sglang_scores_after_the_shots_and_cuts_at_stop_strings():
    result = SGLangProtocol(RECORDS, shots=1).score([
        "so 1,000 in all",                 # Q1 gold 1000: 1000 -> right
        "the change is -3.",               # Q2 gold -3: -3 -> right
        "no idea",                         # Q3 gold 5: invalid
        "$18.00",                          # Q4 gold 18: 18.00 == 18 -> right
        "3 then 4 so 7 Question: next 9",  # Q5 gold 7: cut at "Question" -> 7 -> right
    ], latency_s=2.0, completion_tokens=50)
    assert result.protocol == "sglang" and result.shots == 1 and result.num_questions == 5
    assert result.correct == [True, True, False, True, True]
    assert result.accuracy == 0.8
    assert result.invalid_rate == 0.2
    assert result.golds == ["1000", "-3", "5", "18", "7"]
    assert result.output_throughput == 25.0
    assert result.reported_accuracy == 0.8


def test_sglang_classic_scores_the_shots_too_and_ignores_sign_and_decimals():
    result = SGLangProtocol(RECORDS, shots=1, classic=True).score([
        "18",                              # Q0 gold 18 -> right (a shot, scored too)
        "so 1,000 in all",                 # Q1 gold 1000 -> right
        "the change is -3.",               # Q2 gold -3: 3 against |-3| -> right
        "no idea",                         # Q3: invalid
        "$18.00",                          # Q4 gold 18: reads 0 -> wrong
        "3 then 4 so 7 Question: next 9",  # Q5 gold 7 -> right
    ])
    assert result.correct == [True, True, True, False, False, True]
    assert result.accuracy == pytest.approx(4 / 6)
    assert result.invalid_rate == pytest.approx(1 / 6)


def test_lm_eval_strict_and_flexible_scores():
    train = [GSM8KRecord(f"T{i}?", f"t{i}\n#### {i}") for i in range(10)]
    result = LMEvalProtocol(RECORDS, train).score([
        "She pays 18.\n#### 18",   # gold 18: strict 18 right, flexible 18 right
        "#### 1,000.",             # gold 1000: strict 1000 right, flexible 1000 right
        "The answer is -3",        # gold -3: strict invalid, flexible -3 right
        "It is $5.00.",            # gold 5: strict invalid, flexible "5.00" != "5" wrong
        "#### 18\nQuestion: 12",   # gold 18: cut at "Question:"; both 18 right
    ])
    strict, flexible = result.score("strict-match"), result.score("flexible-extract")
    assert strict.correct == [True, True, False, False, True]
    assert strict.invalid == [False, False, True, True, False]
    assert (strict.accuracy, strict.invalid_rate) == (0.6, 0.4)
    assert flexible.correct == [True, True, True, False, True]
    assert (flexible.accuracy, flexible.invalid_rate) == (0.8, 0.0)
    assert flexible.predictions[3] == "5.00"
    assert result.accuracy == 0.6  # the headline is strict-match
    assert result.seed == 1234


def test_aisbench_scores_numerically_in_percent():
    result = AISBenchProtocol(RECORDS).score([
        "<think>maybe 20</think>answer:18",  # gold 18 -> right
        "answer:1,000",                      # gold 1000: reads 000 -> wrong, not invalid
        "answer: -3\nQuestion: 5",           # gold -3 -> right
        "<think>5</think>I cannot tell",     # gold 5: invalid
        "answer: 18.0",                      # gold 18: 18.0 == 18 -> right
    ])
    assert result.correct == [True, False, True, False, True]
    assert result.accuracy == 0.6
    assert result.invalid_rate == 0.2
    assert result.reported_accuracy == 60.0
    assert result.shots == 0 and result.protocol == "aisbench"


def test_result_carries_no_throughput_unless_given():
    result = AISBenchProtocol(RECORDS).score(["answer: 18"])
    assert result.latency_s is None and result.output_throughput is None
    assert result.to_dict()["scores"][0]["correct"] == [True]


# --- lm-eval's own generation defaults ----------------------------------------------------------------------

def _lm_eval_gsm8k_task() -> dict:
    """lm-evaluation-harness's own gsm8k task config, as installed."""
    import lm_eval

    return yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())


def _lm_eval_default_max_gen_toks() -> int:
    """The new-token limit lm-eval's API models use when a task sets none (its TemplateAPI's max_gen_toks)."""
    from lm_eval.models.api_models import TemplateAPI

    return inspect.signature(TemplateAPI.__init__).parameters["max_gen_toks"].default


def test_lm_eval_protocol_generates_as_lm_evals_gsm8k_task_does():
    task = _lm_eval_gsm8k_task()
    assert "max_gen_toks" not in task["generation_kwargs"]  # so lm-eval's default applies
    protocol = make_protocol("lm-eval")
    assert list(protocol.stop) == task["generation_kwargs"]["until"]
    assert protocol.max_new_tokens == _lm_eval_default_max_gen_toks()
    assert make_protocol("lm-eval", max_new_tokens=40).max_new_tokens == 40
    assert make_protocol("sglang").max_new_tokens == 512  # sglang's script: VALIDATION.md


def test_validate_without_max_new_tokens_takes_the_protocols_default(tmp_path):
    """`npuport validate --protocol lm-eval` with no --max-new-tokens: lm-eval's 256 and its stop strings, in the
    report's settings; the sglang protocol keeps 512."""
    result = CliRunner().invoke(main, ["validate", "--gsm8k", str(trained_tiny_path()), "--protocol", "lm-eval",
                                       "--num-questions", "1", "--batch-size", "1", "--dtype", "float32",
                                       "--device", "cpu", "--no-throughput", "--min-accuracy", "off",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "report.json").read_text())["settings"]
    assert settings["max_new_tokens"] == _lm_eval_default_max_gen_toks()
    assert settings["stop"] == _lm_eval_gsm8k_task()["generation_kwargs"]["until"]
    assert ValidateOptions(Path("a"), protocol="sglang").max_new_tokens == 512
    assert ValidateOptions(Path("a"), protocol="lm-eval", max_new_tokens=9).max_new_tokens == 9
