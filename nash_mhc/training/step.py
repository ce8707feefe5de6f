"""Loss, the jitted training step and the evaluation step.

Dimension letters: B global batch rows, b rows on one device, T predicted positions, V padded vocabulary,
Vt = V / tp the vocabulary columns on one device, k microbatches.

Collectives that matter are written by hand in ``jax.shard_map`` (everything else is GSPMD, see
:mod:`nash_mhc.sharding`):

* vocab-parallel cross-entropy over ``tp``: every device holds logits [b, T, Vt]. The row maximum is
  combined with ``pmax`` (gradient-free: the log-sum-exp does not depend on the shift), the sum of
  exponentials with ``psum``, and the target logit with ``psum`` (only the device that owns the target's
  column contributes). The full [B, T, V] logits are never gathered on one device.
* the loss sum, the token count and the sparsity (aux) sum are ``psum``-ed over ``("data", "fsdp")``, so
  the loss is the exact mask-weighted mean over every prediction of the global batch.

The sparsity term is the mean of the aggregation weights' normalised entropy over the positions that count:
position t of row b weighs ``mask[b, t]`` if it has a choice of scales (:func:`nash_mhc.ops.choice_mask`),
else 0, so padding and masked-out predictions never enter it.

Gradient accumulation: the batch is split *strided* into k microbatches (microbatch i = rows i, i+k, ...),
so each stays evenly sharded over the batch axes without communication, and scanned with ``lax.scan``.
The global token count N and sparsity weight N_aux are summed once up front (they do not depend on the
parameters); microbatch i contributes ``ce_sum_i / N + w · aux_sum_i / N_aux`` to the objective, so the
accumulated gradient is exactly the gradient of the single large-batch objective.

Non-finite loss or gradient norm: the update is discarded (``jnp.where`` per leaf, so model and optimizer
state stay bit-identical), ``step`` does not advance, ``skipped`` increments and ``metrics["skipped"]`` is 1.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PyTree

from nash_mhc import execution
from nash_mhc.model import LanguageModel, lm_head_logits
from nash_mhc.ops.multiscale import choice_mask
from nash_mhc.params import map_declared
from nash_mhc.sharding import BATCH_AXES, TP, batch_shards, batch_spec, constrain, make_mesh, shard_batch
from nash_mhc.training.optim import current_learning_rate
from nash_mhc.training.scale_use import scale_use_metrics, scale_use_sums
from nash_mhc.training.state import Batch, TrainState

Metrics = dict[str, Float[Array, ""]]


# ------------------------------------------------------------------------------------- loss pieces
def vocab_is_split(vocab: int, mesh: Mesh) -> bool:
    """Whether the logits' vocabulary dimension is split over ``tp`` (else it falls back to replicated)."""
    return vocab % mesh.shape[TP] == 0


def loss_terms(logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"],
               mask: Float[Array, "batch seq"], entropy: Float[Array, "batch seq"],
               aux_weight: Float[Array, "batch seq"], mesh: Mesh
               ) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """Global (Σ mask·NLL, Σ mask, Σ aux_weight·entropy) over the whole batch (:func:`cross_entropy_terms`,
    :func:`aux_term`).

    ``logits`` [B, T, V] float32 (padded columns already at -1e30), ``targets`` [B, T] ids < V, ``mask``
    [B, T] token weights, ``entropy`` [B, T] the aggregation entropy per position, ``aux_weight`` [B, T]
    its weights (:func:`aux_weights`). Results are replicated scalars.
    """
    return (*cross_entropy_terms(logits, targets, mask, mesh), aux_term(entropy, aux_weight, mesh))


def cross_entropy_terms(logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"],
                        mask: Float[Array, "batch seq"], mesh: Mesh) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Global (Σ mask·NLL, Σ mask), vocab-parallel in ``shard_map``: rows split over ``("data", "fsdp")``,
    vocabulary over ``tp`` (when V divides by it). Shapes as :func:`loss_terms`."""
    split = vocab_is_split(logits.shape[-1], mesh)
    vocab_axis = TP if split else None
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(BATCH_AXES, None, vocab_axis)))

    def local(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        local_vocab = logits.shape[-1]
        row_max = jnp.max(jax.lax.stop_gradient(logits), axis=-1)
        if split:
            row_max = jax.lax.pmax(row_max, TP)
            start = jax.lax.axis_index(TP) * local_vocab
        else:
            start = 0
        sum_exp = jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1)
        local_target = targets - start
        owned = (local_target >= 0) & (local_target < local_vocab)
        picked = jnp.take_along_axis(logits, jnp.clip(local_target, 0, local_vocab - 1)[..., None], axis=-1)
        target_logit = jnp.where(owned, picked[..., 0], 0.0)
        if split:
            sum_exp = jax.lax.psum(sum_exp, TP)
            target_logit = jax.lax.psum(target_logit, TP)
        nll = jnp.log(sum_exp) + row_max - target_logit
        ce_sum = jax.lax.psum(jnp.sum(nll * mask), BATCH_AXES)
        count = jax.lax.psum(jnp.sum(mask), BATCH_AXES)
        return ce_sum, count

    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES, None, vocab_axis), *[batch_spec(2)] * 2),
                         out_specs=(P(), P()), check_vma=True)(logits, targets, mask)


def aux_term(entropy: Float[Array, "batch seq"], aux_weight: Float[Array, "batch seq"], mesh: Mesh
             ) -> Float[Array, ""]:
    """Global Σ aux_weight·entropy: per-device sums ``psum``-ed over ``("data", "fsdp")``."""
    return jax.shard_map(lambda e, w: jax.lax.psum(jnp.sum(e * w), BATCH_AXES), mesh=mesh,
                         in_specs=(batch_spec(2), batch_spec(2)), out_specs=P(), check_vma=True)(entropy, aux_weight)


def aux_weights(mask: Float[Array, "*batch seq"], model: LanguageModel) -> Float[Array, "*batch seq"]:
    """Weight of each position in the sparsity term: its loss mask where it has a choice of scales, else 0."""
    c = model.config
    return mask * jnp.asarray(choice_mask(mask.shape[-1], c.block_sizes), mask.dtype)


def global_token_count(mask: Float[Array, "*batch seq"], mesh: Mesh) -> Float[Array, ""]:
    """Σ mask over the global batch: per-device sums ``psum``-ed over ``("data", "fsdp")``.

    ``mask`` is [B, T] or [k, B/k, T] (microbatches first, rows split over the batch axes).
    """
    spec = P(None, BATCH_AXES, None) if mask.ndim == 3 else batch_spec(2)
    return jax.shard_map(lambda m: jax.lax.psum(jnp.sum(m), BATCH_AXES), mesh=mesh, in_specs=spec,
                         out_specs=P(), check_vma=True)(mask)


def _mask_of(batch: Batch) -> jax.Array:
    if batch.loss_mask is None:
        return jnp.ones((batch.tokens.shape[0], batch.tokens.shape[1] - 1), jnp.float32)
    return jnp.asarray(batch.loss_mask).astype(jnp.float32)


def chunked_loss_terms(model: LanguageModel, h: Float[Array, "batch seq dim"], targets: Int[Array, "batch seq"],
                       mask: Float[Array, "batch seq"], entropy: Float[Array, "batch seq"],
                       aux_weight: Float[Array, "batch seq"], mesh: Mesh, chunks: int
                       ) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """:func:`loss_terms` of ``model.head_logits(h)`` over ``chunks`` equal slices of the positions, one at a
    time (``lax.scan``), so the logits of only T/chunks positions [B, T/chunks, V] exist at once, forward and
    backward. The results are sums over positions, so they add up.

    Differentiated, the cross-entropy is fused with its gradient (a custom VJP): each slice's logits are made
    once, and the gradients of Σ mask·NLL with respect to ``h`` and the head weight are formed in the same pass
    (``jax.vjp`` of the slice with a unit cotangent, the head's summed in float32 over the slices), then scaled by
    the incoming cotangent; undifferentiated (evaluation) only the loss is computed. (Rematerialising each slice
    instead made its logits twice, and the TPU compiler's estimate charged the LM head and loss 16 % of the `1b`
    step.)"""
    batch, seq, _ = h.shape
    config = model.config

    def split(a: jax.Array) -> jax.Array:  # [B, T, ...] -> [chunks, B, T/chunks, ...]
        return jnp.moveaxis(a.reshape(batch, chunks, seq // chunks, *a.shape[2:]), 1, 0)

    def merge(a: jax.Array) -> jax.Array:  # [chunks, B, T/chunks, ...] -> [B, T, ...]
        return jnp.moveaxis(a, 0, 1).reshape(batch, seq, *a.shape[3:])

    def terms(h_c: jax.Array, head: jax.Array, t_c: jax.Array, m_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        return cross_entropy_terms(lm_head_logits(h_c, head, config), t_c, m_c, mesh)

    zero = jnp.zeros((), jnp.float32)

    @jax.custom_vjp
    def fused(h: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], None]:
            h_c, t_c, m_c = xs
            return tuple(a + b for a, b in zip(carry, terms(h_c, head, t_c, m_c), strict=True)), None

        return jax.lax.scan(step, (zero, zero), (split(h), split(targets), split(mask)))[0]

    def forward(h: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[tuple, tuple]:
        def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], jax.Array]:
            ce_acc, count_acc, d_head = carry
            h_c, t_c, m_c = xs
            (ce, count), pullback = jax.vjp(lambda h_c, head: terms(h_c, head, t_c, m_c), h_c, head)
            d_h, d_head_c = pullback((jnp.ones_like(ce), jnp.zeros_like(count)))
            return (ce_acc + ce, count_acc + count, d_head + d_head_c), d_h

        init = (zero, zero, jnp.zeros_like(head))
        (ce, count, d_head), d_h = jax.lax.scan(step, init, (split(h), split(targets), split(mask)))
        return (ce, count), (merge(d_h), d_head)

    def backward(residuals: tuple, g: tuple) -> tuple:
        d_h, d_head = residuals
        g_ce = g[0]  # the token count has no gradient
        return ((g_ce * d_h.astype(jnp.float32)).astype(d_h.dtype), (g_ce * d_head).astype(d_head.dtype),
                None, None)

    fused.defvjp(forward, backward)
    ce_sum, count = fused(h, model.head_weight(), targets, mask)
    return ce_sum, count, aux_term(entropy, aux_weight, mesh)


def forward_terms(model: LanguageModel, inputs: Int[Array, "batch seq"], targets: Int[Array, "batch seq"],
                  mask: Float[Array, "batch seq"], mesh: Mesh, *, loss_chunks: int = 1
                  ) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""], dict[str, jax.Array]]:
    """Model forward on a (micro)batch → global (Σ mask·NLL, Σ mask, Σ aux weight·entropy, diagnostics).

    ``loss_chunks`` > 1 computes the LM head and cross-entropy a slice of the positions at a time
    (:func:`chunked_loss_terms`); 1 is the plain full-logits loss.
    diagnostics (gradient-free): ``scale_use`` the sums behind the scale-use metrics
    (:func:`~nash_mhc.training.scale_use.scale_use_sums`), ``res_diag`` the mean diagonal of H_res,
    ``nash_residual`` the largest equilibrium residual.
    """
    if loss_chunks == 1:
        out = model(inputs)  # native batch: [B, T] → logits [B, T, V]
        ce_sum, count, aux_sum = loss_terms(out.logits, targets, mask, out.entropy, aux_weights(mask, model),
                                            mesh)
    else:
        h, out = model.features(inputs)  # [B, T, D]: the logits are made chunk by chunk
        ce_sum, count, aux_sum = chunked_loss_terms(model, h, targets, mask, out.entropy, aux_weights(mask, model),
                                                    mesh, loss_chunks)
    diagnostics = {"scale_use": scale_use_sums(out.layer_weights, mask, model), "res_diag": jnp.mean(out.res_diag),
                   "nash_residual": jnp.max(out.nash_residual)}
    return ce_sum, count, aux_sum, jax.lax.stop_gradient(diagnostics)


# --------------------------------------------------------------------------------------- train step
def global_norm(tree: PyTree) -> Float[Array, ""]:
    """sqrt(Σ x²) over every array leaf, float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _check_batch(batch: Batch, mesh: Mesh, accum: int, loss_chunks: int = 1) -> None:
    if (batch.tokens.shape[1] - 1) % loss_chunks:
        raise ValueError(f"{batch.tokens.shape[1] - 1} positions per sequence cannot be split into --loss-chunks "
                         f"{loss_chunks} equal slices")
    rows = batch.tokens.shape[0]
    if not isinstance(batch.tokens, jax.Array):  # host rows: each process passes its own share
        rows *= jax.process_count()
    shards = batch_shards(mesh)
    if rows % (accum * shards):
        raise ValueError(f"batch of {rows} rows cannot be split into {accum} microbatch(es) over "
                         f"data x fsdp = {shards} devices: rows must be a multiple of {accum * shards}")


def _microbatches(x: jax.Array, k: int, mesh: Mesh) -> jax.Array:
    """[B, ...] → [k, B/k, ...] with microbatch i = rows i, i+k, i+2k, ... (stays evenly sharded)."""
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    spec = P(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@eqx.debug.assert_max_traces(max_traces=None)  # counts traces only (eqx.debug.get_num_traces)
def _train_step(batch: Batch, state: TrainState) -> tuple[TrainState, Metrics]:
    mesh, config = state.mesh, state.train_config
    k = config.grad_accum_steps
    weight = state.model.config.sparsity_weight
    tokens = jax.lax.with_sharding_constraint(jnp.asarray(batch.tokens), NamedSharding(mesh, batch_spec(2)))
    mask = jax.lax.with_sharding_constraint(_mask_of(batch), NamedSharding(mesh, batch_spec(2)))
    inputs = _microbatches(tokens[:, :-1], k, mesh)
    targets = _microbatches(tokens[:, 1:], k, mesh)
    masks = _microbatches(mask, k, mesh)
    count = global_token_count(masks, mesh)
    denom = jnp.maximum(count, 1.0)
    aux_denom = jnp.maximum(global_token_count(aux_weights(masks, state.model), mesh), 1.0)

    params, static = eqx.partition(state.model, eqx.is_inexact_array)

    def microbatch(carry: tuple[PyTree, jax.Array, jax.Array], xs: tuple[jax.Array, ...]
                   ) -> tuple[tuple[PyTree, jax.Array, jax.Array], dict[str, jax.Array]]:
        grad_acc, ce_acc, aux_acc = carry

        def objective(p: PyTree) -> tuple[jax.Array, tuple[jax.Array, jax.Array, dict[str, jax.Array]]]:
            ce_sum, _, aux_sum, diagnostics = forward_terms(eqx.combine(p, static), *xs, mesh,
                                                            loss_chunks=execution.current().loss_chunks)
            return ce_sum / denom + weight * aux_sum / aux_denom, (ce_sum, aux_sum, diagnostics)

        # Under the mesh, the model pins its activations' batch dimension (nash_mhc.sharding.constrain_batch),
        # forward and backward.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            (_, (ce_sum, aux_sum, diagnostics)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        grad_acc = jax.tree.map(jnp.add, grad_acc, constrain(grads, mesh))
        return (grad_acc, ce_acc + ce_sum, aux_acc + aux_sum), diagnostics

    zeros = constrain(jax.tree.map(jnp.zeros_like, params), mesh)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, ce_sum, aux_sum), diagnostics = jax.lax.scan(microbatch, init, (inputs, targets, masks))
    ce_loss = ce_sum / denom
    aux_loss = aux_sum / aux_denom
    loss = ce_loss + weight * aux_loss
    grad_norm = global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    updates, opt_state = state.optimizer.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    learning_rate = current_learning_rate(opt_state)

    def keep_if_finite(new: Any, old: Any) -> Any:
        return jnp.where(finite, new, old)

    new_params = jax.tree.map(keep_if_finite, new_params, params)
    opt_state = jax.tree.map(keep_if_finite, opt_state, state.opt_state)
    skipped = (~finite).astype(jnp.int32)
    new_state = TrainState(model=eqx.combine(new_params, static), opt_state=opt_state, anchor=state.anchor,
                           step=state.step + (1 - skipped), skipped=state.skipped + skipped,
                           optimizer=state.optimizer, train_config=config, mesh=mesh)
    new_state = constrain(new_state, mesh)
    metrics = {
        "loss": loss,
        "ce_loss": ce_loss,
        "aux_loss": aux_loss,
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
        "tokens": count,
        "skipped": skipped.astype(jnp.float32),
        **diagnostic_metrics(diagnostics, state.model),
        **travel(new_state.model, state.anchor),
    }
    return new_state, metrics


def diagnostic_metrics(diagnostics: dict[str, jax.Array], model: LanguageModel) -> Metrics:
    """Scalar metrics from the per-microbatch diagnostics [k, ...] of :func:`forward_terms` and the model.

    The scale-use metrics (:mod:`nash_mhc.training.scale_use`) of the whole batch; res_diag: the mean over
    microbatches; nash_residual: their maximum; nash_temperature: the learned temperature tau averaged over layers
    (only for the Nash aggregation).
    """
    metrics = scale_use_metrics(jax.tree.map(lambda a: jnp.sum(a, axis=0), diagnostics["scale_use"]))
    metrics["res_diag"] = jnp.mean(diagnostics["res_diag"])
    metrics["nash_residual"] = jnp.max(diagnostics["nash_residual"])
    temperatures = model.nash_temperatures()
    if temperatures is not None:
        metrics["nash_temperature"] = jnp.mean(temperatures)
    return metrics


def travel(model: LanguageModel, anchor: LanguageModel) -> Metrics:
    """``travel/<group>``: the RMS distance of each coefficient group's parameters (their declared group,
    :mod:`nash_mhc.params`) from their values in ``anchor`` (the start of training)."""
    start: dict[str, jax.Array] = {}
    map_declared(lambda path, leaf, decl, axes: start.__setitem__(path, leaf), anchor)
    sums: dict[str, list[Any]] = {}

    def add(path: str, leaf: Any, decl: Any, axes: Any) -> None:
        if decl is not None and decl.role.coefficient:
            total = sums.setdefault(decl.group, [jnp.zeros((), jnp.float32), 0])
            total[0] = total[0] + jnp.sum(jnp.square(leaf.astype(jnp.float32) - start[path]))
            total[1] += leaf.size

    map_declared(add, eqx.filter(model, eqx.is_inexact_array))
    return {f"travel/{group}": jnp.sqrt(total / count) for group, (total, count) in sorted(sums.items())}


_train_step_jit = eqx.filter_jit(_train_step, donate="all-except-first")


def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    """One optimizer step (``grad_accum_steps`` microbatches). ``state`` is donated: do not reuse it.

    Metrics (replicated float32 scalars): loss (= ce_loss + sparsity_weight·aux_loss), ce_loss (token-
    weighted mean over the global batch), aux_loss (the sparsity term, mask-weighted over the positions
    with a choice of scales), grad_norm (before clipping), learning_rate (used by this step), tokens
    (Σ loss_mask), skipped (1 if the update was skipped), with several attention scales scale_weight/<l>,
    scale_prior/<l>, scale_tv and their per-layer values (:mod:`nash_mhc.training.scale_use`), res_diag (mean
    diagonal of H_res), nash_residual (largest equilibrium residual max_l |w - BR(w)| over positions, layers and
    microbatches) and, for the Nash aggregation, nash_temperature (the learned tau averaged over layers).
    Host arrays in ``batch`` are placed with :func:`nash_mhc.sharding.shard_batch`.
    """
    _check_batch(batch, state.mesh, state.train_config.grad_accum_steps, execution.current().loss_chunks)
    return _train_step_jit(shard_batch(batch, state.mesh), state)


def num_train_step_traces() -> int:
    """How many times the training step has been traced in this process (for recompilation checks)."""
    return eqx.debug.get_num_traces(_train_step)


# ---------------------------------------------------------------------------------------- eval step
@eqx.filter_jit
def _eval_step(model: LanguageModel, batch: Batch, mesh: Mesh) -> Metrics:
    tokens = jax.lax.with_sharding_constraint(jnp.asarray(batch.tokens), NamedSharding(mesh, batch_spec(2)))
    mask = jax.lax.with_sharding_constraint(_mask_of(batch), NamedSharding(mesh, batch_spec(2)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model pins its activations' batch dim
        ce_sum, count, aux_sum, diagnostics = forward_terms(model, tokens[:, :-1], tokens[:, 1:], mask, mesh)
    ce_loss = ce_sum / jnp.maximum(count, 1.0)
    aux_loss = aux_sum / jnp.maximum(global_token_count(aux_weights(mask, model), mesh), 1.0)
    loss = ce_loss + model.config.sparsity_weight * aux_loss
    return {"loss": loss, "ce_loss": ce_loss, "aux_loss": aux_loss, "tokens": count,
            **scale_use_metrics(diagnostics["scale_use"])}


def eval_step(model: LanguageModel, batch: Batch, *, mesh: Mesh | None = None) -> Metrics:
    """Loss metrics of ``model`` on ``batch`` (no update): loss, ce_loss, aux_loss, tokens and, with several
    attention scales, the scale-use metrics (:mod:`nash_mhc.training.scale_use`).

    ``mesh`` (where the batch is split) defaults to the ambient mesh (``jax.set_mesh``; the training program
    sets its mesh once for the run), else to :func:`make_mesh`'s default: every device along ``data``.
    """
    if mesh is None:
        ambient = jax.sharding.get_mesh()
        mesh = make_mesh() if ambient.empty else ambient
    _check_batch(batch, mesh, 1)
    return _eval_step(model, shard_batch(batch, mesh), mesh)
