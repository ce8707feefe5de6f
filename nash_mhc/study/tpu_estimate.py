"""What a study would cost at full size on a TPU slice: an estimate from FLOPs, not a measurement.

    hours = sum over runs of  flops_per_token(variant) x tokens per run / (chips x peak FLOP/s per chip x MFU)

``flops_per_token`` is ``ModelConfig.flops_per_token`` (forward + backward model FLOPs), the peak is the
vendor's dense bf16 figure (:data:`nash_mhc.training.throughput.PEAK_FLOPS`) and the MFU an assumption
(:data:`ASSUMED_MFU`): the first real run's logged ``mfu`` replaces it, and every hour scales by the ratio.
"""

from __future__ import annotations

import dataclasses
import shlex

from nash_mhc.config import ModelConfig
from nash_mhc.study.variants import split

ASSUMED_MFU = 0.4  # of the bf16 peak; the multi-stream residual ops are memory-bound, so mhc variants may get less


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its name, chips and the peak dense bf16 FLOP/s of one chip."""

    name: str
    chips: int
    peak_per_chip: float


def v6e_8() -> Slice:
    from nash_mhc.training.throughput import PEAK_FLOPS

    return Slice("v6e-8", 8, PEAK_FLOPS["tpu v6e"])


def variant_config(preset: str, variant: str, **overrides: object) -> ModelConfig:
    """``preset`` with a variant's residual and attention fields and further ``overrides``."""
    from nash_mhc.study.variants import ATTENTIONS

    residual, attention = split(variant)
    return ModelConfig.preset(preset, residual=residual, **ATTENTIONS[attention], **overrides)


@dataclasses.dataclass(frozen=True)
class FullSize:
    """The full-size version of a study: its command, its total training FLOPs and what they are."""

    command: str
    flops: float
    what: str
    tpu: Slice

    def hours(self, mfu: float = ASSUMED_MFU) -> float:
        return self.flops / (self.tpu.chips * self.tpu.peak_per_chip * mfu) / 3600

    def lines(self, title: str) -> list[str]:
        """Markdown: the command and its estimated cost, labelled as an estimate."""
        total = self.hours()
        return [f"{title} (an **estimate** from FLOPs, not a measurement):", "", "```bash", self.command, "```", "",
                f"{self.what}: {self.flops:.3g} training FLOPs (FLOPs/token x tokens) / ({self.tpu.chips} chips x "
                f"{self.tpu.peak_per_chip / 1e12:.0f} TFLOP/s bf16 peak x an assumed MFU of {ASSUMED_MFU:.0%}) = "
                f"about **{total:,.0f} {self.tpu.name} hours** ({total / 24:,.1f} days). The MFU is an assumption: "
                f"take the `mfu` the first run logs and scale the hours by {ASSUMED_MFU} / that value."]


def command(study: str, flags: list[str]) -> str:
    return shlex.join(["python", "-m", "nash_mhc.study", study, *flags])
