"""What the TPU compiler's cost model charges for one mHC hyper-connection, forward and forward + backward, at the
shapes of one ``1b`` sublayer on one v6e chip (16 x 2048 tokens, n = 4 streams, D = 2048, bfloat16 streams).

    JAX_PLATFORMS=cpu python benchmarks/stream_mix_probe.py [--slice v6e-1] [--tokens 32768] [--dim 2048]
    PYTHONPATH=<older checkout> JAX_PLATFORMS=cpu python benchmarks/stream_mix_probe.py     # the same, before

The sublayer is the identity and the loss sum(w ⊙ X'), so the figures are the connection's own: coefficients,
collapse, stream update and their gradients. Pallas kernels are costed at the chip's roofline from their declared
cost (:func:`nash_mhc.training.estimate.step_cost`). Every figure is the compiler's estimate, not a measurement;
"one pass" is the time to read the n bfloat16 stream slabs once at the chip's HBM bandwidth.
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc.layers.hyperconnection import HyperConnection
from nash_mhc.training.estimate import CLOCK_HZ, ROOFLINE, step_cost
from nash_mhc.training.fit import topology_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slice", default="v6e-1", help="TPU topology whose first chip compiles the connection")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    devices = topology_devices(args.slice)[:1]
    kind = devices[0].device_kind
    mesh = Mesh(devices, ("x",))
    n, t, d = args.streams, args.tokens, args.dim

    def shape(*dims: int, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, P()))

    hc = eqx.filter_eval_shape(lambda: HyperConnection("mhc", n, d, key=jax.random.key(0)))
    params, static = eqx.partition(hc, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    params = jax.tree.map(lambda a: shape(*a.shape, dtype=a.dtype), params)

    def forward(params, xs):
        return eqx.combine(params, static).streams_major(xs, lambda u: u)[0]

    def loss(params, xs, w):
        return jnp.sum(forward(params, xs) * w)

    xs = shape(n, t, d)
    costs = {"forward": (forward, (params, xs)),
             "forward + backward": (jax.grad(loss, argnums=(0, 1)), (params, xs, xs))}
    one_pass = n * t * d * 2 / ROOFLINE[kind][1]
    print(f"{args.slice} ({kind}), {t} tokens, n = {n}, D = {d}: estimated ms (the compiler's cost model); "
          f"one pass over the streams {one_pass * 1e3:.3f} ms")
    for name, (f, operands) in costs.items():
        cost = step_cost(jax.jit(f).lower(*operands).compile().as_text(), device_kind=kind)
        print(f"{name}: {cost.seconds(CLOCK_HZ[kind]) * 1e3:.3f} ms (Pallas kernels "
              f"{cost.kernel_cycles / CLOCK_HZ[kind] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
