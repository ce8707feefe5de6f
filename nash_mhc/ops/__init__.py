"""Pure functions of the Nash-MHC model: Sinkhorn, scale aggregation, RoPE, causal resampling, attention."""

from nash_mhc.ops.aggregation import nash_aggregate, nash_weights
from nash_mhc.ops.attention import causal_attention, masked_attention
from nash_mhc.ops.equilibrium import solve_equilibrium
from nash_mhc.ops.game import (
    combine,
    gate_weights,
    masked_softmax,
    normalised_entropy,
    output_scale,
    prior_weights,
    scale_game,
)
from nash_mhc.ops.multiscale import available_mask, choice_mask, downsample, num_blocks, renormalise, upsample_shifted
from nash_mhc.ops.rope import rope
from nash_mhc.ops.sinkhorn import sinkhorn

__all__ = [
    "available_mask",
    "choice_mask",
    "causal_attention",
    "combine",
    "gate_weights",
    "downsample",
    "masked_attention",
    "masked_softmax",
    "nash_aggregate",
    "nash_weights",
    "normalised_entropy",
    "num_blocks",
    "output_scale",
    "prior_weights",
    "renormalise",
    "rope",
    "scale_game",
    "sinkhorn",
    "solve_equilibrium",
    "upsample_shifted",
]
