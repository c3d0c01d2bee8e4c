"""Turning msgspec's decode and validation errors into a message that names the key, says what
was wrong with it and what to write instead (`kugetsu config check`, `config set`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect

from kugetsu.config.model import _NESTED, Config
from kugetsu.errors import FileError


# ---- loading ---------------------------------------------------------------------------


def line_col(data: bytes, offset: int) -> tuple[int, int]:
    before = data[:offset]
    return before.count(b"\n") + 1, offset - (before.rfind(b"\n") + 1) + 1


def describe_decode_error(path: object, data: bytes, err: Exception) -> str:
    """Turn a msgspec error into 'file: line L col C: what' or 'file: key k: what'."""
    if isinstance(err, UnicodeDecodeError):
        at = err.start  # relative to the string msgspec was decoding: find the byte in the file
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as whole:
            at = whole.start
        line, col = line_col(data, at)
        return f"{path}: not UTF-8 text at line {line}, column {col} (byte {at})"
    text = str(err)
    if "truncated" in text:
        line, col = line_col(data, len(data))
        return f"{path}: not valid JSON: it ends early, at line {line}, column {col} (truncated?)"
    m = re.search(r"\(byte (\d+)\)", text)
    if m:
        line, col = line_col(data, int(m.group(1)))
        return f"{path}: not valid JSON at line {line}, column {col}: {text[: m.start()].strip()}"
    m = re.match(r"Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?", text)
    if m:
        parent = _dotted(m.group(2) or "")
        key = f"{parent}.{m.group(1)}" if parent else m.group(1)
        return f"{path}: unknown key {key!r}{_did_you_mean(key)}"
    m = re.match(r"(.*) - at `\$(.*)`$", text)
    if m:
        return f"{path}: key {_dotted(m.group(2))!r}: {m.group(1)}"
    return f"{path}: {text}"


def _dotted(msgspec_path: str) -> str:
    return re.sub(r"\[(\d+)\]", r".\1", msgspec_path).lstrip(".")


def _did_you_mean(key: str) -> str:
    known = list(Config.__struct_fields__) + [
        f"{top}.{f}" for top, struct in _NESTED.items() for f in struct.__struct_fields__
    ]
    import difflib

    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(Config.__struct_fields__)}"


class InvalidConfig(FileError):
    """A value of config.json (or one `config set` would write) that does not validate.
    `suggestion`: the JSON to write instead, when one is plain (`"30"` for a number where a
    string belongs); the CLI turns it into the command to type."""

    def __init__(self, message: str, key: str | None, suggestion: str | None, setting: str | None):
        super().__init__(message)
        self.key, self.suggestion, self.setting = key, suggestion, setting


# msgspec's words for JSON types -> ours
_TYPE_WORDS = {"str": "a string", "int": "a whole number", "float": "a number", "bool": "true or false",
               "null": "null", "array": "a list [...]", "object": "an object {...}"}
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _explain_invalid(raw: dict[str, Any], text: str) -> tuple[str | None, str, str | None]:
    """msgspec's validation message -> (the dotted key, what is wrong in plain words, a
    suggested JSON value or None)."""
    import json  # only when a config does not validate

    m = re.match(r"(.*) - at `\$(.*)`$", text, re.DOTALL)
    message, masked = (m.group(1), m.group(2)) if m else (text, "")
    parts = _real_path(raw, masked, text)
    key = ".".join(parts) or None
    value = _lookup(raw, parts)
    info = _type_at(parts)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
    if unknown:
        full = ".".join([*parts, unknown.group(1)])
        fields = list(info.cls.__struct_fields__) if isinstance(info, msgspec.inspect.StructType) else []
        close = __import__("difflib").get_close_matches(unknown.group(1), fields, n=1)
        problem = f"unknown key {full!r}" + (f" (did you mean {'.'.join([*parts, close[0]])!r}?)" if close else "")
        if parts:
            return full, f"{problem}; {key} has: {', '.join(fields)}", None
        return full, f"unknown key {full!r}{_did_you_mean(full)}", None
    if message.startswith("Invalid enum value") and isinstance(info, msgspec.inspect.LiteralType):
        return key, f"{value!r} is not one of: {', '.join(map(str, _choices(parts, info)))}", None
    typed = re.match(r"Expected `([^`]*)`(.*?)(?:, got `([^`]*)`)?$", message)
    if typed:
        kinds = set(typed.group(1).split(" | "))
        expected = " or ".join(_TYPE_WORDS.get(t, t) for t in typed.group(1).split(" | "))
        if kinds - {"null"} == {"int", "float", "str"}:  # Duration
            expected = 'a duration ("90s", "15m", "2h", "1d") or seconds' + (", or null" if "null" in kinds else "")
        elif kinds - {"null"} == {"int", "str"}:  # a size
            expected = 'a size ("2GiB", "512MiB") or bytes' + (", or null" if "null" in kinds else "")
        bound = typed.group(2).strip()
        bound = re.sub(r"^<= (\S+)$", r"at most \1", re.sub(r"^>= (\S+)$", r"at least \1", bound))
        bound = re.sub(r"^of length >= (\d+)$", r"of at least \1 item(s)", bound)
        shown = json.dumps(value, ensure_ascii=False) if value is not None or parts else "nothing"
        problem = f"expected {expected}{' ' + bound if bound else ''}, got {shown}"
        if typed.group(1).split(" | ")[0] == "str" and isinstance(value, (int, float, bool)):
            suggestion = json.dumps(json.dumps(value))
            return key, f"{problem}; write it as a JSON string, in quotes: {suggestion}", suggestion
        if isinstance(value, str) and typed.group(1) in ("int", "float", "bool"):
            try:
                plain = json.loads(value)
            except ValueError:
                plain = None
            if isinstance(plain, (int, float, bool)):
                return key, f"{problem}; write it without quotes: {value}", value
        return key, problem, None
    return key, message[:1].lower() + message[1:] if message[:2] != message[:2].upper() else message, None


def _real_path(raw: dict[str, Any], masked: str, text: str) -> list[str]:
    """msgspec's path with each `[...]` (a dict key it does not name) replaced by the key:
    the first key whose entry alone makes the config fail the same way is the one it met."""
    import json  # only when a config does not validate

    parts: list[str] = []
    for name, index in _PATH_PART.findall(masked):
        if index != "...":
            parts.append(name or index)
            continue
        node = _lookup(raw, parts)
        for candidate in node if isinstance(node, dict) else ():
            trial = json.loads(json.dumps(raw))
            holder = _lookup(trial, parts)
            for other in [k for k in holder if k != candidate]:
                del holder[other]
            try:
                msgspec.convert(trial, Config)
            except msgspec.ValidationError as err:
                if str(err) == text:
                    parts.append(candidate)
                    break
        else:
            return parts  # not found: the path up to here is still the truth
    return parts


def _choices(parts: list[str], info: msgspec.inspect.LiteralType) -> tuple[object, ...]:
    """A Literal's values in the order they are declared (fifo first), not sorted."""
    import typing

    parent = _type_at(parts[:-1])
    if isinstance(parent, msgspec.inspect.StructType) and parts:
        hint = typing.get_type_hints(parent.cls).get(parts[-1])
        if typing.get_origin(hint) is typing.Literal:
            return typing.get_args(hint)
    return info.values


def _lookup(raw: object, parts: list[str]) -> Any:
    node = raw
    for part in parts:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_at(parts: list[str]) -> msgspec.inspect.Type | None:
    """The declared type at a real path of the config (a preset, a group, a Literal)."""
    import msgspec.inspect as inspect

    node: inspect.Type = inspect.type_info(Config)
    for part in parts:
        if isinstance(node, inspect.UnionType):  # `X | None`: the X
            node = next((t for t in node.types if not isinstance(t, inspect.NoneType)), node)
        if isinstance(node, inspect.StructType):
            node = next((f.type for f in node.fields if f.name == part), None)
        elif isinstance(node, inspect.DictType):
            node = node.value_type
        elif isinstance(node, inspect.ListType):
            node = node.item_type
        else:
            return None
        if node is None:
            return None
    return node
