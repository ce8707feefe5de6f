"""nash_mhc.ops.dispatch: platform_dependent traces only the branch of the ambient mesh's platform where that
settles the choice; platform_vjp lowers the form of the platform the step is lowered for, in the forward and the
backward pass, and no other form's residuals in between."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import equations
from jax.sharding import AbstractDevice, AbstractMesh

from nash_mhc.ops.dispatch import lowering_platform, platform_dependent, platform_of, platform_vjp


def tpu_form(x, w):
    return jnp.exp(x) * w


def default_form(x, w):
    return jnp.tanh(x) * w  # a residual (tanh(x)) that the TPU form does not have


def problem():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32), jnp.asarray(rng.standard_normal((8,)), jnp.float32))


def loss(f):
    return lambda x, w: jnp.sum(f(x, w) ** 2)


def test_on_the_cpu_value_and_gradient_are_the_default_forms_bit_for_bit():
    x, w = problem()
    got = jax.jit(jax.value_and_grad(loss(platform_vjp(tpu_form, default_form)), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.value_and_grad(loss(default_form), argnums=(0, 1)))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_platform_lowers_its_own_form_forward_and_backward():
    x, w = problem()
    step = jax.jit(jax.grad(loss(platform_vjp(tpu_form, default_form)), argnums=(0, 1)))
    text = {platform: jax.export.export(step, platforms=[platform])(x, w).mlir_module() for platform in ("tpu", "cpu")}
    assert "exponential" in text["tpu"] and "tanh" not in text["tpu"]
    assert "tanh" in text["cpu"] and "exponential" not in text["cpu"]


def test_the_forward_choice_returns_the_output_alone():
    """Differentiated as it is, platform_dependent's cond returns the union of both forms' residuals (zeros for
    the other form's, made unsharded under a mesh); platform_vjp's forward cond returns y and saves (x, w)."""
    x, w = problem()

    def conds(f):
        jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(f, x, w))(x, w)
        return [len(eqn.outvars) for eqn in equations(jaxpr) if eqn.primitive.name == "cond"]

    assert conds(platform_vjp(tpu_form, default_form)) == [1]
    assert max(conds(lambda x, w: jax.lax.platform_dependent(x, w, tpu=tpu_form, default=default_form))) > 1


def abstract_mesh(platform: str | None) -> AbstractMesh:
    """A (2,)-device abstract mesh on ``platform`` (None: no device, as an AbstractMesh built by hand)."""
    device = None if platform is None else AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
    return AbstractMesh((2,), ("data",), abstract_device=device)


def traced(mesh: AbstractMesh | None, names: tuple[str, ...], platform: str | None = None
           ) -> tuple[list[str], set[str]]:
    """(the branches platform_dependent traced under ``mesh`` (None: no mesh) and ``lowering_platform(platform)``
    (None: none), in order; the primitives of the jaxpr), with one branch per name of ``names`` ("default" the
    default branch), each tanh(x) * k for its k."""
    seen = []

    def branch(name: str, k: float):
        def run(x):
            seen.append(name)
            return jnp.tanh(x) * k
        return run

    branches = {name: branch(name, k) for k, name in enumerate(names, start=1)}

    def f(x):
        return platform_dependent(x, **branches)

    with contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh), \
            contextlib.nullcontext() if platform is None else lowering_platform(platform):
        jaxpr = jax.make_jaxpr(f)(jnp.ones((4,), jnp.float32))
    return seen, {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}


@pytest.mark.parametrize(("platform", "names", "want"), [
    ("cpu", ("tpu", "default"), ["default"]),
    ("cpu", ("cpu", "tpu", "default"), ["cpu"]),
    ("tpu", ("tpu", "default"), ["tpu"]),
    ("gpu", ("tpu", "default"), ["default"]),  # no cuda or rocm branch: a GPU takes the default either way
])
def test_under_a_mesh_only_its_platforms_branch_is_traced(platform, names, want):
    seen, primitives = traced(abstract_mesh(platform), names)
    assert seen == want and "cond" not in primitives and "platform_index" not in primitives


@pytest.mark.parametrize(("mesh", "names"), [
    (None, ("tpu", "default")),  # no mesh: jax.export may still lower for any platform
    (abstract_mesh(None), ("tpu", "default")),  # a mesh that names no device
    (abstract_mesh("gpu"), ("cuda", "tpu", "default")),  # "gpu" does not say cuda or rocm
    (abstract_mesh("tpu"), ("cpu",)),  # no branch for the platform: lowering it stays an error of JAX's
])
def test_where_the_mesh_does_not_settle_it_every_branch_is_traced_and_lowering_chooses(mesh, names):
    seen, primitives = traced(mesh, names)
    assert sorted(seen) == sorted(names) and "cond" in primitives


@pytest.mark.parametrize(("mesh", "platform", "names", "want"), [
    (None, "cpu", ("tpu", "default"), ["default"]),
    (None, "tpu", ("tpu", "default"), ["tpu"]),
    (None, "gpu", ("tpu", "default"), ["default"]),
    (abstract_mesh(None), "cpu", ("tpu", "default"), ["default"]),  # a mesh without a device names no platform
    (abstract_mesh("tpu"), "cpu", ("tpu", "default"), ["tpu"]),  # the mesh's platform comes first
])
def test_lowering_platform_settles_the_choice_where_no_mesh_does(mesh, platform, names, want):
    seen, primitives = traced(mesh, names, platform)
    assert seen == want and "cond" not in primitives and "platform_index" not in primitives
    seen, primitives = traced(mesh, names, None)  # outside it, as before
    assert sorted(seen) == (sorted(names) if mesh is None or mesh.abstract_device is None else want)


def test_lowering_platform_holds_only_within_its_block_and_keys_jaxs_trace_caches():
    """Outside its block every branch is traced again; a module-level jax.checkpoint caches its traced jaxpr, and
    a trace made under one platform is not reused under another or under none (the same platform reuses it)."""
    with lowering_platform("tpu"):
        assert traced(None, ("tpu", "default"))[0] == ["tpu"]
    assert sorted(traced(None, ("tpu", "default"))[0]) == ["default", "tpu"]
    seen = []

    @jax.checkpoint
    def f(x):
        return platform_dependent(x, tpu=lambda x: seen.append("tpu") or jnp.exp(x),
                                  default=lambda x: seen.append("default") or jnp.tanh(x))

    def traces(platform):
        seen.clear()
        with lowering_platform(platform):
            jax.make_jaxpr(f)(jnp.ones((3,)))
        return sorted(seen)

    assert [traces(p) for p in ("cpu", "tpu", None, "cpu")] == [["default"], ["tpu"], ["default", "tpu"], []]


def test_platform_of_names_where_a_jit_of_the_arrays_runs():
    devices = jax.devices()
    x = jnp.ones((8,))  # uncommitted: a jit runs it on the default device
    assert platform_of({"a": [np.ones(2), x]}) == platform_of(np.ones(2)) == jax.default_backend()
    with jax.default_device(devices[3]):
        assert platform_of(x) == devices[3].platform
    spread = jax.device_put(x, jax.sharding.NamedSharding(jax.make_mesh((len(devices),), ("data",)),
                                                          jax.sharding.PartitionSpec("data")))
    assert spread.committed and platform_of((x, spread)) == devices[0].platform
    seen = []
    jax.make_jaxpr(lambda y: seen.append(platform_of((x, y))) or y)(x)
    assert seen == [None]  # a tracer: where it runs is not known at trace time
