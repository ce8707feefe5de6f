"""TrainState, Batch, and born-sharded initialisation.

Born sharded: :func:`init_train_state` first traces the whole initialisation abstractly
(``eqx.filter_eval_shape``), derives a ``NamedSharding`` for every array leaf from the rules in
:mod:`nash_mhc.sharding`, then runs the same initialisation under ``jax.jit(..., out_shardings=...)``. XLA
therefore materialises every parameter and optimizer-state array directly in its shards; no array is ever
whole on one device (random numbers are identical on every mesh because ``jax_threefry_partitionable`` is
on, the JAX default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PyTree

from nash_mhc.config import ModelConfig
from nash_mhc.model import LanguageModel
from nash_mhc.sharding import named_shardings
from nash_mhc.training.config import TrainConfig
from nash_mhc.training.optim import coefficient_mask, make_optimizer


class Batch(eqx.Module):
    """A global batch of token sequences.

    tokens: [B, T+1] integer ids; the model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``.
    loss_mask: [B, T] weights of the T predictions (bool or float; None means all ones). The loss is the
      mask-weighted mean over all predictions of the global batch.
    Host (numpy) arrays are accepted; :func:`nash_mhc.sharding.shard_batch` places them.
    """

    tokens: Int[Array | np.ndarray, "batch seq_plus_one"]
    loss_mask: Float[Array | np.ndarray, "batch seq"] | Bool[Array | np.ndarray, "batch seq"] | None = None

    def __check_init__(self) -> None:
        if self.tokens.ndim != 2 or self.tokens.shape[1] < 2:
            raise ValueError(f"Batch.tokens must be [batch, seq+1] with seq >= 1, got {self.tokens.shape}")
        expected = (self.tokens.shape[0], self.tokens.shape[1] - 1)
        if self.loss_mask is not None and tuple(self.loss_mask.shape) != expected:
            raise ValueError(f"Batch.loss_mask must have shape {expected} (tokens {tuple(self.tokens.shape)} "
                             f"minus the last position), got {tuple(self.loss_mask.shape)}")


class TrainState(eqx.Module):
    """Everything one optimizer step reads and writes.

    model: the LanguageModel (float32 parameters, sharded by the rules).
    opt_state: optax state (same sharding as the parameters; scalars replicated).
    anchor: the coefficient parameters' values at the start of training (the model's tree, None elsewhere), from
      which ``travel/<group>`` is measured (:func:`coefficient_anchor`).
    step: number of updates applied (= the optimizer/schedule count).
    skipped: number of steps whose update was skipped because the gradients were not finite.
    Static: the optimizer (``GradientTransformation``), the TrainConfig and the mesh.
    """

    model: LanguageModel
    opt_state: PyTree
    anchor: LanguageModel
    step: Int[Array, ""]
    skipped: Int[Array, ""]
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    train_config: TrainConfig = eqx.field(static=True)
    mesh: Mesh = eqx.field(static=True)

    @property
    def params(self) -> PyTree:
        """The trainable leaves of the model (float arrays; everything else None)."""
        return eqx.filter(self.model, eqx.is_inexact_array)


def coefficient_anchor(model: LanguageModel) -> LanguageModel:
    """A copy of ``model``'s coefficient parameters (declared role ``coefficient``; None elsewhere): where their
    travel is measured from. Copies, never the model's own buffers: the train step donates the whole state, and one
    buffer donated twice (as a parameter and as its anchor) crashes the step."""
    return jax.tree.map(jnp.copy, eqx.filter(model, coefficient_mask(model)))


def with_model(state: TrainState, model: LanguageModel) -> TrainState:
    """``state`` training ``model`` from here: the weights replaced and the travel anchor reset to them (the
    optimizer state is kept; ``--init-from`` starts a fresh one anyway)."""
    return eqx.tree_at(lambda s: (s.model, s.anchor), state, (model, coefficient_anchor(model)),
                       is_leaf=lambda x: x is None)


def _is_shape(x: object) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def state_initializer(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh, *,
                      key: jax.Array) -> tuple[Callable[[jax.Array], list[jax.Array]],
                                               Callable[[list[jax.Array]], TrainState]]:
    """``(init_leaves, finish)``: ``finish(init_leaves(key))`` is the born-sharded TrainState.

    ``init_leaves`` is ``jax.jit(..., out_shardings=...)`` over the array leaves of the state (so it can be
    lowered and inspected, e.g. for its per-device memory); ``key`` only fixes the key's abstract type.
    """
    optimizer = make_optimizer(train_config)

    def build(key: jax.Array) -> TrainState:
        model = LanguageModel(model_config, key=key)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        zero = jnp.zeros((), jnp.int32)
        return TrainState(model=model, opt_state=opt_state, anchor=coefficient_anchor(model), step=zero, skipped=zero,
                          optimizer=optimizer, train_config=train_config, mesh=mesh)

    abstract = eqx.filter_eval_shape(build, key)
    arrays, static = eqx.partition(abstract, _is_shape)
    treedef = jax.tree.structure(arrays)
    shardings = jax.tree.leaves(named_shardings(abstract, mesh))

    def init_leaves(key: jax.Array) -> list[jax.Array]:
        return jax.tree.leaves(eqx.filter(build(key), eqx.is_array))

    def finish(leaves: list[jax.Array]) -> TrainState:
        return eqx.combine(jax.tree.unflatten(treedef, leaves), static)

    return jax.jit(init_leaves, out_shardings=shardings), finish


def reshard_state(state: TrainState, mesh: Mesh) -> TrainState:
    """``state`` moved onto ``mesh`` (a copy; every leaf placed by the rules, the static mesh replaced).

    For changing the mesh of a live single-process state (tests, notebooks); multi-host runs change mesh by
    restoring a checkpoint with the new shardings instead.
    """
    moved = dataclasses.replace(state, mesh=mesh)
    arrays, static = eqx.partition(moved, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    shardings = jax.tree.leaves(named_shardings(moved, mesh))
    # Explicit copies: device_put(may_alias=False) can still alias the source buffer for a shard on the
    # source device (seen with replicated outputs, JAX 0.10.2), and a later donation would delete both.
    leaves = jax.device_put([jnp.copy(leaf) for leaf in leaves], shardings)
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def init_train_state(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh, *,
                     key: jax.Array) -> TrainState:
    """A fresh TrainState whose parameters and optimizer state are born sharded on ``mesh``."""
    init_leaves, finish = state_initializer(model_config, train_config, mesh, key=key)
    return finish(init_leaves(key))
