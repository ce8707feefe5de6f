"""A custom training loop on the library API, in about 50 lines: data, sharded state, jitted step, eval.

    python examples/custom_training_loop.py [--steps 30] [--preset tiny]
"""

from __future__ import annotations

import argparse
import time

import jax

import nash_mhc
from nash_mhc.data import make_datasets
from nash_mhc.training import Batch, eval_step, init_train_state, train_step

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
parser.add_argument("--preset", default="tiny", help="model preset")
parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
args = parser.parse_args()
nash_mhc.select_platform()  # the CPU, quietly, on a CPU host with libtpu installed (a no-op elsewhere)

model_config = nash_mhc.ModelConfig.preset(args.preset)
train_config = nash_mhc.TrainConfig(batch_size=args.batch_size, learning_rate=3e-3, warmup_steps=min(3, args.steps),
                                    total_steps=args.steps)
train_data, eval_data, tokenizer = make_datasets("stdlib", "bytes", model_config.seq_len, seed=0)
model_config = model_config.replace(vocab_size=tokenizer.vocab_size)

mesh = nash_mhc.make_mesh(data=-1)  # every local device on the data axis
state = init_train_state(model_config, train_config, mesh, key=jax.random.key(0))

start = time.perf_counter()
for step in range(args.steps):
    batch = Batch(tokens=train_data.batch_at(step, global_batch=args.batch_size))  # int32 [B, T+1]
    state, metrics = train_step(state, batch)  # the old state is donated: always rebind it
    if step % 10 == 0 or step == args.steps - 1:
        m = jax.device_get(metrics)
        print(f"step {step + 1:3d}  loss {float(m['loss']):.4f}  lr {float(m['learning_rate']):.2e}  "
              f"grad-norm {float(m['grad_norm']):.3f}  ({time.perf_counter() - start:.1f}s)")

evaluation = eval_step(state.model, Batch(tokens=eval_data.batch_at(0, global_batch=args.batch_size)))
print(f"eval loss {float(evaluation['ce_loss']):.4f} over {int(evaluation['tokens'])} tokens")
