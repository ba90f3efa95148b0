"""Chat templates come with the artifact and are code: they are rendered (by transformers, in its sandbox) with a
time bound and a size bound, and every failure - either bound, a sandbox refusal, a template error - is one line
naming the template file, through the aisbench prompts and through `npuport validate`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from npuport.chat_prompt import CHAT_TEMPLATE_TIMEOUT_S, render_chat_prompt
from npuport.cli import main
from npuport.errors import NpuportError
from npuport.fixtures.tiny_tokenizer import write_tokenizer
from npuport.runtime.validation.gsm8k import AISBENCH_INSTRUCTION, AISBenchProtocol, GSM8KRecord

RECORDS = [GSM8KRecord("Q0?", "Work 0.\n#### 18")]
CONVERSATION = [{"role": "user", "content": AISBENCH_INSTRUCTION.format(question="Q0?")}]
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
NESTED_LOOPS_WRITING = "{% for a in range(100000) %}{% for b in range(100000) %}{{ b }}{% endfor %}{% endfor %}"
KIND = "dense-text"


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, 600)
    return folder


def tokenizer_with(tokenizer_files: Path, template: str, folder: Path):
    """The tiny tokenizer, loaded by transformers from `folder` whose chat_template.jinja is `template`."""
    shutil.copytree(tokenizer_files, folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return AutoTokenizer.from_pretrained(folder)


def template_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "chat-template"]


def assert_one_line_naming(error: pytest.ExceptionInfo, folder: Path) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    assert str(folder / "chat_template.jinja") in message
    return message


def test_a_template_within_the_bounds_renders_as_transformers_renders_it(tokenizer_files, tmp_path):
    tokenizer = tokenizer_with(tokenizer_files, (tokenizer_files / "chat_template.jinja").read_text(), tmp_path / "t")
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert render_chat_prompt(tokenizer, CONVERSATION, max_chars=len(expected)) == expected
    with pytest.raises(NpuportError, match=f"rendered {len(expected):,} characters") as error:
        render_chat_prompt(tokenizer, CONVERSATION, max_chars=len(expected) - 1)
    assert_one_line_naming(error, tmp_path / "t")


@pytest.mark.parametrize("template", ["{% set n = 10 ** 8 %}{{ 'x' * n }}", "{{ 'x' * 10**8 }}"],
                         ids=["computed", "literal"])
def test_a_template_making_a_100_mb_prompt_fails_fast_with_one_line(tokenizer_files, tmp_path, template):
    """Computed at render time, the 100 MB string is refused by size; as a literal, Jinja folds it while
    compiling, which the size bound or the time bound stops, whichever comes first on this machine."""
    tokenizer = tokenizer_with(tokenizer_files, template, tmp_path / "t")
    start = time.monotonic()
    with pytest.raises(NpuportError) as error:
        AISBenchProtocol(RECORDS, tokenizer).prompts(1)
    assert time.monotonic() - start < CHAT_TEMPLATE_TIMEOUT_S + 3
    message = assert_one_line_naming(error, tmp_path / "t")
    assert "100,000,000 characters" in message or f"within {CHAT_TEMPLATE_TIMEOUT_S:g} s" in message
    if "set n" in template:
        assert "100,000,000 characters" in message


@pytest.mark.parametrize("template", [NESTED_LOOPS, NESTED_LOOPS_WRITING], ids=["silent", "writing"])
def test_nested_loops_are_stopped_at_the_deadline_and_their_thread_ends(tokenizer_files, tmp_path, template):
    tokenizer = tokenizer_with(tokenizer_files, template, tmp_path / "t")
    start = time.monotonic()
    with pytest.raises(NpuportError, match="did not render within 1 s") as error:
        render_chat_prompt(tokenizer, CONVERSATION, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - start < 4
    assert_one_line_naming(error, tmp_path / "t")
    assert template_threads() == []  # stopped, not left burning a core


@pytest.mark.parametrize(("template", "kind"), [
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ raise_exception('no system role\nallowed\nhere') }}", "TemplateError"),
    ("{% for %}", "TemplateSyntaxError"),
    ("{{ messages[3].content }}", "UndefinedError"),
], ids=["sandbox", "raise_exception", "syntax", "undefined"])
def test_template_errors_are_one_line_naming_the_template(tokenizer_files, tmp_path, template, kind):
    tokenizer = tokenizer_with(tokenizer_files, template, tmp_path / "t")
    with pytest.raises(NpuportError) as error:
        AISBenchProtocol(RECORDS, tokenizer).prompts(1)
    message = assert_one_line_naming(error, tmp_path / "t")
    assert kind in message and "line 1" in message


def model_with_template(tiny_artifacts, tmp_path: Path, template: str) -> Path:
    model = shutil.copytree(tiny_artifacts[KIND], tmp_path / "model")
    (model / "chat_template.jinja").write_text(template, encoding="utf-8")
    return model


def validate_args(model: Path, out: Path) -> list[str]:
    return ["validate", "--gsm8k", str(model), "--protocol", "aisbench", "--num-questions", "1", "--max-new-tokens",
            "2", "--no-throughput", "--device", "cpu", "--out", str(out)]


def test_validate_with_a_sandbox_error_prints_one_line_and_exits_1(tiny_artifacts, tmp_path):
    model = model_with_template(tiny_artifacts, tmp_path, "{{ ''.__class__.__mro__ }}")
    result = CliRunner().invoke(main, validate_args(model, tmp_path / "out"))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: {model / 'chat_template.jinja'}: the chat template failed: SecurityError" in result.output
    assert "Traceback" not in result.output


def test_validate_with_a_looping_template_exits_1_within_seconds(tiny_artifacts, tmp_path):
    """`npuport validate` as a user runs it, on an artifact whose template loops for ever: it used to hang."""
    model = model_with_template(tiny_artifacts, tmp_path, NESTED_LOOPS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "npuport.cli", *validate_args(model, tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"error: {model / 'chat_template.jinja'}: the chat template did not render within "
                    f"{CHAT_TEMPLATE_TIMEOUT_S:g} s (stopped)")
    assert "Traceback" not in done.stderr
    assert time.monotonic() - start < 60
