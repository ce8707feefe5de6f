"""Apply each model mutation to a scratch copy of the repository and list the quick tests it fails.

    python tests/mutations.py [NAME ...]      (all mutations when no name is given)

Each mutation is a literal text replacement in one file of a copy of the tracked files (the working tree is
never touched); the tests outside ``slow`` (``-m "not slow"``: the quick loop's and the kernels' own) of the
named test files then run on the copy. A mutation that no test catches is reported as SURVIVED and makes the exit
status 1. The table in docs/testing.md is this script's output.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = "tests/test_reference.py"
SINKHORN_ORDER = ("c = normalise(z, 0)\n    return c, normalise(c, 1)",
                  "c = normalise(z, 1)\n    return c, normalise(c, 0)")

V3_RULES, V3_TESTS = "nash_mhc/study/ablation3_protocol.py", "tests/test_study_ablation3.py"
DEPTH_RULES, DEPTH_TESTS = "nash_mhc/study/stability_protocol.py", "tests/test_stability_protocol.py"

# name: (file, [(old, new), ...], test files)
MUTATIONS = {
    "attention scale 1/K": ("nash_mhc/ops/attention.py", [("(1.0 / head_dim**0.5)", "(1.0 / head_dim)")],
                            [REFERENCE, "tests/test_golden.py"]),
    "bf16 off": ("nash_mhc/model.py", [("dtype=c.dtype, key=k2", 'dtype="float32", key=k2'),
                                       ("dtype=c.dtype, key=k4", 'dtype="float32", key=k4'),
                                       ("self.embedding[tokens].astype(self.config.dtype)", "self.embedding[tokens]"),
                                       ("head, config.dtype)", 'head, "float32")'),
                                       ("matmul_weights_in_compute_dtype(params, c.dtype)",
                                        'matmul_weights_in_compute_dtype(params, "float32")')],
                     ["tests/test_bf16.py"]),
    "Sinkhorn columns last": ("nash_mhc/ops/sinkhorn_rounds.py", [SINKHORN_ORDER],
                              [REFERENCE, "tests/test_sinkhorn.py", "tests/test_golden.py"]),
    "Sinkhorn backward skips the row step": ("nash_mhc/ops/sinkhorn_rounds.py",
                                             [("dc = dr - exp_r * jnp.sum(dr, axis=1, keepdims=True)",
                                               "dc = dr")],
                                             [REFERENCE, "tests/test_sinkhorn.py", "tests/test_sinkhorn_kernel.py"]),
    "Sinkhorn saves exp(r) as exp(c)": ("nash_mhc/ops/sinkhorn.py",
                                        [("return r, (jnp.exp(c), jnp.exp(r))", "return r, (jnp.exp(r), jnp.exp(r))")],
                                        [REFERENCE, "tests/test_sinkhorn.py"]),
    "collapse backward drops dH_post": ("nash_mhc/ops/stream_collapse.py",
                                        [("pullback((dh_pre, dh_post.astype(F32),",
                                          "pullback((dh_pre, 0.0 * dh_post.astype(F32),")],
                                        [REFERENCE, "tests/test_stream_collapse.py"]),
    "collapse dW keeps the last token tile": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                              [("dw_ref[j] += lax.dot_general", "dw_ref[j] = lax.dot_general")],
                                              ["tests/test_stream_collapse.py"]),
    "collapse u kernel reads stream 0 for all": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                 [("acc = acc + h[:, j:j + 1] * x_ref[j].astype(F32)",
                                                   "acc = acc + h[:, j:j + 1] * x_ref[0].astype(F32)")],
                                                 ["tests/test_stream_collapse.py"]),
    "update collapse collapses the un-updated X": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                   [("_collapse_kernel(pre_weights, eps, xu_ref, w_ref",
                                                     "_collapse_kernel(pre_weights, eps, x_ref, w_ref")],
                                                   ["tests/test_stream_collapse.py"]),
    "update backward reads X' for X": ("nash_mhc/ops/stream_collapse.py",
                                       [("collapsed, cotangents, update)",
                                         "collapsed, cotangents, (collapsed[0], *update[1:]))")],
                                       ["tests/test_stream_collapse.py"]),
    "update dx kernel takes the previous X for the collapse's": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                                 [("gs = _dx_tile(updated, g_ref",
                                                                   "gs = _dx_tile(xs, g_ref")],
                                                                 ["tests/test_stream_collapse.py"]),
    "update dx kernel's dH_res from the updated X": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                     [("= update_grads_tile(xs, gs, y, post)",
                                                       "= update_grads_tile(updated, gs, y, post)")],
                                                     ["tests/test_stream_collapse.py"]),
    "update dx keeps the first column tile's dH_res": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                       [("functools.reduce(jnp.add, mixing[1])", "mixing[1][0]")],
                                                       ["tests/test_stream_collapse.py"]),
    "collapse kernel's H_pre from half the sum of squares": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                             [("h = pre_weights(raw, ss, p_ref[...])",
                                                               "h = pre_weights(raw, 0.5 * ss, p_ref[...])")],
                                                             ["tests/test_stream_collapse.py"]),
    "H_res, not its transpose, applied to g": (
        "nash_mhc/ops/stream_tiles.py",
        [("acc = res[:, offset + j:offset + j + 1] * gs[0]", "acc = res[:, offset + j * n:offset + j * n + 1] * gs[0]"),
         ("k = offset + i * n + j", "k = offset + j * n + i")],
        [REFERENCE, "tests/test_stream_collapse.py", "tests/test_stream_mix.py"]),
    "deferred update's XLA rule applies H_res too": ("nash_mhc/ops/stream_slabs.py",
                                                    [("dx = g if defer else", "dx = g if False else")],
                                                    ["tests/test_stream_mix.py", "tests/test_stream_collapse.py"]),
    "collapse dx sums dW over a parallel axis": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                 [('("parallel", "arbitrary")))(*operands)',
                                                   '("parallel", "parallel")))(*operands)')],
                                                 ["tests/test_stream_collapse.py"]),
    "collapse dW not summed over shards": ("nash_mhc/ops/stream_collapse.py",
                                           [('sums=(None, "tokens", *(None,)', "sums=(None, None, *(None,)")],
                                           ["tests/test_stream_collapse.py"]),
    "collapse dx tiles ignore the update's budget": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                                    [("if tiles is None or blocks is not None or not update:",
                                                      "if True:")],
                                                    ["tests/test_stream_collapse.py"]),
    "collapse budgets ignore small VMEM": ("nash_mhc/kernels/tpu/stream_collapse_kernels.py",
                                           [('return nbytes // 4 if (settled_device_kind() or "")',
                                             'return nbytes // 1 if (settled_device_kind() or "")')],
                                           ["tests/test_stream_collapse.py"]),
    "RoPE backward rotates forward": ("nash_mhc/ops/rope.py", [("return rotate_tpu(g, cos, -sin),",
                                                                "return rotate_tpu(g, cos, sin),")],
                                      [REFERENCE, "tests/test_ops.py", "tests/test_golden.py"]),
    "platform_vjp backward takes the default form": ("nash_mhc/ops/dispatch.py",
                                                      [("tpu=pullback(tpu), default=pullback(default)",
                                                        "tpu=pullback(default), default=pullback(default)")],
                                                      ["tests/test_dispatch.py"]),
    "platform_vjp backward takes the TPU form": ("nash_mhc/ops/dispatch.py",
                                                 [("tpu=pullback(tpu), default=pullback(default)",
                                                   "tpu=pullback(tpu), default=pullback(tpu)")],
                                                 ["tests/test_dispatch.py"]),
    "aggregation reads every head-major tile at head 0": (
        "nash_mhc/kernels/tpu/aggregation_kernels.py", [("lambda t, d: (t // per_seq, d, t % per_seq, 0)",
                                                 "lambda t, d: (t // per_seq, 0, t % per_seq, 0)")],
        ["tests/test_aggregation_kernels.py"]),
    "aggregation splits head-major operands by position": (
        "nash_mhc/kernels/tpu/aggregation_kernels.py",
        [('HEADS, ROWS, SMALL = ("batch", "features", "seq", "head_dim")',
          'HEADS, ROWS, SMALL = ("seq", "features", "batch", "head_dim")')],
        ["tests/test_aggregation_kernels.py"]),
    "platform_vjp keeps both forms' residuals": ("nash_mhc/ops/dispatch.py",
                                                 [("    f.defvjp(forward, backward)\n    return f\n",
                                                   "    f.defvjp(forward, backward)\n    return lambda *a: "
                                                   "jax.lax.platform_dependent(*a, tpu=tpu, default=default)\n")],
                                                 ["tests/test_dispatch.py"]),
    "platform_dependent traces every branch under a mesh": ("nash_mhc/ops/dispatch.py",
                                                            [("    if branch is not None:\n", "    if False:\n")],
                                                            ["tests/test_dispatch.py"]),
    "platform_dependent ignores lowering_platform": ("nash_mhc/ops/dispatch.py",
                                                      [("return _mesh_platform() or _LOWERING_PLATFORM.value",
                                                        "return _mesh_platform()")],
                                                      ["tests/test_dispatch.py"]),
    "platform_dependent takes the default on a TPU mesh": ("nash_mhc/ops/dispatch.py",
                                                           [("branch = per_platform.get(platform, default)",
                                                             "branch = default")],
                                                           ["tests/test_dispatch.py"]),
    "kernels xla takes the platform's forms": ("nash_mhc/ops/dispatch.py",
                                               [('if kernels != "auto" and default is not None:', "if False:")],
                                               ["tests/test_kernels_setting.py"]),
    "kernels setting ignored by the TPU-only paths": ("nash_mhc/ops/dispatch.py",
                                                      [('return kernels == "pallas" or (kernels == "auto" and '
                                                        'settled_platform() == "tpu")',
                                                        'return settled_platform() == "tpu"')],
                                                      ["tests/test_kernels_setting.py"]),
    "kernels pallas compiles the kernels off TPU": ("nash_mhc/ops/dispatch.py",
                                                    [("interpret=interpret or interpreting()", "interpret=interpret")],
                                                    ["tests/test_kernels_setting.py"]),
    "train ignores --kernels": ("nash_mhc/train.py",
                                [("    with run_config.execution.use():", "    with ExecutionConfig().use():")],
                                ["tests/test_kernels_setting.py"]),
    "evaluate ignores --kernels": ("nash_mhc/evaluate.py", [("    with execution.use():  # --kernels",
                                                              "    with ExecutionConfig().use():")],
                                   ["tests/test_kernels_setting.py"]),
    "generate ignores --kernels": ("nash_mhc/generate.py", [("        with execution.use():  # --kernels",
                                                              "        with ExecutionConfig().use():")],
                                   ["tests/test_kernels_setting.py"]),
    "--kernels becomes part of the model config": ("nash_mhc/train.py",
                                                   [("model = ModelConfig.preset(program.preset, **parser.values("
                                                     "ModelConfig, given))",
                                                     "model = ModelConfig.preset(program.preset, **parser.values("
                                                     "ModelConfig, given)).replace(num_layers=1 + ('kernels' not "
                                                     "in given))")],
                                                   ["tests/test_kernels_setting.py"]),
    "RoPE kernel backward rotates forward": ("nash_mhc/kernels/tpu/rope_kernel.py",
                                             [("return _run(g, cos, -sin, rows, interpret)",
                                               "return _run(g, cos, sin, rows, interpret)")],
                                             ["tests/test_rope_kernel.py"]),
    "RoPE kernel swaps nothing": ("nash_mhc/kernels/tpu/rope_kernel.py",
                                  [("swapped = pltpu.roll(x, x.shape[-1] // 2, 1)", "swapped = x")],
                                  ["tests/test_rope_kernel.py"]),
    "RoPE kernel cost reads the tables per sequence": ("nash_mhc/kernels/tpu/rope_kernel.py",
                                                       [("+ 2 * seq * head_dim * 4)",
                                                         "+ 2 * sequences * seq * head_dim * 4)")],
                                                       ["tests/test_rope_kernel.py"]),
    "SwiGLU TPU backward drops silu's slope term": (
        "nash_mhc/ops/swiglu.py", [("d_gate = g32 * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))",
                                    "d_gate = g32 * up32 * sigmoid")], [REFERENCE, "tests/test_golden.py"]),
    "RoPE TPU half swap is the identity": ("nash_mhc/ops/rope.py",
                                           [("np.roll(np.eye(size), size // 2, axis=0)", "np.eye(size)")],
                                           [REFERENCE, "tests/test_ops.py"]),
    "upsampling shift off by one": ("nash_mhc/ops/multiscale.py",
                                    [("keep = seq_len - (block - 1)", "keep = seq_len - block"),
                                     ("jnp.zeros((*batch, block - 1, dim), y.dtype), repeated",
                                      "jnp.zeros((*batch, block, dim), y.dtype), repeated")],
                                    [REFERENCE, "tests/test_golden.py"]),
    "Nash temperature ignored": ("nash_mhc/ops/aggregation.py",
                                 [("effective = temperature.astype(dtype) + FLOOR",
                                   "effective = 1.0 + FLOOR")], [REFERENCE, "tests/test_nash.py"]),
    "Nash floor 2|C|_F (the old one)": ("nash_mhc/ops/aggregation.py",
                                        [("FLOOR * largest_eigenvalue(gram, available)",
                                          "2.0 * jnp.sqrt(jnp.sum(gram**2, axis=(-2, -1)) + 1e-12)")],
                                        [REFERENCE, "tests/test_nash.py"]),
    "Jacobi eigenvalue after one sweep": ("nash_mhc/ops/jacobi.py",
                                          [("fori_loop(0, size + EXTRA_SWEEPS, body", "fori_loop(0, 1, body")],
                                          ["tests/test_nash.py"]),
    "Jacobi gradient from a row of V": ("nash_mhc/ops/jacobi.py",
                                        [("[v[k][0] for k in range(size)]", "[v[0][k] for k in range(size)]"),
                                         ("jnp.where(larger, v[k][j], x)", "jnp.where(larger, v[j][k], x)")],
                                        ["tests/test_nash.py"]),
    "Nash gradient through the prior only": ("nash_mhc/ops/equilibrium.py",
                                             [("(d_gram, d_prior, d_temperature))",
                                               "(jnp.zeros_like(d_gram), d_prior, jnp.zeros_like(d_temperature)))")],
                                             ["tests/test_nash.py"]),
    "Nash loop stops on the whole batch": ("nash_mhc/ops/equilibrium.py",
                                           [("    return solve(gram, prior, temperature, available)",
                                             "    return _solve_positions(gram, prior, temperature, available,"
                                             " max_iters)")],
                                           ["tests/test_nash.py"]),
    "Nash kernel counts every scale available": ("nash_mhc/ops/equilibrium.py",
                                                [("[m > 0 for m in mask]", "[m >= 0 for m in mask]")],
                                                ["tests/test_positions_kernel.py"]),
    "positions kernel cost counts a loop once": ("nash_mhc/kernels/tpu/positions_kernel.py",
                                                 [('.jaxpr), eqn.params["length"]', ".jaxpr), 1")],
                                                 ["tests/test_positions_kernel.py"]),
    "stream copies' gradient rounds each addition": ("nash_mhc/ops/stream_copies.py",
                                                     [("else summed(g, g.dtype),)",
                                                       "else g[0] + g[1] + g[2] + g[3],)")],
                                                     ["tests/test_stream_copies.py"]),
    "stream copies kernel writes one stream": ("nash_mhc/kernels/tpu/stream_copies_kernel.py",
                                               [("for i in range(x_ref.shape[0]):", "for i in range(1):")],
                                               ["tests/test_stream_copies.py"]),
    "stream sum kernel rounds each addition": ("nash_mhc/kernels/tpu/stream_copies_kernel.py",
                                               [("h_ref[...] = slab_sum(x_ref[...]).astype(h_ref.dtype)",
                                                 "h_ref[...] = sum(x_ref[...]).astype(h_ref.dtype)")],
                                               ["tests/test_stream_copies.py"]),
    "stream copies' gradient never sums on the TPU": ("nash_mhc/ops/stream_copies.py",
                                                      [("else summed(g, g.dtype),)",
                                                        "else slab_sum(g).astype(g.dtype),)")],
                                                      ["tests/test_stream_copies.py"]),
    "stream copies cost reads h n times": ("nash_mhc/kernels/tpu/stream_copies_kernel.py",
                                           [("(in_bytes + n * out_bytes)", "n * (in_bytes + out_bytes)")],
                                           ["tests/test_stream_copies.py"]),
    "Nash backward drops the sum's gradient": ("nash_mhc/ops/aggregation.py",
                                               [("(d + weights[..., s, None] * d_sum)", "(d + 0.0 * d_sum)")],
                                               [REFERENCE, "tests/test_nash.py"]),
    "Nash Gram kernel centres unavailable scales": ("nash_mhc/kernels/tpu/aggregation_kernels.py",
                                                     [("(x - mean) * m for x, m in", "(x - mean) for x, m in")],
                                                     ["tests/test_aggregation_kernels.py"]),
    "Nash combine kernel reads one weight": ("nash_mhc/kernels/tpu/aggregation_kernels.py",
                                             [("weights[..., s:s + 1] * x", "weights[..., 0:1] * x")],
                                             ["tests/test_aggregation_kernels.py"]),
    "Nash pullback kernel drops the mean's share": ("nash_mhc/kernels/tpu/aggregation_kernels.py",
                                                    [("d - d_mean + square * x", "d + square * x")],
                                                    ["tests/test_aggregation_kernels.py"]),
    "Nash kernels' backward ignores the scale floor": ("nash_mhc/ops/aggregation.py",
                                                       [("jnp.where(kept, d_scale, 0.0)", "d_scale")],
                                                       ["tests/test_aggregation_kernels.py"]),
    "downsampling kernel reads offset 0 twice": ("nash_mhc/kernels/tpu/downsample_kernel.py",
                                                 [("wide_ref[pl.ds(o, coarse, stride=block), :] * w[o:o + 1, :]",
                                                   "wide_ref[pl.ds(0, coarse, stride=block), :] * w[o:o + 1, :]")],
                                                 ["tests/test_downsample_kernel.py"]),
    "downsampling backward writes dx before reading x": ("nash_mhc/kernels/tpu/downsample_kernel.py",
                                                         [("    gs = [g_ref[...].astype(F32) for g_ref in g_refs]\n",
                                                           "    gs = [g_ref[...].astype(F32) for g_ref in g_refs]\n"
                                                           "    wide_ref[pl.ds(0, gs[0].shape[0], "
                                                           "stride=ws[0].shape[0]), :] = gs[0] * ws[0][0:1, :]\n")],
                                                         ["tests/test_downsample_kernel.py"]),
    "downsampling levels' dx keeps the last level's": ("nash_mhc/kernels/tpu/downsample_kernel.py",
                                                       [("wide_ref[at, :] = part if level == 0 else "
                                                         "wide_ref[at, :] + part", "wide_ref[at, :] = part")],
                                                       ["tests/test_downsample_kernel.py"]),
    "downsampling cost fetches w once per tile": ("nash_mhc/kernels/tpu/downsample_kernel.py",
                                                  [("x, w = elems * x_bytes, sum(blocks) * dim * w_bytes",
                                                    "x, w = elems * x_bytes, sum(blocks) * dim * w_bytes * "
                                                    "(seq // rows) * sequences")],
                                                  ["tests/test_downsample_kernel.py"]),
    "downsampling levels' cost counts no sum": ("nash_mhc/kernels/tpu/downsample_kernel.py",
                                                [("3 * elems * levels + elems * (levels - 1)", "3 * elems * levels")],
                                                ["tests/test_downsample_kernel.py"]),
    "multiscale downsamples the levels apart on TPU": ("nash_mhc/ops/multiscale.py",
                                                       [("min(blocks) > 1 and tpu_kernels()",
                                                         "min(blocks) > 1 and False")],
                                                       ["tests/test_downsample_kernel.py"]),
    "flash dQ kernel's D without dO": ("nash_mhc/kernels/tpu/flash_attention.py",
                                       [("jnp.sum(od_ref[...].astype(F32) * do_ref[...].astype(F32), axis=1",
                                         "jnp.sum(od_ref[...].astype(F32), axis=1")],
                                       ["tests/test_flash_attention.py"]),
    "flash cost reads O in dK, dV, not dQ": ("nash_mhc/kernels/tpu/flash_attention.py",
                                             [("3 * one + 2 * rows + 2 * visited + one, flops=",
                                               "2 * one + 2 * rows + 2 * visited + one, flops=")],
                                             ["tests/test_flash_attention.py"]),
    "splash causal mask offset 1": ("nash_mhc/kernels/tpu/splash.py",
                                    [("mask_lib.CausalMask((seq, seq))", "mask_lib.CausalMask((seq, seq), offset=1)")],
                                    ["tests/test_splash.py"]),
    "splash q unscaled": ("nash_mhc/kernels/tpu/splash.py", [("q = q * jnp.asarray(head_dim**-0.5, q.dtype)", "q = q")],
                          ["tests/test_splash.py"]),
    "splash cost counts the batch twice": ("nash_mhc/kernels/tpu/splash.py",
                                           [("kernel_costs(1, seq, heads", "kernel_costs(q.shape[0], seq, heads")],
                                           ["tests/test_splash.py"]),
    "splash keeps its xprof metadata": ("nash_mhc/kernels/tpu/splash.py",
                                        [('options.pop("metadata", None)', "options")],
                                        ["tests/test_splash.py"]),
    "upsampling kernel shifts nothing": ("nash_mhc/kernels/tpu/upsample_kernel.py",
                                         [("jnp.where(row == 0, previous, pltpu.roll(y, shift=1, axis=0))", "y")],
                                         ["tests/test_upsample_kernel.py"]),
    "upsampling backward drops the next tile's share": ("nash_mhc/kernels/tpu/upsample_kernel.py",
                                                        [("jnp.where(pl.program_id(2) < pl.num_programs(2) - 1, "
                                                          "first, 0.0)", "0.0 * first")],
                                                        ["tests/test_upsample_kernel.py"]),
    "upsampling cost counts no edge rows": ("nash_mhc/kernels/tpu/upsample_kernel.py",
                                            [("edge = tiles * EDGE * dim", "edge = 0")],
                                            ["tests/test_upsample_kernel.py"]),
    "gate reads scale 0 alone": ("nash_mhc/ops/game.py",
                                 [("for m, x in enumerate(o))", "for m, x in enumerate(o[:1]))")],
                                 [REFERENCE, "tests/test_nash.py"]),
    "mhc-lite permutations transposed": ("nash_mhc/layers/hyperconnection.py",
                                         [('jnp.einsum("tk,kij->tij", mix,', 'jnp.einsum("tk,kji->tij", mix,')],
                                         [REFERENCE]),
    "prior starts uniform": ("nash_mhc/layers/aggregation.py", [(".at[0].set(beta)", ".at[0].set(0.0)")],
                             ["tests/test_nash.py", "tests/test_model.py", "tests/test_golden.py"]),
    "H_post = sigma": ("nash_mhc/layers/hyperconnection.py",
                       [("h_post = 2.0 * jax.nn.sigmoid", "h_post = 1.0 * jax.nn.sigmoid")],
                       [REFERENCE, "tests/test_golden.py"]),
    "RoPE tables from float32 angles": ("nash_mhc/ops/rope.py",
                                        [("angles = (np.arange(count, dtype=np.float64) * spacing)[:, None] * "
                                          "freqs[None, :]",
                                          "angles = ((np.arange(count, dtype=np.float32) * spacing)[:, None] * "
                                          "freqs[None, :].astype(np.float32)).astype(np.float32)")],
                                        [REFERENCE]),
    "RoPE spacing 1 at every scale": ("nash_mhc/layers/attention.py",
                                      [("spacing = self.block_sizes[level]", "spacing = 1")],
                                      [REFERENCE, "tests/test_golden.py"]),
    "cross-entropy mean over the local shard": (
        "nash_mhc/training/step.py",
        [("ce_sum = jax.lax.psum(jnp.sum(nll * mask), BATCH_AXES)",  # global count × mean of per-shard means
          "ce_sum = jax.lax.pmean(jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0), BATCH_AXES)"
          " * jax.lax.psum(jnp.sum(mask), BATCH_AXES)")], ["tests/test_step.py"]),
    # ablation v3's protocol (nash_mhc/study/ablation3_protocol.py, ablation3_report.py)
    "v3 rate chosen on the first seed": (V3_RULES, [("(sum(values) / len(values) if values and",
                                                     "(values[0] if values and")], [V3_TESTS]),
    "v3 grid never grows": (V3_RULES, [("grid, added = sorted([*grid, new]), added + 1",
                                        'return {"grid": grid, "best": best, "means": means, "state": "interior"}')],
                            [V3_TESTS]),
    "v3 grid grows the wrong way": (V3_RULES, [("up=best == grid[-1] != grid[0]", "up=best == grid[0]")], [V3_TESTS]),
    "v3 grid without its hard limit": (V3_RULES, [("if added >= max_extra or", "if False or")], [V3_TESTS]),
    "v3 differences not paired by seed": (V3_RULES, [("diffs = {s: a[s] - b[s] for s in seeds}",
                                                      "diffs = {s: a[s] - b[seeds[-1 - i]] for i, s in "
                                                      "enumerate(seeds)}")], [V3_TESTS]),
    "v3 standard error with n for n - 1": (V3_RULES, [("/ (n - 1) / n)", "/ n / n)")], [V3_TESTS]),
    "v3 normal quantile for t": (V3_RULES, [("half = t975(n - 1) * se", "half = 1.96 * se")], [V3_TESTS]),
    "v3 null inverted": (V3_RULES, [('"null": interval[0] <= 0.0 <= interval[1]',
                                     '"null": not interval[0] <= 0.0 <= interval[1]')], [V3_TESTS]),
    "v3 wall-clock ratio inverted": (V3_RULES, [("steps * base_step_time / step_time", "steps * step_time / "
                                                 "base_step_time")], [V3_TESTS]),
    "v3 wall-clock read after the point": (V3_RULES, [("max((s for s in available if 0 < s <= step), default=None)",
                                                       "min((s for s in available if s >= step), default=None)")],
                                           [V3_TESTS]),
    "v3 report at the baseline's rate": ("nash_mhc/study/ablation3_report.py",
                                         [("(r := _get(results, v, best, s))",
                                           '(r := _get(results, v, grids[variants[0]]["best"], s))')], [V3_TESTS]),
    # the depth study's protocol answers (nash_mhc/study/stability_protocol.py)
    "depth usable range without the tolerance": (DEPTH_RULES, [("m <= means[best] + tolerance", "m <= means[best]")],
                                                 [DEPTH_TESTS]),
    "depth usable range keeps diverged rates": (DEPTH_RULES, [("if m is not None and m <= means[best] + tolerance",
                                                               "if m is None or m <= means[best] + tolerance")],
                                                [DEPTH_TESTS]),
    "depth edge flag sides swapped": (DEPTH_RULES, [('"low" if best == grid[0] else "high"',
                                                     '"high" if best == grid[0] else "low"')], [DEPTH_TESTS]),
    "depth vs plain at plain's rate": (DEPTH_RULES, [('entry("own best", mine["best_rate"], theirs["best_rate"])',
                                                      'entry("own best", theirs["best_rate"], theirs["best_rate"])')],
                                       [DEPTH_TESTS]),
}


def run(name: str) -> list[str]:
    """The quick tests that fail with mutation ``name`` applied."""
    path, replacements, tests = MUTATIONS[name]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="mutation_") as scratch:
        for f in files:
            (pathlib.Path(scratch) / f).parent.mkdir(parents=True, exist_ok=True)
            (pathlib.Path(scratch) / f).write_bytes((ROOT / f).read_bytes())
        target = pathlib.Path(scratch) / path
        text = target.read_text()
        for old, new in replacements:
            assert old in text, (name, old)
            text = text.replace(old, new)
        target.write_text(text)
        env = {**os.environ, "PYTHONPATH": scratch}  # the copy's nash_mhc before the installed one
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                              *tests], cwd=scratch, env=env, capture_output=True, text=True).stdout
    return re.findall(r"^FAILED (\S+)", out, re.MULTILINE)


def main(names: list[str]) -> int:
    survived = 0
    print("| mutation | failing quick tests |\n|---|---|")
    for name in names or MUTATIONS:
        failed = run(name)
        survived += not failed
        print(f"| {name} | {', '.join(f'`{t}`' for t in failed) or 'SURVIVED'} |", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
