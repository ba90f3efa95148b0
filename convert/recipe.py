"""msModelSlim YAML recipes: which linear layers get which scheme, by glob pattern on module names.

The one place where names are matched against a recipe. msModelSlim's own lab_practice recipes load
unchanged; what npuport does not implement (smoothing, calibration data, static or low-bit schemes) is
named in a clear message instead of being silently ignored, and so is a key the schema does not have (a
misspelt `exclued:` would otherwise quantize what the user meant to exclude).
"""

from __future__ import annotations

import difflib
import os
import reprlib
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml
from wcmatch import fnmatch as wc_fnmatch

from npuport.errors import RecipeError

W8A8_DYNAMIC = "W8A8_DYNAMIC"
W4A8_DYNAMIC = "W4A8_DYNAMIC"
FLOAT = "FLOAT"
QUANTIZED = (W8A8_DYNAMIC, W4A8_DYNAMIC)  # the labels of a layer npuport writes quantized

# The qconfig of each scheme npuport writes, as msModelSlim's recipes spell it.
SCHEME_QCONFIGS = {
    W8A8_DYNAMIC: {
        "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
    },
    W4A8_DYNAMIC: {  # int4 weights found by msModelSlim's ssz search (convert/w4a8.py), int8 activations per token
        "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "ssz"},
    },
}
# Keys of `spec` that only matter for calibration-based schemes: W8A8_DYNAMIC needs no data.
_CALIBRATION_KEYS = {"dataset", "default_text", "calib_dataset", "calib_cfg", "runner", "anti_cfg", "calib_save_params"}
# Process types that change weights with calibration data before quantization.
_UNSUPPORTED_PROCESS = {"iter_smooth", "flex_smooth_quant", "smooth_quant", "anti_outlier", "awq", "gptq", "ssz"}

# The keys msModelSlim's schema (modelslim_v1, multimodal_vlm_modelslim_v1) has at the levels npuport reads;
# any other key there is refused. The top level takes any key (recipes park YAML anchors there), and steps
# npuport does not implement are refused or skipped whole, so their keys are not checked.
_SPEC_KEYS = ("process", "save", "prior", *sorted(_CALIBRATION_KEYS))
_STEP_KEYS = {"linear_quant": ("type", "qconfig", "include", "exclude"), "group": ("type", "configs")}
_QCONFIG_KEYS = ("act", "weight")
_QUANTIZER_KEYS = ("dtype", "scope", "symmetric", "method", "ext")
_SAVE_KEYS = ("type", "part_file_size", "ext")

MAX_RECIPE_BYTES = 1 << 20  # msModelSlim's recipes are 1-3 kB
MAX_PART_FILE_GB = 1e6  # a shard size limit (GB) no disk reaches: a larger one is a mistake
# A recipe's integers are small; a longer one is refused before Python converts it (it refuses 4,300+ digits).
MAX_INT_CHARS = 100
# Nodes of the YAML tree with every alias expanded: msModelSlim's recipes have a few hundred; a 647-byte
# "billion laughs" alias bomb has 10**9.
MAX_YAML_NODES = 100_000


def _short(value: object, limit: int = 80) -> str:
    """repr(value) for a message, at most `limit` characters, computed without walking all of a big value."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict, _SHORT_REPR.maxtuple = 2, 4, 4, 4
_SHORT_REPR.maxstring, _SHORT_REPR.maxother, _SHORT_REPR.maxlong = 60, 60, 40


def glob_matches(module: str, pattern: str) -> bool:
    """Whether `pattern` matches the module name as msModelSlim matches include/exclude patterns: wcmatch's fnmatch
    with brace expansion (`*self_attn.{q,k}_proj`), case-sensitive, `*` crossing dots."""
    return wc_fnmatch.fnmatch(module, pattern, flags=wc_fnmatch.BRACE | wc_fnmatch.CASE)


@dataclass(frozen=True)
class QuantRule:
    """One `linear_quant` entry: modules matching an include glob and no exclude glob get `scheme`."""

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    where: str
    scheme: str = W8A8_DYNAMIC

    def excluded_by(self, module: str) -> str | None:
        return next((p for p in self.exclude if glob_matches(module, p)), None)

    def includes(self, module: str) -> bool:
        return any(glob_matches(module, p) for p in self.include)


@dataclass
class Recipe:
    name: str
    rules: list[QuantRule]
    part_file_size_gb: float
    text: str
    source_name: str
    path: Path
    notes: list[str] = field(default_factory=list)

    def match(self, module: str) -> QuantRule | None:
        """The first rule that selects `module`, or None."""
        return next((r for r in self.rules if r.includes(module) and not r.excluded_by(module)), None)

    def shown_includes(self) -> str:
        """Every include pattern, for a message (cut short)."""
        return _cut(", ".join(repr(p) for r in self.rules for p in r.include), 200)

    def unmatched_includes(self, modules: Collection[str]) -> list[tuple[str, QuantRule]]:
        """(pattern, its rule) for each include pattern that matches none of `modules`."""
        return [(p, r) for r in self.rules for p in r.include if not any(glob_matches(m, p) for m in modules)]

    def why_not(self, module: str) -> str:
        """Why no rule selects `module` (for the ignore-list)."""
        for r in self.rules:
            pattern = r.excluded_by(module) if r.includes(module) else None
            if pattern:
                return f"excluded by recipe pattern {pattern!r} ({r.where})"
        return "not included by any recipe pattern"


def default_recipe_path(moe: bool) -> Path:
    name = "qwen3_5_moe_w8a8.yaml" if moe else "qwen3_5_dense_w8a8.yaml"
    return Path(str(resources.files("npuport.recipes") / name))


W4A8_RECIPE = "qwen3_5_moe_w4a8"  # the shipped recipe `convert-qwen35 --w4a8` picks


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped with npuport (recipes/*.yaml), by name without `.yaml`."""
    folder = resources.files("npuport.recipes")
    return {Path(e.name).stem: Path(str(e)) for e in folder.iterdir() if e.name.endswith(".yaml")}


def recipe_path_for(value: str) -> Path:
    """`--recipe VALUE`: a recipe file, or the name of a shipped recipe (`qwen3_6_27b_w8a8`); RecipeError naming
    both readings when it is neither."""
    path = Path(value)
    if path.exists() or path.is_symlink():  # whatever it is: load_recipe says what is wrong with it
        return path
    shipped = shipped_recipes()
    if value in shipped or value.removesuffix(".yaml") in shipped:
        return shipped[value.removesuffix(".yaml")]
    raise RecipeError(f"--recipe {value!r}: no such file, and no shipped recipe of that name (shipped: "
                      f"{', '.join(sorted(shipped))})")


# ---------------------------------------------------------------------------------------------------------
# Reading the YAML: bounded, one-line errors


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that checks the composed document before building it: a tree that aliases expand past
    MAX_YAML_NODES nodes, an alias inside its own anchor, a key given twice in one mapping (PyYAML keeps the last
    silently) or an integer longer than MAX_INT_CHARS is refused without being built; a value Python cannot build
    (a date that is none) is refused naming its key."""

    def construct_document(self, node: yaml.Node):
        _check_expanded_size(node)
        self._paths = _check_keys_and_integers(node)
        return super().construct_document(node)

    def construct_object(self, node: yaml.Node, deep: bool = False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            raise _YAMLRefused(f"{_node_where(self._paths, node)}: cannot read this value: {_cut(str(e))}") from None


class _YAMLRefused(Exception):
    pass


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expanded_size(root: yaml.Node) -> None:
    """Count the nodes of the tree the node graph stands for (an alias counts its whole anchored subtree
    again), each shared node measured once; raise _YAMLRefused past MAX_YAML_NODES or on a cycle."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise _YAMLRefused(f"refused: its aliases (*name) expand it past {MAX_YAML_NODES:,} nodes (an alias "
                                   "bomb?)")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise _YAMLRefused("refused: an alias (*name) refers to a node that holds it")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


_INT_TAG, _MERGE_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:merge"


def _node_where(paths: dict[int, str], node: yaml.Node) -> str:
    """`spec.save[0].part_file_size (line 12)`: where a node sits, for a message."""
    return f"{paths.get(id(node)) or 'the document'} (line {node.start_mark.line + 1})"


def _check_keys_and_integers(root: yaml.Node) -> dict[int, str]:
    """The key path of every node (`spec.process[1].include`; a node reached through aliases, its first), after
    refusing a mapping that gives a key twice and an integer longer than MAX_INT_CHARS. Run on a tree whose expanded
    size is already bounded."""
    paths: dict[int, str] = {id(root): ""}
    stack = [root]
    while stack:
        node = stack.pop()
        path = paths[id(node)]
        children: list[tuple[yaml.Node, str]] = []
        if isinstance(node, yaml.ScalarNode) and node.tag == _INT_TAG and len(node.value) > MAX_INT_CHARS:
            raise _YAMLRefused(f"{_node_where(paths, node)}: an integer of {len(node.value):,} characters; a recipe's "
                               f"numbers are small")
        if isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                shown = _cut(key.value, 60) if isinstance(key, yaml.ScalarNode) else "(a key that is not a scalar)"
                children += [(key, f"{path or 'the top level'}: a key"), (value, f"{path}.{shown}" if path else shown)]
                if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:  # `<<: *anchor` merges, then
                    continue  # the mapping's own keys override what it merged: not a repeated key
                first = seen.setdefault((key.tag, key.value), key)
                if first is not key:
                    raise _YAMLRefused(f"{path or 'the top level'}: key {_short(key.value)} given twice (lines "
                                       f"{first.start_mark.line + 1} and {key.start_mark.line + 1}); YAML would keep "
                                       f"only the last")
        for child, child_path in children:
            if id(child) not in paths:
                paths[id(child)] = child_path
                stack.append(child)
    return paths


def _refuse_unless_regular(path: Path, st: os.stat_result) -> os.stat_result:
    """`st`, if it is a regular file's; else a RecipeError naming what `path` is (a named pipe, a device...)."""
    if not stat.S_ISREG(st.st_mode):
        kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                 (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
        kind = next((name for test, name in kinds if test(st.st_mode)), "a special file")
        raise RecipeError(f"{path}: {kind}, not a regular file; a recipe is a YAML text file")
    return st


def _read_yaml(path: Path) -> tuple[str, object]:
    """The text of `path` and the YAML document in it, or a one-line RecipeError naming the file (never its
    contents)."""
    try:
        _refuse_unless_regular(path, path.stat())  # before opening: opening a named pipe waits for a writer
        # O_NONBLOCK: a file swapped for a named pipe after that check does not block the open either
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            size = _refuse_unless_regular(path, os.fstat(f.fileno())).st_size
            data = f.read(MAX_RECIPE_BYTES + 1) if size <= MAX_RECIPE_BYTES else b""
        size = max(size, len(data))
        if size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{path}: {size:,} bytes; a recipe is a small text file (at most "
                              f"{MAX_RECIPE_BYTES:,} bytes)")
        text = data.decode("utf-8")
    except OSError as e:
        raise RecipeError(f"{path}: cannot read recipe: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return text, yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader: plain data, no Python objects
    except _YAMLRefused as e:
        raise RecipeError(f"{path}: {e}") from None
    except RecursionError:
        raise RecipeError(f"{path}: refused: nested too deeply") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {_cut(e.problem or e.context or 'unreadable')}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {_cut(str(e))}") from None


def _cut(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_keys(mapping: dict, allowed: Collection[str], where: str) -> None:
    """Refuse a key the schema does not have at this level, suggesting the nearest one it has."""
    for key in mapping:
        if key in allowed:
            continue
        close = difflib.get_close_matches(str(key), list(allowed), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"the keys here are {', '.join(allowed)}"
        raise RecipeError(f"{where}: unknown key {_short(key)}; {hint}")


def _list(value: object, where: str) -> list:
    """A list in the recipe; an empty entry (`key:` with nothing after it) is an empty list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RecipeError(f"{where}: expected a list, got {_short(value)}")
    return value


# ---------------------------------------------------------------------------------------------------------
# The schema


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise RecipeError(f"{where}: include/exclude must be a glob pattern or a list of them, got {_short(value)}")


def _scheme_of(qconfig: object, where: str) -> str:
    """The scheme a linear_quant step's qconfig asks for (SCHEME_QCONFIGS); RecipeError naming the key otherwise."""
    if not isinstance(qconfig, dict):
        raise RecipeError(f"{where}: missing qconfig")
    _check_keys(qconfig, _QCONFIG_KEYS, f"{where}.qconfig")
    for part in _QCONFIG_KEYS:
        got = qconfig.get(part)
        if not isinstance(got, dict):
            raise RecipeError(f"{where}: qconfig.{part} missing")
        _check_keys(got, _QUANTIZER_KEYS, f"{where}.qconfig.{part}")
        if got.get("ext"):
            raise RecipeError(f"{where}: qconfig.{part}.ext = {_short(got['ext'])} is not implemented; npuport's "
                              "minmax and ssz take no extra parameters")
    weight_dtype = qconfig["weight"].get("dtype", "int8")
    scheme = W4A8_DYNAMIC if weight_dtype == "int4" else W8A8_DYNAMIC
    for part, expected in SCHEME_QCONFIGS[scheme].items():
        for key, want in expected.items():
            if qconfig[part].get(key, want) != want:
                raise RecipeError(
                    f"{where}: qconfig.{part}.{key} = {_short(qconfig[part].get(key))} is not implemented; npuport "
                    "writes W8A8_DYNAMIC (act per_token int8 symmetric minmax, weight per_channel int8 symmetric "
                    "minmax) and W4A8_DYNAMIC (the same act, weight per_channel int4 symmetric ssz)")
    return scheme


def _rules(process: list, where: str, source_name: str, allow_unsupported: bool,
           notes: list[str]) -> list[QuantRule]:
    """The linear_quant steps of `process` (groups flattened), in order; each rule says where it came from
    as `<source_name>: <where>[i]`."""
    rules: list[QuantRule] = []
    for i, step in enumerate(process):
        w = f"{where}[{i}]"
        if not isinstance(step, dict):  # e.g. a step indented under the previous one's key
            raise RecipeError(f"{w}: a step is a mapping with a `type`, got {_short(step)}")
        kind = step.get("type")
        if not isinstance(kind, str):
            raise RecipeError(f"{w}: `type` must be a process type name, got {_short(kind)}")
        if kind in _STEP_KEYS:
            _check_keys(step, _STEP_KEYS[kind], w)
        if kind == "group":
            configs = _list(step.get("configs"), f"{w}.configs")
            rules += _rules(configs, f"{w}.configs", source_name, allow_unsupported, notes)
        elif kind == "linear_quant":
            scheme = _scheme_of(step.get("qconfig"), w)
            rules.append(QuantRule(_patterns(step.get("include", ["*"]), w), _patterns(step.get("exclude"), w),
                                   f"{source_name}: {w}", scheme))
        else:
            msg = f"{w}: process type {_short(kind)} is not implemented"
            if kind in _UNSUPPORTED_PROCESS:
                msg += " (it rewrites weights from calibration activations)"
            if not allow_unsupported:
                raise RecipeError(msg + "; pass --skip-unsupported to convert without it")
            notes.append(msg + "; skipped (--skip-unsupported)")
    return rules


def _prior_stages(spec: dict, allow_unsupported: bool, notes: list[str]) -> None:
    """`spec.prior`: stages run before `process` (rotations), which rewrite weights: refused unless skipped."""
    stages = _list(spec.get("prior"), "spec.prior")
    if not stages:
        return
    msg = f"spec.prior ({len(stages)} stage(s) run before the quantization) is not implemented"
    if not allow_unsupported:
        raise RecipeError(msg + "; pass --skip-unsupported to convert without it")
    notes.append(msg + "; skipped (--skip-unsupported)")


def checked_part_file_size(size: object, where: str) -> float:
    """A shard size limit in GB (`spec.save[].part_file_size`, `--part-file-size`) as a float: a finite number above
    0 and below MAX_PART_FILE_GB, else a RecipeError naming `where` (0 is not "the default", NaN not a size)."""
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < MAX_PART_FILE_GB:
        raise RecipeError(f"{where} must be a finite positive number of GB (below {MAX_PART_FILE_GB:,.0f}), "
                          f"got {_short(size)}")
    return float(size)


def _part_file_size_gb(save_steps: list, notes: list[str]) -> float:
    """The shard size of `spec.save` (GB; 4 when unset), from its ascendv1_saver step."""
    part_gb = 4.0
    for i, save in enumerate(save_steps):
        w = f"spec.save[{i}]"
        if not isinstance(save, dict) or save.get("type") != "ascendv1_saver":
            kind = save.get("type") if isinstance(save, dict) else save
            raise RecipeError(f"{w}: only type 'ascendv1_saver' is implemented, got {_short(kind)}")
        _check_keys(save, _SAVE_KEYS, w)
        part_gb = checked_part_file_size(save.get("part_file_size", part_gb), f"{w}.part_file_size")
        if save.get("ext"):
            notes.append(f"{w}.ext is not implemented; ignored")
    return part_gb


def _parse(doc: object, text: str, path: Path, allow_unsupported: bool) -> Recipe:
    """The Recipe in a loaded YAML document; RecipeErrors name the key, the caller names the file."""
    source_name = path.name
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise RecipeError("not an msModelSlim recipe (no `spec` mapping)")
    spec = doc["spec"]
    if "process" not in spec:
        raise RecipeError("spec.process is missing (msModelSlim V0 recipes with calib_cfg are not supported)")
    _check_keys(spec, _SPEC_KEYS, "spec")
    notes: list[str] = []
    for key in doc:
        if key not in ("apiversion", "metadata", "spec"):
            notes.append(f"top-level key {_short(key)} is not part of the schema (a YAML anchor holder?); ignored")
    part_gb = _part_file_size_gb(_list(spec.get("save"), "spec.save"), notes)
    for key in spec:
        if key in _CALIBRATION_KEYS:
            notes.append(f"spec.{key} ignored: W8A8_DYNAMIC needs no calibration data or model runner")
    _prior_stages(spec, allow_unsupported, notes)
    rules = _rules(_list(spec["process"], "spec.process"), "spec.process", source_name, allow_unsupported, notes)
    if not rules:
        raise RecipeError("no linear_quant step; nothing would be quantized")
    metadata = doc.get("metadata")
    config_id = metadata.get("config_id") if isinstance(metadata, dict) else None
    name = _cut(str(config_id)) if config_id else Path(source_name).stem
    return Recipe(name, rules, part_gb, text, source_name, path, notes)


def load_recipe(path: Path, allow_unsupported: bool = False) -> Recipe:
    """Parse an msModelSlim recipe (`apiversion`, `metadata`, `spec.process[]`, `spec.save[]`). Every problem
    is one RecipeError line naming the file and the key; values in it are cut short."""
    path = Path(path)
    text, doc = _read_yaml(path)
    try:
        return _parse(doc, text, path, allow_unsupported)
    except RecipeError as e:
        raise RecipeError(f"{path}: {e}") from None
