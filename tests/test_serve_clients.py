"""The clients people point at the engines, pointed at `npuport serve` as they are: the official `openai` Python
client (completions, chat, streaming, log-probabilities, an API key) gets what plain HTTP gets, and
lm-evaluation-harness (`local-completions`, which sends each prompt as token ids) runs its own `gsm8k` task - from
a local JSONL copy of the data, nothing downloaded - to the answers `npuport validate --protocol lm-eval` gives
on the same questions and model: the same text, the same extracted answer and the same scores per question."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import lm_eval
import openai
import pytest
from click.testing import CliRunner
from lm_eval.tasks import TaskManager

import npuport
from npuport.cli import main
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from npuport.runtime.validation.gsm8k import gsm8k_path, normalize_lm_eval
from tests.test_serve import post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

QUESTIONS = 4
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def runner() -> RuntimeCompletions:
    return RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float32", batch_size=4)


def test_the_openai_client_reads_completions_chat_streams_and_logprobs(runner):
    prompt = "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:"
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    with running(make_server(runner, "trained", api_key="k-2718")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k-2718", max_retries=0)
        wrong_key = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        plain = post(url, {"prompt": prompt, "max_tokens": 12, "temperature": 0})  # no key: refused
        completion = client.completions.create(model="trained", prompt=prompt, max_tokens=12, temperature=0,
                                               logprobs=3)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="trained", prompt=prompt, max_tokens=12, temperature=0, stream=True) if chunk.choices)
        chat = client.chat.completions.create(model="trained", messages=messages, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=2)
        chat_stream = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="trained", messages=messages, max_tokens=16, temperature=0, stream=True) if chunk.choices)
        models = [m.id for m in client.models.list()]
        with pytest.raises(openai.AuthenticationError):
            wrong_key.completions.create(model="trained", prompt=prompt, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="another", prompt=prompt, max_tokens=2)
    assert plain[0] == 401
    choice = completion.choices[0]
    assert choice.text and streamed == choice.text and completion.usage.completion_tokens == 12
    assert "".join(choice.logprobs.tokens) == choice.text and all(len(t) == 3 for t in choice.logprobs.top_logprobs)
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content and chat_stream == message.content
    assert [len(e.top_logprobs) for e in chat.choices[0].logprobs.content] == [2] * chat.usage.completion_tokens
    assert models == ["trained"]


def gsm8k_task(folder: Path) -> str:
    """lm-eval's own `gsm8k` task config, included whole, with its data read from npuport's JSONL copies."""
    folder.mkdir()
    own = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    (folder / "npuport_gsm8k.yaml").write_text(
        f"include: {own}\ntask: npuport_gsm8k\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  cache_dir: {folder / 'cache'}\n  data_files:\n"
        f"    train: {gsm8k_path('train')}\n    test: {gsm8k_path('test')}\n")
    return "npuport_gsm8k"


def test_lm_evaluation_harness_gsm8k_scores_as_validate_does(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = gsm8k_task(tmp_path / "tasks")
    with running(make_server(runner, "trained")) as url:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
            model_args={"base_url": url + "/v1/completions", "model": "trained", "tokenizer_backend": "huggingface",
                        "tokenizer": str(trained_tiny_path()), "max_gen_toks": NEW_TOKENS, "num_concurrent": 1,
                        "max_retries": 1},
            limit=QUESTIONS, log_samples=True)
    ours = CliRunner().invoke(main, ["validate", "--gsm8k", str(trained_tiny_path()), "--protocol", "lm-eval",
                                     "--num-questions", str(QUESTIONS), "--max-new-tokens", str(NEW_TOKENS),
                                     "--dtype", "float32", "--batch-size", "1", "--device", "cpu", "--no-throughput",
                                     "--min-accuracy", "off", "--out", str(tmp_path / "validate")])
    assert ours.exit_code == 0, ours.output
    rows = [json.loads(line) for line in (tmp_path / "validate" / "completions.jsonl").read_text().splitlines()]
    report = json.loads((tmp_path / "validate" / "report.json").read_text())["gsm8k"][0]["candidate"]
    samples = sorted(results["samples"][task], key=lambda s: (s["filter"], s["doc_id"]))
    by_filter = {name: [s for s in samples if s["filter"] == name] for name in ("strict-match", "flexible-extract")}
    assert [s["resps"][0][0] for s in by_filter["strict-match"]] == [r["text"] for r in rows]
    for score in report["scores"]:
        theirs = by_filter[score["name"]]
        # ours keep the answer normalized as lm-eval's exact_match compares it (its regexes_to_ignore)
        assert [s["filtered_resps"][0] if s["filtered_resps"][0] == "[invalid]" else
                normalize_lm_eval(s["filtered_resps"][0]) for s in theirs] == [
                    p if p is not None else "[invalid]" for p in score["predictions"]]
        assert [bool(s["exact_match"]) for s in theirs] == score["correct"]
        assert results["results"][task][f"exact_match,{score['name']}"] == score["accuracy"]


def readme_lm_eval_command() -> list[str]:
    """The lm_eval command of the README's "lm-eval against npuport serve" section, as argv."""
    readme = (Path(npuport.__file__).parent.parent / "README.md").read_text()
    section = readme.split("### lm-eval against npuport serve", 1)[1].split("\n#", 1)[0]
    [line] = [line for line in section.splitlines() if line.startswith("lm_eval ")]
    return shlex.split(line)


def lm_eval_scores(table: str, task: str) -> dict[str, float]:
    """filter name -> exact_match, from the results table lm_eval prints."""
    scores, in_task = {}, False
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 7 or cells[4] != "exact_match":
            continue
        in_task = cells[0] == task or (in_task and cells[0] == "")
        if in_task:
            scores[cells[2]] = float(cells[6])
    return scores


def test_the_readmes_lm_eval_command_runs_against_serve_and_scores_as_validate(runner, tmp_path):
    """The README's lm_eval command, as written but for the server's address (this test's server listens on a
    free port), run from the repository's root against `npuport serve`'s server: its scores are those of
    `validate --protocol lm-eval` on the same questions."""
    command = readme_lm_eval_command()
    root = Path(npuport.__file__).parent.parent
    limit = int(command[command.index("--limit") + 1])
    with running(make_server(runner, "tiny-trained")) as url:
        argv = [re.sub(r"http://127\.0\.0\.1:8000", url, arg) for arg in command]
        argv[0] = str(Path(sys.executable).parent / argv[0])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
        ran = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert ran.returncode == 0, ran.stderr[-3000:]
    theirs = lm_eval_scores(ran.stdout, "gsm8k_local")
    ours = CliRunner().invoke(main, ["validate", "--gsm8k", str(trained_tiny_path()), "--protocol", "lm-eval",
                                     "--num-questions", str(limit), "--max-new-tokens", "256", "--dtype", "float32",
                                     "--batch-size", "1", "--device", "cpu", "--no-throughput",
                                     "--min-accuracy", "off", "--out", str(tmp_path / "validate")])
    assert ours.exit_code == 0, ours.output
    report = json.loads((tmp_path / "validate" / "report.json").read_text())["gsm8k"][0]["candidate"]
    assert set(theirs) == {"strict-match", "flexible-extract"}, ran.stdout
    assert theirs == {s["name"]: pytest.approx(s["accuracy"], abs=5e-5) for s in report["scores"]}
