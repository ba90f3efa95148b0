"""The one path rule: a file that a checkpoint, artifact or release names (a shard in an index, a file in a
SHA256SUMS) must be a regular file inside the folder that names it. Symlinks are followed only when they resolve
inside that folder, or, where a caller allows it, into the blobs of the Hugging Face cache repo whose snapshot the
folder is (hub_cache_blobs). Errors name the folder and the entry, never a file's contents."""

from __future__ import annotations

from pathlib import Path

from npuport.errors import NpuportError


def file_inside(folder: Path, name: str, what: str, error: type[NpuportError] = NpuportError,
                must_exist: bool = True, also_inside: Path | None = None) -> Path:
    """folder / name, after checking that `name` is a plain relative path whose resolved target (symlinks
    followed) lies inside folder's resolved path (or inside `also_inside`, e.g. hub_cache_blobs(folder)) and, when
    must_exist, is a regular file. `what` names the list the entry came from (e.g. "model.safetensors.index.json"),
    for the error."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{folder}: {what} names an invalid file {name!r}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise error(f"{folder}: {what} names {name!r}, outside the folder (only files inside it are read)")
    path = folder / relative
    roots = [folder.resolve()] + ([Path(also_inside).resolve()] if also_inside is not None else [])
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise error(f"{folder}: {what} names {name!r}, which cannot be resolved (a symlink loop)") from None
    if not any(target.is_relative_to(root) for root in roots):
        raise error(f"{folder}: {what} names {name!r}, which resolves outside the folder (a symlink out of it)")
    if must_exist and not target.is_file():
        state = "is missing" if not target.exists() else "is not a regular file"
        raise error(f"{folder}: {what} names {name!r}, which {state}")
    return path


def hub_cache_blobs(folder: Path) -> Path | None:
    """The `blobs` folder of the Hugging Face cache repo when `folder` is one of its snapshots
    (`models--Org--Name/snapshots/<revision>`), whose files are symlinks into `../../blobs`; None otherwise.
    Only that repo's own blobs are accepted, never another repo's or anything else in the cache."""
    snapshot = Path(folder).resolve()
    repo = snapshot.parent.parent
    if snapshot.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo / "blobs"
    return None
