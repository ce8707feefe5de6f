"""What the command-line programs share: flags generated from settings, one-line errors, the compile cache.

:class:`SettingsParser` makes one kebab-case flag per field declared with :func:`nash_mhc.settings.setting`
(``batch_size`` → ``--batch-size``; a ``bool`` field that defaults to True becomes ``--no-<name>``, and its help
text describes that flag). A flag that is not given leaves the field's own default in place, so a default is
written only in its declaration (``--help`` shows it from there). Adding a flag to a program = declaring a field
with help text in a settings class the program already lists (or ``parser.add_settings(NewSettings)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from nash_mhc.settings import setting

EXIT_USAGE = 2
T = TypeVar("T")


def fail(error: str | BaseException) -> int:
    """Print ``error: <first line of the message>`` on stderr and return exit code 2."""
    text = str(error)
    line = text.splitlines()[0] if text else type(error).__name__
    print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE


def _flag_type(annotation: Any) -> Any:
    """``int`` for ``int | None``, ``float`` for ``float | int``: what argparse converts a flag's text to."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return float if float in args else args[0]


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_a(value: Any, kind: type) -> bool:
    """Whether a config-file value has the type a flag of ``kind`` takes (an int is a fine float)."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


class SettingsParser(OneLineParser):
    """Flags generated from settings dataclasses, with ``--config FILE`` values under them."""

    def __init__(self, prog: str, doc: str) -> None:
        summary = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph, however many lines
        super().__init__(prog=prog, description=summary, argument_default=argparse.SUPPRESS)
        self.owner: dict[str, tuple[type, str, bool]] = {}  # dest -> (settings class, field, negated bool)

    def add_settings(self, cls: type, title: str | None = None, *, prefix: str = "", only: tuple[str, ...] = (),
                     default_text: str | None = None) -> None:
        """A flag for every field of ``cls`` that has help text (only those named in ``only``, when given), in
        group ``title``; ``prefix`` goes in front of the flag name (``mesh-`` → ``--mesh-data``)."""
        group = self.add_argument_group(title) if title else self
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            meta = field.metadata
            if not meta.get("help") or (only and field.name not in only):
                continue
            kind, negated = _flag_type(hints[field.name]), field.default is True
            name = meta.get("flag") or f"--{'no-' if negated else ''}{prefix}{field.name}".replace("_", "-")
            dest = name[2:].replace("-", "_")
            self.owner[dest] = (cls, field.name, negated)
            text = meta["help"].replace("%", "%%")
            if kind is bool:
                group.add_argument(name, dest=dest, action="store_true", help=text)
                continue
            required = field.default is dataclasses.MISSING
            shown = default_text or (None if required or field.default is None else field.default)
            group.add_argument(name, dest=dest, type=kind, choices=meta.get("choices"), required=required,
                               help=text + (f" (default: {shown})" if shown is not None else ""))

    def given(self, argv: list[str] | None = None) -> dict[str, Any]:
        """``{dest: value}`` of the flags given; with ``--config FILE`` its values sit underneath them."""
        flags = vars(self.parse_args(argv))
        path = flags.get("config")
        return {**self._config_file(path), **flags} if path else flags

    def values(self, cls: type, given: dict[str, Any]) -> dict[str, Any]:
        """``{field: value}`` of the given flags that belong to ``cls``."""
        values = {}
        for dest, value in given.items():
            owner, field, negated = self.owner.get(dest, (None, "", False))
            if owner is cls:
                values[field] = not value if negated else value
        return values

    def build(self, cls: type[T], given: dict[str, Any], **fixed: Any) -> T:
        """``cls`` from the given flags that belong to it (its defaults for the rest) and ``fixed`` values;
        a ``ValueError`` of its checks names the flag (``--batch-size must be ...``) instead of the field."""
        try:
            return cls(**{**self.values(cls, given), **fixed})
        except ValueError as error:
            raise self.named(cls, error) from None

    def named(self, cls: type, error: ValueError) -> ValueError:
        """``error`` of ``cls``'s checks with the flag's name instead of the field's (``--batch-size must ...``)."""
        text = str(error).removeprefix(f"{cls.__name__}: ")
        for dest, (owner, field, negated) in self.owner.items():
            if owner is cls and not negated and text.startswith(f"{field} "):
                text = f"--{dest.replace('_', '-')}{text[len(field):]}"
        return ValueError(text)

    def _config_file(self, path: str) -> dict[str, Any]:
        file = Path(path)
        if not file.is_file():
            self.error(f"config file {path} does not exist")
        try:
            data = tomllib.loads(file.read_text()) if file.suffix == ".toml" else json.loads(file.read_text())
        except (ValueError, tomllib.TOMLDecodeError) as error:
            self.error(f"cannot parse config file {path}: {error}")
        if not isinstance(data, dict):
            self.error(f"config file {path} must hold a table of flag values, not a {type(data).__name__}")
        values = {str(k).lstrip("-").replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(values) - set(self.owner) - {"config"})
        if unknown:
            self.error(f"unknown key(s) in {path}: {', '.join(unknown)}")
        actions = {action.dest: action for action in self._actions}
        for dest, value in values.items():
            action = actions.get(dest)
            if action is None:
                continue
            kind = action.type if action.nargs != 0 else bool
            name = dest.replace("_", "-")
            if not _is_a(value, kind or str):
                self.error(f"{name} in {path} must be {_KIND_NAMES.get(kind or str, 'a value')}, got "
                           f"{json.dumps(value) if not isinstance(value, dict) else 'a table'}")
            if action.choices is not None and value not in action.choices:
                self.error(f"{name} in {path} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
        return values


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """JAX's persistent compilation cache: every program keeps compiled steps across runs."""

    compile_cache_dir: str = setting(os.path.join(os.path.expanduser("~"), ".cache", "nash_mhc", "xla"),
                                     "persistent XLA compilation cache, a local directory or gs://... ('none' "
                                     "disables)")

    def use(self) -> None:
        """Point JAX's compilation cache at the directory (nothing when it is 'none' or empty)."""
        if not self.compile_cache_dir or self.compile_cache_dir.lower() == "none":
            return
        import jax

        from nash_mhc import paths

        jax.config.update("jax_compilation_cache_dir", os.fspath(paths.as_path(self.compile_cache_dir)))


def add_compile_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache-dir`` on a plain argparse parser (the study's), from :class:`CompileCache`'s field."""
    field = next(f for f in dataclasses.fields(CompileCache) if f.name == "compile_cache_dir")
    parser.add_argument("--compile-cache-dir", default=field.default, help=field.metadata["help"])


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Which trained checkpoint ``generate`` and ``evaluate`` load."""

    checkpoint_dir: str = setting(help="training run directory (its latest checkpoint) or one step directory "
                                       "inside it")
    step: int | None = setting(None, "checkpoint step to load (default: the latest)")
    untrained: bool = setting(False, "use the run's step-0 initialisation instead (the baseline to compare with)")
    tokenizer: str | None = setting(None, "tokenizer to use instead of the one the run recorded (e.g. when it was "
                                          "given by a path that has moved); must have the same vocabulary size")

    def __post_init__(self) -> None:
        if self.step is not None and self.step < 0:
            raise ValueError(f"--step must be >= 0, got {self.step}")


def checkpoint_program_parser(prog: str, doc: str, settings: type) -> SettingsParser:
    """The flags of a program that loads a trained model (generate, evaluate): which checkpoint, the program's
    own ``settings``, the mesh (``--mesh-*``: none given = one device), the compile cache and ``--kernels``
    (:class:`nash_mhc.execution.ExecutionConfig`, which the program runs its steps under). A flag every such
    program gains is added here, once."""
    from nash_mhc.execution import ExecutionConfig
    from nash_mhc.sharding import MeshConfig

    parser = SettingsParser(prog, doc)
    for cls in (Checkpoint, settings, CompileCache, ExecutionConfig):
        parser.add_settings(cls)
    parser.add_settings(MeshConfig, "mesh (default: one device; any --mesh-* flag: that mesh over all devices, "
                                    "parameters sharded as in training)", prefix="mesh-")
    return parser
