"""Pure functions of the Nash-MHC model: Sinkhorn, scale aggregation, RoPE, causal resampling, attention."""

from nash_mhc.ops.aggregation import combine, masked_softmax, nash_weights, normalised_entropy
from nash_mhc.ops.attention import causal_attention, masked_attention
from nash_mhc.ops.multiscale import available_mask, downsample, num_blocks, upsample_shifted
from nash_mhc.ops.rope import rope
from nash_mhc.ops.sinkhorn import sinkhorn

__all__ = [
    "available_mask",
    "causal_attention",
    "combine",
    "downsample",
    "masked_attention",
    "masked_softmax",
    "nash_weights",
    "normalised_entropy",
    "num_blocks",
    "rope",
    "sinkhorn",
    "upsample_shifted",
]
