"""The version of the model's function and parameter tree, written into every checkpoint's metadata and every
exported model's ``config.json`` (:mod:`nash_mhc.exported`). Imports nothing, so reading it needs no training stack.
"""

# Version of the model's function and parameter tree. Format 3 (nash_mhc 0.3): the Nash game's temperature floor
# is tau + 1.05 lambda_max(C) (was tau + 2 |C|_F) and it is solved to tolerance, the aggregation prior starts on
# scale 0, the optimizer has a coefficient learning-rate group and the train state keeps the coefficients' initial
# values (their travel is logged).
MODEL_FORMAT = 3
FORMAT_CHANGES = {
    1: "since format 1 (nash_mhc 0.1) the Nash aggregation gained a learned temperature and solves for its "
       "equilibrium, coarse-scale inputs are renormalised after pooling, and residual 'hc' became the published "
       "Hyper-Connections, so its weights would compute a different model; retrain, or load it with "
       "nash_mhc 0.1",
    2: "since format 2 (nash_mhc 0.2) the Nash game's temperature floor is tau + 1.05 lambda_max(C) instead of "
       "tau + 2|C|_F (its weights would compute a different model), the optimizer has a coefficient learning-rate "
       "group and the train state keeps the coefficients' initial values (its optimizer state no longer fits); "
       "retrain, or load it with nash_mhc 0.2",
}

__all__ = ["FORMAT_CHANGES", "MODEL_FORMAT"]
