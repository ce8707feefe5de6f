"""Checks of the GPU's attention path on an NVIDIA GPU (the CPU test-suite cannot run cuDNN):

    python benchmarks/gpu_attention_check.py

1. :func:`nash_mhc.ops.attention.attend` lowers to cuDNN's fused attention (a ``__cudnn$fmha`` custom call in
   the compiled module) for bfloat16 operands, at the fine and coarse lengths of ``base`` (T = 1024, 256, 64);
2. its output and gradients against the float32 XLA path (:func:`nash_mhc.ops.attention.causal_attention` of the
   same bfloat16 values cast to float32; a cotangent bfloat16 holds exactly), beside the bfloat16 XLA path's own
   error against that reference, and cuDNN against the bfloat16 XLA path;
3. causality bit for bit: keys and values from position j on replaced, outputs before j unchanged (operator),
   and the ``tiny`` model in bfloat16 (mhc + multiscale + nash, T = 64): changing token j keeps every logit
   before j bit-identical. Prints one line per check and exits 1 if one fails.
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from nash_mhc import LanguageModel, ModelConfig
from nash_mhc.ops.attention import attend, causal_attention, cuda_flash_device

# Largest |error| of the cuDNN path against the float32 reference, relative to the reference's largest |value|,
# allowed at most this multiple of the bfloat16 XLA path's own (both round q k^T operands and p to bfloat16).
SLACK = 4.0


def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def operator_checks(seq: int, failures: list[str]) -> None:
    keys = jax.random.split(jax.random.key(seq), 4)
    q, k, v = (jax.random.normal(key, (2, seq, 12, 64), jnp.float32).astype(jnp.bfloat16) for key in keys[:3])
    # exactly representable in bfloat16, so that the reference's gradients see the cotangent both bf16 paths see
    cotangent = jax.random.normal(keys[3], (2, seq, 12, 64), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    xla = jax.vmap(causal_attention)
    text = jax.jit(attend).lower(q, k, v).compile().as_text()
    check(f"T={seq} lowers to cuDNN", "__cudnn$fmha" in text, f"{text.count('__cudnn$fmha')} fmha custom calls",
          failures)

    def loss(fn, dtype):
        return lambda q, k, v: jnp.vdot(fn(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32),
                                        cotangent)

    reference = [jax.jit(xla)(*(a.astype(jnp.float32) for a in (q, k, v)))]
    reference += jax.jit(jax.grad(loss(xla, jnp.float32), argnums=(0, 1, 2)))(q, k, v)
    results = {}
    for label, fn in (("cuDNN", attend), ("XLA bf16", xla)):
        got = [jax.jit(fn)(q, k, v)] + list(jax.jit(jax.grad(loss(fn, jnp.bfloat16), argnums=(0, 1, 2)))(q, k, v))
        results[label] = got
        errors = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                  for g, r in zip(got, reference, strict=True)]
        if label == "cuDNN":
            cudnn_errors = errors
        else:
            worst = max(c / max(x, 1e-6) for c, x in zip(cudnn_errors, errors, strict=True))
            check(f"T={seq} cuDNN vs float32 reference", worst <= SLACK,
                  "relative max |error| of (out, dq, dk, dv): cuDNN "
                  + ", ".join(f"{e:.2e}" for e in cudnn_errors) + "; XLA bf16 " + ", ".join(f"{e:.2e}" for e in errors)
                  + f"; worst ratio {worst:.2f} (limit {SLACK})", failures)
    apart = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(r)))
             for a, b, r in zip(results["cuDNN"], results["XLA bf16"], reference, strict=True)]
    print(f"     T={seq} cuDNN vs XLA bf16: relative max |difference| " + ", ".join(f"{e:.2e}" for e in apart))
    j = seq // 3
    k2 = k.at[:, j:].set(jax.random.normal(keys[0], (2, seq - j, 12, 64)).astype(jnp.bfloat16))
    v2 = v.at[:, j:].set(jax.random.normal(keys[1], (2, seq - j, 12, 64)).astype(jnp.bfloat16))
    out, out2 = jax.jit(attend)(q, k, v), jax.jit(attend)(q, k2, v2)
    check(f"T={seq} operator causality", bool(jnp.array_equal(out[:, :j], out2[:, :j]))
          and not bool(jnp.array_equal(out[:, j:], out2[:, j:])), f"keys/values from {j} on replaced", failures)


def model_causality(failures: list[str]) -> None:
    config = ModelConfig.preset("tiny", dtype="bfloat16", num_layers=2)
    model = LanguageModel(config, key=jax.random.key(0))
    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_array))
    noisy = [x + 0.05 * jax.random.normal(key, x.shape)
             for x, key in zip(leaves, jax.random.split(jax.random.key(1), len(leaves)), strict=True)]
    model = eqx.combine(jax.tree.unflatten(treedef, noisy), model)
    params, static = eqx.partition(model, eqx.is_array)
    rng = np.random.default_rng(0)
    base = rng.integers(0, config.vocab_size, config.seq_len)
    rows = [base]
    for j in range(config.seq_len):
        changed = base.copy()
        changed[j:] = rng.integers(0, config.vocab_size, config.seq_len - j)
        changed[j] = (base[j] + 1) % config.vocab_size
        rows.append(changed)
    tokens = jnp.asarray(np.stack(rows))
    forward = jax.jit(lambda p, t: eqx.combine(p, static)(t).logits).lower(params, tokens).compile()  # once
    logits = np.asarray(forward(params, tokens).astype(jnp.float32))
    bad = [j for j in range(config.seq_len) if not np.array_equal(logits[j + 1, :j], logits[0, :j])]
    text = forward.as_text()
    check("tiny bf16 model causality", not bad and "__cudnn$fmha" in text,
          f"T={config.seq_len}, {text.count('__cudnn$fmha')} fmha calls; tokens changing an earlier logit: {bad}",
          failures)


def main() -> None:
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if not cuda_flash_device():
        sys.exit("gpu_attention_check.py needs an NVIDIA GPU of compute capability >= 8.0 as JAX's default backend "
                 f"(it is {jax.default_backend()!r})")
    failures: list[str] = []
    for seq in (1024, 256, 64):
        operator_checks(seq, failures)
    model_causality(failures)
    print("all checks passed" if not failures else f"{len(failures)} failed: {', '.join(failures)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
