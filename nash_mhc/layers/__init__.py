"""Equinox modules of the Nash-MHC model."""

from nash_mhc.layers.aggregation import ScaleAggregation
from nash_mhc.layers.attention import MultiscaleAttention
from nash_mhc.layers.ffn import SwiGLU
from nash_mhc.layers.hyperconnection import HyperConnection
from nash_mhc.layers.norm import RMSNorm

__all__ = ["HyperConnection", "MultiscaleAttention", "RMSNorm", "ScaleAggregation", "SwiGLU"]
