"""The README's two commands and CI agree: `.ci/run` runs the README's test command exactly, both install into a
virtual environment made anew and pin what the suite last passed with (constraints.txt), and every package the
project and its test extra name is pinned there to one version."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index(block.group(0)) < text.index("\n## "), "the README must start with its commands"
    return block.group(1).strip().splitlines()


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
    pairs = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(pair) == 2 for pair in pairs), "constraints.txt pins with == only"
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pairs}


def test_the_readme_starts_with_two_commands_and_ci_runs_the_second() -> None:
    demo, tests = readme_commands()
    assert demo.endswith("npuport demo") and tests.endswith("python -m pytest -q tests")
    for command in (demo, tests):
        assert command.startswith("python3 -m venv --clear .venv && ") and "-c constraints.txt" in command
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci == tests


def test_every_dependency_is_pinned_to_one_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    named = project["dependencies"] + project["optional-dependencies"]["test"]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", spec).group(0)).lower() for spec in named}
    pinned = pins()
    assert names <= set(pinned), sorted(names - set(pinned))
    assert pinned["torch"] == "2.13.0"  # the CPU build where one is at hand, PyPI's 2.13.0 elsewhere
