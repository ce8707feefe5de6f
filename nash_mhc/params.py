"""Parameter roles and logical axes, declared once, on the module field that creates each parameter.

A layer module declares every array field with :func:`param`: the parameter's *role* (how training treats it)
and the *logical name* of each dimension (MaxText's logical axes)::

    wq: Float[Array, "scales dim heads head_dim"] = param("matmul", "scales", "embed", "heads", "head_dim")

and a field that holds a stack of modules (the model's ``blocks``) with :func:`stacked` (the stack adds a leading
logical axis to every parameter inside). Everything that treats parameters differently reads these declarations
through :func:`declaration_of` / :func:`map_declared` and nothing else:

* sharding (:mod:`nash_mhc.sharding`): logical axes → mesh axes by one table, ``LOGICAL_AXIS_RULES``;
* weight decay and the coefficient learning-rate group (:mod:`nash_mhc.training.optim`): :class:`Role`;
* the matmul weights cast to the compute dtype once, before the layer scan (:mod:`nash_mhc.model`);
* parameter counts by role (:func:`nash_mhc.model.param_counts`);
* coefficient travel from initialisation (``travel/<group>``, :mod:`nash_mhc.training.step`).

A module that declares any parameter must declare all of its array fields: an undeclared one raises
:class:`UndeclaredParameter` wherever the declarations are read (the tests walk every model variant).
This module imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


@dataclasses.dataclass(frozen=True)
class Role:
    """How training treats a parameter: AdamW weight decay, the coefficient learning-rate group, and the one-time
    cast to the compute dtype before the layer scan."""

    name: str
    decay: bool = False
    coefficient: bool = False
    cast_once: bool = False


ROLES = {role.name: role for role in (
    Role("matmul", decay=True, cast_once=True),  # attention and FFN weights, read once per layer per step
    Role("head", decay=True),                    # an untied LM head
    Role("embedding"),                           # token embedding (also the tied LM head)
    Role("norm"),                                # RMSNorm gains
    Role("kernel"),                              # the multiscale downsampling kernels
    Role("coefficient", coefficient=True),       # mixing/aggregation coefficients whose scale is a logit
)}


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    """One parameter's declaration: its role, the logical name of each dimension and its reporting group (the
    name of its ``travel/<group>`` metric; the role's name unless given)."""

    role: Role
    axes: tuple[str, ...]
    group: str


class UndeclaredParameter(ValueError):
    """An array field of a parameter-declaring module that has no :func:`param` declaration."""


PARAM_KEY, STACK_KEY = "nash_mhc_param", "nash_mhc_stack"


def param(role: str, *axes: str, group: str | None = None) -> Any:
    """Declare an array field (or a tuple of same-rank arrays) as a parameter of ``role`` whose dimensions have the
    logical names ``axes``; ``group`` names its ``travel/<group>`` metric (default: the role)."""
    if role not in ROLES:
        raise ValueError(f"unknown parameter role {role!r}; choose one of {', '.join(ROLES)}")
    return eqx.field(metadata={PARAM_KEY: ParamDecl(ROLES[role], tuple(axes), group or role)})


def stacked(axis: str) -> Any:
    """Declare a field holding modules stacked along a new leading dimension of logical name ``axis``."""
    return eqx.field(metadata={STACK_KEY: axis})


def _declares(module: eqx.Module) -> bool:
    return any(PARAM_KEY in f.metadata for f in dataclasses.fields(module))


def _fields(module: eqx.Module) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(module)}


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    return None  # a pytree node without named children: nothing below it is declared


def declaration_of(tree: Any, path: tuple[Any, ...]) -> tuple[ParamDecl, tuple[str, ...]] | None:
    """(declaration, logical axes of every dimension) of the leaf at key ``path`` of ``tree``, or None for a leaf
    that is not a declared parameter (a step counter, an optimizer count, a leaf outside any layer module).

    Works on any tree that holds the model's modules: the model, its gradients, the optimizer moments (which
    repeat the model's classes), a whole train state. Raises :class:`UndeclaredParameter` for an array field of
    a declaring module without a declaration.
    """
    node, lead, found = tree, (), None
    for key in path:
        if isinstance(node, eqx.Module) and isinstance(key, jax.tree_util.GetAttrKey):
            field = _fields(node).get(key.name)
            meta = field.metadata if field is not None else {}
            if PARAM_KEY in meta:
                found = meta[PARAM_KEY]
            elif STACK_KEY in meta:
                lead = (*lead, meta[STACK_KEY])
            elif found is None and _declares(node) and not isinstance(getattr(node, key.name), eqx.Module):
                child = getattr(node, key.name)
                if any(hasattr(leaf, "shape") for leaf in jax.tree.leaves(child)):
                    raise UndeclaredParameter(f"{type(node).__name__}.{key.name} holds arrays but has no parameter "
                                              "declaration; declare it with nash_mhc.params.param(role, *axes)")
        node = _child(node, key)
        if node is None:
            break
    return None if found is None else (found, (*lead, *found.axes))


def map_declared(fn: Callable[[str, Any, ParamDecl | None, tuple[str, ...] | None], Any], tree: Any, *,
                 stack: tuple[str, ...] = ()) -> Any:
    """``tree`` with every leaf replaced by ``fn(path, leaf, declaration, logical_axes)`` (declaration and axes
    None for a leaf that is not a declared parameter); ``path`` is the dotted path (``blocks.attn.wq``).

    ``stack`` names leading dimensions the whole ``tree`` carries (``("layers",)`` for the model's stacked blocks
    read on their own). The logical axes name every dimension of the leaf: a mismatch with its rank (a stacked
    module read without its stack, a declaration with the wrong number of axes) raises ValueError.
    """
    def visit(key_path: tuple[Any, ...], leaf: Any) -> Any:
        path = dotted(key_path)
        found = declaration_of(tree, key_path) if hasattr(leaf, "shape") else None
        decl, axes = found if found is not None else (None, None)
        axes = None if axes is None else (*stack, *axes)
        if axes is not None and len(axes) != len(leaf.shape):
            raise ValueError(f"parameter {path} has shape {tuple(leaf.shape)} but its declaration names the axes "
                             f"{axes}")
        return fn(path, leaf, decl, axes)

    return jax.tree_util.tree_map_with_path(visit, tree)


def dotted(path: tuple[Any, ...]) -> str:
    """Dotted attribute path of a pytree leaf: ``blocks.attn.down[0]``, ``opt_state.inner_state[1][0].mu.head``."""
    out = ""
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            out += f".{entry.name}"
        elif isinstance(entry, jax.tree_util.DictKey):
            out += f".{entry.key}"
        elif isinstance(entry, jax.tree_util.SequenceKey):
            out += f"[{entry.idx}]"
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            out += f"[{entry.key}]"
        else:
            out += f".{entry}"
    return out.lstrip(".")


def declared_parameters(model: Any) -> list[tuple[str, Any, ParamDecl]]:
    """(path, leaf, declaration) of every array leaf of ``model`` (a model, a layer, their abstract shapes);
    :class:`UndeclaredParameter` for an array leaf that has no declaration."""
    found = map_declared(lambda path, leaf, decl, axes: (path, leaf, decl) if hasattr(leaf, "shape") else None,
                         model)
    entries = jax.tree.leaves(found, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str))
    missing = [path for path, _, decl in entries if decl is None]
    if missing:
        raise UndeclaredParameter(f"{missing[0]} holds an array but has no parameter declaration; declare it with "
                                  "nash_mhc.params.param(role, *axes) on its module's field")
    return entries


def role_mask(tree: Any, predicate: Callable[[ParamDecl], bool]) -> Any:
    """A tree of bools like ``tree``: True where the leaf is a declared parameter whose declaration satisfies
    ``predicate`` (non-array leaves and undeclared leaves: False)."""
    return map_declared(lambda path, leaf, decl, axes: decl is not None and predicate(decl), tree)


__all__ = ["ROLES", "ParamDecl", "Role", "UndeclaredParameter", "declaration_of", "declared_parameters", "dotted",
           "map_declared", "param", "role_mask", "stacked"]
