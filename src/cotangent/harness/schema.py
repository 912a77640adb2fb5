"""Settings described once, checked by one function.

Each field of a settings dataclass (`cotangent.harness.train.TrainConfig`,
`cotangent.harness.campaign.Protocol`) is declared with `setting(doc, default, **rules)`: its
type comes from the annotation, its bounds, choices and meaning from the rules. `check` then
validates raw values (from a TOML file, command-line flags or code) against those descriptions
and converts them (a TOML list to a tuple, an integer to a float where a float is wanted); the
CLI builds its `train` flags and their help from the same descriptions.

Types understood: `bool`, `int`, `float` (finite; an integer is accepted), `str`, `tuple[X, ...]`
(any length), `tuple[X, X]` (that length), `dict` / `dict[str, X]` (a table) and unions of these
(`float | dict[str, float]`: a number or a table of numbers). Bounds and choices apply to each
element of a tuple or table.

Every error is one line: `{where}{name} must be {what it may be}, got {value}`, or
`{where}unknown setting(s) ...; known: ...`.

A field declared with `section(cls, doc)` holds a settings dataclass of its own (a TOML table;
`TrainConfig.optimizer`). Every setting keeps one name of its own, unique across sections (its
*setting name*: the field's name, with the section's prefix, or the `name` rule): flags,
``--set``, a protocol's ``[train]`` table and `check` use it. `nest_values` turns tables
(``[optimizer] lr = ...``) or dotted keys (``optimizer.lr``) into setting names; `build` and
`flatten` turn setting names into the nested object and back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Iterable, Mapping

SPEC = "cotangent.schema"  # the metadata key of a field's Spec
SECTION = "cotangent.schema.section"  # the metadata key of a section's (doc, prefix)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    """What one setting means and may hold (the element's rules, for a tuple or a table)."""

    doc: str  # what it is, with units (the CLI's help text)
    low: float | None = None  # lower bound, inclusive unless low_open
    high: float | None = None  # upper bound, inclusive unless high_open
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None  # the allowed values
    pattern: str | None = None  # a regular expression the whole string must match
    min_items: int = 0  # tuple: at least this many elements
    distinct: bool = False  # tuple: no element twice
    want: str | None = None  # the error's "must be ..." text, when `describe` would say less
    name: str | None = None  # the setting name, when not the section's prefix + field name
    # Filled in from the annotation by `specs`:
    kinds: tuple[type, ...] = ()  # the accepted container or scalar types, in order of trial
    item: type | None = None  # tuple / dict: the element type (None: anything)
    length: int | None = None  # tuple[X, X]: the exact number of elements
    path: tuple[str, ...] = ()  # the attribute path from the top dataclass (a section's field)


def setting(doc: str, default: Any = MISSING, *, default_factory: Any = MISSING,
            **rules) -> Any:
    """A dataclass field described by `doc` and `rules` (the keyword fields of `Spec`).

    Example:
        steps: int = setting("optimizer updates per arm", 300, low=1)
    """
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={SPEC: Spec(doc=doc, **rules)})


def section(cls: type, doc: str, *, prefix: str = "") -> Any:
    """A dataclass field holding settings dataclass `cls` (default: `cls()`), described by
    `doc`; its settings are named `prefix` + field name (or their own `name` rule).

    Example:
        muon: MuonSettings = section(MuonSettings, "study arms' MuonAdamW", prefix="muon_")
    """
    return dataclasses.field(default_factory=cls, metadata={SECTION: (doc, prefix)})


def sections(cls: type) -> dict[str, tuple[type, str]]:
    """The section fields of dataclass `cls`: field name -> (its dataclass, its doc)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata[SECTION][0]) for f in dataclasses.fields(cls)
            if SECTION in f.metadata}


@functools.cache
def specs(cls: type) -> dict[str, Spec]:
    """Every setting of dataclass `cls` by its setting name, with its `Spec` (types filled in
    from the annotations, `path` the attribute path), in field order, a section's settings in
    its place. Raises TypeError for a field declared without `setting` or `section`, of a type
    this module does not check, or a setting name used twice."""
    return _specs(cls, (), "")


def _specs(cls: type, path: tuple[str, ...], prefix: str) -> dict[str, Spec]:
    hints = typing.get_type_hints(cls)
    out: dict[str, Spec] = {}
    for f in dataclasses.fields(cls):
        where = f"{cls.__name__}.{f.name}"
        if SECTION in f.metadata:
            inner = _specs(hints[f.name], path + (f.name,), f.metadata[SECTION][1])
        elif SPEC in f.metadata:
            spec = f.metadata[SPEC]
            spec = dataclasses.replace(_with_types(spec, hints[f.name], where),
                                       path=path + (f.name,))
            inner = {spec.name or prefix + f.name: spec}
        else:
            raise TypeError(f"{where} is not declared with schema.setting or schema.section")
        for name in inner:
            if name in out:
                raise TypeError(f"{where}: setting name {name} is used twice")
        out.update(inner)
    return out


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from `values` (setting name -> value, as `check`
    returns them), defaults for the rest; a section's settings go to its dataclass."""
    rules = specs(cls)
    nested: dict = {}
    for name, value in values.items():
        *outer, last = rules[name].path
        table = nested
        for key in outer:
            table = table.setdefault(key, {})
        table[last] = value
    return _build(cls, nested)


def _build(cls: type, nested: dict) -> Any:
    inner = sections(cls)
    return cls(**{k: _build(inner[k][0], v) if k in inner else v for k, v in nested.items()})


def flatten(obj: Any) -> dict[str, Any]:
    """Every setting of dataclass instance `obj` by its setting name (the inverse of `build`)."""
    out = {}
    for name, spec in specs(type(obj)).items():
        value = obj
        for key in spec.path:
            value = getattr(value, key)
        out[name] = value
    return out


def nest_values(cls: type, raw: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """`raw` (a TOML table's keys: setting names, section tables such as ``optimizer = {lr =
    1e-3}``, or dotted keys such as ``"optimizer.lr"``) by setting names, unchecked.

    Raises:
        ValueError: one line: an unknown key inside a section, a section that is not a table,
            or one setting given twice.
    """
    rules = specs(cls)
    by_path = {spec.path: name for name, spec in rules.items()}
    inner = sections(cls)
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}

    def put(name: str, value: Any, key: str) -> None:
        if name in out:
            raise ValueError(f"{where}setting {name} is given twice (as {spelled[name]} and as "
                             f"{key})")
        out[name], spelled[name] = value, key

    for key, value in raw.items():
        head, dot, rest = str(key).partition(".")
        if head in inner and (dot or isinstance(value, Mapping)):
            items = {rest: value}.items() if dot else value.items()
            for field, v in items:
                name = by_path.get((head, field))
                if name is None:
                    known = [path[1] for path in by_path if len(path) == 2 and path[0] == head]
                    hint = ""
                    if field in rules and rules[field].path[0] == head:
                        hint = f" (in [{head}] it is {rules[field].path[1]})"
                    raise ValueError(f"{where}unknown setting {head}.{field}{hint}; known in "
                                     f"[{head}]: {', '.join(known)}")
                put(name, v, f"{head}.{field}")
        elif head in inner and head not in rules:
            raise ValueError(f"{where}{head} must be a table of settings ([{head}]), got "
                             f"{value!r}")
        elif (isinstance(value, Mapping) or dot) and key not in rules:
            raise ValueError(f"{where}unknown section [{head}] (in {key}); sections: "
                             f"{', '.join(inner)}")
        else:
            put(key, value, key)
    return out


def required(cls: type) -> list[str]:
    """The fields of dataclass `cls` without a default, in field order."""
    return [f.name for f in dataclasses.fields(cls)
            if f.default is MISSING and f.default_factory is MISSING]


def check(cls: type, values: Mapping[str, Any], *, where: str = "", noun: str = "setting",
          allowed: Iterable[str] | None = None, complete: bool = False) -> dict[str, Any]:
    """Check raw `values` against the field descriptions of dataclass `cls`.

    Args:
        values: field name -> value, some or all fields.
        where: prefix of every error message (e.g. "protocol.toml: ").
        noun: what a key is called in the unknown/missing messages ("setting", "key").
        allowed: the names `values` may use (default: every field of `cls`).
        complete: also require every field that has no default.

    Returns:
        A new dict of the same keys with the values converted to what the fields hold
        (lists to tuples, integers to floats where a float is wanted).

    Raises:
        ValueError: one line naming the first unknown or missing key, or the first value of
            the wrong type, outside its bounds or not among its choices.
    """
    rules = specs(cls)
    allowed = set(rules) if allowed is None else set(allowed)
    known = [name for name in rules if name in allowed]
    unknown = [key for key in values if key not in known]
    if unknown:
        tables = sections(cls)
        raise ValueError(f"{where}unknown {noun}(s) {', '.join(map(str, unknown))}; known: "
                         f"{', '.join(known)}" + (f" (or by section: {', '.join(tables)})"
                                                  if tables else ""))
    missing = [name for name in required(cls) if complete and name not in values]
    if missing:
        raise ValueError(f"{where}missing {noun}(s) {', '.join(missing)}")
    return {key: convert(rules[key], key, value, where) for key, value in values.items()}


def convert(spec: Spec, name: str, value: Any, where: str = "") -> Any:
    """`value` as field `name` holds it; ValueError (one line) when it does not fit `spec`."""
    for kind in spec.kinds:
        try:
            return _convert(spec, kind, value)
        except _Mismatch:
            continue
    shown = list(value) if isinstance(value, tuple) else value
    raise ValueError(f"{where}{name} must be {describe(spec)}, got {shown!r}")


def describe(spec: Spec) -> str:
    """What a value of `spec` may be, in words ("an integer >= 1", "cpu, cuda or mps")."""
    if spec.want is not None:
        return spec.want
    words = []
    for kind in spec.kinds:
        if kind is tuple:
            words.append(_describe_tuple(spec))
        elif kind is dict:
            words.append(f"a table of {_plural(spec.item, spec)}")
        else:
            words.append(_describe_scalar(kind, spec))
    return ", or ".join(words)


def alternatives(choices: Iterable[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    choices = list(choices)
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


# ----------------------------------------------------------------------------- internals

class _Mismatch(Exception):
    """A value does not fit one of a spec's kinds."""


def _with_types(spec: Spec, hint, where: str) -> Spec:
    """`spec` with kinds, item and length read from the annotation `hint`."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds, item, length = [], None, None
    for option in options:
        origin, args = typing.get_origin(option) or option, typing.get_args(option)
        if origin is tuple:
            item = args[0] if args else None
            length = None if len(args) == 2 and args[1] is Ellipsis or not args else len(args)
        elif origin is dict:
            item = args[1] if args else None
        elif origin not in (bool, int, float, str):
            raise TypeError(f"{where}: schema cannot check values of type {option}")
        kinds.append(origin)
    return dataclasses.replace(spec, kinds=tuple(kinds), item=item, length=length)


def _convert(spec: Spec, kind: type, value: Any) -> Any:
    if kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        items = tuple(_scalar(spec, spec.item, v) for v in value)
        if (len(items) < spec.min_items or (spec.length is not None and len(items) != spec.length)
                or (spec.distinct and len(set(items)) != len(items))):
            raise _Mismatch
        return items
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch
        return {k: _scalar(spec, spec.item, v) for k, v in value.items()}
    return _scalar(spec, kind, value)


def _scalar(spec: Spec, kind: type | None, value: Any) -> Any:
    if kind is None:
        return value
    if kind is bool:
        if type(value) is not bool:
            raise _Mismatch
        return value
    if kind is str:
        if not isinstance(value, str) or (spec.choices is not None and value not in spec.choices) \
                or (spec.pattern is not None and not re.fullmatch(spec.pattern, value)):
            raise _Mismatch
        return value
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise _Mismatch
    if kind is float:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            raise _Mismatch from None
        if not math.isfinite(value):
            raise _Mismatch
    if not _in_bounds(spec, value):
        raise _Mismatch
    return value


def _in_bounds(spec: Spec, value: float) -> bool:
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        return False
    return spec.high is None or (value < spec.high or (not spec.high_open
                                                       and value == spec.high))


def _number(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _bounds(spec: Spec) -> str:
    """' in [0, 1)', ' from 1 to 10,000,000', ' >= 0', ' > 0' or ''."""
    low, high = spec.low, spec.high
    if low is not None and high is not None:
        if not spec.low_open and not spec.high_open and isinstance(low, int) \
                and isinstance(high, int):
            return f" from {_number(low)} to {_number(high)}"
        return (f" in {'(' if spec.low_open else '['}{_number(low)}, {_number(high)}"
                f"{')' if spec.high_open else ']'}")
    if low is not None:
        return f" {'>' if spec.low_open else '>='} {_number(low)}"
    if high is not None:
        return f" {'<' if spec.high_open else '<='} {_number(high)}"
    return ""


def _describe_scalar(kind: type, spec: Spec) -> str:
    if kind is bool:
        return "true or false"
    if kind is str:
        if spec.choices is not None:  # "cpu, cuda or mps"; a longer list as "one of ..."
            return alternatives(spec.choices) if len(spec.choices) <= 3 else \
                f"one of {', '.join(spec.choices)}"
        return "a string" if spec.pattern is None else f"a string matching {spec.pattern}"
    noun = "an integer" if kind is int else "a number" if spec.high is not None \
        else "a finite number"
    return noun + _bounds(spec)


def _plural(kind: type | None, spec: Spec) -> str:
    if kind is None:
        return "values"
    if kind is str:
        return f"names from {alternatives(spec.choices)}" if spec.choices is not None \
            else "strings"
    noun = {bool: "true/false values", int: "integers", float: "numbers"}[kind]
    return noun + _bounds(spec)


_COUNTS = ("no", "one", "two", "three", "four")


def _describe_tuple(spec: Spec) -> str:
    distinct = "distinct " if spec.distinct else ""
    items = _plural(spec.item, spec)
    if spec.length is not None:
        count = _COUNTS[spec.length] if spec.length < len(_COUNTS) else str(spec.length)
        return f"a list of {count} {distinct}{items}"
    if spec.min_items == 1:
        return f"a non-empty list of {distinct}{items}"
    if spec.min_items > 1:
        count = _COUNTS[spec.min_items] if spec.min_items < len(_COUNTS) else str(spec.min_items)
        return f"a list of at least {count} {distinct}{items}"
    return f"a list of {distinct}{items}"
