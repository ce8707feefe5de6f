"""Incremental decoding with a cache, sampling, and the ``generate`` loop.

Dimension letters as in config.py: T positions (``length`` = the cache's maximum length), D d_model,
n streams, H heads, K head dim, L scales, s_l = r**l, V padded vocabulary, B samples.

What one decoding step needs from the past, per layer (the causal design makes every piece final as soon as
it is written):

* scale 0: the RoPE'd keys and the values of every earlier position (an ordinary KV cache);
* scale l ≥ 1: the keys/values of the *completed* coarse blocks, and the attention output of the last
  completed block. Coarse block j covers fine positions [j·s_l, (j+1)·s_l) of the attention sublayer's
  (normed) input, so it is complete — and is computed, once — exactly when its last fine token arrives. For
  that the cache keeps a ring of the last s_{L-1} normed inputs (the coarsest block; every finer block is a
  suffix of it; its coarse token is pooled and renormalised exactly as in the forward pass) and reads the
  block's values back from the scale-0 value cache. Fine position i then reads
  the output of block ⌊(i+1)/s_l⌋ − 1 (available iff i + 1 ≥ s_l), as the full forward's shifted upsampling
  does, and the Nash/convex aggregation is recomputed for the current position alone;
* the mHC streams: nothing. Every hyper-connection coefficient, norm and FFN is per token.

So :func:`decode_step` reproduces the full forward pass's logits at every position (to float32 rounding of
the one-row matmuls; tests check ≤ 1e-5 for every residual/attention/aggregation mode). The cache arrays have
a leading layer axis and the step scans over the stacked layers, like the forward. Shapes are fixed by
``length``, so a generation loop compiles once for a given maximum length whatever the prompt.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from nash_mhc.layers.attention import MultiscaleAttention
from nash_mhc.model import Block, LanguageModel
from nash_mhc.ops.attention import masked_attention
from nash_mhc.ops.dispatch import lowering_platform, platform_of
from nash_mhc.ops.multiscale import downsample, num_blocks

__all__ = ["DecodeCache", "Sampling", "decode_step", "generate", "init_cache", "num_decode_traces", "prefill",
           "sample_token"]


class DecodeCache(eqx.Module):
    """Decoding state of every layer; arrays have leading axes ``*lead`` = [layers] (or [B, layers]).

    keys, values: [H, length, K] scale-0 keys (after RoPE) and values of the positions written so far
      (head-major, so one query's scores read each head's keys contiguously).
    inputs: [ring, D] ring buffer of the attention sublayer's normed input, position p at p % ring
      (ring = s_{L-1}; 0 for ``attention="full"``).
    coarse_keys, coarse_values: per scale l ≥ 1, [H, ceil(length / s_l), K] of the completed blocks.
    coarse_outputs: [L - 1, H, K] attention output of the last completed block at each scale ≥ 1 (zeros
      before the first block completes).
    """

    keys: Float[Array, "*lead heads length head_dim"]
    values: Float[Array, "*lead heads length head_dim"]
    inputs: Float[Array, "*lead ring dim"]
    coarse_keys: tuple[Float[Array, "*lead heads _ head_dim"], ...]
    coarse_values: tuple[Float[Array, "*lead heads _ head_dim"], ...]
    coarse_outputs: Float[Array, "*lead coarse heads head_dim"]

    @property
    def max_len(self) -> int:
        return self.keys.shape[-2]


def init_cache(model: LanguageModel, max_len: int) -> DecodeCache:
    """An empty cache for positions 0..max_len-1 (arrays in the compute dtype, leading layer axis)."""
    c = model.config
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    dt = jnp.dtype(c.dtype)
    layers, heads, head_dim = c.num_layers, c.num_heads, c.head_dim
    coarse = c.block_sizes[1:]
    ring = c.coarsest_block if coarse else 0
    zeros = lambda *shape: jnp.zeros((layers, *shape), dt)  # noqa: E731
    return DecodeCache(
        keys=zeros(heads, max_len, head_dim),
        values=zeros(heads, max_len, head_dim),
        inputs=zeros(ring, c.d_model),
        coarse_keys=tuple(zeros(heads, num_blocks(max_len, s), head_dim) for s in coarse),
        coarse_values=tuple(zeros(heads, num_blocks(max_len, s), head_dim) for s in coarse),
        coarse_outputs=zeros(len(coarse), heads, head_dim),
    )


def _write(array: jax.Array, update: jax.Array, layer: Int[Array, ""], index: Int[Array, ""] | None = None,
           axis: int | None = None) -> jax.Array:
    """``array`` with ``array[layer]`` (or ``array[layer, ..., index, ...]``, index on ``axis``) = ``update``.

    One dynamic-update-slice: unlike ``.at[].set`` (whose out-of-bounds handling selects over the whole
    array) it is done in place under jit, so writing one row costs one row.
    """
    update = jnp.expand_dims(update, (0,) if axis is None else (0, axis)).astype(array.dtype)
    starts = [jnp.zeros((), jnp.int32)] * array.ndim
    starts[0] = layer
    if axis is not None:
        starts[axis] = index
    return jax.lax.dynamic_update_slice(array, update, starts)


def _seq_major(x: Float[Array, "heads seq head_dim"]) -> Float[Array, "seq heads head_dim"]:
    return jnp.transpose(x, (1, 0, 2))


def _attention_step(attn: MultiscaleAttention, x: Float[Array, "1 dim"], cache: DecodeCache, layer: Int[Array, ""],
                    position: Int[Array, ""]) -> tuple[Float[Array, "1 dim"], DecodeCache]:
    """Multiscale attention of the token at ``position`` in layer ``layer``; writes that layer's cache entries.

    Writes are single-row dynamic-update-slices of the stacked cache in the scan carry (in place under jit);
    the attention reads this layer's keys/values with the current row already written.
    """
    dt = jnp.dtype(attn.dtype)
    x = x.astype(dt)
    dim = x.shape[-1]
    length = cache.keys.shape[-2]
    v = attn.values(x)
    heads, head_dim = v.shape[1:]
    q, k = attn.queries_keys(0, x, position[None], length)
    keys = _write(cache.keys, k[0], layer, position, axis=2)
    values = _write(cache.values, v[0], layer, position, axis=2)
    layer_values = values[layer]
    fine = masked_attention(q, _seq_major(keys[layer]), _seq_major(layer_values),
                            (jnp.arange(length) <= position)[None])
    if attn.aggregation is None:
        return attn.output(fine), dataclasses.replace(cache, keys=keys, values=values)

    ring_size = cache.inputs.shape[-2]
    inputs = _write(cache.inputs, x[0], layer, position % ring_size, axis=1)
    outputs, available = [fine.reshape(1, dim)], [jnp.ones((), bool)]
    coarse_keys, coarse_values, coarse_outputs = [], [], []
    for level, block in enumerate(attn.block_sizes[1:], start=1):
        if block > length:  # no block of this scale completes within the cache: never available
            coarse_keys.append(cache.coarse_keys[level - 1])
            coarse_values.append(cache.coarse_values[level - 1])
            coarse_outputs.append(cache.coarse_outputs[layer, level - 1])
            outputs.append(jnp.zeros((1, dim), dt))
            available.append(jnp.zeros((), bool))
            continue
        # Block `last` = ⌊(i+1)/s⌋ − 1 is the last complete one; it completes now iff (i+1) % s == 0, and only
        # then is anything written (the values computed otherwise are discarded).
        complete = (position + 1) % block == 0
        last = jnp.maximum((position + 1) // block - 1, 0)
        start = jnp.maximum(position + 1 - block, 0)
        x_block = jax.lax.dynamic_slice_in_dim(inputs[layer], start % ring_size, block)
        v_block = _seq_major(jax.lax.dynamic_slice_in_dim(layer_values, start, block, axis=1)).reshape(block, dim)
        x_l = attn.coarse_input(level, x_block)
        v_l = downsample(v_block, attn.down[level - 1].astype(dt)).reshape(1, heads, head_dim)
        old_k, old_v = cache.coarse_keys[level - 1], cache.coarse_values[level - 1]
        q_l, k_l = attn.queries_keys(level, x_l, last[None], old_k.shape[-2])
        new_k = _write(old_k, jnp.where(complete, k_l[0], old_k[layer, :, last]), layer, last, axis=2)
        new_v = _write(old_v, jnp.where(complete, v_l[0], old_v[layer, :, last]), layer, last, axis=2)
        o_l = masked_attention(q_l, _seq_major(new_k[layer]), _seq_major(new_v[layer]),
                               (jnp.arange(old_k.shape[-2]) <= last)[None])[0]
        o_l = jnp.where(complete, o_l, cache.coarse_outputs[layer, level - 1])
        coarse_keys.append(new_k)
        coarse_values.append(new_v)
        coarse_outputs.append(o_l)
        outputs.append(o_l.reshape(1, dim))
        available.append(position + 1 >= block)
    combined = attn.aggregation(outputs, jnp.stack(available)[None]).output
    out = attn.output(combined.reshape(1, heads, head_dim))
    return out, DecodeCache(keys=keys, values=values, inputs=inputs, coarse_keys=tuple(coarse_keys),
                            coarse_values=tuple(coarse_values),
                            coarse_outputs=_write(cache.coarse_outputs, jnp.stack(coarse_outputs), layer))


def _block_step(block: Block, x: Float[Array, "1 n dim"], cache: DecodeCache, layer: Int[Array, ""],
                position: Int[Array, ""]) -> tuple[Float[Array, "1 n dim"], DecodeCache]:
    """One block on one token: the same two hyper-connected sublayers as ``Block.__call__``."""
    updated = {}

    def attention(normed: Float[Array, "1 dim"]) -> Float[Array, "1 dim"]:
        y, updated["cache"] = _attention_step(block.attn, normed, cache, layer, position)
        return y

    x, _ = block.attn_hc(x, attention, block.attn_norm)
    x, _ = block.ffn_hc(x, block.ffn, block.ffn_norm)
    return x, updated["cache"]


def decode_step(model: LanguageModel, cache: DecodeCache, token: Int[Array, ""], position: Int[Array, ""] | int
                ) -> tuple[Float[Array, "vocab"], DecodeCache]:
    """Feed ``token`` at ``position`` (positions 0..position-1 already in ``cache``).

    Returns the logits that predict position + 1 — equal to ``model(tokens).logits[position]`` — and the
    cache with ``position`` written. ``position`` must be < ``cache.max_len`` (not checked under jit). The
    layers run in one ``lax.scan`` whose carry holds the stacked cache, updated in place.
    """
    position = jnp.asarray(position, jnp.int32)
    x = model.embed(token[None])
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def layer(carry: tuple[jax.Array, DecodeCache], xs: tuple[Block, jax.Array]
              ) -> tuple[tuple[jax.Array, DecodeCache], None]:
        block_params, index = xs
        return _block_step(eqx.combine(block_params, static), *carry, index, position), None

    (x, cache), _ = jax.lax.scan(layer, (x, cache), (params, jnp.arange(model.config.num_layers)))
    return model.unembed(x)[0], cache


def prefill(model: LanguageModel, tokens: Int[Array, "seq"], cache: DecodeCache,
            length: Int[Array, ""] | int | None = None) -> tuple[Float[Array, "vocab"], DecodeCache]:
    """Feed ``tokens[:length]`` (default: all) at positions 0.. into an empty ``cache``.

    ``tokens`` may be padded to a fixed size with a traced ``length``, so one compilation serves every
    prompt length. Returns the logits after the last prompt token and the filled cache.
    """
    n = tokens.shape[0] if length is None else length

    def body(i: Int[Array, ""], carry: tuple[jax.Array, DecodeCache]) -> tuple[jax.Array, DecodeCache]:
        return decode_step(model, carry[1], tokens[i], i)

    logits = jnp.zeros((model.config.padded_vocab_size,), jnp.float32)
    return jax.lax.fori_loop(0, n, body, (logits, cache))


# ------------------------------------------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn. temperature 0 = greedy (argmax); top_k 0 and top_p 1 disable those filters."""

    temperature: float | int = 1.0
    top_k: int = 0
    top_p: float | int = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must lie in (0, 1], got {self.top_p}")


def sample_token(key: PRNGKeyArray, logits: Float[Array, "vocab"], sampling: Sampling, vocab_size: int
                 ) -> Int[Array, ""]:
    """Draw one id from float32 ``logits[:vocab_size]`` (the real vocabulary) with temperature, top-k, top-p."""
    logits = logits[:vocab_size].astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < vocab_size:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][-1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if sampling.top_p < 1:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p (always the top token).
        ordered = jnp.sort(logits)[::-1]
        probs = jax.nn.softmax(ordered)
        keep = (jnp.cumsum(probs) - probs < sampling.top_p) & jnp.isfinite(ordered)
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf))
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


# ------------------------------------------------------------------------------------------- generation
class _Carry(eqx.Module):
    """Generation state between steps: the cache (or, uncached, the token buffer), next-token logits."""

    state: DecodeCache | Int[Array, "batch length"]
    logits: Float[Array, "batch vocab"]
    position: Int[Array, ""]
    key: PRNGKeyArray


_TRACES = {"advance": 0}


def num_decode_traces() -> int:
    """How many times the per-token generation step has been traced (compiled) in this process."""
    return _TRACES["advance"]


@eqx.filter_jit
def _start(model: LanguageModel, prompt: Int[Array, "length"], length: Int[Array, ""], key: PRNGKeyArray,
           num_samples: int, use_cache: bool) -> _Carry:
    """Consume the (padded) prompt; the next-token logits and state, repeated for ``num_samples``."""
    if use_cache:
        logits, state = prefill(model, prompt, init_cache(model, prompt.shape[0]), length)
        state = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (num_samples, *a.shape)), state)
    else:
        logits = jax.lax.dynamic_index_in_dim(model(prompt).logits, length - 1, keepdims=False)
        state = jnp.broadcast_to(prompt[None], (num_samples, prompt.shape[0]))
    logits = jnp.broadcast_to(logits[None], (num_samples, logits.shape[0]))
    return _Carry(state=state, logits=logits, position=length, key=key)


@eqx.filter_jit(donate="all-except-first")
def _advance(model: LanguageModel, carry: _Carry, sampling: Sampling, use_cache: bool
             ) -> tuple[Int[Array, "batch"], _Carry]:
    """Sample each sample's next token, then feed it at ``carry.position`` to get the following logits."""
    _TRACES["advance"] += 1
    position = carry.position
    num_samples = carry.logits.shape[0]
    keys = jax.random.split(jax.random.fold_in(carry.key, position), num_samples)
    vocab = model.config.vocab_size
    tokens = jax.vmap(lambda k, lg: sample_token(k, lg, sampling, vocab))(keys, carry.logits)
    if use_cache:
        step = lambda c, t: decode_step(model, c, t, position)  # noqa: E731
        if num_samples == 1:  # no vmap: keeps the cache updates plain in-place row writes
            logits, state = step(jax.tree.map(lambda a: a[0], carry.state), tokens[0])
            logits, state = logits[None], jax.tree.map(lambda a: a[None], state)
        else:
            logits, state = jax.vmap(step)(carry.state, tokens)
    else:
        state = carry.state.at[:, position].set(tokens)
        logits = jax.vmap(lambda t: jax.lax.dynamic_index_in_dim(model(t).logits, position, keepdims=False))(state)
    return tokens, _Carry(state=state, logits=logits, position=position + 1, key=carry.key)


def generate_tokens(model: LanguageModel, prompt: Sequence[int | np.integer] | np.ndarray | Int[Array, "prompt"], *,
             max_new_tokens: int, temperature: float | int = 1.0, top_k: int = 0, top_p: float | int = 1.0,
             key: PRNGKeyArray | int = 0, num_samples: int = 1, use_cache: bool = True, max_len: int | None = None,
             eos_id: int | None = None, callback: Callable[[int, np.ndarray], None] | None = None
             ) -> np.ndarray:
    """Continue ``prompt`` (token ids) ``num_samples`` times; returns int32 [num_samples, steps] new ids.

    temperature 0 is greedy (deterministic); otherwise tokens are drawn with temperature, top-k (0 = off) and
    top-p (1 = off) from ``key`` (an int seed or a PRNG key), reproducibly. ``use_cache=False`` recomputes the
    full forward pass over the (padded) context for every token — the reference the cache is tested against.
    ``max_len`` (default ``model.config.seq_len``) fixes the compiled shapes: prompt + new tokens must fit in
    it. ``callback(step, ids)`` gets each step's new ids [num_samples] as soon as they are known (streaming).
    With ``eos_id``, a sample that produced it keeps emitting ``eos_id`` and generation stops early once
    every sample has, so ``steps`` may be < ``max_new_tokens``.
    """
    c = model.config
    max_len = c.seq_len if max_len is None else max_len
    ids = np.asarray(prompt).reshape(-1)
    if ids.size == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"prompt ids must be integers in [0, {c.vocab_size})")
    if max_new_tokens < 0 or num_samples < 1:
        raise ValueError(f"max_new_tokens must be >= 0 and num_samples >= 1, got {max_new_tokens}, {num_samples}")
    if ids.size + max_new_tokens > max_len:
        raise ValueError(f"prompt ({ids.size} tokens) + max new tokens ({max_new_tokens}) exceed the context of "
                         f"{max_len} tokens")
    sampling = Sampling(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    if isinstance(key, int):
        key = jax.random.key(key)
    padded = np.zeros((max_len,), np.int32)
    padded[:ids.size] = ids
    # The steps trace only the kernel-or-XLA branches of the platform they run on (nash_mhc.ops.dispatch).
    platform = platform_of((model, key))
    with lowering_platform(platform):
        carry = _start(model, jnp.asarray(padded), jnp.asarray(ids.size, jnp.int32), key, num_samples, use_cache)
        pending = _advance(model, carry, sampling, use_cache) if max_new_tokens else None
    steps: list[np.ndarray] = []
    done = np.zeros((num_samples,), bool)
    for step in range(max_new_tokens):
        tokens, carry = pending
        # Dispatch the next step before reading this one's ids: the device computes while the host streams.
        with lowering_platform(platform):
            pending = _advance(model, carry, sampling, use_cache) if step + 1 < max_new_tokens else None
        new = np.asarray(tokens)
        if eos_id is not None:
            new = np.where(done, eos_id, new).astype(np.int32)
            done |= new == eos_id
        steps.append(new)
        if callback is not None:
            callback(step, new)
        if eos_id is not None and done.all():
            break
    if not steps:
        return np.zeros((num_samples, 0), np.int32)
    return np.stack(steps, axis=1).astype(np.int32)


def generate(*args: Any, **kwargs: Any) -> np.ndarray:
    """Deprecated name of :func:`generate_tokens` (``nash_mhc.generate`` is the program); same arguments."""
    warnings.warn("nash_mhc.decoding.generate is deprecated: call nash_mhc.generate_tokens (same arguments)",
                  DeprecationWarning, stacklevel=2)
    return generate_tokens(*args, **kwargs)
