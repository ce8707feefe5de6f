"""nash_mhc: Nash-MHC language models in JAX + Equinox.

Manifold-constrained hyper-connections (n residual streams mixed by Sinkhorn doubly-stochastic matrices)
and causal multiscale attention combined per position by Nash-equilibrium aggregation.
"""

from nash_mhc import decoding, ops, training
from nash_mhc.config import ModelConfig
from nash_mhc.decoding import generate
from nash_mhc.model import Block, LanguageModel, ModelOutput
from nash_mhc.sharding import MeshError, make_mesh
from nash_mhc.training import TrainConfig

__version__ = "0.2.0"

__all__ = ["Block", "LanguageModel", "MeshError", "ModelConfig", "ModelOutput", "TrainConfig", "make_mesh", "ops",
           "training", "__version__"]
__all__ += ["decoding", "generate"]
