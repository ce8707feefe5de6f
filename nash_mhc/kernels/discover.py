"""Which kernels a preset's train step uses, at which shapes: the step traced under :func:`dispatch.recording`.

The train step is traced (not compiled) for the given devices with the kernels on: under ``auto`` on a TPU, under
``pallas`` elsewhere (the same TPU branches, interpreted). Every named choice of :func:`dispatch.platform_dependent`
(and :func:`dispatch.platform_vjp`) that the trace made outside another one is a :class:`dispatch.Choice`: its TPU
form, its XLA form and its operands' shapes. The check replays each choice whose TPU form runs a Pallas kernel of
the step's program (read from the traced step's jaxpr), and :func:`kernel_choices` says which of the program's
kernels no choice runs (none: every ``pallas_call`` site is reached through a named choice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from nash_mhc.config import ModelConfig
from nash_mhc.kernels.jaxprs import pallas_kernels
from nash_mhc.kernels.replay import has_vjp, runner
from nash_mhc.ops import dispatch
from nash_mhc.sharding import make_mesh
from nash_mhc.training.config import TrainConfig


def step_kernels(devices: Sequence[Any]) -> str:
    """The ``kernels`` setting under which the step traces its TPU forms on ``devices``."""
    return "auto" if devices[0].platform == "tpu" else "pallas"


@dataclasses.dataclass(frozen=True)
class Discovery:
    """A traced train step: its named choices (in the order traced), the Pallas kernels its program holds
    (:func:`nash_mhc.kernels.jaxprs.kernel_id`) and the data-parallel mesh it was traced on."""

    choices: tuple[dispatch.Choice, ...]
    kernels: frozenset[str]
    mesh: Mesh


def discover(model_config: ModelConfig, train_config: TrainConfig, devices: Sequence[Any] | None = None
             ) -> Discovery:
    """Trace the train step of ``model_config`` at ``train_config``'s batch on ``devices`` (default: the local
    ones; abstract TPU devices too) with the kernels on, recording its named choices."""
    from nash_mhc.tpu_compile import fit
    from nash_mhc.training import step as train_step_module

    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(-1, 1, 1, devices=devices)
    state = fit.abstract_train_state(model_config, train_config, mesh)
    batch = fit.abstract_batch(train_config.batch_size, model_config.seq_len, mesh)
    with dispatch.use_kernels(step_kernels(devices)), dispatch.recording() as recorder:
        traced = jax.jit(lambda b, s: train_step_module._train_step_jit(b, s)).trace(batch, state)
    return Discovery(tuple(recorder.choices.values()), frozenset(pallas_kernels(traced.jaxpr)), mesh)


def traced_kernels(choice: dispatch.Choice, mesh: Mesh) -> tuple[str, ...]:
    """The Pallas kernels of ``choice``'s TPU form, forward and backward (its VJP in every floating operand), as
    traced under ``pallas`` and ``mesh``, in order without repeats."""
    with jax.set_mesh(mesh), dispatch.use_kernels("pallas"):
        vjp = has_vjp(choice)
        out = jax.eval_shape(choice.tpu, *choice.args)
        jaxpr = jax.make_jaxpr(runner(choice.tpu, choice.args, vjp))(*choice.args, out)
    return tuple(dict.fromkeys(pallas_kernels(jaxpr)))


def kernel_choices(discovery: Discovery) -> tuple[list[tuple[dispatch.Choice, tuple[str, ...]]], set[str]]:
    """([(choice, its kernels)] for each choice whose TPU form runs a kernel of the step's program, the step's
    kernels that none of them runs). A choice traced but left out of the program (the primal of a ``custom_vjp``
    that its own rule differentiates) holds none of the program's kernels and is skipped."""
    found = [(choice, traced_kernels(choice, discovery.mesh)) for choice in discovery.choices]
    kept = [(choice, names) for choice, names in found if set(names) & discovery.kernels]
    return kept, set(discovery.kernels) - {name for _, names in kept for name in names}


__all__ = ["Discovery", "discover", "kernel_choices", "step_kernels", "traced_kernels"]
