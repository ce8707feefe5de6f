"""How the programs run their steps, as opposed to what model they run: the ``kernels`` setting.

:class:`ExecutionConfig` is added to the flags of ``train``, ``evaluate`` and ``generate``; each program runs its
steps under :meth:`ExecutionConfig.use` (:func:`nash_mhc.ops.dispatch.use_kernels`, ``nash_mhc.use_kernels`` in
the library). It is not part of ``ModelConfig`` nor of a run's identity: a checkpoint written under one value
loads and resumes under another.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nash_mhc.ops.dispatch import KERNELS, use_kernels
from nash_mhc.settings import check_settings, setting


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the steps run (the same parameters and the same function under every value)."""

    kernels: str = setting("auto", "which forms of the ops the steps run: auto (our Pallas kernels where the step "
                                   "is lowered for a TPU, XLA elsewhere), xla (XLA everywhere: no Pallas kernel; "
                                   "use it if a kernel misbehaves on your chip), pallas (the TPU kernels everywhere, "
                                   "in Pallas' interpreter off TPU: slow, for tests)", choices=KERNELS)

    def __post_init__(self) -> None:
        check_settings(self)

    def use(self) -> Any:
        """A context manager: the steps traced within it run with these settings."""
        return use_kernels(self.kernels)
