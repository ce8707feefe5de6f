"""Training core: TrainConfig, optimizer, TrainState (born sharded) and the jitted step."""

from nash_mhc.training.config import TrainConfig
from nash_mhc.training.optim import current_learning_rate, decay_mask, make_optimizer, make_schedule
from nash_mhc.training.state import Batch, TrainState, init_train_state, reshard_state
from nash_mhc.training.step import eval_step, loss_terms, num_train_step_traces, train_step

__all__ = [
    "Batch", "TrainConfig", "TrainState", "current_learning_rate", "decay_mask", "eval_step",
    "init_train_state", "loss_terms", "make_optimizer", "make_schedule", "num_train_step_traces",
    "reshard_state", "train_step",
]
