"""Strict readers for the YAML config: every error names its key path.

:mod:`mlxd.config` describes *what* the config means; this module is the
machinery it reads with:

* :class:`Source` remembers the file and the line of every key path (from
  PyYAML's node tree), so that an error can end with ``(models.yaml, line 12)``.
* :class:`Table` reads one mapping of the config: it rejects unknown keys with
  a hint for the nearest known key, and reads values with strict types (a bool
  is a YAML bool, a number is an int or float and never a bool, finite, in range).
* :func:`parse_memory_size`, :func:`expand_path_text`, :func:`classify_source`
  (a local directory or a Hugging Face repo id: the rule the engines use too):
  the value grammars shared by several keys.

Every failure is a :class:`mlxd.errors.ConfigError` whose message is one line
starting with the key path: ``models[2].estimated_memory_gb: must be a
positive number (got -1)``. A :class:`Source` made with ``problems=[]``
collects instead of stopping: each reader that meets a bad value records its
error and goes on with the key's default, and a mapping with unknown keys
records one error per key and reads the rest, so one run reports every mistake
(:class:`mlxd.config.rules.Parser` raises them together at the end).
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from mlxd.errors import ConfigError
from mlxd.units import GIB, MIB

T = TypeVar("T")

#: The variable that expands to mlxd's state directory even when it is unset.
STATE_DIR_VAR = "MLXD_STATE_DIR"

_MAX_DEPTH = 32
_VAR = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A part of a Hugging Face repo id, as huggingface_hub.utils.validate_repo_id
# checks it: 1 to 96 ASCII letters, digits, "_", "-" or ".", starting and ending
# with a letter, digit or "_".
_HUB_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")


def show(value: object) -> str:
    """A short one-line rendering of a YAML value for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join(where: str, key: str | int) -> str:
    """The key path of ``key`` inside ``where`` (``models[2]`` + ``name``)."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _parent(where: str) -> str:
    cut = max(where.rfind("."), where.rfind("["))
    return where[:cut] if cut > 0 else ""


@dataclass(frozen=True)
class Source:
    """Where the config came from: the file to name in errors and each key path's line."""

    file: str | None = None
    lines: Mapping[str, int] = field(default_factory=dict)
    #: relative local paths are resolved against this directory
    base_dir: Path = field(default_factory=Path.cwd)
    #: None: the first error raises; a list: errors are collected here and reading goes on
    problems: list[ConfigError] | None = None

    def recorded(self, error: ConfigError) -> bool:
        """Keep ``error`` if this source collects (True), else tell the caller to raise it."""
        if self.problems is None:
            return False
        if all(p.message != error.message for p in self.problems):
            self.problems.append(error)
        return True

    def line_of(self, where: str) -> int | None:
        """The line of ``where``, or of its nearest ancestor that has one."""
        while where:
            if (line := self.lines.get(where)) is not None:
                return line
            where = _parent(where)
        return None

    def error(self, where: str, message: str) -> ConfigError:
        """A one-line :class:`ConfigError` for the key path ``where``."""
        text = f"{where or 'top level'}: {message}"
        if self.file is not None:
            line = self.line_of(where)
            text += f" ({self.file}, line {line})" if line else f" ({self.file})"
        return ConfigError(" ".join(text.split("\n")), param=where or None)


#: a config file larger than this is refused unread (10,000 models take about 1 MB)
MAX_CONFIG_BYTES = 16 * MIB
#: libyaml's safe loader when PyYAML was built with it (about 5x faster), else the Python one
SAFE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path, display: str) -> tuple[object, dict[str, int]]:
    """Parse a YAML file with the safe loader; return its data and each key path's line.

    A missing, unreadable or too large (:data:`MAX_CONFIG_BYTES`) file and a
    YAML syntax error raise :class:`ConfigError` naming the file (and the line
    and column of a syntax error). So does a key given twice in one mapping,
    which PyYAML would silently resolve to the last. Blocking: the daemon calls
    it on a worker thread.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{display}: cannot read config: larger than {MAX_CONFIG_BYTES // MIB} MiB"
            )
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{display}: cannot read config: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{display}: cannot read config: {e.strerror or e}") from None
    loader = SAFE_LOADER(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{display}:{mark.line + 1}:{mark.column + 1}" if mark else display
        problem = ", ".join(p for p in (e.context, e.problem) if p) or "syntax error"
        raise ConfigError(" ".join(f"{where}: invalid YAML: {problem}".split())) from None
    except yaml.YAMLError as e:
        raise ConfigError(" ".join(f"{display}: invalid YAML: {e}".split())) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    if node is not None:
        _collect_lines(node, "", lines, Source(display, lines), set(), 0)
    return data, lines


def _collect_lines(
    node: yaml.Node,
    where: str,
    out: dict[str, int],
    source: Source,
    visited: set[int],
    depth: int,
) -> None:
    # An alias shares its anchor's node: walk each node once, so that nested
    # aliases ("billion laughs") cost no more than the text that spells them.
    if depth > _MAX_DEPTH or id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            path = join(where, key)
            if key in seen and key != "<<":
                out[path] = key_node.start_mark.line + 1
                raise source.error(path, "key given twice in one mapping")
            seen.add(key)
            out.setdefault(path, key_node.start_mark.line + 1)
            _collect_lines(value_node, path, out, source, visited, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = join(where, i)
            out.setdefault(path, item.start_mark.line + 1)
            _collect_lines(item, path, out, source, visited, depth + 1)


def _recovering(fallback: Callable[..., object]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A :class:`Table` reader that, on a collecting source, records its error and returns
    ``fallback(*args, **kwargs)`` (the key's default) instead of raising."""

    def wrap(reader: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(reader)
        def read(self: Table, *args: Any, **kwargs: Any) -> T:
            try:
                return reader(self, *args, **kwargs)
            except ConfigError as e:
                if not self.source.recorded(e):
                    raise
                return fallback(*args, **kwargs)  # type: ignore[return-value]

        return read

    return wrap


def _default(_key: str, default: object, *_a: object, **_k: object) -> object:
    return default


def _none(*_a: object, **_k: object) -> None:
    return None


class Table:
    """One mapping of the config, read key by key with strict types.

    Construction rejects a non-mapping, non-string keys and unknown keys (with a
    ``did you mean`` hint; on a collecting source each is recorded and the other
    keys are read). Each reader returns the default when the key is absent;
    ``null`` is accepted only where a reader says ``nullable``.
    """

    def __init__(
        self,
        source: Source,
        where: str,
        raw: object,
        known: Collection[str],
        *,
        what: str = "a mapping",
    ) -> None:
        if not isinstance(raw, dict):
            raise source.error(where, f"must be {what} (got {show(raw)})")
        kept: dict[str, object] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                error = source.error(where, f"keys must be strings (got {show(key)})")
            elif key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                suffix = f" (did you mean '{hint[0]}'?)" if hint else ""
                error = source.error(join(where, key), f"unknown key{suffix}")
            else:
                kept[key] = value
                continue
            if not source.recorded(error):
                raise error
        self.source = source
        self.where = where
        self.raw: dict[str, object] = kept

    def path(self, key: str) -> str:
        return join(self.where, key)

    def error(self, key: str, message: str) -> ConfigError:
        return self.source.error(self.path(key), message)

    def has(self, key: str) -> bool:
        """True if ``key`` is present with a value other than null."""
        return self.raw.get(key) is not None

    def table(self, key: str, known: Collection[str]) -> Table:
        """The mapping under ``key`` (absent or null: an empty one)."""
        value = self.raw.get(key)
        try:
            return Table(self.source, self.path(key), {} if value is None else value, known)
        except ConfigError as e:
            if not self.source.recorded(e):
                raise
            return Table(self.source, self.path(key), {}, known)

    def _get(self, key: str, default: T, nullable: bool, kind: str) -> object:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if value is None and not nullable:
            raise self.error(key, f"must be {kind} (got null)")
        return value

    @_recovering(_default)
    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default, False, "true or false")
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false (got {show(value)})")
        return value

    @_recovering(_none)
    def optional_boolean(self, key: str) -> bool | None:
        value = self._get(key, None, True, "true or false")
        if value is not None and not isinstance(value, bool):
            raise self.error(key, f"must be true or false (got {show(value)})")
        return value

    @_recovering(_default)
    def string(
        self,
        key: str,
        default: str,
        *,
        choices: Collection[str] | None = None,
    ) -> str:
        value = self._get(key, default, False, "a string")
        return self._check_string(key, value, choices)

    @_recovering(_none)
    def optional_string(self, key: str, *, choices: Collection[str] | None = None) -> str | None:
        value = self._get(key, None, True, "a string")
        return None if value is None else self._check_string(key, value, choices)

    def _check_string(self, key: str, value: object, choices: Collection[str] | None) -> str:
        if choices is not None:
            listed = ", ".join(choices)
            if not isinstance(value, str) or value not in choices:
                raise self.error(key, f"must be one of {listed} (got {show(value)})")
            return value
        if not isinstance(value, str):
            raise self.error(key, f"must be a string (got {show(value)})")
        if not value.strip():
            raise self.error(key, "must not be empty")
        return value

    @_recovering(_default)
    def number(
        self,
        key: str,
        default: float,
        *,
        positive: bool = False,
        at_most: float | None = None,
    ) -> float:
        """A finite int or float; ``>= 0`` (or ``> 0`` if ``positive``); ``<= at_most``."""
        value = self._get(key, default, False, "a number")
        return check_number(self.source, self.path(key), value, positive=positive, at_most=at_most)

    @_recovering(_none)
    def optional_number(
        self,
        key: str,
        *,
        positive: bool = False,
        at_most: float | None = None,
    ) -> float | None:
        value = self._get(key, None, True, "a number")
        if value is None:
            return None
        return check_number(self.source, self.path(key), value, positive=positive, at_most=at_most)

    @_recovering(_default)
    def integer(self, key: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = self._get(key, default, False, "an integer")
        return check_integer(self.source, self.path(key), value, minimum=minimum, maximum=maximum)

    @_recovering(_none)
    def optional_integer(self, key: str, *, minimum: int) -> int | None:
        value = self._get(key, None, True, "an integer")
        if value is None:
            return None
        return check_integer(self.source, self.path(key), value, minimum=minimum)

    @_recovering(lambda *_a, **_k: ())
    def int_list(self, key: str, *, minimum: int) -> tuple[int, ...]:
        """A list of integers (absent or null: empty)."""
        value = self.raw.get(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.error(key, f"must be a list of integers (got {show(value)})")
        return tuple(
            check_integer(self.source, join(self.path(key), i), item, minimum=minimum)
            for i, item in enumerate(value)
        )


def _bounds_text(positive: bool, at_most: float | None) -> str:
    if at_most is not None:
        return f"a number in ({'0' if positive else '-inf'}, {at_most:g}]"
    return "a positive number" if positive else "a number >= 0"


def check_number(
    source: Source,
    where: str,
    value: object,
    *,
    positive: bool = False,
    at_most: float | None = None,
) -> float:
    """``value`` as a float: a finite YAML int or float (never a bool) within bounds."""
    wanted = _bounds_text(positive, at_most)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise source.error(where, f"must be {wanted} (got {show(value)})")
    number = float(value)
    if not math.isfinite(number):
        raise source.error(where, f"must be a finite number (got {show(value)})")
    if number < 0 or (positive and number == 0) or (at_most is not None and number > at_most):
        raise source.error(where, f"must be {wanted} (got {show(value)})")
    return number


def check_integer(
    source: Source, where: str, value: object, *, minimum: int, maximum: int | None = None
) -> int:
    """``value`` as an int: a YAML integer (never a bool or a float) within bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise source.error(where, f"must be an integer (got {show(value)})")
    if value < minimum or (maximum is not None and value > maximum):
        rng = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise source.error(where, f"must be an integer {rng} (got {value})")
    return value


def parse_memory_size(value: object) -> int:
    """Bytes of a memory size with the seed's grammar; raises ``ValueError`` with the reason.

    A number is GB (GiB, like the seed). A string is ``"<n>gb"``, ``"<n>mb"``,
    ``"<n>b"`` or a bare number of GB, case- and space-insensitive. Unlike the
    seed, the result must be a positive, finite number of at least one byte.
    """
    grammar = "a size like '16gb', '512mb', '1000000b' or a number of GB"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"must be {grammar} (got {show(value)})")
    if isinstance(value, str):
        raw = value.strip().lower()
        scale = GIB
        for suffix, unit in (("gb", GIB), ("mb", MIB), ("b", 1)):
            if raw.endswith(suffix):
                raw, scale = raw[: -len(suffix)], unit
                break
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"must be {grammar} (got {show(value)})") from None
    else:
        number, scale = float(value), GIB
    if not math.isfinite(number):
        raise ValueError(f"must be a finite size (got {show(value)})")
    if number <= 0:
        raise ValueError(f"must be a positive size (got {show(value)})")
    size = int(number * scale)
    if size < 1:
        raise ValueError(f"must be at least one byte (got {show(value)})")
    return size


def expand_path_text(text: str, state_dir: Callable[[], Path]) -> str:
    """Expand ``~`` and ``$VAR``/``${VAR}``; raises ``ValueError`` for an unset variable.

    ``$MLXD_STATE_DIR`` always expands to ``state_dir()`` (which honours the
    variable when it is set), so configs can put files in mlxd's state directory
    on every platform.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group("braced") if match.group("braced") is not None else match.group("plain")
        if not _ENV_NAME.match(name):
            raise ValueError(f"'${{{name}}}' is not a valid environment variable reference")
        if name == STATE_DIR_VAR:  # set or not: the same folder the daemon uses, made absolute
            return str(state_dir().absolute())
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"environment variable ${name} is not set")
        return value

    return os.path.expanduser(_VAR.sub(replace, text))


def is_env_name(text: str) -> bool:
    """True if ``text`` is a valid environment variable name."""
    return bool(_ENV_NAME.match(text))


def is_hub_repo_id(text: str) -> bool:
    """True if ``text`` is a Hugging Face repo id with its namespace, ``org/name``.

    The Hub's own rule (``huggingface_hub.utils.validate_repo_id``) for each
    part, plus: exactly one ``/`` (a bare ``name`` is more likely a mistyped
    path than one of the Hub's few namespace-less repos), no ``--`` or ``..``,
    not ending in ``.git``.
    """
    parts = text.split("/")
    return (
        len(parts) == 2
        and all(_HUB_PART.match(p) for p in parts)
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
    )


def looks_local(text: str) -> bool:
    """True if a source is written as a filesystem path (``/``, ``./``, ``../``, ``~``, ``$VAR``)."""
    return text.startswith(("/", "./", "../", "~", "$")) or text in {".", ".."}


SourceKind = Literal["local", "hub"]


def classify_source(text: str, base_dir: Path) -> SourceKind:
    """Whether a model source names a local directory or a Hugging Face repo: the one rule.

    In order: written as a path (:func:`looks_local`) is local; something that
    exists relative to ``base_dir`` (the config file's folder) is local, even
    when it is also shaped like ``org/name``; a repo id (:func:`is_hub_repo_id`)
    is fetched from the Hub. Anything else raises :class:`ValueError`: a typo
    in a path must not become a download.
    """
    if text and (looks_local(text) or (base_dir / text).exists()):
        return "local"
    if is_hub_repo_id(text):
        return "hub"
    raise ValueError(
        f"{show(text)} is neither an existing local path (start a path with / or ./) "
        "nor a Hugging Face repo id (org/name)"
    )
