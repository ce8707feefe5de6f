"""The version of the model's function and parameter tree, written into every checkpoint's metadata and every
exported model's ``config.json`` (:mod:`nash_mhc.exported`). Imports nothing, so reading it needs no training stack.
"""

# Version of the model's function and parameter tree, written into every checkpoint's metadata. Format 2
# (nash_mhc 0.2): the Nash aggregation is a converged equilibrium with a learned temperature, coarse-scale
# inputs are renormalised after pooling, and ``residual="hc"`` is the published Hyper-Connections.
MODEL_FORMAT = 2
FORMAT_CHANGES = {
    1: "since format 1 (nash_mhc 0.1) the Nash aggregation gained a learned temperature and solves for its "
       "equilibrium, coarse-scale inputs are renormalised after pooling, and residual 'hc' became the published "
       "Hyper-Connections, so its weights would compute a different model; retrain, or load it with "
       "nash_mhc 0.1",
}

__all__ = ["FORMAT_CHANGES", "MODEL_FORMAT"]
