"""The `npuport validate` command line equivalent to a validation run's options, as its report records it
(settings "command"), and that line with its folders named as the model card names them. Only options that
change what is measured are written, each that differs from its default; an API key never is."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

# ValidateOptions field -> its flag; a flag whose value is True alone for a bool (False: the --no- form, below)
_FLAGS = {
    "protocol": "--protocol", "data": "--data", "num_questions": "--num-questions", "shots": "--shots",
    "max_new_tokens": "--max-new-tokens", "batch_size": "--batch-size", "mtp": "--mtp", "seed": "--seed",
    "reference": "--reference", "endpoint": "--endpoint", "endpoint_model": "--endpoint-model",
    "tokenizer": "--tokenizer", "repeat": "--repeat", "mtp_reference_endpoint": "--mtp-reference-endpoint",
    "mtp_reference_endpoint_model": "--mtp-reference-endpoint-model", "compare_without_mtp": "--compare-without-mtp",
    "reference_endpoint": "--reference-endpoint", "reference_endpoint_model": "--reference-endpoint-model",
    "fidelity_top_k": "--fidelity-top-k", "parallel": "--parallel", "timeout_s": "--timeout", "retries": "--retries",
    "device": "--device", "dtype": "--dtype", "dispatch": "--dispatch", "fidelity_questions": "--fidelity-questions",
    "max_accuracy_drop": "--max-accuracy-drop", "min_acceptance": "--min-acceptance", "min_accuracy": "--min-accuracy",
    "chat_template_kwargs": "--chat-template-kwargs",
}
_NEGATED = {"throughput": "--no-throughput", "batch_invariant": "--no-batch-invariant"}
_SET = {"batch_invariant": "--batch-invariant"}
PATH_FLAGS = ("--data", "--reference", "--tokenizer")  # their values are folders or files on the machine that ran
OFF = "off"  # --min-accuracy / --max-accuracy-drop given as None


def _value(value: Any) -> str:
    if value is None:
        return OFF
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def validate_command(options: Any, out: Path | str) -> str:
    """`npuport validate --gsm8k ARTIFACT ... --out OUT` for a ValidateOptions: every option given a value other
    than its default, paths as given."""
    parts = ["npuport", "validate", "--gsm8k"] + ([str(options.artifact)] if options.artifact is not None else [])
    for f in fields(options):
        value = getattr(options, f.name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if value == default and f.name != "max_new_tokens":  # max_new_tokens: the protocol's default, written out
            continue
        if f.name in _NEGATED and value is False:
            parts.append(_NEGATED[f.name])
        elif f.name in _SET and value is True:
            parts.append(_SET[f.name])
        elif f.name in _FLAGS and isinstance(value, bool):
            if value:
                parts.append(_FLAGS[f.name])
        elif f.name in _FLAGS:
            parts += [_FLAGS[f.name], _value(value)]
    return shlex.join(parts + ["--out", str(out)])


def renamed_command(command: str, names: Mapping[str, str], rename: Callable[[str], str]) -> str:
    """`command` (as validate_command writes it) with its artifact and its --out replaced by `names["artifact"]`
    and `names["out"]`, and each path value of PATH_FLAGS by `rename(path)`."""
    words = shlex.split(command)
    out = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in PATH_FLAGS and i + 1 < len(words):
            out += [word, rename(words[i + 1])]
            i += 2
            continue
        if word == "--out" and i + 1 < len(words):
            out += [word, names["out"]]
            i += 2
            continue
        out.append(word)
        i += 1
    if len(out) > 3 and not out[3].startswith("--"):  # npuport validate --gsm8k ARTIFACT
        out[3] = names["artifact"]
    return shlex.join(out)
