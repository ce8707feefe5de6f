"""The `small` train step's matmul shapes timed alone on the CPU: JAX (XLA CPU) and, when installed, PyTorch.

    python benchmarks/cpu_matmul_rate.py [--batch-size 8] [--repeats 20]

For each product of the step (batch 8 x 256 tokens = 2048 rows, d_model D, FFN hidden F, padded vocabulary V) in
the layouts its forward and backward passes use (``nn``: x @ w; ``nt``: x @ wᵀ, an input gradient; ``tn``: xᵀ @ dy,
a weight gradient): the best and median GFLOP/s of ``--repeats`` calls, float32, after 3 warm-up calls. These are
the rates a matmul reaches with the machine to itself; ``benchmarks/cpu_profile.py`` prints each matmul's rate
inside the step, where it shares the cores with the step's other work.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np


def shapes(batch_size: int) -> list[tuple[str, int, int, int, str]]:
    """(what, M, K, N, layout) of the `small` step's matmuls: the product [M, K] x [K, N]."""
    from nash_mhc import ModelConfig

    config = ModelConfig.preset("small")
    rows, d, f, v = batch_size * config.seq_len, config.d_model, config.ffn_hidden, config.padded_vocab_size
    return [("projection q/k/v/o", rows, d, d, "nn"), ("FFN gate/up", rows, d, f, "nn"),
            ("FFN down", rows, f, d, "nn"), ("FFN gate/up input gradient", rows, f, d, "nt"),
            ("projection weight gradient", d, rows, d, "tn"), ("FFN weight gradient", d, rows, f, "tn"),
            ("LM head", rows, d, v, "nt")]


def product(x, y, *, lhs_t: bool, rhs_t: bool):
    """x @ y with either operand transposed first (``.T`` works on JAX arrays and PyTorch tensors alike)."""
    return (x.T if lhs_t else x) @ (y.T if rhs_t else y)


def rates(run, a, b, flops: int, repeats: int) -> tuple[float, float]:
    """(best, median) GFLOP/s of ``run(a, b)`` over ``repeats`` timed calls."""
    for _ in range(3):
        run(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(a, b)
        times.append(time.perf_counter() - start)
    return flops / min(times) / 1e9, flops / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.batch_size < 1 or args.repeats < 1:
        parser.error("--batch-size and --repeats must be at least 1")

    import jax

    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(f"float32 matmuls of the small step, batch {args.batch_size}; GFLOP/s best (median) of {args.repeats}")
    for what, m, k, n, layout in shapes(args.batch_size):
        a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=np.float32)
        b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=np.float32)
        flops = 2 * m * k * n
        transposed = functools.partial(product, lhs_t=layout[0] == "t", rhs_t=layout[1] == "t")
        jitted = jax.jit(transposed)
        best, median = rates(lambda x, y, f=jitted: f(x, y).block_until_ready(), jax.numpy.asarray(a),
                             jax.numpy.asarray(b), flops, args.repeats)
        line = f"{what:28s} [{m}, {k}] x [{k}, {n}] {layout}: JAX {best:6.1f} ({median:6.1f})"
        if torch is not None:
            best, median = rates(transposed, torch.from_numpy(a), torch.from_numpy(b), flops, args.repeats)
            line += f"   PyTorch {best:6.1f} ({median:6.1f}), {torch.get_num_threads()} threads"
        print(line)


if __name__ == "__main__":
    main()
