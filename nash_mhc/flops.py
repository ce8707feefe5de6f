"""Every operation of a train step per token: :meth:`nash_mhc.ModelConfig.flops_per_token_all`.

``ModelConfig.flops_per_token`` is the MFU convention: the weight matmuls (6·N) and causal attention, nothing else.
Nash-MHC spends much of its step elsewhere (Sinkhorn, the stream collapse and update, the Nash solve, the
resampling between scales), so an "equal FLOPs" comparison on that count favours it. :func:`flops_per_token_all`
counts every arithmetic operation of the forward and backward pass, by these conventions:

* an elementwise arithmetic op (add, multiply, subtract, divide, max, compare, select) is 1 FLOP per element, as in
  XLA's cost model; a transcendental (exp, log, rsqrt, sigmoid, tanh) is 1 FLOP too (XLA lists those apart, as
  ``transcendentals``: compare with ``flops + transcendentals``); a reduction is 1 per element reduced; a matmul
  2 per multiply-add; copies, reshapes, transposes and gathers are free;
* backward = 2 × forward, for elementwise work as for matmuls (6·N): every forward op counts 3 times. Where the
  code rematerialises (the attention core and the scale aggregation run under ``jax.checkpoint``) their forward
  counts once more: 4 times;
* attention as the step runs it on the XLA path: the queries split into ``ops.attention.query_chunks`` chunks,
  each scored against the keys up to its end, a fraction (c + 1) / 2c of the square score matrix (the TPU and cuDNN
  kernels skip masked blocks at their own tile size); softmax and its mask 7 ops per score;
* the Nash solve at its configured ``nash_iters`` Newton steps per position: the TPU kernel runs all of them (done
  positions frozen); the XLA loop stops when every position of the batch is done, so there this is an upper bound.
  The ops of one step are counted from the solver's own code (:func:`nash_step_ops`: its jaxpr on one position);
* the optimizer (a per-step cost of a few FLOPs per parameter, not per token) is left out.

Per-element forward counts used below: RMSNorm 4 (square, sum, scale, gain) plus 3 per row (mean, eps, rsqrt);
the stream collapse Σ_k H_pre[k] X[k] 2 per stream element; the update H_res X + H_post ⊗ y 2n + 2 per stream
element; a log-sum-exp normalisation of an n × n Sinkhorn iterate 5 per entry (max, subtract, exp, sum, subtract:
2 per round, column then row); RoPE 3 per rotated element; SwiGLU 3 per hidden unit; softmax cross-entropy 5 per
logit.
"""

from __future__ import annotations

import functools
import math

# ``ModelConfig`` (nash_mhc.config) in the annotations is a name only: config.py calls this module, so importing it
# back, even for type checking, would make a cycle.

FREE_PRIMITIVES = {"broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims", "slice",
                   "concatenate", "transpose", "copy", "copy_p", "pjit", "iota", "stop_gradient"}


@functools.cache
def nash_step_ops(num_scales: int) -> tuple[int, int]:
    """(ops of one safeguarded Newton step, ops of the start and finish) of the Nash solver per position, counted
    on the jaxpr of :func:`nash_mhc.ops.equilibrium._equilibrium_entries` for one position (every value a scalar):
    1 per elementwise equation, loop bodies times their trip count, structural equations free."""
    import jax
    import jax.numpy as jnp

    from nash_mhc.ops import equilibrium

    def solve(gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array, iters: int) -> tuple:
        return equilibrium._equilibrium_entries(equilibrium._matrix_entries(gram), equilibrium._entries(prior),
                                                temperature, equilibrium._entries(available), 1e-6, iters, fixed=True)

    size = num_scales
    args = (jnp.ones((size, size)), jnp.ones((size,)), jnp.ones(()), jnp.ones((size,), bool))
    one, two = (_count(jax.make_jaxpr(solve, static_argnums=4)(*args, iters).jaxpr) for iters in (1, 2))
    return two - one, 2 * one - two


def _count(jaxpr: object) -> int:
    """Elementwise equations of ``jaxpr`` weighted by their output size, sub-jaxprs (loop bodies times their
    trip count) included."""
    total = 0
    for eqn in jaxpr.eqns:
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        subs = [p for p in eqn.params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
        if subs:
            total += trips * sum(_count(p if hasattr(p, "eqns") else p.jaxpr) for p in subs)
        elif eqn.primitive.name not in FREE_PRIMITIVES:
            total += max((math.prod(v.aval.shape) for v in eqn.outvars), default=0)
    return total


def attention_fraction(length: int) -> float:
    """Fraction of the square [T_l, T_l] score matrix the XLA path computes (``ops.attention.query_chunks``)."""
    from nash_mhc.ops.attention import query_chunks

    chunks = query_chunks(length)
    return (chunks + 1) / (2 * chunks)


def flops_breakdown(config: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) by part, module docstring's conventions. Sums to
    :func:`flops_per_token_all`; ``matmul`` is ``flops_per_token`` without its causal attention term."""
    T = config.seq_len if seq_len is None else seq_len
    D, n, L, H, F = config.d_model, config.num_streams, config.num_scales, config.num_heads, config.ffn_hidden
    blocks = config.block_sizes
    attention_mm = sum(6 * D * (T / s) ** 2 / T for s in blocks)
    parts = {"matmul": config.flops_per_token(T) - config.num_layers * attention_mm}
    # the LM head's padding columns and the loss: softmax cross-entropy over the padded vocabulary
    parts["head"] = 6 * D * (config.padded_vocab_size - config.vocab_size) + 3 * (5 * config.padded_vocab_size
                                                                                 + 4 * D + 3 + n * D)
    layer: dict[str, float] = {}
    # attention core per scale: QKᵀ and PV forward, 2x backward, QKᵀ again (remat); softmax 7 ops per score
    scores = [attention_fraction(T // s) * (T // s) ** 2 / T for s in blocks]  # per token, per head
    layer["attention"] = sum(14 * D * x + 4 * 7 * H * x for x in scores)
    layer["rope"] = 3 * 3 * 2 * D * sum(1 / s for s in blocks)
    layer["ffn"] = 3 * 3 * F
    layer["norms"] = 2 * 3 * (4 * D + 3)  # the two sublayers' pre-norms
    if L > 1:
        down = sum(2 * 2 * D + (4 * D + 3) / s for s in blocks[1:])  # x and V pooled, coarse x renormalised
        layer["resample"] = 3 * down
        gram = D * (8 * L + 2 * L * L)  # masking, scale, mean, centring, Gram matrix, weighted sum
        if config.aggregation == "nash":
            step, ends = nash_step_ops(L)
            solve = config.nash_iters * step + ends + 10 * L * L  # the implicit backward: one L x L solve
        elif config.aggregation == "gate":
            gram, solve = D * (4 * L + 2 * L), 8 * L  # scale and weighted sum; softmax (the gate's matmul: 6N)
        else:
            gram, solve = 2 * L * D, 8 * L
        layer["aggregation"] = 4 * (gram + solve)  # rematerialised: forward twice
    layer["residual"] = 2 * 3 * _connection_ops(config)
    for name, value in layer.items():
        parts[name] = config.num_layers * value
    return parts


def _connection_ops(config: ModelConfig) -> float:
    """Forward ops per token of one sublayer's residual connection (beside its Φ / Θ matmul, counted in 6·N)."""
    D, n = config.d_model, config.num_streams
    if n == 1:
        return D  # X + y
    collapse_update = 2 * n * D + (2 * n + 2) * n * D
    if config.residual == "hc":
        coefficients = n * (4 * D + 3) + 3 * n * (2 + n)  # each stream's norm, tanh and scale-and-shift
        return coefficients + collapse_update
    coefficients = 2 * n * D + 3 + config.num_hc_coefficients + 3 * 2 * n  # Σx², rsqrt scaling, sigmoids
    if config.residual == "mhc":
        mix = config.sinkhorn_iters * 2 * 5 * n * n + n * n  # log-domain rounds, then exp
    else:
        perms = math.factorial(n)
        mix = 3 * perms + 5 * perms + 2 * perms * n * n  # logits, softmax over n!, Σ_k p_k P_k
    return coefficients + mix + collapse_update


def flops_per_token_all(config: ModelConfig, seq_len: int | None = None) -> float:
    """Every arithmetic operation of the forward and backward pass per token (module docstring)."""
    return float(sum(flops_breakdown(config, seq_len).values()))
