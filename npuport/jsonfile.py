"""Reading a user's text and JSON files: UTF-8 text, and JSON within the bounds npuport reads, each error one line
naming the file. Every JSON that npuport takes from a user's file or option is parsed by `parse_json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError

# The deepest JSON npuport reads is a validation report (7 levels). Python's parser recurses once per level and
# fails with RecursionError near 1,000; a bound well below that also keeps whatever walks the parsed value safe.
MAX_DEPTH = 64
# The longest integer npuport reads is a 64-bit byte offset (20 digits); Python refuses more than 4,300 digits.
MAX_INT_DIGITS = 100


class JSONBoundError(ValueError):
    """JSON text nested deeper than MAX_DEPTH, or with an integer longer than MAX_INT_DIGITS."""


class DuplicateKeyError(ValueError):
    """A JSON object that holds a key twice: Python's parser would keep the last value without a word."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook refusing a key that appears twice in one object (DuplicateKeyError naming it)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            shown = repr(key) if len(key) <= 80 else repr(key[:80]) + "..."
            raise DuplicateKeyError(f"key {shown} appears twice in one object")
        obj[key] = value
    return obj


def parse_json(text: str, **hooks: Any) -> Any:
    """`json.loads(text, **hooks)` within npuport's bounds. Raises ValueError for text that is not JSON, and
    JSONBoundError (a ValueError) for JSON nested deeper than MAX_DEPTH or holding an integer of more than
    MAX_INT_DIGITS digits; never RecursionError. A key twice in one object is a DuplicateKeyError (a ValueError)
    naming the key, unless the caller gives hooks of its own for objects. The messages quote no other part of the
    text."""
    if "object_hook" not in hooks and "object_pairs_hook" not in hooks:
        hooks["object_pairs_hook"] = unique_keys
    if _has_long_digit_run(text):  # else no integer can be too long, and the parser keeps its fast path
        hooks["parse_int"] = _bounded_int(hooks.get("parse_int", int))
    try:
        value = json.loads(text, **hooks)
    except RecursionError:
        raise JSONBoundError(f"nested more than {MAX_DEPTH} levels deep") from None
    if _deeper_than(value, MAX_DEPTH):
        raise JSONBoundError(f"nested more than {MAX_DEPTH} levels deep")
    return value


_ALL_DIGITS_TO_ZERO = str.maketrans("123456789", "0" * 9)


def _has_long_digit_run(text: str) -> bool:
    """Whether `text` holds more than MAX_INT_DIGITS digits in a row (a string search, far faster than a regex)."""
    return "0" * (MAX_INT_DIGITS + 1) in text.translate(_ALL_DIGITS_TO_ZERO)


def _bounded_int(parse_int: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(literal: str) -> Any:
        digits = len(literal) - literal.startswith("-")
        if digits > MAX_INT_DIGITS:
            raise JSONBoundError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
        return parse_int(literal)

    return parse


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` levels deep (walked level by level, without
    recursion)."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, dict | list)]
        if not level:
            return False
    return True


def read_text(path: Path, error: type[NpuportError] = NpuportError) -> str:
    """The UTF-8 text in `path`; raises `error` naming the file when it is missing, unreadable or not UTF-8."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: missing") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read: {e.strerror or e}") from None


def read_json_object(path: Path, error: type[NpuportError] = NpuportError) -> dict[str, Any]:
    """The JSON object in `path` (parse_json's bounds); raises `error` naming the file when it is missing,
    unreadable, not UTF-8, not JSON or not an object."""
    text = read_text(path, error)
    try:
        data = parse_json(text)
    except ValueError as e:
        raise error(f"{path}: cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data


class JSONFieldError(ValueError):
    """A field of a JSON document that is missing or of the wrong type; the message names it by its path."""


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words, for a message that must not quote it."""
    kinds = ((bool, "true or false"), (int | float, "a number"), (str, "a string"), (list, "a list"),
             (dict, "an object"))
    return "null" if value is None else next((kind for t, kind in kinds if isinstance(value, t)), type(value).__name__)


class JSONFields:
    """Typed reads of one object of a parsed JSON document (`where`: its path in the document, "" at the top). A
    field that is missing or of the wrong type is a JSONFieldError naming it by its path (`gsm8k[0].candidate.
    scores`), so a damaged file is refused by name before anything is built from it. `optional` fields may be
    absent or null (None is returned)."""

    def __init__(self, value: object, where: str = "") -> None:
        if not isinstance(value, dict):
            raise JSONFieldError(f"{where or 'the document'} must be an object, is {json_kind(value)}")
        self.data, self.where = value, where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, fits: Callable[[Any], bool], wanted: str, optional: bool) -> Any:
        value = self.data.get(key)
        if value is None:
            if optional:
                return None
            raise JSONFieldError(f"{self.path(key)} is missing")
        if not fits(value):
            raise JSONFieldError(f"{self.path(key)} must be {wanted}, is {json_kind(value)}")
        return value

    def number(self, key: str, optional: bool = False) -> float | int | None:
        return self._get(key, _is_number, "a number", optional)

    def integer(self, key: str, optional: bool = False) -> int | None:
        return self._get(key, _is_integer, "an integer", optional)

    def text(self, key: str, optional: bool = False) -> str | None:
        return self._get(key, _is_text, "a string", optional)

    def flag(self, key: str, optional: bool = False) -> bool | None:
        return self._get(key, _is_flag, "true or false", optional)

    def _list(self, key: str, fits: Callable[[Any], bool], wanted: str, optional: bool) -> list:
        items = self._get(key, _is_list, "a list", optional) or []
        for i, item in enumerate(items):
            if not fits(item):
                raise JSONFieldError(f"{self.path(key)}[{i}] must be {wanted}, is {json_kind(item)}")
        return items

    def numbers(self, key: str, optional: bool = False) -> list[float | int]:
        return self._list(key, _is_number, "a number", optional)

    def texts(self, key: str, optional: bool = False) -> list[str]:
        return self._list(key, _is_text, "a string", optional)

    def object(self, key: str, optional: bool = False) -> JSONFields | None:
        value = self._get(key, _is_object, "an object", optional)
        return None if value is None else JSONFields(value, self.path(key))

    def objects(self, key: str, optional: bool = False) -> list[JSONFields]:
        items = self._get(key, _is_list, "a list", optional) or []
        return [JSONFields(item, f"{self.path(key)}[{i}]") for i, item in enumerate(items)]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_flag(value: object) -> bool:
    return isinstance(value, bool)


def _is_object(value: object) -> bool:
    return isinstance(value, dict)


def _is_list(value: object) -> bool:
    return isinstance(value, list)
