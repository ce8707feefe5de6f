"""nash_mhc: Nash-MHC language models in JAX + Equinox.

Manifold-constrained hyper-connections (n residual streams mixed by Sinkhorn doubly-stochastic matrices)
and causal multiscale attention combined per position by Nash-equilibrium aggregation.

Importing the package changes no JAX setting and starts no backend. The programs (``python -m nash_mhc.train``,
``evaluate``, ``generate``, ``export``, ``hardware``, ``study``) choose the platform when they start
(:func:`select_platform`); a library user on a CPU host with libtpu installed may call it before JAX starts.
"""

from nash_mhc import decoding, ops, training
from nash_mhc.config import ModelConfig
from nash_mhc.decoding import generate_tokens
from nash_mhc.execution import ExecutionConfig
from nash_mhc.model import Block, LanguageModel, ModelOutput
from nash_mhc.ops.dispatch import use_kernels
from nash_mhc.platforms import select_platform
from nash_mhc.run_config import RunConfig
from nash_mhc.sharding import MeshError, make_mesh
from nash_mhc.training import TrainConfig

__version__ = "0.3.0"


def load_exported(directory: str, *, device: object = None) -> LanguageModel:
    """The model of an export folder (``python -m nash_mhc.export``): see :func:`nash_mhc.exported.load_exported`."""
    from nash_mhc.exported import load_exported as load

    return load(directory, device=device)


__all__ = ["Block", "ExecutionConfig", "LanguageModel", "MeshError", "ModelConfig", "ModelOutput", "RunConfig",
           "TrainConfig", "make_mesh", "ops", "training", "__version__"]
__all__ += ["decoding", "generate_tokens", "load_exported", "select_platform", "use_kernels"]


def __getattr__(name: str) -> object:
    """``nash_mhc.generate``: the program's module, imported on first use (the library function is
    :func:`generate_tokens`; ``nash_mhc.generate`` was its name before version 0.3)."""
    if name == "generate":
        import importlib

        return importlib.import_module("nash_mhc.generate")
    raise AttributeError(f"module 'nash_mhc' has no attribute {name!r}")
