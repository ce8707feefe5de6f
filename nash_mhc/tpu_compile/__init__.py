"""Compile-only tools for TPU slices, run on any host with libtpu installed: :mod:`.fit` compiles the real train
step for a TPU topology and reports per-chip memory; :mod:`.estimate` reads the compiled program's per-operation
cycle estimates into a step-time band (with :mod:`.hlo`, the optimised HLO's text, and :mod:`.mosaic`, the
matrix-unit FLOPs of each Pallas kernel). Nothing here executes a step."""
