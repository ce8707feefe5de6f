"""Our Pallas TPU kernels, one module per op family, and the wrapper of JAX's shipped splash attention kernel.

Each kernel has an XLA form in :mod:`nash_mhc.ops` that computes the same function; the op there chooses between
them per platform and per the ``kernels`` setting (:mod:`nash_mhc.ops.dispatch`). Nothing here is imported by a
layer: the layers call the ops. ``python -m nash_mhc.kernels check`` compares each kernel with its XLA form.
"""
