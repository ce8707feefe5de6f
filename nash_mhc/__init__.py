"""nash_mhc: Nash-MHC language models in JAX + Equinox.

Manifold-constrained hyper-connections (n residual streams mixed by Sinkhorn doubly-stochastic matrices)
and causal multiscale attention combined per position by Nash-equilibrium aggregation.
"""

from nash_mhc.platforms import select_platform

# Before anything can start a JAX backend: on a CPU host with libtpu installed, use the CPU quietly.
select_platform()

from nash_mhc import decoding, ops, training  # noqa: E402
from nash_mhc.config import ModelConfig  # noqa: E402
from nash_mhc.decoding import generate_tokens  # noqa: E402
from nash_mhc.model import Block, LanguageModel, ModelOutput  # noqa: E402
from nash_mhc.ops.dispatch import use_kernels  # noqa: E402
from nash_mhc.sharding import MeshError, make_mesh  # noqa: E402
from nash_mhc.training import TrainConfig  # noqa: E402

__version__ = "0.3.0"


def load_exported(directory: str, *, device: object = None) -> LanguageModel:
    """The model of an export folder (``python -m nash_mhc.export``): see :func:`nash_mhc.exported.load_exported`."""
    from nash_mhc.exported import load_exported as load

    return load(directory, device=device)


__all__ = ["Block", "LanguageModel", "MeshError", "ModelConfig", "ModelOutput", "TrainConfig", "make_mesh", "ops",
           "training", "__version__"]
__all__ += ["decoding", "generate_tokens", "load_exported", "use_kernels"]


def __getattr__(name: str) -> object:
    """``nash_mhc.generate``: the program's module (callable, deprecated, as the function of versions < 0.3)."""
    if name == "generate":
        import importlib

        return importlib.import_module("nash_mhc.generate")
    raise AttributeError(f"module 'nash_mhc' has no attribute {name!r}")
