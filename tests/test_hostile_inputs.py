"""Hostile files that npuport reads - JSON nested 100,000 deep or holding a 5,000-digit integer, bytes that are not
UTF-8, a SHA256SUMS far larger than any release could need, fields of the wrong type or of absurd size - are each
refused in one line naming the file (and the field), with exit status 1 and no traceback, wherever a user meets
them: convert-qwen35, check, package, verify-release, generate, validate."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from npuport.checksums import SUMS_NAME
from npuport.cli import main
from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.output_folder import MAX_SUMS_BYTES
from npuport.release.package import package_release
from npuport.runtime.validation.gsm8k import AISBenchProtocol, GSM8KRecord
from npuport.runtime.validation.report import (
    AccuracyRow,
    Gate,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
)
from npuport.runtime.validation.report_files import write_report

DEEP = "[" * 100_000  # Python's json recurses once per level: RecursionError long before the end
BIG_INT = '{"a": ' + "7" * 5000 + "}"  # Python refuses to read an integer of more than 4300 digits
HOSTILE_JSON = {"nested 100000 deep": DEEP, "a 5000-digit integer": BIG_INT}
NOT_UTF8 = b"\xff\xfe not text\n"
SHARD = "quant_model_weights-00001-of-00001.safetensors"
INDEX = "quant_model_weights.safetensors.index.json"
DESCRIPTION = "quant_model_description.json"
MANIFEST = "npuport_manifest.json"
RECORDS = [GSM8KRecord(f"Q{i}?", f"w\n#### {g}") for i, g in enumerate([18, 3, 70])]


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BF16 source, its artifact, a validation report of it and the release packaged from both."""
    root = tmp_path_factory.mktemp("hostile")
    source = make_tiny(root / "Qwen3.5-tiny", TinySpec(layout="text"))
    artifact = convert_qwen35(source, root / "Qwen3.5-tiny-w8a8", show_progress=False, log=quiet).out
    protocol = AISBenchProtocol(RECORDS)
    report = ValidationReport(
        artifact=artifact.name, device="cpu (test)", seed=7,
        accuracy=[AccuracyRow(protocol.score(["answer: 18", "answer: 4", "answer: 70"]))],
        throughput=[ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=20.0)],
        mtp=MTPAcceptance(num_speculative_tokens=2, mean_acceptance_length=1.5, per_position=[0.4, 0.1]),
        gates=[Gate("min-acceptance 1.0", True, "1.50")])
    report_json = write_report(report, root / "report").json
    release = package_release(artifact, root / "release", report_json, log=quiet)
    return {"source": source, "artifact": artifact, "report": report_json, "release": release}


@pytest.fixture
def copy(made: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """copy(what): a fresh copy of made[what] (a folder; for the report, its whole folder) to damage."""

    def copy_of(what: str) -> Path:
        src = made[what]
        if src.is_file():
            return Path(shutil.copytree(src.parent, tmp_path / what)) / src.name
        return Path(shutil.copytree(src, tmp_path / what))

    return copy_of


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_no_traceback(result: Result) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def error_line(result: Result, *needles: str) -> str:
    """The one `error:` line of a command that failed cleanly; it holds every needle."""
    assert_no_traceback(result)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def fail_lines(result: Result, *needles: str) -> list[str]:
    """The FAIL lines of a check or verify-release that failed cleanly, those that hold every needle (some)."""
    assert_no_traceback(result)
    assert result.exit_code == 1, result.output
    found = [line for line in result.output.splitlines()
             if line.startswith("FAIL ") and all(n in line for n in needles)]
    assert found, result.output
    return found


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def hostile_header(path: Path, text: str) -> None:
    """Replace the safetensors file `path` by one whose header (with a valid length field) is `text`."""
    raw = text.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


# ---------------------------------------------------------------------------------------------------------
# JSON nested too deep, or holding an integer too long for Python


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_convert_refuses_hostile_json_in_source(copy, tmp_path: Path, name: str, content: str) -> None:
    source = copy("source")
    (source / name).write_text(content, encoding="utf-8")
    line = error_line(invoke("convert-qwen35", "--a8w8", source, tmp_path / "out"), f"{source / name}:")
    assert "sys.set_int_max_str_digits" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_convert_refuses_hostile_json_in_a_shard_header(copy, tmp_path: Path, content: str) -> None:
    source = copy("source")
    shard = sorted(source.glob("*.safetensors"))[0]
    hostile_header(shard, content)
    error_line(invoke("convert-qwen35", "--a8w8", source, tmp_path / "out"), shard.name, "corrupt safetensors header")


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
@pytest.mark.parametrize("name", ["config.json", INDEX, DESCRIPTION, SHARD])
def test_check_names_hostile_json_in_the_artifact(copy, name: str, content: str) -> None:
    artifact = copy("artifact")
    if name == SHARD:
        hostile_header(artifact / name, content)
    else:
        (artifact / name).write_text(content, encoding="utf-8")
    line = fail_lines(invoke("check", artifact), name)[0]
    assert "sys.set_int_max_str_digits" not in line


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
@pytest.mark.parametrize("name", [MANIFEST, DESCRIPTION, INDEX, "config.json", "tokenizer_config.json"])
def test_package_refuses_hostile_json_in_the_artifact(copy, tmp_path: Path, name: str, content: str) -> None:
    artifact = copy("artifact")
    (artifact / name).write_text(content, encoding="utf-8")
    line = error_line(invoke("package", artifact, "--out", tmp_path / "out"), name)
    assert "sys.set_int_max_str_digits" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_package_refuses_a_hostile_report(made, copy, tmp_path: Path, content: str) -> None:
    report = copy("report")
    report.write_text(content, encoding="utf-8")
    line = error_line(invoke("package", made["artifact"], "--out", tmp_path / "out", "--report", report),
                      f"{report}:")
    assert "sys.set_int_max_str_digits" not in line


@pytest.mark.parametrize("content", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
@pytest.mark.parametrize("name", ["validation/report.json", "config.json", "tokenizer_config.json", INDEX])
def test_verify_release_names_hostile_json(copy, name: str, content: str) -> None:
    release = copy("release")
    (release / name).write_text(content, encoding="utf-8")
    line = fail_lines(invoke("verify-release", release), name, "JSON")[0]
    assert "sys.set_int_max_str_digits" not in line


@pytest.mark.parametrize("content", [*HOSTILE_JSON.values(), "[1]"], ids=[*HOSTILE_JSON.keys(), "a list"])
@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "generation_config.json"])
def test_generate_names_a_hostile_json_file_of_the_model(copy, name: str, content: str) -> None:
    artifact = copy("artifact")
    (artifact / name).write_text(content, encoding="utf-8")
    error_line(invoke("generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"), f"{artifact / name}:")


def test_generate_names_a_tokenizer_that_does_not_load(copy) -> None:
    """A tokenizer.json that is JSON but not a tokenizer fails inside the tokenizers library, with its own error."""
    artifact = copy("artifact")
    (artifact / "tokenizer.json").write_text("{}", encoding="utf-8")
    error_line(invoke("generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"), f"{artifact}:", "tokenizer")


def test_validate_names_a_hostile_line_of_the_gsm8k_data(made, tmp_path: Path) -> None:
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n" + DEEP + "\n", encoding="utf-8")
    error_line(invoke("validate", "--gsm8k", made["artifact"], "--data", data, "--out", tmp_path / "report",
                      "--no-throughput"), f"{data}:2:")


def test_validate_names_hostile_chat_template_kwargs(made, tmp_path: Path) -> None:
    error_line(invoke("validate", "--gsm8k", made["artifact"], "--chat-template-kwargs", DEEP, "--out",
                      tmp_path / "report"), "--chat-template-kwargs")


def test_a_hostile_swap_journal_beside_out_means_nothing_was_moved(made, tmp_path: Path) -> None:
    """The journal a swap writes beside OUT is read back when a run was killed mid-swap; one that cannot be read
    means nothing moved, whatever it holds."""
    (tmp_path / ".out.npuport-swapping").write_text(DEEP, encoding="utf-8")
    result = invoke("package", made["artifact"], "--out", tmp_path / "out")
    assert_no_traceback(result)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / SUMS_NAME).is_file()


# ---------------------------------------------------------------------------------------------------------
# Bytes that are not UTF-8


@pytest.mark.parametrize("name", [SUMS_NAME, "README.md"])
def test_verify_release_names_a_file_that_is_not_utf8(copy, name: str) -> None:
    release = copy("release")
    (release / name).write_bytes(NOT_UTF8)
    fail_lines(invoke("verify-release", release), name, "not UTF-8")


def test_package_names_a_report_md_that_is_not_utf8(made, copy, tmp_path: Path) -> None:
    report = copy("report")
    (report.parent / "report.md").write_bytes(NOT_UTF8)
    error_line(invoke("package", made["artifact"], "--out", tmp_path / "out", "--report", report), "report.md",
               "not UTF-8")


# ---------------------------------------------------------------------------------------------------------
# A SHA256SUMS far larger than the release could need


def test_verify_release_refuses_an_oversized_sha256sums_in_one_line(copy) -> None:
    """A listing over MAX_SUMS_BYTES is not read: reading one of 200 MB line by line took minutes and printed a
    line for each of its millions of entries."""
    release = copy("release")
    sums = release / SUMS_NAME
    line = f"{'0' * 64}  weights/shard-{{:08d}}.safetensors\n"
    count = MAX_SUMS_BYTES // len(line.format(0)) + 1
    sums.write_text(sums.read_text(encoding="utf-8") + "".join(line.format(i) for i in range(count)),
                    encoding="utf-8")
    result = invoke("verify-release", release)
    about_sums = [line for line in result.output.splitlines() if SUMS_NAME in line]
    assert len(about_sums) == 1, result.output[:2000]
    fail_lines(result, SUMS_NAME, "bytes")


# ---------------------------------------------------------------------------------------------------------
# Fields of the wrong type or of absurd size


def test_check_names_an_index_metadata_that_is_not_an_object(copy) -> None:
    artifact = copy("artifact")
    edit_json(artifact / INDEX, lambda index: index.update(metadata=[1]))
    fail_lines(invoke("check", artifact), INDEX, "metadata")


@pytest.mark.parametrize("model_type", [["qwen3_5"], "x" * 100_000], ids=["a list", "100000 characters"])
def test_convert_names_a_model_type_of_the_wrong_type_or_length(copy, tmp_path: Path, model_type: object) -> None:
    source = copy("source")
    edit_json(source / "config.json", lambda config: config.update(model_type=model_type))
    line = error_line(invoke("convert-qwen35", "--a8w8", source, tmp_path / "out"), "config.json", "model_type")
    assert len(line) < 500 + len(str(source))


@pytest.mark.parametrize("field", ["num_hidden_layers", "mtp_num_hidden_layers"])
@pytest.mark.parametrize("command", ["convert-qwen35", "check"])
def test_a_layer_count_no_model_comes_near_is_refused_at_once(copy, tmp_path: Path, command: str, field: str) -> None:
    """A count of 10**12 layers is refused by name; it made npuport build lists that long (it ran out of memory)."""
    folder = copy("source" if command == "convert-qwen35" else "artifact")

    def huge(config: dict) -> None:
        del config["layer_types"]  # so that num_hidden_layers decides how many layers there are
        config[field] = 10**12

    edit_json(folder / "config.json", huge)
    if command == "check":
        fail_lines(invoke("check", folder), field)
    else:
        error_line(invoke("convert-qwen35", "--a8w8", folder, tmp_path / "out"), field)


def test_an_expert_count_no_model_comes_near_is_refused_at_once(tmp_path: Path) -> None:
    """num_experts of 10**12 against a checkpoint with a few experts per layer: named, not a range built that long."""
    source = make_tiny(tmp_path / "moe", TinySpec(arch="moe", layout="text", mtp_experts="per-expert"))
    edit_json(source / "config.json", lambda config: config.update(num_experts=10**12))
    error_line(invoke("convert-qwen35", "--a8w8", source, tmp_path / "out"), "num_experts=1000000000000")


MALFORMED_REPORTS = {
    "gsm8k entry not an object": lambda r: r.update(gsm8k=[1]),
    "mtp not an object": lambda r: r.update(mtp="x"),
    "labels a list": lambda r: r.update(labels=[1]),
    "a figure that is a string": lambda r: r["gsm8k"][0]["candidate"].update(invalid_rate="0.1"),
    "versions a list": lambda r: r.update(versions=[1]),
    "a gate detail that is a number": lambda r: r["gates"][0].update(detail=5),
}


@pytest.mark.parametrize("change", MALFORMED_REPORTS.values(), ids=MALFORMED_REPORTS.keys())
def test_package_and_verify_release_name_a_report_of_the_wrong_shape(made, copy, tmp_path: Path,
                                                                      change: Callable[[dict], object]) -> None:
    report = copy("report")
    edit_json(report, change)
    error_line(invoke("package", made["artifact"], "--out", tmp_path / "out", "--report", report), f"{report}:")
    assert not (tmp_path / "out").exists()
    release = copy("release")
    edit_json(release / "validation" / "report.json", change)
    fail_lines(invoke("verify-release", release), "validation/report.json")


MALFORMED_MANIFESTS = {
    "source a list": lambda m: m.update(source=[1]),
    "ignore_list entry not an object": lambda m: m.update(ignore_list=[1]),
    "recipe a string": lambda m: m.update(recipe="x"),
    "recipe notes a number": lambda m: m["recipe"].update(notes=5),
}


@pytest.mark.parametrize("change", MALFORMED_MANIFESTS.values(), ids=MALFORMED_MANIFESTS.keys())
def test_package_names_a_manifest_of_the_wrong_shape(copy, tmp_path: Path, change: Callable[[dict], object]) -> None:
    artifact = copy("artifact")
    edit_json(artifact / MANIFEST, change)
    error_line(invoke("package", artifact, "--out", tmp_path / "out"), MANIFEST)
    assert not (tmp_path / "out").exists()


def test_verify_release_names_card_front_matter_nested_too_deep(copy) -> None:
    release = copy("release")
    card = (release / "README.md").read_text(encoding="utf-8")
    (release / "README.md").write_text("---\nlicense: " + DEEP + "\n" + card.split("\n", 1)[1], encoding="utf-8")
    fail_lines(invoke("verify-release", release), "README.md", "front matter")


# ---------------------------------------------------------------------------------------------------------
# A key twice in one JSON object: refused naming the file and the key (Python's parser keeps the last value)


def key_twice(path: Path, key: str, first: object) -> None:
    """Rewrite the JSON object in `path` with `key` written twice at its top: `first`, then its own value."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data.setdefault(key, first)
    path.write_text("{" + json.dumps(key) + ": " + json.dumps(first) + ", " + json.dumps(data)[1:], encoding="utf-8")


@pytest.mark.parametrize("command", ["convert-qwen35", "check"])
def test_a_config_key_given_twice_is_refused(copy, tmp_path: Path, command: str) -> None:
    """tie_word_embeddings true, then false: the last value was taken without a word."""
    folder = copy("source" if command == "convert-qwen35" else "artifact")
    key_twice(folder / "config.json", "tie_word_embeddings", True)
    if command == "check":
        fail_lines(invoke("check", folder), "config.json", "'tie_word_embeddings' appears twice")
    else:
        error_line(invoke(command, folder, tmp_path / "out"), "config.json", "'tie_word_embeddings' appears twice")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "key"), [("tokenizer_config.json", "eos_token"),
                                           ("generation_config.json", "eos_token_id"),
                                           ("special_tokens_map.json", "eos_token")])
def test_a_tokenizer_or_generation_config_key_given_twice_is_refused_by_check_and_generate(copy, name: str,
                                                                                           key: str) -> None:
    artifact = copy("artifact")
    if not (artifact / name).exists():
        (artifact / name).write_text("{}", encoding="utf-8")
    key_twice(artifact / name, key, 0 if key.endswith("_id") else "<|im_end|>")
    fail_lines(invoke("check", artifact), name, f"'{key}' appears twice")
    error_line(invoke("generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"), name,
               f"'{key}' appears twice")


# ---------------------------------------------------------------------------------------------------------
# `check` reads the tokenizer as generate and serve do


def test_check_fails_a_tokenizer_config_that_generate_refuses(copy) -> None:
    """Nested past npuport's bounds inside a field: check passed it, generate then refused it."""
    artifact = copy("artifact")
    edit_json(artifact / "tokenizer_config.json", lambda c: c.update(extra=json.loads("[" * 70 + "]" * 70)))
    generated = error_line(invoke("generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"),
                           "tokenizer_config.json")
    checked = fail_lines(invoke("check", artifact), "tokenizer_config.json")[0]
    assert generated.split("tokenizer_config.json", 1)[1] in checked


def test_check_fails_a_chat_template_that_serve_would_fail(copy) -> None:
    artifact = copy("artifact")
    (artifact / "chat_template.jinja").write_text("{{ raise_exception('planted') }}", encoding="utf-8")
    fail_lines(invoke("check", artifact), "chat_template.jinja", "planted")


# ---------------------------------------------------------------------------------------------------------
# --data records: bytes that are not UTF-8, a field twice, a field of the wrong type


@pytest.mark.parametrize(("line", "needles"), [
    (b'{"question": "Q?", "question": "R?", "answer": "#### 1"}', ["'question' appears twice"]),
    (b'{"question": {"text": "Q?"}, "answer": "#### 1"}', ["question must be a string, is an object"]),
    (b'{"question": "Q?", "answer": 7}', ["answer must be a string, is a number"]),
    (b'["Q?", "#### 1"]', ["not a GSM8K record", "is a list"]),
    (b'{"question": "Q\xff?", "answer": "#### 1"}', ["not UTF-8 text", "0xff"]),
], ids=["question twice", "question an object", "answer a number", "a list", "not UTF-8"])
def test_validate_names_the_line_and_field_of_a_bad_data_record(made, tmp_path: Path, line: bytes,
                                                                 needles: list[str]) -> None:
    data = tmp_path / "test.jsonl"
    data.write_bytes(json.dumps({"question": "Q?", "answer": "#### 1"}).encode() + b"\n" + line + b"\n")
    error_line(invoke("validate", made["artifact"], "--data", data, "--out", tmp_path / "report", "--no-throughput"),
               f"{data}:2:", *needles)


# ---------------------------------------------------------------------------------------------------------
# A control character in a file name; --max-new-tokens past the context


def test_package_refuses_a_file_name_with_a_newline(copy, tmp_path: Path) -> None:
    artifact = copy("artifact")
    (artifact / "notes\nv2.txt").write_text("x", encoding="utf-8")
    fail_lines(invoke("check", artifact), "'notes\\nv2.txt'", "control character")
    error_line(invoke("package", artifact, "--out", tmp_path / "out"), "'notes\\nv2.txt'", "control character")
    error_line(invoke("package", artifact, "--out", tmp_path / "out", "--force"), "'notes\\nv2.txt'", "rename it")
    assert not (tmp_path / "out").exists()


def test_generate_refuses_max_new_tokens_past_the_context_before_loading(made, monkeypatch) -> None:
    import npuport.runtime.textgen as textgen

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(textgen, "load_model", no_load)
    error_line(invoke("generate", made["artifact"], "--prompt", "hi", "--max-new-tokens", 10**9),
               "--max-new-tokens 1,000,000,000", "context (262,144 tokens")
