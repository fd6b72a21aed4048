"""YAML with line numbers, and the error context every suite parser reports through.

`safe_load_with_lines` is `yaml.safe_load` (a SafeLoader subclass: no Python objects) whose
mappings and lists remember the line of every key and item, so that any parser can say
`file:line: what is wrong; how to fix it` through `Context.fail`.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from pathlib import Path

import yaml

from ..errors import SuiteError


class Map(dict):
    line: int = 0
    key_lines: dict


class Seq(list):
    line: int = 0
    item_lines: list


class LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping, key and list item."""


def _construct_map(loader, node):
    _check_keys(loader, node)  # before merge keys are flattened: an explicit key may override a merged one
    loader.flatten_mapping(node)
    result = Map(
        (loader.construct_object(k, deep=True), loader.construct_object(v, deep=True)) for k, v in node.value
    )
    result.line = node.start_mark.line + 1
    result.key_lines = {loader.construct_object(k, deep=True): k.start_mark.line + 1 for k, _ in node.value}
    return result


def _check_keys(loader, node) -> None:
    """Keys are plain scalars, each once: a list or mapping as a key, or a key written twice (where
    YAML would silently keep the last), is refused at its line."""
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, "a key is a list or a mapping; keys are plain names", key_node.start_mark
            )
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key '{key}' is given twice (lines {seen[key]} and {line}); keep one",
                key_node.start_mark,
            )
        seen[key] = line


def _construct_seq(loader, node):
    result = Seq(loader.construct_object(item, deep=True) for item in node.value)
    result.line = node.start_mark.line + 1
    result.item_lines = [item.start_mark.line + 1 for item in node.value]
    return result


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


MAX_NODES = 1_000_000  # a suite's YAML, with every alias expanded, has at most this many nodes


def safe_load_with_lines(text: str):
    """yaml.safe_load, keeping line numbers: LineLoader is a SafeLoader, so no Python objects.
    Aliases are counted as expanded before anything is built: a 700-byte alias bomb is refused at once."""
    loader = LineLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_NODES:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"more than {MAX_NODES:,} values once its aliases are "
                "expanded (an alias bomb?); write the values out",
                node.start_mark,
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node, memo: dict) -> int:
    """Nodes in the document with aliases expanded, counted once per distinct node (cheap for bombs)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_NODES + 1  # a node met again while being counted is a recursive alias: too big
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(item, memo) for item in node.value)
    else:
        total = 1
    memo[id(node)] = min(total, MAX_NODES + 1)
    return memo[id(node)]


def line_of(node, key=None) -> int:
    if key is not None and isinstance(node, Map) and key in node.key_lines:
        return node.key_lines[key]
    if key is not None and isinstance(node, Seq) and isinstance(key, int) and key < len(node.item_lines):
        return node.item_lines[key]
    return getattr(node, "line", 1)


MAX_DATA_BYTES = 512 * 2**20  # a data file larger than this is refused before it is read


class Context:
    """Where errors point: the suite file, plus the data files read. `data_roots` are directories
    besides the suite's own from which data files may be read (the --data-root option)."""

    def __init__(self, path: Path, data_roots=()):
        self.path = path
        self.roots = [path.parent.resolve(), *(_resolved(Path(r).expanduser(), path) for r in data_roots)]
        self.digest = hashlib.sha256()
        self.files: list[Path] = []  # every data file read, resolved

    def fail(self, node, key, message: str):
        raise SuiteError(f"{self.path}:{line_of(node, key)}: {message}")

    def check_keys(self, node, allowed, where: str = "", hint: str = "") -> None:
        """Every key of the mapping `node` is one of `allowed` (listed in the order given); the first
        that is not is one line naming the allowed keys and, where one is near, the key meant."""
        for key in node:
            if key not in allowed:
                near = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.75)
                meant = f"did you mean '{near[0]}'? " if near else ""
                self.fail(
                    node, key, f"unknown key '{key}'{where}; {meant}allowed: {', '.join(allowed)}{hint}"
                )

    def read_data(self, node, key, relative: str, max_lines: int | None = None) -> tuple[Path, str]:
        """A data file named relative to the suite: it must lie in the suite's directory or below it
        (or under a --data-root; a suite cannot read /proc/self/environ or ~/.ssh), be a regular file
        (not a FIFO or a device), hold at most `max_lines` lines (counted before it is decoded) and
        be UTF-8 text. Messages name the file, never its content."""
        shown = repr(str(relative))[1:-1][:200]
        try:
            path = (self.roots[0] / str(relative)).resolve()
        except (RuntimeError, OSError):  # a loop of symbolic links (RuntimeError before Python 3.13)
            self.fail(node, key, f"data file '{shown}' is a loop of symbolic links; point it at a real file")
        if not any(path.is_relative_to(root) for root in self.roots):
            self.fail(
                node,
                key,
                f"data file '{shown}' lies outside the suite's directory {self.roots[0]}; copy it next "
                "to the suite, or allow its directory with --data-root",
            )
        if not path.exists():
            self.fail(
                node,
                key,
                f"data file '{shown}' not found (looked in {path.parent}); give a path relative to the suite "
                "file",
            )
        if not path.is_file():
            self.fail(
                node,
                key,
                f"data file '{shown}' is not a regular file (a directory, FIFO or device); give a text file",
            )
        size = path.stat().st_size
        if size > MAX_DATA_BYTES:
            self.fail(
                node,
                key,
                f"data file '{shown}' has {size / 2**20:.0f} MB, more than {MAX_DATA_BYTES // 2**20} MB; "
                "split it",
            )
        try:
            with open(path, "rb") as handle:  # + 1: a header line
                data, lines = counted_read(handle, None if max_lines is None else max_lines + 1)
        except OSError as exc:
            self.fail(node, key, f"cannot read data file '{shown}' ({exc.strerror}); fix its permissions")
        if data is None:
            self.fail(
                node,
                key,
                f"data file '{shown}' has at least {lines:,} lines, more than max_prompts = {max_lines:,}; "
                "raise `max_prompts:` in the suite or split the file",
            )
        try:
            text = data.decode("utf-8-sig")  # a spreadsheet's UTF-8 export starts with a byte-order mark
        except UnicodeDecodeError:
            self.fail(node, key, f"data file '{shown}' is not UTF-8 text; save it as UTF-8")
        self.digest.update(path.name.encode() + b"\0" + text.encode())
        self.files.append(path)
        return path, text


READ_BLOCK = 8 * 2**20


def counted_read(handle, max_lines: int | None) -> tuple[bytes | None, int]:
    """(the file's bytes, its lines at LF, CRLF and old-Mac CR alike), read in blocks; (None, the
    lines so far) as soon as they pass `max_lines`: a file of too many lines is refused after
    reading only as far as that, in bounded memory."""
    blocks, lines, previous = [], 0, b""
    while block := handle.read(READ_BLOCK):
        lines += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
        lines -= previous.endswith(b"\r") and block.startswith(b"\n")  # a CRLF across two blocks
        if max_lines is not None and lines > max_lines:
            return None, lines
        blocks.append(block)
        previous = block
    return b"".join(blocks), lines


def _resolved(root: Path, suite: Path) -> Path:
    """A --data-root directory, resolved; a loop of symbolic links is one line."""
    try:
        return root.resolve()
    except (RuntimeError, OSError):
        raise SuiteError(
            f"{suite}: data root '{root}' is a loop of symbolic links; give a real directory"
        ) from None


def file_lines(text: str) -> list[str]:
    """The lines of a data file as an editor numbers them: split at \\n, \\r\\n or \\r only (not at
    U+2028, U+0085 or a form feed, which str.splitlines also treats as line ends)."""
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def required_str(ctx, node, key) -> str:
    if node.get(key) is None:
        ctx.fail(node, key if key in node else None, f"missing `{key}:`; add it")
    return optional_str(ctx, node, key)


def optional_str(ctx, node, key) -> str | None:
    value = node.get(key)
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or str(value).strip() == "":
        ctx.fail(node, key, f"`{key}` must be a non-empty string")
    return str(value)


def as_list(ctx, node, key, what) -> Seq:
    """`node[key]` as a non-empty list (an absent key is an empty list); errors point at the key."""
    value = node.get(key)
    if value is None:
        return Seq()
    if not isinstance(value, list):
        ctx.fail(node, key, f"`{key}` must be a list of {what}")
    if len(value) == 0:
        ctx.fail(node, key, f"`{key}` is an empty list; give at least one entry ({what}) or remove the key")
    return value


def number_or_text(value: str):
    """Table cells that read as numbers become int or float; everything else stays text."""
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        return number if kind is int or math.isfinite(number) else value
    return value
