"""`npuport validate --gsm8k`: one GSM8K protocol on the artifact (built-in runtime, or any OpenAI-compatible
endpoint) and on its BF16 source, the paired comparison, fidelity, throughput, MTP acceptance and the gates,
written as report.json, report.md, plots and completions.jsonl (VALIDATION.md). Optionally the determinism of
greedy output: the questions answered again, and by the same model without MTP (determinism.py).

Every answer, fidelity sequence and throughput run is appended to the output folder as it is made, and a run
stopped in any way continues where it stopped (--resume, or the same command again): journal.py."""

from __future__ import annotations

import dataclasses
import json
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npuport.benchlog import Progress
from npuport.checksums import listing_checksum, sha256_file
from npuport.devices import pick_device
from npuport.errors import EndpointError, NpuportError
from npuport.runtime.completion import MAX_TOP_LOGPROBS, CompletionBatch
from npuport.runtime.generate import AcceptanceStats
from npuport.runtime.selftest.run import implementations_record
from npuport.runtime.text_completions import RuntimeBatch, RuntimeCompletions
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.validation.command_line import validate_command
from npuport.runtime.validation.determinism import CompletionAgreement, Determinism, compare_completions
from npuport.runtime.validation.endpoint import served_models
from npuport.runtime.validation.endpoint_fidelity import DEFAULT_TOP_K, logprob_fidelity
from npuport.runtime.validation.fidelity import measure_fidelity
from npuport.runtime.validation.gates import (
    CHANCE,
    DEFAULT_MAX_ACCURACY_DROP,
    acceptance_gate,
    accuracy_drop_gate,
    answered_gate,
    min_accuracy_gate,
)
from npuport.runtime.validation.gsm8k import (
    DEFAULT_PROTOCOL,
    LM_EVAL_SEED,
    GSM8KProtocol,
    default_max_new_tokens,
    make_protocol,
    questions_name,
)
from npuport.runtime.validation.gsm8k_results import GSM8KResult
from npuport.runtime.validation.journal import Journal
from npuport.runtime.validation.labels import BF16, is_w8a8, report_labels
from npuport.runtime.validation.report import (
    AccuracyRow,
    Fidelity,
    Gate,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
)
from npuport.runtime.validation.report_files import ReportFiles, write_report
from npuport.runtime.validation.runners import EndpointRunner, Runner, RuntimeRunner
from npuport.runtime.validation.throughput import measure_throughput

COMPLETIONS_NAME = "completions.jsonl"
ANSWERS_NAME = "answers.jsonl"
REFERENCE_ANSWERS_NAME = "answers-reference.jsonl"
WITHOUT_MTP_ANSWERS_NAME = "answers-without-mtp.jsonl"
FIDELITY_NAME = "fidelity.jsonl"  # each fidelity sequence's sums (or a server's fidelity, whole), as made
THROUGHPUT_NAME = "throughput.jsonl"  # each timed throughput run, as made
REPORT_NAMES = ("report.json", "report.md", "accuracy.png", "mtp_acceptance.png", "throughput.png")
_RESULT_FILES = re.compile(r"answers(-reference|-without-mtp|-run\d+)?\.jsonl")
CHECKSUM_METHOD = "sha256 of the artifact's SHA256SUMS listing (the sha256 of every file, sha256sum format)"
NO_CHECKSUM = "not taken: no local files (validated through --endpoint with --tokenizer only)"

Log = Callable[[str], None]


@dataclass
class ValidateOptions:
    """Everything one validation run is told (the CLI's options, one to one)."""

    artifact: Path | None  # None: only on --endpoint, with --tokenizer
    protocol: str = DEFAULT_PROTOCOL
    data: Path | None = None  # None: the GSM8K test split shipped with the package
    num_questions: int | None = None  # None: every question the protocol can score
    shots: int | None = None  # None: the protocol's default
    max_new_tokens: int | None = None  # None: the protocol's own default (gsm8k.default_max_new_tokens)
    batch_size: int = 16
    mtp: int = 0
    seed: int = LM_EVAL_SEED
    reference: Path | None = None
    endpoint: str | None = None
    endpoint_model: str | None = None  # None: the one model the server lists, else the artifact path as given
    parallel: int = 16
    timeout_s: float = 600.0
    retries: int = 3
    device: str | None = None
    dtype: str = "bfloat16"
    fidelity_questions: int | None = None  # None: all questions of the run
    throughput: bool = True
    max_accuracy_drop: float | None = DEFAULT_MAX_ACCURACY_DROP  # None: no accuracy gate
    min_acceptance: float | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # decode / verify steps on the batch-invariant kernels (runtime/invariance.py); None: on with MTP
    batch_invariant: bool | None = None
    reference_endpoint: str | None = None  # the reference on a server instead of `reference` in the runtime
    reference_endpoint_model: str | None = None  # None: the one model the server lists
    fidelity_top_k: int = DEFAULT_TOP_K  # log-probabilities per position asked of a server for fidelity
    dispatch: str | None = None  # MoE dispatch in the built-in runtime (run_options.DISPATCH_CHOICES); None: default
    api_key: str | None = None  # sent as a bearer token to every endpoint
    tokenizer: Path | None = None  # the tokenizer's folder for --endpoint; None: the artifact's
    repeat: int = 1  # times the artifact's runner answers the questions; later runs are compared with the first
    mtp_reference_endpoint: str | None = None  # --endpoint's model served without MTP
    mtp_reference_endpoint_model: str | None = None  # None: the one model the server lists
    compare_without_mtp: bool = False  # the built-in runtime answers once more without MTP
    resume: bool = False  # continue the run stopped in the output folder (one stopped there is continued anyway)
    min_accuracy: float | str | None = CHANCE  # gates.min_accuracy_gate: CHANCE or percent; None: no floor

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = default_max_new_tokens(self.protocol)

    def check(self) -> None:
        """Refuse combinations that cannot be measured, before anything is loaded."""
        if self.artifact is None and (self.endpoint is None or self.tokenizer is None):
            raise NpuportError("give ARTIFACT (the model's folder), or --endpoint URL with --tokenizer DIR to validate "
                               "a server without local model files")
        if self.tokenizer is not None and self.endpoint is None:
            raise NpuportError("--tokenizer is for --endpoint; the built-in runtime reads ARTIFACT's own tokenizer")
        if self.repeat < 1:
            raise NpuportError("--repeat must be at least 1")
        if self.mtp_reference_endpoint is not None and self.endpoint is None:
            raise NpuportError("--mtp-reference-endpoint is compared with --endpoint; on the built-in runtime give "
                               "--mtp K with --compare-without-mtp")
        if self.compare_without_mtp and (self.endpoint is not None or not self.mtp):
            raise NpuportError("--compare-without-mtp needs MTP on the built-in runtime: give --mtp K (K > 0); for a "
                               "server give --mtp-reference-endpoint")
        if self.endpoint is not None and self.mtp:
            raise NpuportError("--mtp drives the built-in runtime; with --endpoint the server decides its own "
                               "speculative decoding")
        if self.min_acceptance is not None and not self.mtp:
            raise NpuportError("--min-acceptance needs MTP on the built-in runtime: give --mtp K (K > 0)")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise NpuportError("--max-new-tokens and --batch-size must be at least 1")
        if self.throughput and self.endpoint is None and self.max_new_tokens < 2:
            raise NpuportError("throughput needs --max-new-tokens of at least 2 (or --no-throughput)")
        if self.reference is not None and self.reference_endpoint is not None:
            raise NpuportError("give the reference once: --reference SRC (built-in runtime) or --reference-endpoint "
                               "URL (a server)")
        if not 1 <= self.fidelity_top_k <= MAX_TOP_LOGPROBS:
            raise NpuportError(f"--fidelity-top-k must be between 1 and {MAX_TOP_LOGPROBS}")


@dataclass(frozen=True)
class ValidationOutcome:
    """What a run wrote: the report (its gates included), the report files and completions.jsonl."""

    report: ValidationReport
    files: ReportFiles
    completions: Path

    @property
    def failed_gates(self) -> list[Gate]:
        return [gate for gate in self.report.gates if not gate.passed]


# ---------------------------------------------------------------------------------------------------------
# Facts about the inputs


def artifact_checksum(folder: Path) -> str:
    """sha256 of the `SHA256SUMS` text (npuport.checksums' format) of every file under `folder`."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    return listing_checksum({p.relative_to(folder).as_posix(): sha256_file(p) for p in files})


def describe_device(device: torch.device) -> str:
    """The device type and what its backend calls it ('cuda (NVIDIA H200)'); for the host, the processor and
    the number of threads torch uses ('cpu (x86_64, 2 threads)')."""
    get_name = getattr(torch.get_device_module(device), "get_device_name", None)
    if get_name is not None:
        return f"{device.type} ({get_name(device)})"
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------------------------------------
# The steps


def run_gsm8k(runner: Runner, protocol: GSM8KProtocol, prompts: Sequence[str], label: str, log: Log,
              answers: Path) -> tuple[GSM8KResult, CompletionBatch]:
    """Complete and score the prompts; the batch carries the texts, token counts and latency. Each answer is
    appended to `answers` as it is made, and what `answers` holds already (a stopped run's) is kept; a failed
    question is scored as its empty text."""
    log(f"{label}: {protocol.name} protocol, {len(prompts)} questions, up to {protocol.max_new_tokens} new tokens")
    with Progress(label, len(prompts), "questions", tokens=True) as progress:
        batch = runner.complete_questions(protocol, prompts, answers, progress)
    if progress.start:
        log(f"{label}: {progress.start} of {len(prompts)} answers kept from the stopped run ({answers.name})")
    if batch.failures:
        log(f"{label}: {len(batch.failures)} of {len(prompts)} question(s) FAILED (scored as wrong): "
            f"{', '.join(map(str, sorted(batch.failures)))}")
    result = protocol.score(batch.texts, latency_s=batch.latency_s, completion_tokens=batch.completion_tokens)
    rate = result.output_throughput
    log(f"{label}: accuracy {result.accuracy * 100:.2f} %, invalid {result.invalid_rate * 100:.2f} %, "
        f"latency {batch.latency_s:.1f} s" + (f", {rate:.1f} output tok/s" if rate is not None else ""))
    return result, batch


def acceptance_figures(stats: AcceptanceStats) -> MTPAcceptance:
    return MTPAcceptance(stats.k, stats.mean_accepted_length(), stats.acceptance_rate_per_position(),
                         sum(stats.rounds))


# Timed repeats per throughput figure, the median kept: decode time is the difference of two calls, and a single
# slow call (the host busy for a moment) would move it; the spread over the repeats tells differences from noise.
THROUGHPUT_REPEATS = 3


def implementations_setting(device: torch.device) -> str:
    """Which implementation ran each operator on `device` (torch_npu's native operator, Triton, or the PyTorch
    reference) and the operators the self-test switched to their references, with why."""
    record = implementations_record(device)
    text = ", ".join(f"{op} {impl}" for op, impl in record["implementations"].items())
    fallen = "; ".join(f"{op}: {why}" for op, why in record["fallen_back"].items())
    return text + (f" (switched to the reference by the self-test: {fallen})" if fallen else "")


def throughput_runs(runner: RuntimeCompletions, prompts: Sequence[Sequence[int]], new_tokens: int, mtp: int,
                    label: str, log: Log, journal: Journal | None = None) -> list[ThroughputRun]:
    """The runner's model on one batch, without MTP and (when mtp > 0) with it; each run appended to the
    journal's throughput.jsonl when timed, and one it holds already (a stopped run's) not timed again."""
    kept = {row["label"]: ThroughputRun(**row["run"]) for row in journal.rows(THROUGHPUT_NAME)} if journal else {}
    runs = []
    for k in sorted({0, mtp}):
        name = label if k == 0 else f"{label} + MTP k={k}"
        if name in kept:
            runs.append(kept[name])
            log(f"{name}: timed by the stopped run ({THROUGHPUT_NAME})")
            continue
        run = measure_throughput(runner.model, prompts, new_tokens, mtp=k, label=name, repeats=THROUGHPUT_REPEATS,
                                 invariant=runner.options.invariant, model_label=label)
        if journal is not None:
            with journal.appender(THROUGHPUT_NAME) as f:
                f.write({"label": name, "run": dataclasses.asdict(run)})
        runs.append(run)
        decode = (f"decode {run.decode_tokens_per_s:.1f} tok/s, {run.time_per_output_token_ms:.2f} ms per output token"
                  if run.decode_tokens_per_s is not None else "decode not measurable (noise above the decode time)")
        log(f"{name}: prefill {run.prefill_tokens_per_s:.1f} tok/s, {decode} (batch {len(prompts)})")
    return runs


def write_completions(path: Path, rows: Sequence[tuple[str, GSM8KResult, CompletionBatch]]) -> Path:
    """One JSON line per model and question: the text scored, its prediction and verdict, tokens, finish, and
    for a question that got no usable answer its error."""
    with open(path, "w", encoding="utf-8") as f:
        for label, result, batch in rows:
            score = result.scores[0]
            for i, c in enumerate(batch.completions):
                row = {"model": label, "question": i, "gold": result.golds[i], "prediction": score.predictions[i],
                       "correct": score.correct[i], "text": c.text, "completion_tokens": c.completion_tokens,
                       "finish_reason": c.finish_reason}
                if c.error is not None:
                    row["error"] = c.error
                f.write(json.dumps(row) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------


def _endpoint_runner(opts: ValidateOptions, url: str, model: str | None, option: str) -> EndpointRunner:
    """A client of the server at `url` sending `model`, else the one model the server lists (`option` names the
    option that names it, for the error when it lists several)."""
    if model is None:
        listed = served_models(url, timeout_s=opts.timeout_s, api_key=opts.api_key)
        if len(listed) != 1:
            raise NpuportError(f"{url} serves {len(listed)} models ({', '.join(listed) or 'none'}); name the one to "
                               f"validate with {option}")
        model = listed[0]
    return EndpointRunner(url, model, parallel=opts.parallel, timeout_s=opts.timeout_s, retries=opts.retries,
                          api_key=opts.api_key)


def _endpoint_tokenizer(opts: ValidateOptions) -> Any:
    """The tokenizer of --tokenizer DIR (which must hold one), else the artifact's (None if it has none)."""
    if opts.tokenizer is None:
        return load_tokenizer(opts.artifact)
    tokenizer = load_tokenizer(opts.tokenizer)
    if tokenizer is None:
        raise NpuportError(f"{opts.tokenizer} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    return tokenizer


def _endpoint_model(opts: ValidateOptions) -> str | None:
    """The name to send to --endpoint: --endpoint-model; else the one model the server lists, or ARTIFACT as given
    where it lists that among others (sglang and vLLM serve a folder as the path given, npuport serve by the
    folder's name); ARTIFACT as given where the server lists none. None: the server must list one."""
    if opts.endpoint_model is not None or opts.artifact is None:
        return opts.endpoint_model
    try:
        listed = served_models(opts.endpoint, timeout_s=opts.timeout_s, api_key=opts.api_key)
    except EndpointError:  # no model list: the questions' own requests say what is wrong
        return str(opts.artifact)
    if len(listed) == 1:
        return listed[0]
    if str(opts.artifact) in listed or not listed:
        return str(opts.artifact)
    raise NpuportError(f"{opts.endpoint} serves {len(listed)} models ({', '.join(listed)}); name the one to validate "
                       "with --endpoint-model")


def _candidate_runner(opts: ValidateOptions, device: torch.device, log: Log) -> tuple[Runner, Any, str]:
    """The artifact's runner (a server or the runtime), the tokenizer for chat prompts, a description."""
    if opts.endpoint is not None:
        client = _endpoint_runner(opts, opts.endpoint, _endpoint_model(opts), "--endpoint-model")
        return (client, _endpoint_tokenizer(opts),
                f"endpoint {client.url} (model {client.model}, {opts.parallel} in parallel)")
    log(f"loading {opts.artifact} on {device} in {opts.dtype}")
    runtime = RuntimeRunner.load(opts.artifact, device=device, dtype=opts.dtype, batch_size=opts.batch_size,
                                 mtp=opts.mtp, invariant=opts.batch_invariant, dispatch=opts.dispatch)
    return runtime, runtime.tokenizer, f"built-in runtime, batch size {opts.batch_size}, MTP k={opts.mtp}, {opts.dtype}"


def _reference_runner(opts: ValidateOptions, device: torch.device, log: Log) -> tuple[Runner, str] | None:
    """The reference - the BF16 source in the built-in runtime, a server, or none - and a description."""
    if opts.reference is not None:
        log(f"loading reference {opts.reference} on {device} in {opts.dtype}")
        reference = RuntimeRunner.load(opts.reference, device=device, dtype=opts.dtype, batch_size=opts.batch_size,
                                       mtp=opts.mtp, invariant=opts.batch_invariant, dispatch=opts.dispatch)
        return reference, str(opts.reference)
    if opts.reference_endpoint is None:
        return None
    client = _endpoint_runner(opts, opts.reference_endpoint, opts.reference_endpoint_model,
                              "--reference-endpoint-model")
    return client, f"endpoint {client.url} (model {client.model})"


def kernels_setting(invariant: bool, mtp: int) -> str:
    """The report's line on the kernels the built-in runtime's decode and verify steps ran."""
    if invariant:
        return ("batch-invariant decode and verify steps (invariant GEMMs for the float linear layers and the "
                "lm_head, MoE, attention and GDN launched for the largest verify step): MTP keeps greedy output")
    return ("fast (vendor GEMMs and tiles by step size in decode and verify steps"
            + ("; MTP may change greedy output: --batch-invariant)" if mtp else ")"))


def _measure_on_runtime(report: ValidationReport, opts: ValidateOptions, candidate: RuntimeCompletions,
                        cand_batch: RuntimeBatch, reference: RuntimeCompletions | None,
                        ref_batch: RuntimeBatch | None, log: Log, journal: Journal) -> None:
    """What only the models themselves give: fidelity, throughput, MTP acceptance (the batches are the
    built-in runtime's, which carry token ids and acceptance). Each fidelity sequence and throughput run is
    appended to the journal as it is made, and what it holds already is not measured again."""
    if reference is not None and ref_batch is not None:
        journal.phase("fidelity")
        f = min(opts.fidelity_questions or len(cand_batch.prompt_ids), len(cand_batch.prompt_ids))
        log(f"fidelity: {report.candidate_label} against {report.reference_label} on {f} prompts")
        done = [row["sums"] for row in journal.rows(FIDELITY_NAME) if "sums" in row]
        with journal.appender(FIDELITY_NAME) as rows, Progress("fidelity", f, "sequences", tokens=True) as progress:
            report.fidelity = measure_fidelity(
                candidate.model, reference.model, cand_batch.prompt_ids[:f], cand_batch.token_ids[:f],
                ref_batch.token_ids[:f], done=done, progress=progress,
                on_sequence=lambda sums: rows.write({"sequence": progress.done, "sums": sums}))
        if progress.start:
            log(f"fidelity: {progress.start} of {f} sequences kept from the stopped run ({FIDELITY_NAME})")
    if opts.throughput:
        journal.phase("throughput")
        prompts = cand_batch.prompt_ids[:opts.batch_size]
        for label, runner in ((report.candidate_label, candidate), (report.reference_label, reference)):
            if runner is not None:
                report.throughput += throughput_runs(runner, prompts, opts.max_new_tokens, opts.mtp, label, log,
                                                     journal)
        report.settings["throughput"] = (
            f"the first {len(prompts)} {report.settings.get('questions_name', 'GSM8K')} prompts as one batch "
            f"(mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), {opts.max_new_tokens} new tokens each, "
            "no stop tokens, after a warm-up; prefill = a call "
            f"making one token, decode = the rest; each figure over {THROUGHPUT_REPEATS} repeats (the median "
            "prefill and decode times), with its lowest and highest")
    if cand_batch.acceptance is not None:
        report.mtp = acceptance_figures(cand_batch.acceptance)
        if ref_batch is not None and ref_batch.acceptance is not None:
            report.mtp_reference = acceptance_figures(ref_batch.acceptance)


def _measure_by_logprobs(report: ValidationReport, opts: ValidateOptions, candidate: Runner, reference: Runner,
                         tokenizer: Any, prompts: Sequence[str], protocol: GSM8KProtocol, log: Log,
                         journal: Journal) -> None:
    """Fidelity where a side is a server: from log-probabilities (endpoint_fidelity.py), on the first
    fidelity_questions prompts, tokenized by the artifact's tokenizer; appended to the journal whole once
    measured (a stopped run measures it again from the start, a finished one not)."""
    if tokenizer is None:
        report.settings["fidelity"] = "not measured: the artifact has no tokenizer to turn the prompts into tokens"
        return
    journal.phase("fidelity")
    kept = [row["logprob_fidelity"] for row in journal.rows(FIDELITY_NAME) if "logprob_fidelity" in row]
    if kept:
        fidelity = {**kept[-1], "topk_kl_estimates": {int(k): v for k, v in kept[-1]["topk_kl_estimates"].items()}}
        report.fidelity = Fidelity(**fidelity)
        log(f"fidelity: measured by the stopped run ({FIDELITY_NAME})")
    else:
        f = min(opts.fidelity_questions or len(prompts), len(prompts))
        log(f"fidelity: {report.candidate_label} against {report.reference_label} on {f} prompts, from "
            f"top-{opts.fidelity_top_k} log-probabilities")
        ids = [list(tokenizer.encode(p)) for p in prompts[:f]]
        measured = logprob_fidelity(candidate.logprob_source(), reference.logprob_source(), ids,
                                    protocol.max_new_tokens, protocol.stop, opts.fidelity_top_k)
        report.fidelity = measured.fidelity
        with journal.appender(FIDELITY_NAME) as rows:
            rows.write({"logprob_fidelity": dataclasses.asdict(measured.fidelity)})
    report.settings["fidelity"] = (
        f"from top-{opts.fidelity_top_k} log-probabilities ({report.fidelity.kl_method}); the estimate's bias "
        "against the full-vocabulary KL is what validate reports beside it when both models run in the built-in "
        "runtime")


@dataclass(frozen=True)
class _ModelRun:
    """One model's GSM8K run: its label, its runner, what it answered and how that scored, where its answers went."""

    label: str
    runner: Runner
    answers: Path
    result: GSM8KResult
    batch: CompletionBatch


RunQuestions = Callable[[str, Runner, str], _ModelRun]  # (label, runner, answers file name) -> the run


def _without_mtp(opts: ValidateOptions, candidate: Runner) -> tuple[Runner, str] | None:
    """The artifact's model without MTP - on --mtp-reference-endpoint, or the built-in runtime's own model with
    MTP off - and a description; None when not asked for."""
    if opts.mtp_reference_endpoint is not None:
        client = _endpoint_runner(opts, opts.mtp_reference_endpoint, opts.mtp_reference_endpoint_model,
                                  "--mtp-reference-endpoint-model")
        return client, f"endpoint {client.url} (model {client.model}), the same model served without MTP"
    if opts.compare_without_mtp and isinstance(candidate, RuntimeRunner):
        return candidate.without_mtp(), "the built-in runtime's same model, batches and kernels, MTP off"
    return None


def measure_determinism(opts: ValidateOptions, first: _ModelRun, run: RunQuestions, how: str,
                        log: Log) -> tuple[Determinism | None, list[_ModelRun]]:
    """The artifact's questions answered again (--repeat) and without MTP, each run compared with the first,
    completion by completion; the runs themselves too (completions.jsonl lists them). None when not asked for."""
    without_mtp = _without_mtp(opts, first.runner)
    if opts.repeat == 1 and without_mtp is None:
        return None, []
    determinism = Determinism(first.label, how, first.result.accuracy)
    runs = []

    def compared(name: str, later: _ModelRun) -> CompletionAgreement:
        agreement = compare_completions(name, first.batch.completions, later.batch.completions, later.result.accuracy)
        share = "–" if agreement.share is None else f"{agreement.share * 100:.2f} %"
        log(f"{later.label}: {agreement.identical} of {agreement.num_compared} completions identical to run 1's "
            f"({share})")
        runs.append(later)
        return agreement

    for k in range(2, opts.repeat + 1):
        later = run(f"{first.label} run {k}", first.runner, f"answers-run{k}.jsonl")
        determinism.repeats.append(compared(f"run {k} against run 1", later))
    if without_mtp is not None:
        runner, determinism.mtp_how = without_mtp
        plain = run(f"{first.label} without MTP", runner, WITHOUT_MTP_ANSWERS_NAME)
        determinism.mtp = compared("without MTP against run 1 (with MTP)", plain)
    return determinism, runs


def _folder_checksum(folder: Path | None, log: Log) -> str | None:
    if folder is None:
        return None
    log(f"checksum of {folder}")
    return artifact_checksum(folder)


def _data_checksum(data: Path | None) -> str:
    """The questions' files, by content: "shipped" for the copy shipped with npuport."""
    if data is None:
        return "shipped"
    data = Path(data)
    files = sorted(data.glob("*.jsonl")) if data.is_dir() else [data]
    return listing_checksum({p.name: sha256_file(p) for p in files})


def resume_options(opts: ValidateOptions, device: torch.device, checksums: dict[str, str | None]) -> dict[str, Any]:
    """What decides a run's results, by the option that says it (`checksums`: the artifact's, the reference's and
    the tokenizer's, where local): a stopped run is continued only with all of them the same. Gates, the
    endpoints' timeouts, retries, parallelism and key may change."""
    return {
        "ARTIFACT (checksum of its files)": checksums.get("artifact"),
        "--reference (checksum of its files)": checksums.get("reference"),
        "--tokenizer (checksum of its files)": checksums.get("tokenizer"),
        "--protocol": opts.protocol, "--data (checksum of its files)": _data_checksum(opts.data),
        "--num-questions": opts.num_questions, "--shots": opts.shots, "--max-new-tokens": opts.max_new_tokens,
        "--seed": opts.seed, "--chat-template-kwargs": opts.chat_template_kwargs, "--batch-size": opts.batch_size,
        "--mtp": opts.mtp, "--device": str(device), "--dtype": opts.dtype,
        "--batch-invariant": opts.batch_invariant, "--dispatch": opts.dispatch,
        "--endpoint": opts.endpoint, "--endpoint-model": opts.endpoint_model,
        "--reference-endpoint": opts.reference_endpoint, "--reference-endpoint-model": opts.reference_endpoint_model,
        "--repeat": opts.repeat, "--mtp-reference-endpoint": opts.mtp_reference_endpoint,
        "--mtp-reference-endpoint-model": opts.mtp_reference_endpoint_model,
        "--compare-without-mtp": opts.compare_without_mtp, "--fidelity-questions": opts.fidelity_questions,
        "--fidelity-top-k": opts.fidelity_top_k, "--throughput": opts.throughput,
    }


def owned_files(out: Path) -> list[str]:
    """The files of an earlier run in `out` that a fresh run removes first: its results and its report."""
    answers = [p.name for p in out.glob("answers*.jsonl") if _RESULT_FILES.fullmatch(p.name)] if out.is_dir() else []
    return [*answers, FIDELITY_NAME, THROUGHPUT_NAME, COMPLETIONS_NAME, *REPORT_NAMES]


def run_validation(options: ValidateOptions, out_dir: Path | str, log: Log = print) -> ValidationOutcome:
    """Measure, gate and write the report into `out_dir`; the gates' verdicts are in the outcome (a failed
    gate is not an exception: the caller decides the exit status). With a reference on the built-in
    runtime both models are held at once (fidelity compares them position by position).

    Every result is appended to `out_dir` as it is made (journal.py); a run stopped there with the same options
    is continued (options.resume or not), one with other options refused."""
    opts = options
    opts.check()
    device = pick_device(opts.device)
    out = Path(out_dir)
    journal = Journal(out, log)
    checksums = {"artifact": _folder_checksum(opts.artifact, log),
                 "reference": _folder_checksum(opts.reference, log),
                 "tokenizer": _folder_checksum(opts.tokenizer, log)}
    journal.start(resume_options(opts, device, checksums), opts.resume, owned_files(out))
    try:
        outcome = _run_validation(opts, out, log, device, journal, checksums["artifact"])
        journal.finish()
        return outcome
    finally:
        journal.close()


def _run_validation(opts: ValidateOptions, out_dir: Path, log: Log, device: torch.device, journal: Journal,
                    checksum: str | None) -> ValidationOutcome:
    cand_label, ref_label = report_labels(opts.artifact, opts.reference, dtype=opts.dtype,
                                          artifact_served=opts.endpoint is not None,
                                          reference_served=opts.reference_endpoint is not None)
    ref_label = ref_label or BF16  # no reference: the label is never shown
    candidate, tokenizer, runner_text = _candidate_runner(opts, device, log)
    if opts.protocol == "aisbench" and tokenizer is None:
        log(f"warning: {opts.artifact} has no tokenizer; the aisbench prompts are sent without a chat template")
    protocol = make_protocol(opts.protocol, opts.data, shots=opts.shots, chat_template=tokenizer,
                             chat_template_kwargs=opts.chat_template_kwargs, seed=opts.seed,
                             max_new_tokens=opts.max_new_tokens)
    n = opts.num_questions or protocol.num_available
    prompts = protocol.prompts(n)
    settings: dict[str, Any] = {
        "runner": runner_text, "protocol": protocol.name, "shots": protocol.shots, "questions": n,
        "max_new_tokens": opts.max_new_tokens, "stop": list(protocol.stop),
        "data": str(opts.data) if opts.data is not None else "GSM8K test split shipped with npuport",
        "questions_name": questions_name(opts.data), "command": validate_command(opts, out_dir)}
    log(f"questions: {settings['questions_name']}, from {settings['data']}")

    def run(label: str, runner: Runner, answers_name: str) -> _ModelRun:
        answers = Path(out_dir) / answers_name
        journal.phase(f"answers of {label} ({answers_name})")
        return _ModelRun(label, runner, answers, *run_gsm8k(runner, protocol, prompts, label, log, answers))

    runs = [run(cand_label, candidate, ANSWERS_NAME)]
    determinism, again = measure_determinism(opts, runs[0], run, runner_text, log)
    row = AccuracyRow(runs[0].result)
    reference_and_text = _reference_runner(opts, device, log)
    if reference_and_text is not None:
        reference, settings["reference"] = reference_and_text
        runs.append(run(ref_label, reference, REFERENCE_ANSWERS_NAME))
        row = AccuracyRow.paired(runs[0].result, runs[1].result, seed=opts.seed)

    local = [r.runner.in_process for r in runs]
    device_text = describe_device(device)
    where = candidate.where(device_text)
    if len(runs) > 1 and None in local:
        where += f"; reference on {runs[1].runner.where(device_text)}"
    artifact = (str(opts.artifact) if opts.artifact is not None or not isinstance(candidate, EndpointRunner)
                else f"model {candidate.model} at {candidate.url}")
    report = ValidationReport(artifact=artifact, device=where, seed=opts.seed,
                              candidate_label=cand_label, reference_label=ref_label, accuracy=[row],
                              settings=settings, determinism=determinism)
    if opts.tokenizer is not None:
        settings["tokenizer"] = str(opts.tokenizer)
    if any(model is not None for model in local):
        report.dtypes = {"float tensors and activations": opts.dtype}
        if any(m is not None and is_w8a8(f) for f, m in zip((opts.artifact, opts.reference), local, strict=False)):
            report.dtypes["quantized linears"] = "int8 weights per channel x int8 activations per token"
    if local[0] is not None:
        settings["kernels"] = kernels_setting(local[0].options.invariant, opts.mtp)
        settings["implementations"] = implementations_setting(local[0].model.device)
        ref_local = local[1] if len(runs) > 1 else None
        _measure_on_runtime(report, opts, local[0], runs[0].batch, ref_local,
                            runs[1].batch if ref_local is not None else None, log, journal)
    for r in runs:
        failed = r.runner.failed_questions(r.label, r.batch)
        if failed is not None:
            report.failed_questions.append(failed)
            report.gates.append(answered_gate(failed))
    served = [r for r in runs + again if r.runner.in_process is None]
    if served:
        settings["answers"] = "each endpoint answer, or its error, as it arrived: " + ", ".join(
            r.answers.name for r in served)
        if len(runs) > 1:
            _measure_by_logprobs(report, opts, candidate, runs[1].runner, tokenizer, prompts, protocol, log, journal)

    if opts.min_accuracy is not None:
        report.gates.append(min_accuracy_gate(row.candidate, opts.min_accuracy, cand_label))
    if row.reference is not None and opts.max_accuracy_drop is not None:
        report.gates.append(accuracy_drop_gate(row, opts.max_accuracy_drop, cand_label, ref_label))
    if opts.min_acceptance is not None and report.mtp is not None:
        report.gates.append(acceptance_gate(report.mtp, opts.min_acceptance))

    if checksum is not None:
        report.artifact_checksum = checksum
        settings["artifact_checksum"] = CHECKSUM_METHOD
    else:
        settings["artifact_checksum"] = NO_CHECKSUM
    journal.phase("report")
    files = write_report(report, out_dir)
    completions = [(r.label, r.result, r.batch) for r in runs + again]
    return ValidationOutcome(report, files, write_completions(files.json.parent / COMPLETIONS_NAME, completions))
