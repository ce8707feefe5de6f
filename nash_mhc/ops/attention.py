"""Causal softmax attention on one sequence (no batch axis; vmap for batches), and :func:`attend`, the attention
op the layers call: a batch, on the platform's fastest form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.kernels.tpu.splash import splash_block, splash_causal_attention
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.matmul import f32_einsum
from nash_mhc.sharding import per_shard_attention


@jaxtyped(typechecker=beartype)
def masked_attention(q: Float[Array, "query heads head_dim"], k: Float[Array, "key heads head_dim"],
                     v: Float[Array, "key heads head_dim"], mask: Bool[Array, "query key"]
                     ) -> Float[Array, "query heads head_dim"]:
    """softmax(q kᵀ / √K, restricted to ``mask``) v with float32 scores and softmax.

    Both matmuls take operands of q's and v's dtype and accumulate in float32, forward and backward (the
    float32 cotangents of the scores and the output are rounded to that dtype: :func:`f32_einsum`).

    Masked scores are -inf, so their probabilities are exactly 0. Every query row needs at least one
    unmasked key. The core of :func:`causal_attention` and of one-query incremental decoding.
    Rematerialised: the backward pass keeps q, k, v and recomputes the [H, Tq, Tk] probabilities instead
    of saving them (one extra QKᵀ matmul for no score-sized residuals).
    """
    return jax.checkpoint(_masked_attention, prevent_cse=False)(q, k, v, mask)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    out = _attention_core(*(_head_major(a) for a in (q, k, v)), mask)
    return _head_major(out)


def _head_major(a: jax.Array) -> jax.Array:
    """[T, H, K] ↔ [H, T, K]: both matmuls of :func:`_attention_core` then batch over the leading heads."""
    return jnp.swapaxes(a, 0, 1)


def _attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Head-major q [H, Tq, K], k and v [H, Tk, K], mask [Tq, Tk] → [H, Tq, K]."""
    head_dim = q.shape[-1]
    scores = f32_einsum("hqk,hsk->hqs", q, k, q.dtype)  # float32 scores; the backward matmuls stay in q's dtype
    scores = scores * (1.0 / head_dim**0.5)
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return f32_einsum("hqs,hsk->hqk", probs, v, v.dtype).astype(v.dtype)


CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_SEQ_MULTIPLE = 64
CUDNN_MIN_CAPABILITY = (8, 0)  # cuDNN's flash attention: Ampere and later


def cuda_flash_device() -> bool:
    """Whether JAX's default backend is an NVIDIA GPU that runs cuDNN's flash attention: a CUDA (not ROCm)
    platform, compute capability ≥ 8.0. A cuDNN call cannot even be traced elsewhere."""
    if jax.default_backend() != "gpu":
        return False
    device = jax.local_devices()[0]
    if "cuda" not in device.client.platform_version.lower():
        return False
    return tuple(int(x) for x in device.compute_capability.split(".")) >= CUDNN_MIN_CAPABILITY


def cudnn_usable(q: jax.Array) -> bool:
    """Whether :func:`cudnn_causal_attention` runs ``q`` [B, T, H, K] here: :func:`cuda_flash_device`, operands in
    bfloat16 / float16 (cuDNN's flash attention takes no float32), K ≤ 128 a multiple of 8, and T a multiple of
    64 (the lengths checked on a GPU: benchmarks/gpu_attention_check.py; others keep the XLA path)."""
    return (q.dtype in CUDNN_DTYPES and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0
            and q.shape[-3] % CUDNN_SEQ_MULTIPLE == 0 and cuda_flash_device())


def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's fused flash attention with the causal mask (NVIDIA GPUs): q, k, v [B, T, H, K] → [B, T, H, K].

    The function of :func:`causal_attention` (scale 1/√K, float32 scores, softmax and accumulation, operands and
    output in the inputs' dtype), computed block by block on chip: the [T, T] scores never reach HBM, and the
    backward pass recomputes them from q, k, v and the saved log-sum-exp. Masked keys get probability exactly
    0 (a change at key j never reaches a query i < j)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


MAX_QUERY_CHUNKS = 8
MIN_CHUNK = 64


def query_chunks(seq: int) -> int:
    """How many equal query chunks :func:`causal_attention` splits ``seq`` into (1 = no split).

    The most chunks (≤ 8) of at least 64 queries that divide ``seq``: chunk c only needs keys up to its
    own end, so 8 chunks compute 9/16 of the full score matrix and 4 chunks 5/8.
    """
    for chunks in range(min(MAX_QUERY_CHUNKS, seq // MIN_CHUNK), 1, -1):
        if seq % chunks == 0:
            return chunks
    return 1


@jaxtyped(typechecker=beartype)
def causal_attention(q: Float[Array, "seq heads head_dim"], k: Float[Array, "seq heads head_dim"],
                     v: Float[Array, "seq heads head_dim"]) -> Float[Array, "seq heads head_dim"]:
    """softmax(q kᵀ / √K + causal mask) v with float32 scores and softmax.

    Masked scores are -inf, so their probabilities are exactly 0 and a change at key j can never change
    the output at a query i < j, bit for bit. Causal block skipping: the queries are split into
    :func:`query_chunks` chunks and chunk c is scored only against keys [0, end of chunk c), so the
    all-masked upper blocks of the score matrix are never computed. Rematerialised as a whole: the
    backward pass keeps q, k, v and recomputes the probabilities chunk by chunk.
    """
    return jax.checkpoint(_block_causal, static_argnums=(3,), prevent_cse=False)(q, k, v, query_chunks(q.shape[0]))


def _block_causal(q: jax.Array, k: jax.Array, v: jax.Array, chunks: int) -> jax.Array:
    """The chunk loop of :func:`causal_attention`, slicing inside the checkpoint so only q, k, v are kept.

    q, k, v are made head-major once ([H, T, K]; the chunks slice them along T), not once per chunk: on the
    CPU each chunk's [T, H, K] slice was otherwise transposed for its matmul, 2.5 x the copying at 4 chunks."""
    q, k, v = (_head_major(a) for a in (q, k, v))
    seq = q.shape[1]
    size = seq // chunks
    outputs = []
    for chunk in range(chunks):
        start, end = chunk * size, (chunk + 1) * size
        mask = jnp.tril(jnp.ones((size, end), bool), k=start)  # query start+i sees keys j <= start+i
        outputs.append(_attention_core(q[:, start:end], k[:, :end], v[:, :end], mask))
    return _head_major(outputs[0] if chunks == 1 else jnp.concatenate(outputs, axis=1))


def attend(q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch seq heads head_dim"],
           v: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention of a batch: q, k, v [B, T, H, K] → [B, T, H, K].

    Lowered for TPU, JAX's shipped splash attention kernel (:func:`nash_mhc.kernels.tpu.splash.splash_causal_attention`)
    wherever its blocks tile T (a multiple of 128: :func:`nash_mhc.kernels.tpu.splash.splash_block`), for full attention
    and for every multiscale scale (a coarse scale is plain causal attention over its T / s_l coarse tokens); for
    an NVIDIA GPU (when JAX's default backend is one that runs it and the operands are bfloat16 / float16:
    :func:`cudnn_usable`), cuDNN's fused flash attention
    (:func:`cudnn_causal_attention`); both on each device's shard
    (:func:`nash_mhc.sharding.per_shard_attention`), so the [T, T] scores never reach HBM. Elsewhere (CPU, a
    float32 GPU step), and on TPU where no splash block divides T, the XLA path
    (:func:`causal_attention` per sequence). The choice is made for the step's
    platform (``dispatch.platform_dependent``), so one model serves every backend, except that the cuDNN
    branch exists only where the tracing host's default backend is such a GPU (a cuDNN call cannot be traced
    elsewhere: a step traced on a CPU host takes the XLA path on a GPU). All paths compute the same function
    with float32 scores and softmax; their rounding differs (block-wise online softmax; splash scales q by 1/√K
    in q's dtype before its kernel). Our own Pallas flash kernel (:mod:`nash_mhc.kernels.tpu.flash_attention`) is not
    used here: splash covers every length it covers.
    """
    xla = jax.vmap(causal_attention)
    kernels = {}
    if splash_block(q.shape[1]) is not None:
        kernels["tpu"] = per_shard_attention(splash_causal_attention)
    if cudnn_usable(q):
        kernels["cuda"] = per_shard_attention(cudnn_causal_attention)
    if not kernels:
        return xla(q, k, v)
    return platform_dependent(q, k, v, default=xla, name="attention", **kernels)
