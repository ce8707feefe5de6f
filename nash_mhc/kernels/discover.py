"""Which kernels a preset's train step uses, at which shapes: the step traced under :func:`dispatch.recording`.

The train step is traced (not compiled) for the given devices with the kernels on: under ``auto`` on a TPU, under
``pallas`` elsewhere (the same TPU branches, interpreted). Every named choice of :func:`dispatch.platform_dependent`
(and :func:`dispatch.platform_vjp`) that the trace made outside another one is a :class:`dispatch.Choice`: its TPU
form, its XLA form and its operands' shapes. The check replays each choice whose TPU form calls a Pallas kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from nash_mhc.config import ModelConfig
from nash_mhc.ops import dispatch
from nash_mhc.sharding import make_mesh
from nash_mhc.training.config import TrainConfig


def step_kernels(devices: Sequence[Any]) -> str:
    """The ``kernels`` setting under which the step traces its TPU forms on ``devices``."""
    return "auto" if devices[0].platform == "tpu" else "pallas"


def discover(model_config: ModelConfig, train_config: TrainConfig, devices: Sequence[Any] | None = None
             ) -> tuple[list[dispatch.Choice], Mesh]:
    """(the named choices of the train step with kernels, in the order traced; the data-parallel mesh of
    ``devices``, default the local ones). Only choices whose TPU form called a Pallas kernel in its forward pass
    or whose name the backward pass alone met are kept (see :func:`kernel_choices`)."""
    from nash_mhc.training import fit
    from nash_mhc.training import step as train_step_module

    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(-1, 1, 1, devices=devices)
    state = fit.abstract_train_state(model_config, train_config, mesh)
    batch = fit.abstract_batch(train_config.batch_size, model_config.seq_len, mesh)
    with dispatch.use_kernels(step_kernels(devices)), dispatch.recording() as recorder:
        jax.jit(lambda b, s: train_step_module._train_step_jit(b, s)).trace(batch, state)
    return list(recorder.choices.values()), mesh


def traced_kernels(choice: dispatch.Choice, mesh: Mesh | None = None, kernels: str = "pallas") -> tuple[str, ...]:
    """The Pallas kernels that ``choice``'s TPU form calls, forward and backward (its VJP in every floating
    operand), traced under ``kernels`` and ``mesh`` (default: the choice's own abstract mesh)."""
    from nash_mhc.kernels.replay import has_vjp, runner

    context = jax.sharding.use_abstract_mesh(choice.mesh) if mesh is None else jax.set_mesh(mesh)
    with context, dispatch.use_kernels(kernels):
        vjp = has_vjp(choice)
        with dispatch.recording() as recorder:
            jax.eval_shape(runner(choice.tpu, choice.args, vjp), *choice.args, jax.eval_shape(choice.tpu, *choice.args))
    return tuple(dict.fromkeys(recorder.kernels))


def kernel_choices(choices: Sequence[dispatch.Choice], mesh: Mesh | None = None, kernels: str = "pallas"
                   ) -> list[tuple[dispatch.Choice, tuple[str, ...]]]:
    """(choice, the kernels its TPU form calls) for each choice whose TPU form calls at least one."""
    found = [(choice, traced_kernels(choice, mesh, kernels)) for choice in choices]
    return [(choice, names) for choice, names in found if names]


__all__ = ["discover", "kernel_choices", "step_kernels", "traced_kernels"]
