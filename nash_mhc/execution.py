"""How the programs run their steps, as opposed to what model they run: :class:`ExecutionConfig`.

It holds the settings that change a step's speed and memory but not its result: which forms of the ops run
(``kernels``), the layer scan's rematerialisation (``remat``, ``remat_group``) and unrolling (``scan_unroll``),
and the loss's slicing (``loss_chunks``). None of them is part of ``ModelConfig`` or of a run's identity: a
checkpoint written under one value loads and resumes under another.

The programs (``train``, ``evaluate``, ``generate``) take them as flags and run their steps under
:meth:`ExecutionConfig.use`; in the library, ``with nash_mhc.ExecutionConfig(remat="full").use(): ...`` (the
steps traced within it run so). A flag not given takes its value from :data:`DEFAULTS`, the one table of
per-preset defaults, and else the field's default.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from nash_mhc.ops.dispatch import KERNELS, use_kernels
from nash_mhc.settings import POSITIVE_INT, check_settings, setting

REMAT_POLICIES = ("none", "full", "dots")

# Per preset, the values a flag not given takes (the same on every accelerator: no measurement here has shown a
# preset wanting different ones on CPU, GPU and TPU). scan_unroll: every layer of base, 1b and 3b unrolled
# (4 of small's). 1b and 3b rematerialise each layer and slice the loss in 8, without which their train step
# does not fit a v5e-8, v6e-8 or v4-32 slice at the fit table's batches (docs/tpu.md, "Does it fit?").
DEFAULTS: dict[str, dict[str, Any]] = {
    "small": {"scan_unroll": 4},
    "base": {"scan_unroll": 12},
    "1b": {"scan_unroll": 16, "remat": "full", "remat_group": 1, "loss_chunks": 8},
    "3b": {"scan_unroll": 28, "remat": "full", "remat_group": 1, "loss_chunks": 8},
}


@dataclasses.dataclass(frozen=True)
class Execution:
    """The resolved settings the model and the train step read while they are traced (:func:`current`)."""

    remat: str = "none"
    remat_group: int = 1
    scan_unroll: int = 1
    loss_chunks: int = 1


_EXECUTION = jax.make_user_context(Execution())  # part of the key of JAX's jit and trace caches


def current() -> Execution:
    """The :class:`Execution` in force (its defaults outside any :meth:`ExecutionConfig.use`)."""
    return _EXECUTION.value


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the steps run (the same parameters and the same function under every value). None: the preset's value
    in :data:`DEFAULTS` (:meth:`for_preset`), else the default named in the help."""

    kernels: str = setting("auto", "which forms of the ops the steps run: auto (our Pallas kernels where the step "
                                   "is lowered for a TPU, XLA elsewhere), xla (XLA everywhere: no Pallas kernel; "
                                   "use it if a kernel misbehaves on your chip), pallas (the TPU kernels everywhere, "
                                   "in Pallas' interpreter off TPU: slow, for tests)", choices=KERNELS)
    remat: str | None = setting(None, "rematerialisation policy of the layer scan (default none; 1b, 3b: full)",
                                choices=REMAT_POLICIES)
    remat_group: int | None = setting(None, "with --remat: layers per rematerialised group; the layer scan keeps "
                                            "only each group's input for the backward pass (must divide "
                                            "num_layers; default 1)", check=POSITIVE_INT)
    scan_unroll: int | None = setting(None, "layers per iteration of the layer scan (lax.scan's unroll; with "
                                            "--remat-group, the layers within a group, then whole groups): fewer "
                                            "loop iterations and no stacking of the saved activations between "
                                            "the unrolled layers; >= num_layers runs them unrolled; compile time "
                                            "grows with it (default 1; small 4; base, 1b, 3b every layer)",
                                      check=POSITIVE_INT)
    loss_chunks: int | None = setting(None, "compute the LM head and cross-entropy over this many slices of the "
                                            "sequence, one at a time, so only one slice's full-vocabulary logits "
                                            "exist at once (saves memory for large vocabularies; must divide "
                                            "seq-len; default 1; 1b, 3b: 8)", check=POSITIVE_INT)

    def __post_init__(self) -> None:
        check_settings(self)

    def for_preset(self, preset: str | None) -> ExecutionConfig:
        """Every field left None set from :data:`DEFAULTS` for ``preset``, else to its plain default. The pair
        remat / remat_group is taken from the table only when neither is given."""
        table = dict(DEFAULTS.get(preset or "", {}))
        if self.remat is not None or self.remat_group is not None:
            table.pop("remat", None), table.pop("remat_group", None)
        plain = {"remat": "none", "remat_group": 1, "scan_unroll": 1, "loss_chunks": 1}
        return dataclasses.replace(self, **{name: table.get(name, default) for name, default in plain.items()
                                            if getattr(self, name) is None})

    def check(self, num_layers: int, seq_len: int) -> None:
        """ValueError (one line) when remat_group does not divide ``num_layers`` or loss_chunks ``seq_len``."""
        resolved = self.for_preset(None)
        if num_layers % resolved.remat_group:
            raise ValueError(f"--remat-group {resolved.remat_group} does not divide --num-layers {num_layers}")
        if seq_len % resolved.loss_chunks:
            raise ValueError(f"--loss-chunks {resolved.loss_chunks} does not divide --seq-len {seq_len}")

    @contextlib.contextmanager
    def use(self) -> Iterator[ExecutionConfig]:
        """A context manager: the steps traced within it run with these settings (None fields at their plain
        defaults)."""
        resolved = self.for_preset(None)
        with use_kernels(resolved.kernels), _EXECUTION(Execution(resolved.remat, resolved.remat_group,
                                                                 resolved.scan_unroll, resolved.loss_chunks)):
            yield resolved
