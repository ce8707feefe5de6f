"""The model variants the studies compare, as ModelConfig fields (the training program's flags of the same names)."""

from __future__ import annotations

RESIDUALS = ("plain", "hc", "mhc")  # the baseline first
ATTENTIONS = {  # variant name -> ModelConfig fields
    "full": {"attention": "full"},
    "nash": {"attention": "multiscale", "aggregation": "nash"},
    "convex": {"attention": "multiscale", "aggregation": "convex"},
}
ATTENTION_LABELS = {"full": "full", "nash": "multiscale+nash", "convex": "multiscale+convex"}


def attention_flags(variant: str) -> list[str]:
    """``--attention ... [--aggregation ...]`` of ``python -m nash_mhc.train`` for an attention variant."""
    return [word for field, value in ATTENTIONS[variant].items() for word in (f"--{field}", value)]
