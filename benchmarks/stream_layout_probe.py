"""What the TPU compiler's cost model charges for mHC's per-token stream operations in the model's layout
(token-major X [tokens, n, D]) against a streams-major one (X [n, tokens, D], the n streams as separate slabs).

    JAX_PLATFORMS=cpu python benchmarks/stream_layout_probe.py [--slice v6e-1] [--tokens 32768] [--dim 2048]

Each operation is compiled alone for one chip of ``--slice`` (libtpu on this CPU host, no TPU) and its estimated
cycles are read as :func:`nash_mhc.training.estimate.step_cost` reads a train step. The shapes default to one
``1b`` layer on v6e-8 at the fit table's batch (16 x 2048 tokens per chip, n = 4, D = 2048). Every figure is the
compiler's estimate, not a measurement.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc.training.estimate import step_cost
from nash_mhc.training.fit import topology_devices

F32 = jnp.float32


def operations(n: int) -> list[tuple[str, str, object, object]]:
    """(name, what it computes, token-major function, streams-major function); x is bf16, h float32."""
    def pre_token(h, x):  # h [T, n], x [T, n, D]
        return jnp.einsum("tn,tnd->td", h, x.astype(F32)).astype(x.dtype)

    def pre_stream(h, x):  # h [n, T], x [n, T, D]: one slab per stream
        return sum(h[i][:, None] * x[i].astype(F32) for i in range(n)).astype(x.dtype)

    def rms_token(x):
        return jnp.mean(jnp.square(x.astype(F32)), axis=(1, 2))

    def rms_stream(x):
        return sum(jnp.sum(jnp.square(x[i].astype(F32)), axis=-1) for i in range(n)) / (x.shape[0] * x.shape[-1])

    def res_token(h, p, x, y):  # h [T, n, n], p [T, n], y [T, D]
        return (jnp.einsum("tij,tjd->tid", h, x.astype(F32)) + p[:, :, None] * y[:, None].astype(F32)).astype(x.dtype)

    def res_stream(h, p, x, y):  # h [n, n, T], p [n, T]
        xs = [x[j].astype(F32) for j in range(n)]
        return jnp.stack([(sum(h[i, j][:, None] * xs[j] for j in range(n)) + p[i][:, None] * y.astype(F32)
                           ).astype(x.dtype) for i in range(n)])

    return [("pre-mix", "u = sum_k H_pre[k] X[k]", pre_token, pre_stream),
            ("rms", "mean of X^2 over n*D per token", rms_token, rms_stream),
            ("res-mix", "X <- H_res X + H_post y", res_token, res_stream)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slice", default="v6e-1", help="TPU topology whose first chip compiles the operations")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    mesh = Mesh(topology_devices(args.slice)[:1], ("x",))
    t, n, d = args.tokens, args.streams, args.dim

    def shape(*dims: int, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, P()))

    def cycles(f, *operands) -> float:
        return step_cost(jax.jit(f).lower(*operands).compile().as_text()).cycles

    token_args = {"pre-mix": (shape(t, n, dtype=F32), shape(t, n, d)), "rms": (shape(t, n, d),),
                  "res-mix": (shape(t, n, n, dtype=F32), shape(t, n, dtype=F32), shape(t, n, d), shape(t, d))}
    stream_args = {"pre-mix": (shape(n, t, dtype=F32), shape(n, t, d)), "rms": (shape(n, t, d),),
                   "res-mix": (shape(n, n, t, dtype=F32), shape(n, t, dtype=F32), shape(n, t, d), shape(t, d))}
    print(f"{args.slice}, {t} tokens, n = {n}, D = {d}: estimated cycles (the compiler's cost model)")
    print("| operation | computes | token-major [T, n, D] | streams-major [n, T, D] | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, what, token_major, streams_major in operations(n):
        a, b = cycles(token_major, *token_args[name]), cycles(streams_major, *stream_args[name])
        print(f"| {name} | {what} | {a:.3g} | {b:.3g} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
