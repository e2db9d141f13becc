"""The one gate for files from elsewhere: checkpoints, manifests, `state.json`, shards and their
index, hostfiles, profiles, log lines, YAML and compressed files.

A file from elsewhere is data from an unknown hand. Every reader in mlxdist goes through these
functions, which give either data of the expected shape or one `ConfigError` line naming the
file and the field and what to do; never another exception, never code run, and never more
memory than the limits below (a file's size is checked before it is read, a compressed file
is decompressed in pieces against a cap, YAML aliases are counted before they are expanded).

A schema is a small tree of specs (`Int`, `Float`, `Str`, `Bool`, `List`, `Dict`, `Maybe`,
`Tree`): `check(value, spec, where)` returns the value when it fits and raises the one line
when it does not. `Tree` is what a state tree may hold from a file: numbers, strings, lists
and dicts with string keys, nothing that names code.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from .problems import ConfigError

MiB = 1 << 20

# Limits: generous for any real file of its kind, small enough that a hostile one is refused
# before it costs memory. A caller may pass its own.
JSON_BYTES = 64 * MiB  # state.json with a resolved config and controllers is ~100 KB
YAML_BYTES = 16 * MiB
TEXT_BYTES = 4 << 30  # one text document for `prepare`: a whole book is ~1 MB
YAML_NODES = 1_000_000  # nodes after aliases are expanded (a billion-laughs file has 10^9)
TREE_DEPTH = 64
DECOMPRESSED_BYTES = 64 << 30  # an absolute cap on any one decompressed file
DECOMPRESSION_RATIO = 1000  # zstd of fp32 weights is ~1.08:1; of zeros ~ 4000:1 needs this bound


class FileRefused(ConfigError):
    """A file from elsewhere that is not what it must be. One line: the file, the field, and
    what to do."""


def refuse(path: str | os.PathLike, problem: str, fix: str = "") -> FileRefused:
    err = FileRefused(f"{path}: {problem}" + (f"; {fix}" if fix else ""))
    err.path, err.problem = path, problem  # for a caller that names the file its own way
    return err


# -- files -------------------------------------------------------------------------------------

def regular_file(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """The file's stat when it is a regular file (after symlinks): a FIFO, a device or a socket
    would block a reader for good or never end."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise refuse(path, f"{what} not found") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise refuse(_printable(path), f"{what} cannot be opened ({_reason(e)})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise refuse(path, f"{what} is {kind}", f"give a plain file as the {what}")
    return st


def read_bytes(path: str | os.PathLike, what: str = "file", max_bytes: int = JSON_BYTES) -> bytes:
    """A regular file's bytes, refused before reading when it is larger than `max_bytes`."""
    st = regular_file(path, what)
    if st.st_size > max_bytes:
        raise refuse(path, f"{what} is {st.st_size:,} bytes, more than the {max_bytes:,} a {what} may have",
                     "is it the right file?")
    try:
        with open(path, "rb") as f:
            data = f.read(st.st_size + 1)  # one byte more: a file that grew while being read says so
    except OSError as e:
        raise refuse(path, f"{what} cannot be read ({_reason(e)})") from None
    if len(data) > st.st_size:
        raise refuse(path, f"{what} grew while being read", "is something still writing it?")
    return data


def read_text(path: str | os.PathLike, what: str = "file", max_bytes: int = JSON_BYTES) -> str:
    return decode_utf8(read_bytes(path, what, max_bytes), path, what)


def decode_utf8(data: bytes, where: Any, what: str = "file") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise refuse(where, f"{what} is not UTF-8 text (byte {e.start}, line {line})",
                     "is it the right file? save it as UTF-8") from None


def read_json(path: str | os.PathLike, what: str = "file", spec: Spec | None = None,
              max_bytes: int = JSON_BYTES) -> Any:
    """A JSON file, checked against `spec` when given."""
    value = parse_json(read_text(path, what, max_bytes), path, what)
    return check(value, spec, path) if spec is not None else value


def parse_json(text: str, where: Any, what: str = "file") -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        at = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise refuse(where, f"{what} is not valid JSON{at}", "is it the right file, or cut short?") from None


def _no_constant(name: str) -> float:
    """JSON's NaN/Infinity extensions, as Python writes them, read as the floats they are; a
    schema with `Float(finite=True)` refuses them where a number must be finite."""
    return float(name.replace("Infinity", "inf"))


# -- YAML --------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """The safe loader (no tags that build objects) that refuses duplicate keys and counts
    the nodes aliases would expand to."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:  # the mapping's own keys; merged ones (`<<`) may be overridden
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "a mapping key that is not a plain value",
                                                    key_node.start_mark) from None
        if key in seen:
            raise _Duplicate(key, key_node.start_mark, seen[key])
        seen[key] = key_node.start_mark
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _Duplicate(yaml.YAMLError):
    def __init__(self, key: Any, mark: Any, first: Any):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.mark, self.first = key, mark, first


def _expanded_nodes(node: yaml.Node, limit: int) -> int:
    """Nodes the document has once every alias is expanded (a shared node counted each time it
    is reached, memoised so the count itself is linear)."""
    memo: dict[int, int] = {}

    def count(n: yaml.Node) -> int:
        if id(n) in memo:
            return memo[id(n)]
        memo[id(n)] = 1  # a recursive alias counts once, not forever
        if isinstance(n, yaml.SequenceNode):
            total = 1 + sum(count(c) for c in n.value)
        elif isinstance(n, yaml.MappingNode):
            total = 1 + sum(count(k) + count(v) for k, v in n.value)
        else:
            total = 1
        memo[id(n)] = min(total, limit + 1)
        return memo[id(n)]

    return count(node)


def load_yaml(text: str, where: Any, max_nodes: int = YAML_NODES) -> Any:
    """YAML text as plain data (mappings, lists, strings, numbers, booleans, null)."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            n = _expanded_nodes(node, max_nodes)
            if n > max_nodes:
                raise refuse(where, f"its aliases expand to more than {max_nodes:,} values",
                             "write the values out instead of nesting aliases")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _Duplicate as e:
        raise refuse(where, f"line {e.mark.line + 1}: key {e.key!r} is given twice (first on line "
                            f"{e.first.line + 1})", "keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        problem = getattr(e, "problem", None)
        raise refuse(where, f"not valid YAML{line}{': ' + problem if problem else ''}") from None
    except RecursionError:
        raise refuse(where, "YAML nested too deeply") from None


def read_yaml(path: str | os.PathLike, what: str = "YAML file", max_bytes: int = YAML_BYTES) -> Any:
    return load_yaml(read_text(path, what, max_bytes), path)


# -- compressed files --------------------------------------------------------------------------

def decompress_zstd(path: str | os.PathLike, what: str = "file", max_bytes: int = DECOMPRESSED_BYTES,
                    max_ratio: float = DECOMPRESSION_RATIO) -> bytes:
    """A zstd file decompressed in pieces, refused as soon as it passes `max_bytes` or
    `max_ratio` times its compressed size: a 196 KB file never becomes 6 GiB in memory."""
    import zstandard

    st = regular_file(path, what)
    cap = min(max_bytes, int(max(st.st_size, 1) * max_ratio))
    out = bytearray()
    try:
        with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as reader:
            while True:
                piece = reader.read(min(16 * MiB, cap + 1 - len(out)))
                if not piece:
                    break
                out += piece
                if len(out) > cap:
                    raise refuse(path, f"{what} decompresses to more than {cap:,} bytes ({st.st_size:,} compressed; "
                                       f"at most {max_ratio:g}x or {max_bytes:,} bytes are read)",
                                 "is it the right file?")
    except zstandard.ZstdError as e:
        raise refuse(path, f"{what} is not a whole zstd file ({e})") from None
    except OSError as e:
        raise refuse(path, f"{what} cannot be read ({_reason(e)})") from None
    return bytes(out)


# -- schemas -----------------------------------------------------------------------------------

class Spec:
    """What a value read from a file must be. `check` returns the value (possibly normalised:
    an int where a float is asked) or raises one line."""

    def check(self, value: Any, where: str, field: str) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _fail(where: Any, field: str, value: Any, wanted: str) -> FileRefused:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    name = f"'{field}'" if field else "its content"
    return refuse(where, f"{name} is {shown}, not {wanted}", "is it the right file, or was it edited?")


@dataclass(frozen=True)
class Int(Spec):
    lo: int | None = 0
    hi: int | None = 2**62

    def check(self, value, where, field):
        if isinstance(value, bool) or not isinstance(value, int) or \
                (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise _fail(where, field, value, self.describe())
        return value

    def describe(self):
        return f"a whole number{_bounds(self.lo, self.hi)}"


@dataclass(frozen=True)
class Float(Spec):
    lo: float | None = None
    hi: float | None = None
    finite: bool = True

    def check(self, value, where, field):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (self.finite and not math.isfinite(value)) or \
                (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise _fail(where, field, value, self.describe())
        return float(value)

    def describe(self):
        return f"a {'finite ' if self.finite else ''}number{_bounds(self.lo, self.hi)}"


@dataclass(frozen=True)
class Str(Spec):
    max_len: int = 4096

    def check(self, value, where, field):
        if not isinstance(value, str) or len(value) > self.max_len:
            raise _fail(where, field, value, self.describe())
        return value

    def describe(self):
        return f"a string of at most {self.max_len} characters"


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, value, where, field):
        if not isinstance(value, bool):
            raise _fail(where, field, value, self.describe())
        return value

    def describe(self):
        return "true or false"


@dataclass(frozen=True)
class Maybe(Spec):
    """`spec` or null."""
    spec: Spec

    def check(self, value, where, field):
        return None if value is None else self.spec.check(value, where, field)

    def describe(self):
        return f"{self.spec.describe()} or null"


@dataclass(frozen=True)
class List(Spec):
    item: Spec
    max_len: int = 1_000_000

    def check(self, value, where, field):
        if not isinstance(value, list) or len(value) > self.max_len:
            raise _fail(where, field, value, self.describe())
        return [self.item.check(v, where, f"{field}[{i}]") for i, v in enumerate(value)]

    def describe(self):
        return f"a list of at most {self.max_len:,} items"


@dataclass(frozen=True)
class Dict(Spec):
    """A mapping with string keys. `fields`: keys with their own spec; `required`: which of them
    must be there; `values`: the spec of any other key (None: other keys are refused)."""
    fields: dict[str, Spec] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    values: Spec | None = None
    max_len: int = 1_000_000

    def check(self, value, where, field):
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise _fail(where, field, value, "a mapping" + (f" with '{self.required[0]}'" if self.required else ""))
        dot = f"{field}." if field else ""
        for key in self.required:
            if key not in value:
                raise refuse(where, f"'{dot}{key}' is missing", "is it the right file, or cut short?")
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise _fail(where, f"{dot}{key!r}", key, "a string key")
            spec = self.fields.get(key, self.values)
            if spec is None:
                raise refuse(where, f"'{dot}{key}' is not a key this file has", "is it the right file?")
            out[key] = spec.check(v, where, f"{dot}{key}")
        return out

    def describe(self):
        return "a mapping"


@dataclass(frozen=True)
class Tree(Spec):
    """Plain data only: numbers, strings, booleans, null, lists, and dicts with string keys,
    at most `depth` deep. Nothing in it can name code that runs."""
    depth: int = TREE_DEPTH

    def check(self, value, where, field):
        def walk(v: Any, path: str, depth: int) -> None:
            if depth > self.depth:
                raise refuse(where, f"'{path}' is nested more than {self.depth} deep")
            if v is None or isinstance(v, (bool, int, float, str)):
                return
            if isinstance(v, list):
                for i, x in enumerate(v):
                    walk(x, f"{path}[{i}]", depth + 1)
                return
            if isinstance(v, dict):
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise _fail(where, f"{path}.{k!r}", k, "a string key")
                    walk(x, f"{path}.{k}" if path else k, depth + 1)
                return
            raise _fail(where, path, v, "plain data (numbers, strings, lists, mappings)")

        walk(value, field, 0)
        return value

    def describe(self):
        return "plain data"


@dataclass(frozen=True)
class OneOf(Spec):
    choices: tuple

    def check(self, value, where, field):
        if value not in self.choices or isinstance(value, bool) != any(isinstance(c, bool) for c in self.choices):
            raise _fail(where, field, value, f"one of {', '.join(map(repr, self.choices))}")
        return value

    def describe(self):
        return f"one of {self.choices}"


@dataclass(frozen=True)
class Where(Spec):
    """`spec`, then a test of the value: `test` returns None when it holds, or what is wrong."""
    spec: Spec
    test: Callable[[Any], str | None]

    def check(self, value, where, field):
        value = self.spec.check(value, where, field)
        problem = self.test(value)
        if problem:
            raise refuse(where, f"'{field}' {problem}", "is it the right file, or was it edited?")
        return value

    def describe(self):
        return self.spec.describe()


def check(value: Any, spec: Spec, where: Any, field: str = "") -> Any:
    """`value` when it fits `spec`, else one line naming `where` (the file) and the field."""
    return spec.check(value, where, field)


def _bounds(lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f" from {lo:,} to {hi:,}" if isinstance(lo, int) and isinstance(hi, int) else f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e)


def _printable(path: Any) -> str:
    return repr(str(path)) if "\x00" in str(path) else str(path)


# -- files read while a job runs, and JSON lines ----------------------------------------------

JSONL_LINE_BYTES = 64 * MiB  # one JSONL line (an example, a log event); a file without newlines is not read whole


def open_regular(path: str | os.PathLike, what: str = "file") -> tuple[int, os.stat_result]:
    """A read-only descriptor of a regular file and its stat, taken from the descriptor itself:
    opened without blocking, so a FIFO put in the file's place after `regular_file` looked is
    refused, not waited on for good."""
    regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise refuse(_printable(path), f"{what} cannot be opened ({_reason(e)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refuse(path, f"{what} is not a regular file (a FIFO, device or socket)", f"give a plain file as the {what}")
    return fd, st


def jsonl_lines(path: str | os.PathLike, what: str = "JSONL file", max_line: int = JSONL_LINE_BYTES):
    """(line number, bytes) of each line of a regular file, read a line at a time; a line longer
    than `max_line` is refused with its number rather than read into memory."""
    fd, _ = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        n = 0
        while True:
            try:
                raw = f.readline(max_line + 1)
            except OSError as e:
                raise refuse(f"{path}:{n + 1}", f"{what} cannot be read ({_reason(e)})") from None
            if not raw:
                return
            n += 1
            if len(raw) > max_line:
                raise refuse(f"{path}:{n}", f"line is longer than {max_line:,} bytes", f"is it the right {what}?")
            yield n, raw


def parse_json_line(raw: bytes, path: str | os.PathLike, line: int, what: str = "JSONL file") -> Any:
    """One JSONL line's value, or one line naming `path:line` and the byte or column: the
    whole-file `decode_utf8`/`parse_json` would count lines from the line itself."""
    where = f"{path}:{line}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(where, f"not UTF-8 text (byte {e.start + 1} of the line)",
                     f"is it the right {what}? save it as UTF-8") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise refuse(where, f"not valid JSON ({e.msg} at column {e.colno})", "is it cut short?") from None
    except (ValueError, RecursionError):
        raise refuse(where, "not valid JSON (nested too deeply)") from None
