"""What the TPU compiler's cost model charges for multiscale attention's block-wise downsampling, written five
ways, forward and forward + backward, at one ``1b`` layer's shapes on one v6e chip (16 x 2048 tokens, D = 2048,
bfloat16).

    JAX_PLATFORMS=cpu python benchmarks/downsample_probe.py [--slice v6e-1] [--batch 16] [--seq 2048] [--dim 2048]

Coarse token j = sum_o w[o] x[j s + o] for the block sizes s of the default scales (4 and 16):

- ``einsum``: ``...bod,od->...bd`` on x reshaped [..., T/s, s, D] (the compiler batches over D; the CPU and GPU
  form of :func:`nash_mhc.ops.multiscale.downsample`);
- ``chunked one-hot``: the TPU form before the kernels (``nash_mhc.ops.multiscale._downsample_chunked``, still
  used where no kernel tile fits), an exact permutation matmul per chunk of 128 positions that groups the offsets,
  then a float32 weighted sum of whole slabs;
- ``kernel``: :func:`nash_mhc.ops.multiscale.downsample` as lowered for TPU, the Pallas kernels of
  :mod:`nash_mhc.ops.downsample_kernel` (strided loads of each block's offsets), costed at their declared roofline;
- ``reduction``: float32 products summed over the s axis of [..., T/s, s, D];
- ``row slices``: x reshaped [..., T/s, s·D], the s offsets as [..., D] slices of each row, summed in float32.

Every figure is the compiler's estimate, not a measurement; the kernel's is its declared roofline, a lower bound
(docs/tpu.md). Of the XLA forms, alone, the row slices cost the least; in the ``1b`` mhc + multiscale + nash train
step they cost the most (2,940 ms per step, against 2,639 for strided slices and 2,596 for the einsum): reshaping
the normalised input to [..., T/s, s·D] changed the layouts the compiler chose for the RMSNorm and the stream
collapse that produce it. The chunked one-hot form was the first to beat the einsum in the step, the kernels beat
it (docs/tpu.md); judge a change of this kind by the step's estimate, not by this probe.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc.ops.multiscale import _downsample_chunked, downsample
from nash_mhc.training.estimate import CLOCK_HZ, step_cost
from nash_mhc.training.fit import topology_devices

F32 = jnp.float32


def einsum(x: jax.Array, w: jax.Array) -> jax.Array:
    *batch, seq, dim = x.shape
    return jnp.einsum("...bod,od->...bd", x.reshape(*batch, seq // w.shape[0], w.shape[0], dim), w.astype(x.dtype))


def row_slices(x: jax.Array, w: jax.Array) -> jax.Array:
    *batch, seq, dim = x.shape
    rows = x.reshape(*batch, seq // w.shape[0], w.shape[0] * dim)
    return sum(rows[..., o * dim:(o + 1) * dim].astype(F32) * w[o].astype(F32) for o in range(w.shape[0])
               ).astype(x.dtype)


def reduction(x: jax.Array, w: jax.Array) -> jax.Array:
    *batch, seq, dim = x.shape
    blocks = x.reshape(*batch, seq // w.shape[0], w.shape[0], dim)
    return jnp.sum(blocks.astype(F32) * w.astype(F32), axis=-2).astype(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slice", default="v6e-1", help="TPU topology whose first chip compiles the operation")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    devices = topology_devices(args.slice)[:1]
    kind = devices[0].device_kind
    mesh = Mesh(devices, ("x",))

    def shape(*dims: int, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, P()))

    def ms(f, *operands) -> float:
        return step_cost(jax.jit(f).lower(*operands).compile().as_text(), kind).seconds(CLOCK_HZ[kind]) * 1e3

    print(f"{args.slice} ({kind}), x [{args.batch}, {args.seq}, {args.dim}] bfloat16: estimated ms (the compiler's "
          "cost model)")
    print("| block size | form | forward | forward + backward |")
    print("| ---: | --- | ---: | ---: |")
    for block in (4, 16):
        x, w = shape(args.batch, args.seq, args.dim), shape(block, args.dim, dtype=F32)
        g = shape(args.batch, args.seq // block, args.dim)
        for name, f in (("einsum", einsum), ("chunked one-hot", _downsample_chunked), ("kernel", downsample),
                        ("reduction", reduction), ("row slices", row_slices)):
            def backward(x, w, g, f=f):
                return jax.vjp(f, x, w)[1](g)
            print(f"| {block} | {name} | {ms(f, x, w):.3f} | {ms(backward, x, w, g):.3f} |")


if __name__ == "__main__":
    main()
