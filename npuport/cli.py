"""The `npuport` command line: thin click commands that parse arguments and call the library."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from npuport import __version__
from npuport.errors import NpuportError
from npuport.runtime.dispatch import BF16_ENV, INT8_ENV
from npuport.runtime.run_options import DISPATCH_CHOICES, MAX_DRAFTS


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that every cleanup
    that runs on Ctrl-C runs for them too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # kill, docker stop, systemd, Slurm; a closed terminal


@contextmanager
def _stop_like_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped while a command runs; the previous handlers are restored afterwards."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class _Group(click.Group):
    """Prints an NpuportError as one clear line and exits 1, instead of a traceback; Ctrl-C, SIGTERM and SIGHUP
    stop a command the same way (its cleanup runs), with one line and exit status 128 + the signal's number."""

    def invoke(self, ctx: click.Context):
        try:
            with _stop_like_ctrl_c():
                return super().invoke(ctx)
        except NpuportError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:  # a file the system refused where no check of npuport's came first (a read-only folder)
            click.echo(f"error: {'' if e.filename is None else f'{e.filename}: '}{e.strerror or e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            click.echo(f"error: stopped by {signal.Signals(signum).name}", err=True)
            sys.exit(128 + signum)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="npuport")
def main() -> None:
    """Convert Qwen3.5 checkpoints to msModelSlim-format W8A8 for Ascend NPUs, validate and package them."""


# Options shared by the commands that run the model. The device names are npuport/devices.py's; they are
# repeated here so that the command line starts without importing torch.
device_option = click.option("--device", type=click.Choice(["npu", "cuda", "cpu"]), default=None,
                             help="Default: npu if torch_npu imports, else cuda, else cpu.")
devices_option = click.option(
    "--devices", type=click.IntRange(min=1), default=1, show_default=True,
    help="Split the model over N devices of this machine, one process each: attention, GatedDeltaNet and MLPs by "
         "heads and channels (tensor parallel), the routed experts by expert (expert parallel, tokens dispatched "
         "as BF16 or int8 per layer). Rank 0 reads the inputs and writes the outputs. Under torchrun, not needed.")
invariant_option = click.option(
    "--batch-invariant/--no-batch-invariant", default=None,
    help="GPU/NPU: decode and verify steps on kernels whose rows do not depend on the batch (invariant GEMMs for "
         "the float linear layers and the lm_head; MoE, attention and GDN kernels launched for the largest verify "
         "step), so that a verify step rounds as decode steps do and greedy MTP output is greedy output. Default: "
         "on with --mtp on one device, off otherwise; --no-batch-invariant for speed (bench/RESULTS.md has the "
         "cost).")
mtp_option = click.option(
    "--mtp", type=click.IntRange(0, MAX_DRAFTS), default=0, show_default=True,
    help=f"MTP speculative decoding with K draft tokens per round, at most {MAX_DRAFTS} (0 = off).")
dispatch_option = click.option(
    "--dispatch", type=click.Choice(list(DISPATCH_CHOICES)), default=None,
    help=f"How tokens travel to MoE experts: bf16, or int8 with per-token scales (W8A8 experts only), or auto "
         f"(int8 into W8A8 experts, BF16 into BF16 experts). Default: {BF16_ENV}=1 in the environment gives bf16, "
         f"{INT8_ENV}=1 int8, else auto. The MTP head always takes BF16.")
dtype_option = click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32", "float64"]),
                            default=None, help="Default: float32 on a CPU (bfloat16 is emulated there, about 10x "
                                               "slower), bfloat16 on an NPU or GPU.")


def resolved_dtype(dtype: str | None, device: str | None) -> str:
    """--dtype, else the device's default (npuport.devices.default_dtype). Each command's first line about the model
    names it: serve's "serving ...", validate's "loading ...", generate's first line."""
    from npuport.devices import default_dtype

    return dtype or default_dtype(device)


def echo_to_stderr(message: str) -> None:
    """A progress line for the user (picklable: rank 0 of a --devices run gets it)."""
    click.echo(message, err=True)


def _report_problems(subject: Path, problems: list[str]) -> None:
    """Print each problem as a FAIL line and exit 1 if there is any; else print OK."""
    for p in problems:
        click.echo(f"FAIL {p}")
    if problems:
        click.echo(f"{subject}: {len(problems)} problem(s)", err=True)
        sys.exit(1)
    click.echo(f"{subject}: OK")


# The names of tiny_checkpoint.REAL_MODELS, repeated so that the command line starts without importing torch
# (tests/test_make_tiny_like.py holds the two lists equal); typed in any case.
LIKE_MODELS = ("27B", "35B-A3B", "122B-A10B", "397B-A17B", "Qwen3.6-27B", "Qwen3.6-35B-A3B", "Qwen3.8-27B",
               "Qwen3.8-2.4T-A95B")


@main.command("make-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--like", type=click.Choice(LIKE_MODELS, case_sensitive=False), metavar=f"[{'|'.join(LIKE_MODELS)}]",
              default=None,
              help="The real widths of that published model (a size alone names a Qwen3.5): hidden size, heads, "
                   "GDN heads, experts, top-k and vocabulary, at --layers depth (default 4), with its MTP head; "
                   "dense or MoE as the model is, its config.json keys as published, in the layout it is released "
                   "in (Qwen3.8-2.4T-A95B: text) (instead of --arch and --size). Vocabulary 248320 although the "
                   "tokenizer written has 2048 tokens: embedding and lm_head have their real size, for benchmarks. "
                   "At 4 layers the 27Bs are 9 GB, the 35B-A3Bs 10 GB, 122B-A10B 28 GB, 397B-A17B 70 GB, "
                   "Qwen3.8-2.4T-A95B 271 GB (113 GB at 1 layer: 52 GB of experts per MoE layer, the MTP's too).")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Decoder layers (default: 4 with --like, else the preset's); each fourth is full attention, "
                   "the others GatedDeltaNet, as in the real models.")
@click.option("--arch", type=click.Choice(["dense", "moe"]), default="dense", show_default=True)
@click.option("--layout", type=click.Choice(["multimodal", "text"]), default="multimodal", show_default=True,
              help="multimodal: model.language_model.* plus a small model.visual.*; text: model.*")
@click.option("--mtp-experts", type=click.Choice(["fused", "per-expert"]), default="fused", show_default=True,
              help="How the MoE MTP layer stores its experts.")
@click.option("--size", type=click.Choice(["tiny", "small", "mid"]), default="tiny", show_default=True,
              help="tiny: under 5 MB (tests); small: ~100M parameters; mid: a few GB (benchmarks).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tie-word-embeddings", is_flag=True, help="Share lm_head with embed_tokens (no lm_head tensor).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def make_tiny_cmd(ctx: click.Context, out: Path, like: str | None, layers: int | None, arch: str, layout: str,
                  mtp_experts: str, size: str, seed: int, tie_word_embeddings: bool, quiet: bool) -> None:
    """Write a deterministic Qwen3.5 checkpoint with random weights to OUT (a new folder): BF16 safetensors in
    shards of at most 4 GB (a larger tensor alone in one), config.json, tokenizer, MTP head."""
    from npuport.fixtures.tiny_checkpoint import TinySpec, like_spec, make_tiny

    if out.exists():
        raise NpuportError(f"{out} already exists; choose a new folder")
    if like:
        typed = click.core.ParameterSource.COMMANDLINE
        given = [f"--{p}" for p in ("arch", "size") if ctx.get_parameter_source(p) is typed]
        if given:
            raise NpuportError(f"--like {like} sets the architecture and sizes; leave out {' and '.join(given)}")
        # a --layout left out is the model's own (the text-only release has no multimodal one)
        chosen = layout if ctx.get_parameter_source("layout") is typed else None
        spec = like_spec(like, layers, seed, chosen, mtp_experts, tie_word_embeddings)
    else:
        spec = TinySpec(arch, layout, mtp_experts, size, seed, tie_word_embeddings, layers)
    make_tiny(out, spec, progress=lambda msg: click.echo(msg, err=True), show_progress=not quiet)
    click.echo(f"wrote {spec.arch} {like or size} Qwen3.5 checkpoint ({spec.layout} layout) to {out}")


@main.command("convert-qwen35")
@click.argument("src", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--a8w8", "a8w8", is_flag=True, default=False,
              help="W8A8_DYNAMIC: int8 weights per channel, int8 activations per token (the default; accepted for "
                   "scripts that name it).")
@click.option("--w4a8", "w4a8", is_flag=True, default=False,
              help="W4A8_DYNAMIC routed experts, as msModelSlim's W4A8 recipe writes them for the largest MoE models: "
                   "int4 expert weights per channel (msModelSlim's ssz search, no calibration data; about 5 s per "
                   "expert projection at 397B-A17B widths on one core - use --workers), int8 activations per token; "
                   "attention W8A8_DYNAMIC but o_proj. Picks the shipped qwen3_5_moe_w4a8 recipe unless --recipe "
                   "names one; MoE sources only.")
@click.option("--recipe", "recipe_name", metavar="FILE|NAME",
              help="An msModelSlim YAML recipe file, or the name of a recipe shipped with npuport (qwen3_5_dense_w8a8, "
                   "qwen3_5_moe_w8a8, qwen3_5_235b_w8a8, qwen3_6_27b_w8a8, qwen3_6_dense_w8a8; README's recipe table "
                   "says which does what). Default: the shipped Qwen3.5 dense or MoE recipe, from config.json.")
@click.option("--engine", "engine_name", metavar="ENGINE[==VERSION]",
              help="The serving engine the artifact is for (sglang or vllm-ascend; default release: the newest "
                   "npuport's table of engine facts was checked against). Layers that release is known not to load "
                   "quantized are kept BF16, each named in the ignore-list with the engine, its releases and the "
                   "issue. Without it the artifact is what the recipe asks, as msModelSlim writes it; `npuport check` "
                   "then says which engines load it.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists, once the new artifact is complete; only an "
              "artifact or release npuport wrote, or an empty folder, is replaced.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Shards written in parallel; the output bytes do not depend on it.")
@click.option("--skip-unsupported", is_flag=True,
              help="Convert even if the recipe has steps npuport does not implement (e.g. smoothing); they are listed.")
@click.option("--part-file-size", type=float, default=None,
              help="Shard size limit in GB, a finite number above 0 (default: the recipe's, 4).")
@click.option("--source-sha256", is_flag=True,
              help="Record the sha256 of every source shard in the manifest (one more read of the source); "
                   "by default a fingerprint of the config, index and shard headers is recorded.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert_cmd(src: Path, out: Path, a8w8: bool, w4a8: bool, recipe_name: str | None, engine_name: str | None,
                force: bool, workers: int, skip_unsupported: bool, part_file_size: float | None, source_sha256: bool,
                quiet: bool) -> None:
    """Convert the Qwen3.5 / 3.6 / 3.8 BF16 checkpoint SRC into an msModelSlim-format W8A8 artifact OUT (W4A8
    experts with --w4a8).

    The MTP head (mtp.*) and every layer on the ignore-list stay BF16; the ignore-list is printed and
    saved in OUT/npuport_manifest.json. OUT appears only when complete and checked.
    """
    from npuport.convert.converter import convert_qwen35
    from npuport.convert.engine_facts import EngineTarget
    from npuport.convert.recipe import W4A8_DYNAMIC, W4A8_RECIPE, recipe_path_for

    if a8w8 and w4a8:
        raise NpuportError("--a8w8 and --w4a8: choose one scheme")
    if w4a8 and recipe_name is None:
        recipe_name = W4A8_RECIPE
    recipe_path = recipe_path_for(recipe_name) if recipe_name is not None else None
    engine = EngineTarget.parse(engine_name) if engine_name is not None else None
    result = convert_qwen35(src, out, recipe_path=recipe_path, engine=engine, force=force, workers=workers,
                            scheme=W4A8_DYNAMIC if w4a8 else None,
                            skip_unsupported=skip_unsupported, part_file_size_gb=part_file_size,
                            show_progress=not quiet, full_sha256=source_sha256, log=lambda m: click.echo(m, err=True))
    mb = result.bytes_written / 1e6
    click.echo(f"wrote {out} ({mb:.1f} MB, {len(result.plan.shards)} shard(s)) in {result.seconds:.1f} s; "
               f"npuport check: OK")


@main.command("check")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
def check_cmd(folder: Path) -> None:
    """Check FOLDER, a W8A8 artifact or a BF16 Qwen3.5 source; list every violation, one line each, and exit 1 if
    any. An artifact (it has a quant_model_description.json) is checked against the W8A8 checkpoint contract; a
    source as convert-qwen35 checks it (config, index, shard headers, every tensor against the config). Both against
    the engine rules: what vLLM, sglang and transformers assert of a Qwen3.5 config and folder (rotary and M-RoPE
    sizes, heads, layer kinds, tokenizer, vision tokens, processor files; docs/ENGINE_RULES.md). Then warn of what
    serving engines are known to do with a folder like it (npuport's table of engine facts, each with its workaround
    and source), and say for an artifact which engines (sglang, vllm-ascend; their newest releases checked) load
    it and which cannot, with the remedy."""
    from npuport.convert.check import check_folder
    from npuport.convert.engine_facts import engine_support, folder_facts

    problems = check_folder(folder)
    if not problems:
        for fact in folder_facts(folder, "breaks"):
            click.echo(f"warning: {fact.warning()}")
        for line in engine_support(folder):
            click.echo(f"engine: {line}")
    _report_problems(folder, problems)


@main.command("demo")
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("npuport-demo"), show_default=True,
              help="Where the demo writes; rebuilt on every run (only if an earlier demo made it).")
@click.option("--model", type=click.Choice(["trained", "random-dense", "random-moe"]), default="trained",
              show_default=True, help="trained: the tiny checkpoint shipped with npuport, trained with its MTP head "
              "on GSM8K text and arithmetic word problems; random-*: make-tiny weights (MTP drafts are then never "
              "accepted).")
def demo_cmd(workdir: Path, model: str) -> None:
    """Run the whole job on a small Qwen3.5 on CPU: convert its BF16 source to W8A8, check it, validate it
    against the source on a few of the arithmetic word problems shipped with npuport, in GSM8K's format (accuracy,
    fidelity, throughput, MTP acceptance), package the release and verify it."""
    from npuport.demo import run_demo

    out = run_demo(workdir, model, log=lambda m: click.echo(m))
    click.echo(f"demo done; everything is under {out.workdir}")


@main.command("package")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--out", "out", type=click.Path(path_type=Path), required=True,
              help="The release folder (new, or with --force one npuport packaged).")
@click.option("--report", "report", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="The validation report.json; report.md and its plots next to it are packaged too.")
@click.option("--base-model", help="The base model as the card names it, e.g. a hub id (default: the source "
              "folder's name from the manifest).")
@click.option("--force", is_flag=True, help="Package even if the artifact fails the contract or a gate failed "
              "(the model card then says so at the top); and replace an OUT (and OUT.tar) that npuport packaged.")
@click.option("--archive", is_flag=True, help="Also write OUT.tar and OUT.tar.sha256 beside OUT.")
def package_cmd(artifact: Path, out: Path, report: Path | None, base_model: str | None, force: bool,
                archive: bool) -> None:
    """Assemble the release folder OUT from ARTIFACT: its files, the validation report and plots, a model card
    README.md and SHA256SUMS. OUT appears only when complete."""
    from npuport.release.package import package_release

    package_release(artifact, out, report, force, archive, base_model=base_model,
                    log=lambda m: click.echo(m, err=True))
    click.echo(f"{out}: release written")


@main.command("verify-release")
@click.argument("release", type=click.Path(path_type=Path, exists=True, file_okay=False))
def verify_release_cmd(release: Path) -> None:
    """Check a packaged RELEASE: checksums, the checkpoint contract, the model card's figures against
    validation/report.json (figures and labels), no BF16 files; list every problem, exit 1 if any. Warns of a
    release that carries no measurement (no validation report)."""
    from npuport.release.verify import SCOPE, release_warnings, verify_release

    for warning in release_warnings(release):
        click.echo(f"warning: {warning}", err=True)
    _report_problems(release, verify_release(release))
    click.echo(SCOPE)


@main.command("generate")
@click.argument("model", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--prompt", "texts", multiple=True, help="A text prompt (repeat for a batch).")
@click.option("--prompt-ids", "id_prompts", multiple=True, help="A prompt as token ids, e.g. 1,2,3 (repeatable).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Refused when the longest prompt and these exceed the model's context (config.json "
                   "max_position_embeddings; 262,144 where it states none), before anything is allocated.")
@mtp_option
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@device_option
@devices_option
@dtype_option
@invariant_option
@dispatch_option
@click.option("--json", "as_json", is_flag=True, help="Print token ids, text and acceptance statistics as JSON.")
def generate_cmd(model: Path, texts: tuple[str, ...], id_prompts: tuple[str, ...], max_new_tokens: int, mtp: int,
                 temperature: float, top_p: float, seed: int, device: str | None, devices: int, dtype: str,
                 batch_invariant: bool | None, dispatch: str | None, as_json: bool) -> None:
    """Generate from MODEL (a BF16 source or a W8A8 artifact) with the built-in runtime."""
    import json

    from npuport.runtime.sampling import SamplingParams
    from npuport.runtime.several_devices import check_split, on_devices
    from npuport.runtime.textgen import format_report, run_generate

    check_split(model, devices)
    dtype = resolved_dtype(dtype, device)
    report = on_devices(run_generate, (model, texts, id_prompts, max_new_tokens, mtp,
                                       SamplingParams(temperature, top_p, seed), device, dtype, batch_invariant,
                                       dispatch),
                        devices, device)
    if report is None:  # a torchrun rank other than 0: rank 0 prints
        return
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


# The GSM8K protocol names and defaults: a standard-library module, cheap to import with the command line.
from npuport.runtime.validation.gsm8k import (  # noqa: E402
    DEFAULT_PROTOCOL,
    LM_EVAL_MAX_NEW_TOKENS,
    LM_EVAL_SEED,
    MAX_NEW_TOKENS,
    PROTOCOLS,
)


class _GateLevel(click.ParamType):
    """A gate's number within [low, high], or "off" (None: no gate); with `chance`, also "chance" (gates.CHANCE)."""

    def __init__(self, low: float, high: float | None, chance: bool = False) -> None:
        self.low, self.high, self.chance = low, high, chance
        self.name = ("chance|" if chance else "") + "NUMBER|off"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201
        if value is None or isinstance(value, float) or (self.chance and value == "chance"):
            return value
        if value == "off":
            return None
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or number < self.low or (self.high is not None and number > self.high):
            self.fail(f"{value!r}: give " + ("'chance', " if self.chance else "") + f"a number from {self.low:g}"
                      + (f" to {self.high:g}" if self.high is not None else " up") + ", or 'off'", param, ctx)
        return number


@main.command("validate")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False), required=False)
@click.option("--gsm8k", "gsm8k", is_flag=True, default=True,
              help="Run GSM8K or a set in its format (--data): the benchmark validate runs, so the default; accepted "
                   "for scripts that name it.")
@click.option("--protocol", type=click.Choice(PROTOCOLS), default=DEFAULT_PROTOCOL, show_default=True,
              help="Whose GSM8K conventions: prompts, scored questions, stop strings, answer extraction.")
@click.option("--data", type=click.Path(path_type=Path, exists=True),
              help="A GSM8K folder (test.jsonl, train.jsonl) or a test .jsonl file; default: the copy shipped "
                   "with npuport.")
@click.option("--num-questions", type=click.IntRange(min=1), default=None, help="Default: every question.")
@click.option("--shots", type=click.IntRange(min=0), default=None, help="Default: 5 (aisbench: 0).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help=f"Per question; also per request in the throughput runs. Default: the protocol's own, "
                   f"{MAX_NEW_TOKENS} (lm-eval: {LM_EVAL_MAX_NEW_TOKENS}).")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Questions per generate call on the built-in runtime; the throughput runs use one such batch.")
@click.option("--mtp", type=click.IntRange(0, MAX_DRAFTS), default=0, show_default=True,
              help=f"MTP speculative decoding with K drafts per round on the built-in runtime, at most {MAX_DRAFTS} "
                   "(0 = off); with K > 0 throughput is timed with and without it.")
@click.option("--seed", type=int, default=LM_EVAL_SEED, show_default=True,
              help="lm-eval's shot sampling and the paired bootstrap.")
@click.option("--reference", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="The BF16 source: the same run on it (built-in runtime), the paired accuracy difference and "
                   "fidelity.")
@click.option("--endpoint", metavar="URL", help="Run the artifact on an OpenAI-compatible server (/v1/completions) "
              "instead of the built-in runtime; throughput is then not measured, and fidelity comes from the "
              "servers' log-probabilities. ARTIFACT, when given, is still read here: its tokenizer renders chat "
              "prompts and tokenizes fidelity's prompts, and the report's checksum is taken over its files; without "
              "it give --tokenizer (no checksum is then taken).")
@click.option("--endpoint-model", metavar="NAME",
              help="The model name to send (default: the one model the server lists, else ARTIFACT as given).")
@click.option("--tokenizer", "tokenizer", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="With --endpoint: a folder with the model's tokenizer files (tokenizer.json, "
                   "tokenizer_config.json), used instead of ARTIFACT's; then ARTIFACT may be left out.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Answer the questions N times (on --endpoint or the built-in runtime) and report the share of "
                   "completions identical to run 1's, per later run; accuracy and the rest are run 1's.")
@click.option("--mtp-reference-endpoint", metavar="URL",
              help="With --endpoint: the same model served without MTP; the same greedy requests are sent to it and "
                   "the share of completions identical to --endpoint's reported (does speculative decoding change the "
                   "engine's greedy output?).")
@click.option("--mtp-reference-endpoint-model", metavar="NAME",
              help="The model name to send to --mtp-reference-endpoint (default: the one model it lists).")
@click.option("--compare-without-mtp", is_flag=True, default=False,
              help="With --mtp K on the built-in runtime: answer the questions once more without MTP (same model, "
                   "batches and kernels) and report the share of identical completions.")
@click.option("--reference-endpoint", metavar="URL",
              help="The BF16 reference on an OpenAI-compatible server instead of --reference: the same GSM8K run on "
                   "it, the paired difference, and fidelity from log-probabilities (echo + logprobs where the "
                   "server takes them).")
@click.option("--reference-endpoint-model", metavar="NAME",
              help="The model name to send to --reference-endpoint (default: the one model it lists).")
@click.option("--fidelity-top-k", type=click.IntRange(1, 20), default=5, show_default=True,
              help="Log-probabilities per position asked of a server for fidelity (the OpenAI API gives at most 5; "
                   "vLLM and npuport serve 20).")
@click.option("--api-key", envvar=["NPUPORT_API_KEY", "OPENAI_API_KEY"], show_envvar=True, default=None,
              help="Sent as 'Authorization: Bearer KEY' to every endpoint given (prefer the "
                   "environment variables: a command line is visible to other users of the machine).")
@click.option("--parallel", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests in flight to --endpoint.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Wall-clock seconds per request, from connecting to the answer's last byte.")
@click.option("--retries", type=click.IntRange(min=0), default=3, show_default=True,
              help="Retries of a request that failed to connect, timed out or got HTTP 429/5xx (waits 1, 2, 4 s...).")
@device_option
@devices_option
@dtype_option
@invariant_option
@dispatch_option
@click.option("--fidelity-questions", type=click.IntRange(min=1), default=None,
              help="Fidelity on the first N questions only (default: all of them).")
@click.option("--throughput/--no-throughput", default=True, show_default=True,
              help="Time prefill and decode on the built-in runtime.")
@click.option("--max-accuracy-drop", type=_GateLevel(0, None), default=1.0, show_default=True,
              help="Gate (with --reference): fail when the artifact's accuracy is more than this many points below "
                   "the reference's; off: no such gate.")
@click.option("--min-accuracy", type=_GateLevel(0, 100, chance=True), default="chance", show_default=True,
              help="Gate, with or without a reference: fail unless the artifact's accuracy is above chance - higher "
                   "than the accuracy of always giving the most common gold answer of the questions run, so a model "
                   "answering at chance, or every question wrong, fails - or, given a number, at least that many "
                   "percent; off: no such gate. The report names the floor and the answer behind it.")
@click.option("--min-acceptance", type=click.FloatRange(min=1.0), default=None,
              help="Gate (with --mtp): fail when the MTP mean acceptance length - accepted drafts + 1 per verify "
                   "round, 1 to K+1 - is below this.")
@click.option("--chat-template-kwargs", metavar="JSON", default=None,
              help='For aisbench\'s chat prompt, e.g. \'{"enable_thinking": false}\'.')
@click.option("--out", "out", type=click.Path(path_type=Path), default=None,
              help="Report folder (default: ./validation-<ARTIFACT folder name>, without ARTIFACT "
                   "./validation-endpoint). Results are written there as they are made; while it holds a file "
                   "PARTIAL the run is unfinished, and the same command continues it.")
@click.option("--resume", is_flag=True, default=False,
              help="Continue the run stopped in --out (killed, interrupted, crashed): what it finished is kept, the "
                   "rest is run, and the report is what an uninterrupted run writes. Refused when an option that "
                   "decides the results differs. Without --resume the same command continues it too; a finished "
                   "folder is then started over.")
def validate_cmd(artifact: Path | None, gsm8k: bool, protocol: str, data: Path | None, num_questions: int | None,
                 shots: int | None, max_new_tokens: int | None, batch_size: int, mtp: int, seed: int,
                 reference: Path | None,
                 endpoint: str | None, endpoint_model: str | None, tokenizer: Path | None, repeat: int,
                 mtp_reference_endpoint: str | None, mtp_reference_endpoint_model: str | None,
                 compare_without_mtp: bool, reference_endpoint: str | None,
                 reference_endpoint_model: str | None, fidelity_top_k: int, api_key: str | None, parallel: int,
                 timeout_s: float,
                 retries: int,
                 device: str | None, devices: int, dtype: str, batch_invariant: bool | None, dispatch: str | None,
                 fidelity_questions: int | None, throughput: bool,
                 max_accuracy_drop: float | None, min_accuracy: float | str | None, min_acceptance: float | None,
                 chat_template_kwargs: str | None, out: Path | None, resume: bool) -> None:
    """Validate the W8A8 ARTIFACT: GSM8K accuracy, and with --reference (or --reference-endpoint) the paired
    difference and fidelity against the BF16 source; throughput and MTP acceptance; report.json, report.md, plots
    and completions.jsonl. Either side may run on a server (--endpoint, --reference-endpoint). ARTIFACT (the model's
    folder) is needed unless the model runs on --endpoint and --tokenizer names its tokenizer. --repeat and
    --mtp-reference-endpoint / --compare-without-mtp measure whether greedy output is deterministic. Exits 1 when a
    gate fails. A stopped run is continued by the same command (or with --resume), from what it wrote to --out."""
    from npuport.jsonfile import parse_json
    from npuport.runtime.several_devices import check_split, on_devices
    from npuport.runtime.validation.validate import ValidateOptions, run_validation

    try:
        template_kwargs = parse_json(chat_template_kwargs) if chat_template_kwargs else {}
    except ValueError as e:
        raise NpuportError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(template_kwargs, dict):
        raise NpuportError("--chat-template-kwargs must be a JSON object")
    dtype = resolved_dtype(dtype, device)
    options = ValidateOptions(artifact, protocol, data, num_questions, shots, max_new_tokens, batch_size, mtp, seed,
                              reference, endpoint, endpoint_model, parallel, timeout_s, retries, device, dtype,
                              fidelity_questions, throughput, max_accuracy_drop, min_acceptance, template_kwargs,
                              batch_invariant, reference_endpoint=reference_endpoint,
                              reference_endpoint_model=reference_endpoint_model, fidelity_top_k=fidelity_top_k,
                              dispatch=dispatch, api_key=api_key, tokenizer=tokenizer, repeat=repeat,
                              mtp_reference_endpoint=mtp_reference_endpoint,
                              mtp_reference_endpoint_model=mtp_reference_endpoint_model,
                              compare_without_mtp=compare_without_mtp, resume=resume, min_accuracy=min_accuracy)
    options.check()
    if devices > 1 and endpoint:
        raise NpuportError("--devices splits the built-in runtime's model; with --endpoint the server runs it")
    for model in (artifact, reference):
        if model is not None:
            check_split(model, devices)
    if devices == 1 and (not endpoint or reference is not None):  # the built-in runtime runs here: check it first
        from npuport.runtime.selftest.run import quiet_selftest

        quiet_selftest(device)
    default_out = Path(f"validation-{artifact.resolve().name if artifact is not None else 'endpoint'}")
    out = out or default_out
    try:
        outcome = on_devices(run_validation, (options, out, echo_to_stderr), devices, device)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP
        from npuport.runtime.validation.journal import PARTIAL_NAME

        if (out / PARTIAL_NAME).exists():
            click.echo(f"{out} keeps what was finished; the same command with --resume continues it", err=True)
        raise
    if outcome is None:  # a torchrun rank other than 0: rank 0 reports
        return
    files = outcome.files
    click.echo(f"report: {files.markdown} ({files.json.name}, {len(files.plots)} plot(s), {outcome.completions.name})")
    for gate in outcome.report.gates:
        click.echo(f"gate {'passed' if gate.passed else 'FAILED'}: {gate.name} ({gate.detail})")
    if outcome.failed_gates:
        click.echo(f"error: {len(outcome.failed_gates)} gate(s) failed", err=True)
        sys.exit(1)


@main.command("serve")
@click.argument("model", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0: any free port (the line printed at start names it).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Loopback by default (::1 for IPv6); 0.0.0.0 or :: serves every network the machine is on (a "
                   "warning says so; see --api-key).")
@click.option("--served-model-name", default=None,
              help="The name /v1/models lists and answers carry (default: the MODEL folder's own name). Requests may "
                   "also name the model by MODEL's path, as given or resolved.")
@mtp_option
@click.option("--max-batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Rows (prompts x n) in the running batch at once, prefilling or decoding (continuous batching: a "
                   "request joins at the next step, a finished row leaves at once; more wait in line). A decode "
                   "step's float rounding follows the batch's size, so a greedy answer in a batch may differ in a "
                   "late token from the same request alone; --batch-invariant rules that out.")
@click.option("--prefill-tokens", type=click.IntRange(min=1), default=None,
              help="Prompt tokens prefilled per step, over all prompts being prefilled, between the running rows' "
                   "decode steps: a long prompt is prefilled in chunks, so that it delays the others' tokens by one "
                   "chunk at a time. Default: 1024 on a CPU, 16384 on a GPU / NPU.")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help="Every answer bit for bit the one its request gets alone: each row generated in a call of its "
                   "own (requests wait for each other instead of sharing a batch), on batch-invariant steps where "
                   "the Triton kernels run. --no-batch-invariant: also MTP's verify steps on the fast kernels "
                   "(greedy MTP output may then differ from greedy output). Default: batching, and batch-invariant "
                   "steps with --mtp on one GPU/NPU.")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=4096, show_default=True,
              help="The largest max_tokens a request may ask for (the model's context bounds it as well).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=32768, show_default=True,
              help="The most tokens a prompt may have (the model's context bounds it as well).")
@click.option("--header-timeout", "header_timeout_s", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, help="Seconds a client has, from connecting, to send its request line and headers.")
@click.option("--request-timeout", "request_timeout_s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds a client then has to send the body; slower ones are dropped.")
@click.option("--max-connections", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests served at once, counted once a request has arrived whole (with the API key); more are "
                   "answered 503.")
@click.option("--max-pending-connections", type=click.IntRange(min=1), default=256, show_default=True,
              help="Connections of all clients still sending their requests at once (each within the timeouts "
                   "above; one still sending its request line and headers holds no thread). One more takes the "
                   "place of the oldest of these, of the client address with the most (answered 503), else gets 503.")
@click.option("--max-client-connections", type=click.IntRange(min=1), default=64, show_default=True,
              help="Connections one client address may have open at once, whatever they are doing. One more takes "
                   "the place of that address's oldest connection still sending its request line and headers "
                   "(answered 503), else gets 503: a client flooding the server displaces only its own.")
@click.option("--max-client-requests", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests of one client address served at once (waiting for the model or generating); more are "
                   "answered 429. As many as --max-connections by default (a benchmark from one machine may use "
                   "every slot); lower it where clients share the server.")
@click.option("--allow-client-chat-template", is_flag=True, default=False,
              help="Let a chat request bring its own chat template (chat_template). A template is code the server "
                   "runs, with no bound on the memory it takes: only for clients trusted with the machine.")
@click.option("--api-key", envvar="NPUPORT_API_KEY", show_envvar=True, default=None,
              help="Require 'Authorization: Bearer KEY' on every /v1 request (prefer the environment variable: a "
                   "command line is visible to other users of the machine).")
@device_option
@devices_option
@dtype_option
@dispatch_option
@click.option("--shutdown-timeout", "shutdown_timeout_s", type=click.FloatRange(min=0), default=5.0,
              show_default=True, help="On Ctrl-C or SIGTERM, seconds the requests in flight have to finish before "
                                      "they are cancelled.")
@click.option("--quiet", is_flag=True,
              help="Do not log each request (else one line each: time, client, method, path, status, latency, "
                   "prompt/completion tokens).")
def serve_cmd(model: Path, port: int, host: str, served_model_name: str | None, mtp: int, max_batch_size: int,
              prefill_tokens: int | None, batch_invariant: bool | None, max_tokens_limit: int, max_prompt_tokens: int,
              header_timeout_s: float, request_timeout_s: float, max_connections: int, max_pending_connections: int,
              max_client_connections: int, max_client_requests: int, allow_client_chat_template: bool,
              api_key: str | None, device: str | None, devices: int, dtype: str, dispatch: str | None,
              shutdown_timeout_s: float, quiet: bool) -> None:
    """Serve MODEL (a W8A8 artifact or BF16 source) on the built-in runtime as an OpenAI-compatible endpoint:
    POST /v1/completions and /v1/chat/completions (logprobs, echo, n, stream; prompts as text or token ids; chat
    through the model's own template; vLLM's ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output),
    GET /v1/models, /health and /metrics (Prometheus' text format). Requests in flight are batched continuously:
    one that arrives while others generate joins their batch at the next step, its prompt prefilled in chunks
    between their decode steps."""
    import functools

    from npuport.runtime.serving.limits import ServeLimits
    from npuport.runtime.serving.serve import serve_model
    from npuport.runtime.several_devices import check_split, on_devices

    check_split(model, devices)
    dtype = resolved_dtype(dtype, device)
    if devices == 1:
        from npuport.runtime.selftest.run import quiet_selftest

        quiet_selftest(device)
    limits = ServeLimits(max_tokens=max_tokens_limit, request_timeout_s=request_timeout_s,
                         max_connections=max_connections, max_prompt_tokens=max_prompt_tokens,
                         header_timeout_s=header_timeout_s, max_pending_connections=max_pending_connections,
                         allow_client_chat_template=allow_client_chat_template,
                         max_client_connections=max_client_connections, max_client_requests=max_client_requests)
    serve = functools.partial(
        serve_model, model, host=host, port=port, served_model=served_model_name, device=device, dtype=dtype,
        mtp=mtp, dispatch=dispatch, max_batch_size=max_batch_size, batch_invariant=batch_invariant,
        prefill_tokens=prefill_tokens, limits=limits,
        api_key=api_key, announce=click.echo, log=None if quiet else echo_to_stderr, warn=echo_to_stderr,
        shutdown_timeout_s=shutdown_timeout_s)
    on_devices(serve, (), devices, device)


@main.command("selftest")
@device_option
@click.option("--quick", is_flag=True, help="Fewer shapes and tokens (what validate and serve run first).")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=Path("selftest.json"),
              show_default=True, help="Where to write the result as JSON.")
def selftest_cmd(device: str | None, quick: bool, out: Path) -> None:
    """Check every kernel (and on an NPU every torch_npu operator) against its PyTorch reference on this machine's
    device, timed, and a tiny model's greedy tokens with and without graphs and with MTP. A kernel that fails or
    disagrees is switched to its reference for the rest of the run, with a warning naming it. Writes OUT - attach
    it to a bug report. Exits 1 when a check failed."""
    from npuport.runtime.selftest.run import selftest_command, summary

    result = selftest_command(device, out, quick, echo_to_stderr)
    click.echo(f"{summary(result)}; wrote {out}")
    if not result.passed:
        sys.exit(1)


# The training data names and the arithmetic sets' sizes: a torch-free module, cheap to import with the command line.
from npuport.fixtures.arithmetic import TEST_PROBLEMS, TRAIN_PROBLEMS, TRAINING_DATA  # noqa: E402


@main.command("make-arithmetic")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--train", "train", type=click.IntRange(min=1), default=TRAIN_PROBLEMS, show_default=True,
              help="Problems in train.jsonl.")
@click.option("--test", "test", type=click.IntRange(min=1), default=TEST_PROBLEMS, show_default=True,
              help="Problems in test.jsonl, none of whose questions is in train.jsonl.")
def make_arithmetic_cmd(out: Path, seed: int, train: int, test: int) -> None:
    """Write grade-school arithmetic word problems in GSM8K's format (train.jsonl, test.jsonl) to the new folder
    OUT; `validate --data OUT` runs them. The defaults write the set shipped with npuport (the demo's questions)."""
    from npuport.fixtures.arithmetic import write_arithmetic

    write_arithmetic(out, seed, train, test)
    click.echo(f"wrote {out}: {train} training and {test} test problems (seed {seed})")


@main.command("train-tiny")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True,
              help="tiny: a few MB, 24.6M tokens, minutes on one GPU (on 2 CPU cores the better part of an hour); "
                   "small: ~100M parameters, minutes on one GPU.")
@click.option("--arch", type=click.Choice(["dense", "moe"]), default="dense", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps (default: the preset's).")
@device_option
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="CPU threads while training; the weights depend on it.")
@click.option("--data", type=click.Choice(TRAINING_DATA), default="both", show_default=True,
              help="gsm8k: GSM8K's train split; arithmetic: the shipped arithmetic word problems in GSM8K's format "
                   "(what a model this small learns to solve); both: one shuffled stream of the two.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train_tiny_cmd(out: Path, size: str, arch: str, seed: int, steps: int | None, device: str | None, threads: int,
                   data: str, quiet: bool) -> None:
    """Train a small Qwen3.5 and its MTP head on GSM8K train text and arithmetic word problems; write it BF16 to
    OUT (make-tiny's layout)."""
    from npuport.fixtures.train_tiny import TrainSpec, train_tiny

    result = train_tiny(out, TrainSpec(size, arch, seed, steps, threads, data), device, show_progress=not quiet,
                        log=lambda m: click.echo(m, err=True))
    click.echo(f"wrote {out}: {result.steps} steps ({result.tokens / 1e6:.1f}M tokens) in {result.seconds:.0f} s; "
               f"final loss {result.target_loss:.3f}, MTP loss {result.mtp_loss:.3f}")


if __name__ == "__main__":
    main()
