"""The math of Sinkhorn's rounds on matrices laid out [n, n, T] (the tokens minor), shared by the XLA path
(:mod:`nash_mhc.ops.sinkhorn`) and the Pallas TPU kernels (:mod:`nash_mhc.kernels.tpu.sinkhorn_kernel`).

    normalise(z, axis)              z - logsumexp(z) along axis (0: each column sums to 1 after exp; 1: each row)
    sinkhorn_round(z)               (c, r): c = the column step of z, r = the row step of c
    project(z, num_iters)           exp of num_iters rounds from z (the forward pass)
    walk_back(dr, c, r)             d z of one round, given d r and the round's iterates c and r
    walk_back_exp(dr, ec, er)       the same from exp(c) and exp(r)

With the tokens minor, every reduction is over a major axis of n entries: elementwise work across the tokens
that a compiler vectorises along them (on TPU: the 128 lanes; on CPU: the SIMD width).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normalise(z: jax.Array, axis: int) -> jax.Array:
    """z - logsumexp(z) along ``axis`` of [n, n, T], shifted by the maximum (finite for finite z)."""
    peak = jnp.max(z, axis=axis, keepdims=True)
    return z - (jnp.log(jnp.sum(jnp.exp(z - peak), axis=axis, keepdims=True)) + peak)


def sinkhorn_round(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One round on [n, n, T]: c (columns normalised), then r (c's rows normalised); r is the next iterate."""
    c = normalise(z, 0)
    return c, normalise(c, 1)


def project(z: jax.Array, num_iters: int) -> jax.Array:
    """exp of the iterate after ``num_iters`` rounds from z, [n, n, T]."""
    return jnp.exp(jax.lax.fori_loop(0, num_iters, lambda _, z: sinkhorn_round(z)[1], z))


def walk_back(dr: jax.Array, c: jax.Array, r: jax.Array) -> jax.Array:
    """The cotangent of a round's input z from that of its output r, all [n, n, T] (:func:`walk_back_exp` of
    exp(c) and exp(r))."""
    return walk_back_exp(dr, jnp.exp(c), jnp.exp(r))


def walk_back_exp(dr: jax.Array, exp_c: jax.Array, exp_r: jax.Array) -> jax.Array:
    """:func:`walk_back` from the exponentiated iterates exp(c), exp(r), all [n, n, T].

    Row step r = c - lse_j(c): dc = dr - exp(r) Σ_j dr. Column step c = z - lse_i(z): dz = dc - exp(c) Σ_i dc."""
    dc = dr - exp_r * jnp.sum(dr, axis=1, keepdims=True)
    return dc - exp_c * jnp.sum(dc, axis=0, keepdims=True)
