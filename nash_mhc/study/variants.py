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


# Ablation v3 (nash_mhc.study.ablation3): a variant may also fix the aggregation's start and the sparsity weight,
# named <residual>+<attention>[@<scale prior>[-sp<sparsity weight>]] (mhc+nash@uniform, mhc+nash@scale0-sp0).
V3_VARIANTS = (BASELINE, "mhc+full", "mhc-lite+full",
               *(f"mhc+{a}@{p}" for p in ("scale0", "uniform") for a in ("nash", "gate", "convex")),
               "mhc+nash@scale0-sp0", "mhc+nash@uniform-sp0")


def spec3(variant: str) -> dict[str, object]:
    """``"mhc+nash@uniform-sp0"`` -> residual, attention, scale_prior (None: the training default), sparsity_weight
    (None: the default); ValueError for a name that is not of that form."""
    base, _, rest = variant.partition("@")
    residual, attention = split(base)
    prior, _, sparsity = rest.partition("-sp")
    if rest and (attention == "full" or prior not in ("scale0", "uniform")):
        raise ValueError(f"unknown variant {variant!r}: '@<prior>' goes with a multiscale attention and is scale0 "
                         f"or uniform (e.g. mhc+nash@uniform, mhc+nash@scale0-sp0)")
    try:
        weight = float(sparsity) if sparsity else None
    except ValueError:
        raise ValueError(f"unknown variant {variant!r}: '-sp<w>' takes a number (e.g. -sp0)") from None
    return {"residual": residual, "attention": attention, "scale_prior": prior or None, "sparsity_weight": weight}


def variant_flags3(variant: str) -> list[str]:
    """The training flags of a v3 variant (``variant_flags`` plus ``--scale-prior`` / ``--sparsity-weight``)."""
    spec = spec3(variant)
    flags = variant_flags(variant.partition("@")[0])
    if spec["scale_prior"]:
        flags += ["--scale-prior", str(spec["scale_prior"])]
    if spec["sparsity_weight"] is not None:
        flags += ["--sparsity-weight", f"{spec['sparsity_weight']:g}"]
    return flags


def label3(variant: str) -> str:
    """``"mhc / multiscale+nash, uniform start, sparsity 0"``."""
    spec = spec3(variant)
    text = label(variant.partition("@")[0])
    if spec["scale_prior"]:
        text += f", {spec['scale_prior']} start"
    if spec["sparsity_weight"] is not None:
        text += f", sparsity {spec['sparsity_weight']:g}"
    return text
