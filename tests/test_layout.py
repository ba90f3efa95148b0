"""The import directions the packages' docstrings promise: kernels and convert stand alone, the engine never
imports its validator or its server, the validator and the server never import each other, no library module
imports the CLI, the demo or the test fixtures."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"npuport": "npuport", "convert": "npuport.convert", "runtime": "npuport.runtime",
           "kernels": "npuport.kernels"}
SHARED = {"npuport", "npuport.errors", "npuport.devices", "npuport.jsonfile", "npuport.checksums", "npuport.benchlog",
          "npuport.paths", "npuport.output_folder", "npuport.chat_prompt", "npuport.tokenizer_folder",
          "npuport.data"}
FRONT = ("npuport.cli", "npuport.demo")

# Package prefix -> the prefixes its modules must not import.
FORBIDDEN = {
    "npuport.kernels": ("npuport.runtime", "npuport.convert", "npuport.release", "npuport.fixtures", *FRONT),
    "npuport.convert": ("npuport.runtime", "npuport.kernels", "npuport.release", "npuport.fixtures", *FRONT),
    "npuport.runtime.validation": ("npuport.runtime.serving", "npuport.release", "npuport.fixtures", *FRONT),
    "npuport.runtime.serving": ("npuport.runtime.validation", "npuport.release", "npuport.fixtures", *FRONT),
    "npuport.runtime": ("npuport.runtime.validation", "npuport.runtime.serving", "npuport.release", "npuport.fixtures",
                        *FRONT),
    "npuport.release": ("npuport.fixtures", *FRONT),
    "npuport.fixtures": ("npuport.release", *FRONT),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """Every npuport module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "npuport" or name.startswith("npuport.")}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_for(module: str) -> tuple[str, tuple[str, ...]] | None:
    """The most specific FORBIDDEN entry that covers `module`."""
    covering = [p for p in FORBIDDEN if within(module, p)]
    return (max(covering, key=len), FORBIDDEN[max(covering, key=len)]) if covering else None


def test_the_scanner_sees_real_imports() -> None:
    modules = library_modules()
    assert "npuport.runtime.validation.validate" in modules and "npuport.kernels.gated_delta_rule.chunk" in modules
    assert "npuport.kernels.gated_delta_rule" in imported_modules(modules["npuport.runtime.mixers"])
    # a lazy import inside a function counts too
    assert "npuport.release.package" in imported_modules(modules["npuport.demo"])


@pytest.mark.parametrize("module", sorted(library_modules()))
def test_imports_follow_the_layout(module: str) -> None:
    imports = imported_modules(library_modules()[module])
    if module in SHARED:
        outside = sorted(name for name in imports if not any(within(name, s) for s in SHARED))
        assert not outside, f"{module} is a shared helper and may import only other shared helpers: {outside}"
    if module not in FRONT:
        assert not [name for name in imports if any(within(name, f) for f in FRONT)], f"{module} imports the CLI"
    rule = rule_for(module)
    if rule:
        package, forbidden = rule
        wrong = sorted(name for name in imports if any(within(name, f) for f in forbidden))
        assert not wrong, f"{module} ({package}) must not import {wrong}"


def test_every_package_says_what_lives_there_and_what_it_may_import() -> None:
    for init in sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc.lower(), f"{init.relative_to(ROOT)}: the docstring should say what it may import"


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists packages one by one: a new folder left out would import here (editable install)
    and be missing from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert folders <= listed, f"not in pyproject.toml's packages: {sorted(folders - listed)}"
