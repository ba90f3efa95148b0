"""The one path rule: a file that a checkpoint, artifact or release names (a shard in an index, a file in a
SHA256SUMS) must be a regular file inside the folder that names it. Symlinks are followed only when they resolve
inside that folder. Errors name the folder and the entry, never a file's contents."""

from __future__ import annotations

from pathlib import Path

from npuport.errors import NpuportError


def file_inside(folder: Path, name: str, what: str, error: type[NpuportError] = NpuportError,
                must_exist: bool = True) -> Path:
    """folder / name, after checking that `name` is a plain relative path whose resolved target (symlinks
    followed) lies inside folder's resolved path and, when must_exist, is a regular file. `what` names the list
    the entry came from (e.g. "model.safetensors.index.json"), for the error."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{folder}: {what} names an invalid file {name!r}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise error(f"{folder}: {what} names {name!r}, outside the folder (only files inside it are read)")
    path = folder / relative
    root = folder.resolve()
    target = path.resolve()
    if not target.is_relative_to(root):
        raise error(f"{folder}: {what} names {name!r}, which resolves outside the folder (a symlink out of it)")
    if must_exist and not target.is_file():
        state = "is missing" if not target.exists() else "is not a regular file"
        raise error(f"{folder}: {what} names {name!r}, which {state}")
    return path
