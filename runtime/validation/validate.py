"""`npuport validate --gsm8k`: one GSM8K protocol on the artifact (built-in runtime, or any OpenAI-compatible
endpoint) and on its BF16 source, the paired comparison, fidelity, throughput, MTP acceptance and the gates,
written as report.json, report.md, plots and completions.jsonl (VALIDATION.md). An endpoint's answers are also
written to answers.jsonl as they arrive."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npuport.checksums import listing_checksum, sha256_file
from npuport.devices import pick_device
from npuport.errors import NpuportError
from npuport.runtime.generate import AcceptanceStats
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.validation.completions import RuntimeBatch, RuntimeCompletions
from npuport.runtime.validation.endpoint import (
    CompletionsEndpoint,
    EndpointBatch,
    EndpointCompletion,
    EndpointGivenUp,
    served_models,
)
from npuport.runtime.validation.endpoint_fidelity import (
    DEFAULT_TOP_K,
    EndpointLogprobs,
    RuntimeLogprobs,
    logprob_fidelity,
)
from npuport.runtime.validation.fidelity import measure_fidelity
from npuport.runtime.validation.gates import (
    DEFAULT_MAX_ACCURACY_DROP,
    acceptance_gate,
    accuracy_drop_gate,
    answered_gate,
)
from npuport.runtime.validation.gsm8k import (
    DEFAULT_PROTOCOL,
    LM_EVAL_SEED,
    MAX_NEW_TOKENS,
    GSM8KProtocol,
    GSM8KResult,
    make_protocol,
)
from npuport.runtime.validation.openai_api import MAX_TOP_LOGPROBS
from npuport.runtime.validation.report import (
    AccuracyRow,
    FailedQuestions,
    Gate,
    MTPAcceptance,
    ReportFiles,
    ThroughputRun,
    ValidationReport,
    write_report,
)
from npuport.runtime.validation.throughput import measure_throughput

COMPLETIONS_NAME = "completions.jsonl"
ANSWERS_NAME = "answers.jsonl"
REFERENCE_ANSWERS_NAME = "answers-reference.jsonl"
CANDIDATE_LABEL = "W8A8"
REFERENCE_LABEL = "BF16"
CHECKSUM_METHOD = "sha256 of the artifact's SHA256SUMS listing (the sha256 of every file, sha256sum format)"

Log = Callable[[str], None]


@dataclass
class ValidateOptions:
    """Everything one validation run is told (the CLI's options, one to one)."""

    artifact: Path
    protocol: str = DEFAULT_PROTOCOL
    data: Path | None = None  # None: the GSM8K test split shipped with the package
    num_questions: int | None = None  # None: every question the protocol can score
    shots: int | None = None  # None: the protocol's default
    max_new_tokens: int = MAX_NEW_TOKENS
    batch_size: int = 16
    mtp: int = 0
    seed: int = LM_EVAL_SEED
    reference: Path | None = None
    endpoint: str | None = None
    endpoint_model: str | None = None  # None: the artifact path as given (what sglang and vLLM serve it as)
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

    def check(self) -> None:
        """Refuse combinations that cannot be measured, before anything is loaded."""
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


def _progress(label: str, total: int, log: Log) -> Callable[[int], None]:
    """Logs about ten progress lines over `total` questions."""
    step = max(1, total // 10)
    shown = [0]

    def report(done: int) -> None:
        if done - shown[0] >= step or done == total:
            shown[0] = done
            log(f"  {label}: {done}/{total}")

    return report


def answer_row(question: int, answer: EndpointCompletion) -> dict[str, Any]:
    """One line of answers.jsonl: the question number and the raw answer, or the error that ended it."""
    if answer.error is not None:
        return {"question": question, "error": answer.error}
    return {"question": question, "text": answer.text, "completion_tokens": answer.completion_tokens,
            "finish_reason": answer.finish_reason}


def complete_on_endpoint(endpoint: CompletionsEndpoint, protocol: GSM8KProtocol, prompts: Sequence[str],
                         answers: Path, progress: Callable[[int], None]) -> EndpointBatch:
    """The endpoint's completions, each appended to `answers` (one JSON line, flushed) as it arrives, so that a
    crash or a lost server loses nothing already answered. When the endpoint is given up, the one-line error
    says where the answers received are."""
    answers.parent.mkdir(parents=True, exist_ok=True)
    with open(answers, "w", encoding="utf-8") as f:
        def keep(question: int, answer: EndpointCompletion) -> None:
            f.write(json.dumps(answer_row(question, answer)) + "\n")
            f.flush()

        try:
            return endpoint.complete(prompts, max_tokens=protocol.max_new_tokens, stop=protocol.stop,
                                     progress=progress, on_answer=keep)
        except EndpointGivenUp as e:
            raise EndpointGivenUp(f"{e}; what ended is in {answers}", e.answered) from None


def run_gsm8k(runner: RuntimeCompletions | CompletionsEndpoint, protocol: GSM8KProtocol, prompts: Sequence[str],
              label: str, log: Log, answers: Path | None = None) -> tuple[GSM8KResult, EndpointBatch]:
    """Complete and score the prompts; the batch carries the texts, token counts and latency. On an endpoint
    the answers are also written to `answers` as they arrive; a failed question is scored as its empty text."""
    log(f"{label}: GSM8K {protocol.name}, {len(prompts)} questions, up to {protocol.max_new_tokens} new tokens")
    progress = _progress(label, len(prompts), log)
    if isinstance(runner, CompletionsEndpoint):
        if answers is None:
            raise ValueError("an endpoint run writes its answers as they arrive: give `answers`")
        batch = complete_on_endpoint(runner, protocol, prompts, answers, progress)
    else:
        batch = runner.complete(prompts, max_tokens=protocol.max_new_tokens, stop=protocol.stop, progress=progress)
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


# Timed calls per throughput figure, the fastest kept: decode time is the difference of two calls, and a single
# slow one-token call (the host busy for a moment) would inflate the decode rate.
THROUGHPUT_REPEATS = 3


def throughput_runs(runner: RuntimeCompletions, prompts: Sequence[Sequence[int]], new_tokens: int, mtp: int,
                    label: str, log: Log) -> list[ThroughputRun]:
    """The runner's model on one batch, without MTP and (when mtp > 0) with it."""
    runs = []
    for k in sorted({0, mtp}):
        name = label if k == 0 else f"{label} + MTP k={k}"
        run = measure_throughput(runner.model, prompts, new_tokens, mtp=k, label=name, repeats=THROUGHPUT_REPEATS,
                                 invariant=runner.invariant)
        runs.append(run)
        decode = (f"decode {run.decode_tokens_per_s:.1f} tok/s, {run.time_per_output_token_ms:.2f} ms per output token"
                  if run.decode_tokens_per_s is not None else "decode not measurable (noise above the decode time)")
        log(f"{name}: prefill {run.prefill_tokens_per_s:.1f} tok/s, {decode} (batch {len(prompts)})")
    return runs


def write_completions(path: Path, rows: Sequence[tuple[str, GSM8KResult, EndpointBatch]]) -> Path:
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


def _candidate_runner(opts: ValidateOptions, device: torch.device,
                      log: Log) -> tuple[RuntimeCompletions | CompletionsEndpoint, Any, str]:
    """The artifact's runner (an endpoint client or the runtime), the tokenizer for chat prompts, a description."""
    if opts.endpoint is not None:
        client = CompletionsEndpoint(opts.endpoint, opts.endpoint_model or str(opts.artifact),
                                     parallel=opts.parallel, timeout_s=opts.timeout_s, retries=opts.retries)
        return (client, load_tokenizer(opts.artifact),
                f"endpoint {client.url} (model {client.model}, {opts.parallel} in parallel)")
    log(f"loading {opts.artifact} on {device}")
    runtime = RuntimeCompletions.load(opts.artifact, device=device, dtype=opts.dtype, batch_size=opts.batch_size,
                                      mtp=opts.mtp, invariant=opts.batch_invariant)
    return runtime, runtime.tokenizer, f"built-in runtime, batch size {opts.batch_size}, MTP k={opts.mtp}, {opts.dtype}"


def _measure_on_runtime(report: ValidationReport, opts: ValidateOptions, candidate: RuntimeCompletions,
                        cand_batch: RuntimeBatch, reference: RuntimeCompletions | None,
                        ref_batch: RuntimeBatch | None, log: Log) -> None:
    """What only the models themselves give: fidelity, throughput, MTP acceptance."""
    if reference is not None and ref_batch is not None:
        f = opts.fidelity_questions or len(cand_batch.prompt_ids)
        log(f"fidelity: {CANDIDATE_LABEL} against {REFERENCE_LABEL} on {min(f, len(cand_batch.prompt_ids))} prompts")
        report.fidelity = measure_fidelity(candidate.model, reference.model, cand_batch.prompt_ids[:f],
                                           cand_batch.token_ids[:f], ref_batch.token_ids[:f])
    if opts.throughput:
        prompts = cand_batch.prompt_ids[:opts.batch_size]
        for label, runner in ((CANDIDATE_LABEL, candidate), (REFERENCE_LABEL, reference)):
            if runner is not None:
                report.throughput += throughput_runs(runner, prompts, opts.max_new_tokens, opts.mtp, label, log)
        report.settings["throughput"] = (
            f"the first {len(prompts)} GSM8K prompts as one batch (mean {sum(map(len, prompts)) / len(prompts):.0f} "
            f"tokens), {opts.max_new_tokens} new tokens each, no stop tokens, after a warm-up; prefill = a call "
            f"making one token, decode = the rest; each call the fastest of {THROUGHPUT_REPEATS}")
    if cand_batch.acceptance is not None:
        report.mtp = acceptance_figures(cand_batch.acceptance)
        if ref_batch is not None and ref_batch.acceptance is not None:
            report.mtp_reference = acceptance_figures(ref_batch.acceptance)


def _reference_runner(opts: ValidateOptions, device: torch.device,
                      log: Log) -> RuntimeCompletions | CompletionsEndpoint | None:
    """The reference: the BF16 source in the built-in runtime, a server, or none."""
    if opts.reference is not None:
        log(f"loading reference {opts.reference} on {device}")
        return RuntimeCompletions.load(opts.reference, device=device, dtype=opts.dtype, batch_size=opts.batch_size,
                                       mtp=opts.mtp, invariant=opts.batch_invariant)
    if opts.reference_endpoint is None:
        return None
    model = opts.reference_endpoint_model
    if model is None:
        listed = served_models(opts.reference_endpoint, timeout_s=opts.timeout_s)
        if len(listed) != 1:
            raise NpuportError(f"{opts.reference_endpoint} serves {len(listed)} models ({', '.join(listed) or 'none'}"
                               "); name the reference with --reference-endpoint-model")
        model = listed[0]
    return CompletionsEndpoint(opts.reference_endpoint, model, parallel=opts.parallel, timeout_s=opts.timeout_s,
                               retries=opts.retries)


def _measure_by_logprobs(report: ValidationReport, opts: ValidateOptions,
                         candidate: RuntimeCompletions | CompletionsEndpoint,
                         reference: RuntimeCompletions | CompletionsEndpoint, tokenizer: Any,
                         prompts: Sequence[str], protocol: GSM8KProtocol, log: Log) -> None:
    """Fidelity where a side is a server: from log-probabilities (endpoint_fidelity.py), on the first
    fidelity_questions prompts, tokenized by the artifact's tokenizer."""
    if tokenizer is None:
        report.settings["fidelity"] = "not measured: the artifact has no tokenizer to turn the prompts into tokens"
        return
    f = min(opts.fidelity_questions or len(prompts), len(prompts))
    log(f"fidelity: {CANDIDATE_LABEL} against {REFERENCE_LABEL} on {f} prompts, from top-{opts.fidelity_top_k} "
        "log-probabilities")

    def source(runner: RuntimeCompletions | CompletionsEndpoint) -> EndpointLogprobs | RuntimeLogprobs:
        return RuntimeLogprobs(runner) if isinstance(runner, RuntimeCompletions) else EndpointLogprobs(runner)

    ids = [list(tokenizer.encode(p)) for p in prompts[:f]]
    measured = logprob_fidelity(source(candidate), source(reference), ids, protocol.max_new_tokens, protocol.stop,
                                opts.fidelity_top_k)
    report.fidelity = measured.fidelity
    report.settings["fidelity"] = (
        f"from top-{opts.fidelity_top_k} log-probabilities ({measured.fidelity.kl_method}); the estimate's bias "
        "against the full-vocabulary KL is what validate reports beside it when both models run in the built-in "
        "runtime")


def run_validation(options: ValidateOptions, out_dir: Path | str, log: Log = print) -> ValidationOutcome:
    """Measure, gate and write the report into `out_dir`; the gates' verdicts are in the outcome (a failed
    gate is not an exception: the caller decides the exit status). With a reference on the built-in
    runtime both models are held at once (fidelity compares them position by position)."""
    opts = options
    opts.check()
    device = pick_device(opts.device)
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
        "data": str(opts.data) if opts.data is not None else "GSM8K test split shipped with npuport"}

    answers = Path(out_dir) / ANSWERS_NAME
    cand_result, cand_batch = run_gsm8k(candidate, protocol, prompts, CANDIDATE_LABEL, log, answers)
    completions = [(CANDIDATE_LABEL, cand_result, cand_batch)]
    row = AccuracyRow(cand_result)
    reference = _reference_runner(opts, device, log)
    ref_batch = None
    if reference is not None:
        ref_result, ref_batch = run_gsm8k(reference, protocol, prompts, REFERENCE_LABEL, log,
                                          Path(out_dir) / REFERENCE_ANSWERS_NAME)
        completions.append((REFERENCE_LABEL, ref_result, ref_batch))
        row = AccuracyRow.paired(cand_result, ref_result, seed=opts.seed)
        settings["reference"] = (str(opts.reference) if opts.reference is not None
                                 else f"endpoint {reference.url} (model {reference.model})")

    local = isinstance(candidate, RuntimeCompletions)
    ref_local = isinstance(reference, RuntimeCompletions)
    device_text = describe_device(device)
    if local:
        settings["kernels"] = (
            "batch-invariant decode and verify steps (invariant GEMMs for the float linear layers and the lm_head, "
            "MoE, attention and GDN launched for the largest verify step): MTP keeps greedy output"
            if candidate.invariant else "fast (vendor GEMMs and tiles by step size in decode and verify steps"
            + ("; MTP may change greedy output: --batch-invariant)" if opts.mtp else ")"))
    if local and candidate.model.parallel.active:
        device_text += f" x {candidate.model.parallel.world} (tensor + expert parallel)"
    if not local:
        device_text = f"endpoint {candidate.url}" + (f"; reference on {device_text}" if ref_local else "")
    if isinstance(reference, CompletionsEndpoint):
        device_text += f"; reference on endpoint {reference.url}"
    report = ValidationReport(artifact=str(opts.artifact), device=device_text, seed=opts.seed,
                              candidate_label=CANDIDATE_LABEL, reference_label=REFERENCE_LABEL, accuracy=[row],
                              settings=settings)
    if local or ref_local:
        report.dtypes = {"float tensors and activations": opts.dtype,
                         "quantized linears": "int8 weights per channel x int8 activations per token"}
    if local:
        _measure_on_runtime(report, opts, candidate, cand_batch, reference if ref_local else None,
                            ref_batch if ref_local else None, log)
    for label, runner, batch in ((CANDIDATE_LABEL, candidate, cand_batch), (REFERENCE_LABEL, reference, ref_batch)):
        if isinstance(runner, CompletionsEndpoint):
            failed = FailedQuestions(label, n, batch.failures)
            report.failed_questions.append(failed)
            report.gates.append(answered_gate(failed))
    if not local or isinstance(reference, CompletionsEndpoint):
        settings["answers"] = "each endpoint answer, or its error, as it arrived: " + ", ".join(
            name for name, r in ((ANSWERS_NAME, candidate), (REFERENCE_ANSWERS_NAME, reference))
            if isinstance(r, CompletionsEndpoint))
        if reference is not None:
            _measure_by_logprobs(report, opts, candidate, reference, tokenizer, prompts, protocol, log)

    if row.reference is not None and opts.max_accuracy_drop is not None:
        report.gates.append(accuracy_drop_gate(row, opts.max_accuracy_drop, CANDIDATE_LABEL, REFERENCE_LABEL))
    if opts.min_acceptance is not None and report.mtp is not None:
        report.gates.append(acceptance_gate(report.mtp, opts.min_acceptance))

    log(f"checksum of {opts.artifact}")
    report.artifact_checksum = artifact_checksum(opts.artifact)
    settings["artifact_checksum"] = CHECKSUM_METHOD
    files = write_report(report, out_dir)
    return ValidationOutcome(report, files, write_completions(files.json.parent / COMPLETIONS_NAME, completions))
