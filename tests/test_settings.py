"""Settings are declared once (a dataclass field with ``setting(default, help)``): its flag is generated from the
declaration, the flag lands in that field, and the field is read by code outside its declaration."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path

import equinox as eqx
import jax
import pytest

from nash_mhc import train as train_module
from nash_mhc.model import LanguageModel
from nash_mhc.training.optim import make_optimizer

PACKAGE = Path(__file__).resolve().parents[1] / "nash_mhc"


def non_default_argv(action: argparse.Action, declared: object) -> list[str]:
    """The flag with a value its declaration does not default to."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(next(c for c in action.choices if c != declared))]
    kind = action.type if callable(action.type) else str
    value = next(v for v in ("3", "5", "0.5", "some/value") if _parses(kind, v) and kind(v) != declared)
    return [flag, value] if action.nargs in (None, "?") else [flag, value, value]


def _parses(kind, text: str) -> bool:
    try:
        kind(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


def attribute_reads() -> dict[str, set[tuple[str, str]]]:
    """``{attribute name: {(module, where)}}`` of every ``x.name`` read in the package; ``where`` is
    ``"<Class>.__post_init__"`` for reads in a class's validation, else ``""``."""
    reads: dict[str, set[tuple[str, str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        validation = {id(node): f"{cls.name}.__post_init__" for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                      for method in cls.body if isinstance(method, ast.FunctionDef) and method.name == "__post_init__"
                      for node in ast.walk(method)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                reads.setdefault(node.attr, set()).add((str(path), validation.get(id(node), "")))
    return reads


def test_every_flag_lands_in_its_field_and_the_field_has_a_reader():
    """For every generated flag of the training program: given alone, it sets exactly its declared field; and that
    field is read (``config.field``) somewhere in nash_mhc other than its class's ``__post_init__`` (validation
    is not a consumer)."""
    parser = train_module.build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    reads = attribute_reads()
    assert len(parser.owner) >= 40
    for dest, (cls, field, _) in parser.owner.items():
        declared = next(f.default for f in dataclasses.fields(cls) if f.name == field)
        given = vars(parser.parse_args(non_default_argv(actions[dest], declared)))
        values = parser.values(cls, given)
        assert list(values) == [field], (dest, values)
        assert values[field] != declared, dest
        validation = (str(Path(inspect.getsourcefile(cls)).resolve()), f"{cls.__name__}.__post_init__")
        readers = reads.get(field, set()) - {validation}
        assert readers, f"--{dest.replace('_', '-')}: {cls.__name__}.{field} is declared but nothing reads it"


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_model_and_optimizer_flags_reach_the_layers_and_the_update():
    """Walk a few flags to their consumers: the aggregation's Newton steps and the Sinkhorn iterations in the built
    model's layers, the coefficient learning-rate scale in the optimizer's update."""
    configs, _ = train_module.configs(["--model", "tiny", "--nash-iters", "3", "--sinkhorn-iters", "7",
                                       "--nash-temperature", "0.25", "--coefficient-lr-scale", "4",
                                       "--weight-decay", "0", "--warmup-steps", "0"])
    model = LanguageModel(configs.model, key=jax.random.key(0))
    aggregation = model.blocks.attn.aggregation
    assert aggregation.num_iters == 3
    assert float(jax.numpy.exp(aggregation.log_temperature).ravel()[0]) == pytest.approx(0.25)
    assert model.blocks.attn_hc.sinkhorn_iters == 7
    optimizer = make_optimizer(configs.train)
    grads = jax.tree.map(jax.numpy.ones_like, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = optimizer.update(eqx.filter(grads, eqx.is_inexact_array), optimizer.init(params), params)
    alpha, weight = abs(float(updates.blocks.attn_hc.alpha.ravel()[0])), abs(float(updates.blocks.ffn.w_gate
                                                                                    .ravel()[0]))
    assert weight > 0 and alpha == pytest.approx(4 * weight, rel=1e-5)
