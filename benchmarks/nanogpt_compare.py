"""Train-step speed against nanoGPT's PyTorch model in eager mode, at the ``small`` preset's shapes, alternated in
one process so that the shared machine's drift hits every contestant alike.

    python benchmarks/nanogpt_compare.py PATH/TO/nanoGPT/model.py [--rounds 20] [--batch-size 8] [--json OUT] \
        [--baseline-tree DIR] [--same-process]

nanoGPT's ``model.py`` is not part of this project: pass the path of a checkout's copy (``git clone
https://github.com/karpathy/nanoGPT``); it needs ``torch`` (``pip install -e ".[nanogpt]"``). Contestants, float32,
batch 8 x 256 tokens, one device / the default torch threads:

* nanoGPT: ``GPT(GPTConfig(block_size=256, vocab_size=384, n_layer=4, n_head=4, n_embd=256, dropout=0.0,
  bias=False))`` (384 = our padded vocabulary, so both LM heads are the same matmul), its own
  ``configure_optimizers`` (AdamW, weight decay 0.1, betas 0.9 / 0.95) and the step of its ``train.py``:
  forward with targets, ``backward``, ``clip_grad_norm_(1.0)``, ``step``, ``zero_grad(set_to_none=True)``;
* ours: :func:`nash_mhc.training.train_step` of ``small`` as plain + full, and as mhc + multiscale (the
  preset's default), AdamW with the same settings and clipping.

Each contestant runs in its own process (PyTorch's OpenMP threads and XLA's thread pool in one process slow
each other down: nanoGPT's step took 10 x longer next to a JAX step in the same process here), waiting on a pipe
between steps. Every contestant is compiled / warmed up first; then each round times one step of each, in turn,
so only one runs at a time. Reported: median step time and tokens/s of each, and the medians of the per-round
ratios. ``--baseline-tree DIR`` (a checkout of another commit: ``git worktree add DIR COMMIT``) adds that
commit's plain + full and mhc + multiscale as two more contestants, for a before/after in the same run.
``--same-process`` runs every contestant in this one process instead (the setup whose thread-pool fight the
separate processes avoid; kept to show it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def nanogpt_step(model_py: Path, batch_size: int, seq_len: int, vocab: int):
    """A callable running one nanoGPT training step in eager mode (returns the loss as a float)."""
    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    config = module.GPTConfig(block_size=seq_len, vocab_size=vocab, n_layer=4, n_head=4, n_embd=256, dropout=0.0,
                              bias=False)
    model = module.GPT(config)
    model.train()
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    data = torch.randint(0, 259, (batch_size, seq_len + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> float:
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def train_step_of(config, batch_size: int, learning_rate: float):
    """A callable running one of our train steps of ``config`` (compiled on the first call) on one device: random
    tokens, AdamW with weight decay 0.1, clipping; returns the loss without waiting for it."""
    import jax

    from nash_mhc import TrainConfig, make_mesh
    from nash_mhc.training import Batch, init_train_state, train_step

    train = TrainConfig(batch_size=batch_size, learning_rate=learning_rate, weight_decay=0.1, warmup_steps=1,
                        total_steps=100_000)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    holder = {"state": init_train_state(config, train, mesh, key=jax.random.key(0))}
    tokens = jax.random.randint(jax.random.key(1), (batch_size, config.seq_len + 1), 0, config.vocab_size)
    batch = Batch(tokens=tokens)

    def step() -> jax.Array:
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def nash_step(residual: str, attention: str, batch_size: int):
    """A callable running one of our ``small`` train steps (compiled on the first call), waiting for its loss."""
    import jax

    from nash_mhc import ModelConfig

    config = ModelConfig.preset("small", residual=residual, attention=attention)
    step = train_step_of(config, batch_size, learning_rate=1e-3)
    return (lambda: float(jax.block_until_ready(step()))), config


def build(name: str, model_py: str, batch_size: int):
    """The step callable of contestant ``name`` ("nanoGPT eager", "plain+full", "mhc+multiscale", optionally
    followed by " @ DIR": that tree's nash_mhc, imported first; only in a process of its own)."""
    if " @ " in name:
        name, tree = name.split(" @ ")
        sys.path.insert(0, tree)
    if name == "nanoGPT eager":
        from nash_mhc import ModelConfig

        config = ModelConfig.preset("small")
        step = nanogpt_step(Path(model_py), batch_size, config.seq_len, config.padded_vocab_size)
    else:
        residual, attention = name.split("+")
        step, _ = nash_step(residual, attention, batch_size)
    return step


def worker(name: str, model_py: str, batch_size: int, connection) -> None:
    """One contestant's process: build and warm up its step, then time one step per request."""
    step = build(name, model_py, batch_size)
    step()  # compile
    step()
    connection.send("ready")
    while connection.recv() == "step":
        start = time.perf_counter()
        step()
        connection.send(time.perf_counter() - start)
    connection.close()


def versions() -> str:
    import jax
    import torch

    return f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_py", type=Path, help="nanoGPT's model.py")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each per round)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout whose plain+full and "
                        "mhc+multiscale are timed too")
    parser.add_argument("--same-process", action="store_true", help="run every contestant in this process")
    args = parser.parse_args()
    import multiprocessing

    started = time.time()
    names = ["nanoGPT eager", "plain+full", "mhc+multiscale"]
    if args.baseline_tree is not None:
        if args.same_process:
            raise SystemExit("--baseline-tree needs separate processes")
        names += [f"plain+full @ {args.baseline_tree.resolve()}", f"mhc+multiscale @ {args.baseline_tree.resolve()}"]
    model_py = str(args.model_py.resolve())
    run: dict[str, object] = {}
    if args.same_process:
        for name in names:
            step = build(name, model_py, args.batch_size)
            step()
            step()
            run[name] = step
    else:
        context = multiprocessing.get_context("spawn")
        for name in names:  # one at a time: compiling next to another compile would only slow both
            here, there = context.Pipe()
            context.Process(target=worker, args=(name, model_py, args.batch_size, there), daemon=True).start()
            if here.recv() != "ready":
                raise SystemExit(f"{name} did not start")
            run[name] = here
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            if args.same_process:
                start = time.perf_counter()
                run[name]()
                times[name].append(time.perf_counter() - start)
            else:
                run[name].send("step")
                times[name].append(run[name].recv())
    for pipe in run.values():
        if not args.same_process:
            pipe.send("stop")
    from nash_mhc import ModelConfig

    tokens = args.batch_size * ModelConfig.preset("small").seq_len
    def per_round(numerator: str, denominator: str) -> list[float]:  # tokens/s ratio = inverse time ratio
        return [d / n for n, d in zip(times[numerator], times[denominator], strict=True)]

    ratios = {"plain+full / nanoGPT (tokens/s)": per_round("plain+full", "nanoGPT eager"),
              "mhc+multiscale / plain+full (tokens/s)": per_round("mhc+multiscale", "plain+full")}
    if args.baseline_tree is not None:
        before = [n for n in names if " @ " in n]
        ratios["baseline plain+full / nanoGPT (tokens/s)"] = per_round(before[0], "nanoGPT eager")
        ratios["baseline mhc+multiscale / baseline plain+full (tokens/s)"] = per_round(before[1], before[0])
        ratios["plain+full / baseline plain+full (tokens/s)"] = per_round("plain+full", before[0])
    figures = {
        "step_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "tokens_per_second": {name: tokens / statistics.median(t) for name, t in times.items()},
        "ratio_median": {name: statistics.median(r) for name, r in ratios.items()},
        "ratio_range": {name: [min(r), max(r)] for name, r in ratios.items()},
        "rounds": args.rounds, "same_process": args.same_process,
        "batch": f"{args.batch_size} x {tokens // args.batch_size}",
        "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "versions": versions(), "wall_seconds": round(time.time() - started, 1),
    }
    for name in names:
        print(f"{name:>16.60}: {figures['step_ms'][name]:7.1f} ms/step, {figures['tokens_per_second'][name]:8,.0f} "
              f"tokens/s (median of {args.rounds})")
    for name, value in figures["ratio_median"].items():
        low, high = figures["ratio_range"][name]
        print(f"{name}: {value:.2f} (per-round range {low:.2f}-{high:.2f})")
    print(f"{figures['machine']}; {figures['versions']}; wall time {figures['wall_seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
