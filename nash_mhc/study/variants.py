"""The model variants the studies compare, as ModelConfig fields (the training program's flags of the same names).

A variant is a residual mode x an attention variant, named ``<residual>+<attention>`` (``plain+full`` is the
baseline: one stream, full attention). ``nash``, ``gate`` and ``convex`` are multiscale attention with that
aggregation of the scales.
"""

from __future__ import annotations

RESIDUALS = ("plain", "hc", "mhc", "mhc-lite")  # the baseline first
ATTENTIONS = {  # variant name -> ModelConfig fields
    "full": {"attention": "full"},
    "nash": {"attention": "multiscale", "aggregation": "nash"},
    "gate": {"attention": "multiscale", "aggregation": "gate"},
    "convex": {"attention": "multiscale", "aggregation": "convex"},
}
ATTENTION_LABELS = {"full": "full", "nash": "multiscale+nash", "gate": "multiscale+gate",
                    "convex": "multiscale+convex"}
BASELINE = "plain+full"
FULL_MODEL = "mhc+nash"  # Nash-MHC as the paper of the project describes it


def attention_flags(variant: str) -> list[str]:
    """``--attention ... [--aggregation ...]`` of ``python -m nash_mhc.train`` for an attention variant."""
    return [word for field, value in ATTENTIONS[variant].items() for word in (f"--{field}", value)]


def split(variant: str) -> tuple[str, str]:
    """``"mhc+nash"`` → ``("mhc", "nash")``; ValueError naming the choices for anything else."""
    residual, _, attention = variant.partition("+")
    if residual not in RESIDUALS or attention not in ATTENTIONS:
        raise ValueError(f"unknown variant {variant!r}: use <residual>+<attention> with residual one of "
                         f"{', '.join(RESIDUALS)} and attention one of {', '.join(ATTENTIONS)} (e.g. {FULL_MODEL})")
    return residual, attention


def variant_flags(variant: str) -> list[str]:
    """``--residual R --attention A [--aggregation G]`` of a variant."""
    residual, attention = split(variant)
    return ["--residual", residual, *attention_flags(attention)]


def label(variant: str) -> str:
    """``"mhc / multiscale+nash"``: the residual and the attention as the reports write them."""
    residual, attention = split(variant)
    return f"{residual} / {ATTENTION_LABELS[attention]}"
