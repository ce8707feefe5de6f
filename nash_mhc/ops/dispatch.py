"""A TPU form or an XLA form of one function, chosen when the step is lowered, with one backward rule for both.

:func:`platform_dependent` is ``jax.lax.platform_dependent`` that traces only the branch of the platform the
ambient mesh's devices are on (the train and eval steps run the model under their mesh, whose abstract mesh
names the platform: a CPU host's step never traces a Pallas kernel, a step for a TPU topology only the kernels),
or, where no mesh names a platform, of :func:`lowering_platform`'s (generation runs its steps under the platform
where a jit of the model's arrays runs); with neither, or a platform that does not settle the choice, every branch is
traced and the choice is made when the program is lowered. Tracing the TPU branches of the `tiny` preset's train
step on the CPU took over a third of its tracing time (docs/testing.md); on TPU, the branches not taken left
conditionals in the compiled step (docs/tpu.md).

Differentiated as it is, ``jax.lax.platform_dependent``'s conditional keeps the residuals of every branch: JAX's
partial evaluation of a ``cond`` makes each branch return the union of the branches' residuals, zeros in place of
the others'. Those zeros are made outside any mesh annotation, so unsharded: in the `1b` Nash-MHC step on v6e-8
the XLA downsampling's residual became a bf16[32, 512, 4, 2048] zero of the global batch on every chip, 1.7 % of
the step's estimate (docs/tpu.md). :func:`platform_vjp` saves the operands instead and chooses again in the
backward pass, between the two forms' own VJPs.

The ``kernels`` setting (:func:`use_kernels`: ``auto``, ``xla``, ``pallas``) is the one place that can overrule
these choices: ``auto`` is the above; ``xla`` takes every function's default (XLA) form on every platform, and
:func:`tpu_kernels`, which the TPU-only paths outside ``platform_dependent`` ask, says no; ``pallas`` takes the TPU
form on every platform, run in Pallas' interpreter where the step is not lowered for a TPU (:func:`pallas_call`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import pallas as pl

# The abstract mesh's platform names the lowering platform; a GPU's is "gpu", which platform_dependent splits into
# "cuda" and "rocm", so it settles the choice only for functions with neither branch.
_GPU_BRANCHES = ("cuda", "rocm")
# lowering_platform's value: a context of JAX's jit and trace caches (a trace made under one platform is never
# reused under another, nor under none, e.g. a module-level jax.checkpoint's cached jaxpr).
_LOWERING_PLATFORM = jax.make_user_context(None)
KERNELS = ("auto", "xla", "pallas")  # use_kernels' values
# use_kernels' value: a context of JAX's jit and trace caches as _LOWERING_PLATFORM is.
_KERNELS = jax.make_user_context("auto")


def _mesh_device() -> Any:
    """The ambient mesh's abstract device (its platform and device kind), or None without a mesh or device."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def _mesh_platform() -> str | None:
    """The platform of the ambient mesh's devices ("cpu", "tpu", "gpu"), or None without a mesh or device."""
    device = _mesh_device()
    return None if device is None else device.platform


def settled_platform() -> str | None:
    """The platform ("cpu", "tpu", "gpu") whose branch :func:`platform_dependent` traces: the ambient mesh's, else
    :func:`lowering_platform`'s; None where the choice waits for lowering."""
    return _mesh_platform() or _LOWERING_PLATFORM.value


def settled_device_kind() -> str | None:
    """The device kind ("TPU v4", "TPU v6 lite", ...) of the ambient mesh's devices, else of JAX's default device
    where its platform is :func:`settled_platform`'s; None where neither says (a kernel's tiles then assume the
    larger chips)."""
    device = _mesh_device()
    if device is not None:
        return device.device_kind
    default = jax.devices()[0]
    return default.device_kind if default.platform == settled_platform() else None


def lowering_platform(platform: str | None) -> Any:
    """A context manager: within it, :func:`platform_dependent` takes ``platform``'s branch ("cpu", "tpu", "gpu")
    where no mesh names a platform (None: every branch, as outside). Part of the key of JAX's jit and trace caches,
    like the mesh. For programs that run where :func:`platform_of` says (``jax.export`` for another platform must
    not run under it)."""
    return _LOWERING_PLATFORM(platform)


def use_kernels(kernels: str) -> Any:
    """A context manager: within it, the steps run with the ``kernels`` setting, one of :data:`KERNELS`. ``auto``:
    the Pallas kernels where the step is lowered for a TPU, XLA elsewhere; ``xla``: XLA's forms on every platform
    (no Pallas kernel, no TPU-only path); ``pallas``: the TPU kernels on every platform, in Pallas' interpreter
    where the step is not lowered for a TPU (slow: for tests). Part of the key of JAX's jit and trace caches. A
    setting of how the step runs, not of the model: the parameters are the same under every value."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    return _KERNELS(kernels)


def kernels_setting() -> str:
    """The :func:`use_kernels` value in force ("auto" outside any)."""
    return _KERNELS.value


# disable_kernels' value: the names of the choices that take their XLA form (a context as _KERNELS is).
_DISABLED = jax.make_user_context(frozenset())


def disable_kernels(names: Any) -> Any:
    """A context manager: within it the :func:`platform_dependent` choices named ``names`` take their XLA form
    whatever the ``kernels`` setting (the kernels that failed their check). Part of the key of JAX's caches."""
    return _DISABLED(frozenset(names))


def disabled_kernels() -> frozenset[str]:
    """The :func:`disable_kernels` names in force."""
    return _DISABLED.value


def tpu_kernels() -> bool:
    """Whether the step takes the TPU kernels' paths that are chosen while it is traced (outside
    :func:`platform_dependent`, e.g. a layout that only the kernels want): under ``auto`` where
    :func:`settled_platform` is "tpu", under ``pallas`` always, under ``xla`` never."""
    kernels = _KERNELS.value
    return kernels == "pallas" or (kernels == "auto" and settled_platform() == "tpu")


def interpreting() -> bool:
    """Whether :func:`pallas_call` runs its kernel in Pallas' interpreter: under ``pallas`` where the step is not
    lowered for a TPU (:func:`settled_platform`, else JAX's default backend)."""
    return _KERNELS.value == "pallas" and (settled_platform() or jax.default_backend()) != "tpu"


def kernel_name(kernel: Callable[..., Any], options: dict[str, Any]) -> str:
    """The name Pallas gives the kernel's custom call (``kernel_name`` in the lowered TPU module)."""
    while isinstance(kernel, functools.partial):
        kernel = kernel.func
    return options.get("name") or getattr(kernel, "__name__", "kernel")


def pallas_call(kernel: Callable[..., Any], *, interpret: bool = False, **options: Any) -> Any:
    """``pl.pallas_call(kernel, **options)``, in Pallas' interpreter with ``interpret`` or :func:`interpreting`:
    every kernel of the package is called through it. Under :func:`recording` each call is noted by its
    :func:`kernel_name`; the kernel named by the environment variable :data:`BREAK_KERNEL` returns its outputs
    plus one (a test hook: it makes the kernels check fail)."""
    call = pl.pallas_call(kernel, interpret=interpret or interpreting(), **options)
    name = kernel_name(kernel, options)
    recorder = _RECORDER.value
    if recorder is not None:
        recorder.kernels.append(name)
    if name not in os.environ.get(BREAK_KERNEL, "").split(","):
        return call
    return lambda *args: jax.tree.map(lambda out: out + 1, call(*args))


def platform_of(tree: Any) -> str | None:
    """The platform a jit of ``tree``'s arrays runs on: its committed arrays' (None if on several platforms), else
    the default device's (``jax.default_device``, else the default backend); None if ``tree`` holds a tracer."""
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    if any(isinstance(leaf, jax.core.Tracer) for leaf in arrays):
        return None
    committed = {device.platform for leaf in arrays if getattr(leaf, "committed", False) for device in leaf.devices()}
    if committed:
        return committed.pop() if len(committed) == 1 else None
    default = jax.config.jax_default_device
    if default is None:
        return jax.default_backend()
    return default if isinstance(default, str) else default.platform  # a str is "cpu", "gpu" or "tpu"


def platform_dependent(*args: Any, default: Callable[..., Any] | None = None, name: str | None = None,
                       **per_platform: Callable[..., Any]) -> Any:
    """``jax.lax.platform_dependent(*args, default=default, **per_platform)``, tracing only the branch of the
    ambient mesh's platform (or, where no mesh names one, :func:`lowering_platform`'s) where it settles the choice
    (the same branch that lowering would pick); else every branch, chosen when the program is lowered
    (``jax.export`` for several platforms, a model called by a bare jit). Under :func:`use_kernels` ``xla``
    always ``default``'s branch, under ``pallas`` always ``tpu``'s (where there is one). ``name`` names the choice
    for the kernels check (:func:`recording`); a name in :func:`disable_kernels` takes ``default``'s branch."""
    recorder = _RECORDER.value
    if recorder is None or name is None or "tpu" not in per_platform or default is None or recorder.depth:
        return _choose(args, default, per_platform, name)
    start = len(recorder.kernels)
    recorder.depth += 1
    try:
        out = _choose(args, default, per_platform, name)
    finally:
        recorder.depth -= 1
    recorder.note(Choice(name, per_platform["tpu"], default, jax.tree.map(_spec, args),
                         tuple(recorder.kernels[start:]), jax.sharding.get_abstract_mesh()))
    return out


def _choose(args: tuple[Any, ...], default: Callable[..., Any] | None, per_platform: dict[str, Callable[..., Any]],
            name: str | None) -> Any:
    kernels = _KERNELS.value
    if name is not None and default is not None and name in _DISABLED.value:
        kernels = "xla"
    if kernels != "auto" and default is not None:
        return (default if kernels == "xla" else per_platform.get("tpu", default))(*args)
    platform = settled_platform()
    if platform == "gpu" and not any(name in per_platform for name in _GPU_BRANCHES):
        branch = default
    elif platform in ("cpu", "tpu"):
        branch = per_platform.get(platform, default)
    else:
        branch = None
    if branch is not None:
        return branch(*args)
    return jax.lax.platform_dependent(*args, default=default, **per_platform)


def platform_vjp(tpu: Callable[..., jax.Array], default: Callable[..., jax.Array], *, name: str | None = None
                 ) -> Callable[..., jax.Array]:
    """``f(*args) = platform_dependent(*args, tpu=tpu, default=default)``, differentiable in every
    argument, whose backward pass is ``platform_dependent`` of the two forms' VJPs at the saved ``args``.

    For functions whose backward needs no more than their operands (linear maps such as the multiscale
    resampling): each form's forward inside its VJP is dead code, which the compiler drops. Both forms must
    take and return arrays of the same shapes and dtypes."""

    def pullback(form: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
        def run(*operands: jax.Array) -> tuple[jax.Array, ...]:
            *args, cotangent = operands
            return jax.vjp(form, *args)[1](cotangent)
        return run

    @jax.custom_vjp
    def f(*args: jax.Array) -> jax.Array:
        return platform_dependent(*args, tpu=tpu, default=default, name=name)

    def forward(*args: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return f(*args), args

    def backward(args: tuple[jax.Array, ...], cotangent: jax.Array) -> tuple[jax.Array, ...]:
        forms = dict(tpu=pullback(tpu), default=pullback(default))
        return _choose((*args, cotangent), forms.pop("default"), forms, name)  # a choice, but not recorded

    f.defvjp(forward, backward)
    return f


# ------------------------------------------------------------------------------------------- recording
BREAK_KERNEL = "NASH_MHC_BREAK_KERNEL"  # test hook: comma-separated kernel names whose outputs pallas_call perturbs
# recording's value: a Recorder (hashed by identity, so each recording traces afresh) or None.
_RECORDER = jax.make_user_context(None)


def _spec(leaf: Any) -> Any:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if hasattr(leaf, "shape") else leaf


@dataclasses.dataclass(frozen=True)
class Choice:
    """One named choice that :func:`platform_dependent` made while a step was traced: its two forms, the operands'
    shapes (pytree of ``ShapeDtypeStruct``, the shapes at the call: per shard inside a ``shard_map``), the Pallas
    kernels its chosen branch called in the forward pass and the abstract mesh in force."""

    name: str
    tpu: Callable[..., Any]
    default: Callable[..., Any]
    args: tuple[Any, ...]
    kernels: tuple[str, ...]
    mesh: Any

    @property
    def key(self) -> tuple[Any, ...]:
        leaves, tree = jax.tree.flatten(self.args)
        return self.name, str(tree), tuple(str(leaf) for leaf in leaves), self.kernels


class Recorder:
    """What :func:`recording` collects: the outermost named choices (one per distinct :attr:`Choice.key`) and
    every Pallas kernel called through :func:`pallas_call`, in order."""

    def __init__(self) -> None:
        self.choices: dict[tuple[Any, ...], Choice] = {}
        self.kernels: list[str] = []
        self.depth = 0

    def note(self, choice: Choice) -> None:
        self.choices.setdefault(choice.key, choice)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """A context manager giving a :class:`Recorder` of the named choices and kernels traced within it (part of the
    key of JAX's caches, so a step traced before is traced again)."""
    recorder = Recorder()
    with _RECORDER(recorder):
        yield recorder


__all__ = ["BREAK_KERNEL", "KERNELS", "Choice", "Recorder", "disable_kernels", "disabled_kernels", "interpreting",
           "kernel_name", "kernels_setting", "lowering_platform", "pallas_call", "platform_dependent", "platform_of",
           "platform_vjp", "recording", "settled_device_kind", "settled_platform", "tpu_kernels", "use_kernels"]
