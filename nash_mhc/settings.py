"""One declaration per setting: a dataclass field that holds its default, help text, choices and check.

The configs (``ModelConfig``, ``TrainConfig``, ``DataConfig``, ``MeshConfig``, ``LoopConfig``, the programs' own)
declare their fields with :func:`setting`; :class:`nash_mhc.cli.SettingsParser` turns every field that has help
text into a kebab-case flag (``batch_size`` → ``--batch-size``), and ``__post_init__`` calls
:func:`check_settings`, so a default, its help and its validation are written once. This module imports
nothing of the package, so every config can use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

Check = Callable[[Any], bool]


def setting(default: Any = dataclasses.MISSING, help: str = "", *, choices: Sequence[Any] | None = None,
            check: tuple[Check, str] | None = None, flag: str | None = None) -> Any:
    """A dataclass field: ``default``, ``help`` (a field without help gets no flag), allowed ``choices``, a
    ``check`` = (predicate, what it requires), and ``flag`` when the flag is not named after the field."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "check": check,
                                                        "flag": flag})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


POSITIVE_INT: tuple[Check, str] = (lambda v: _is_int(v) and v >= 1, "must be a positive integer")
NON_NEGATIVE_INT: tuple[Check, str] = (lambda v: _is_int(v) and v >= 0, "must be a non-negative integer")
POSITIVE: tuple[Check, str] = (lambda v: _is_number(v) and v > 0, "must be > 0")
NON_NEGATIVE: tuple[Check, str] = (lambda v: _is_number(v) and v >= 0, "must be >= 0")


def between(low: float | int, high: float | int, *, high_open: bool = False) -> tuple[Check, str]:
    """A number in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    def inside(v: Any) -> bool:
        return _is_number(v) and low <= v and (v < high if high_open else v <= high)

    return inside, f"must be in [{low}, {high}{')' if high_open else ']'}"


def check_settings(config: Any) -> None:
    """Raise ``ValueError("<Class>: <field> <requirement>, got <value>")`` for the first field of ``config``
    whose value is not among its ``choices`` or fails its ``check`` (``None`` means "not set" and passes)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        choices, check = field.metadata.get("choices"), field.metadata.get("check")
        problem = None
        if choices is not None and value not in choices:
            problem = f"must be one of {', '.join(map(str, choices))}"
        elif check is not None and not check[0](value):
            problem = check[1]
        if problem:
            raise ValueError(f"{type(config).__name__}: {field.name} {problem}, got {value!r}")
