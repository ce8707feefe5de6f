"""Golden logits: the ``tiny`` model from a fixed key on a fixed batch, against numbers stored in the repository.

Any change of the model's function (initialisation or forward math) shows as a failure here and, once
deliberate, as a diff of ``tests/golden/tiny_logits.npz``. Regenerate deliberately, and say why in the commit:

    JAX_PLATFORMS=cpu python tests/test_golden.py --regenerate

Stored: every 4th position's logits over the real vocabulary (a slice of [2, 16, 259]) and, for all 2·64
positions, the logits' mean and RMS (a digest: a change anywhere moves it).
"""

from __future__ import annotations

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from nash_mhc import LanguageModel, ModelConfig

GOLDEN = pathlib.Path(__file__).parent / "golden" / "tiny_logits.npz"
CONFIG = ModelConfig.preset("tiny")
STRIDE = 4


def tokens() -> np.ndarray:
    """A fixed batch [2, 64]: the same ids on every platform (NumPy's PCG64)."""
    return np.random.default_rng(2024).integers(0, CONFIG.vocab_size, (2, CONFIG.seq_len)).astype(np.int32)


def compute() -> dict[str, np.ndarray]:
    model = LanguageModel(CONFIG, key=jax.random.key(0))
    logits = eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(tokens()))
    logits = np.asarray(logits, np.float64)[..., :CONFIG.vocab_size]
    return {"tokens": tokens(), "slice": logits[:, ::STRIDE].astype(np.float32),
            "mean": logits.mean(-1), "rms": np.sqrt((logits**2).mean(-1))}


def test_tiny_logits_match_the_golden_file():
    """Tolerance 1e-5 of the logits' spread: float32 rounding differences between XLA versions and CPUs are
    ~1e-7 relative; any change of the model's math (a scale, a coefficient, an init) moves them by 1e-3 or
    more."""
    golden = np.load(GOLDEN)
    np.testing.assert_array_equal(golden["tokens"], tokens())
    got = compute()
    spread = float(np.std(golden["slice"]))
    assert spread > 0.05  # the logits are not flat: the model's function shows in them
    for name in ("slice", "mean", "rms"):
        np.testing.assert_allclose(got[name], golden[name], rtol=0, atol=1e-5 * spread, err_msg=name)


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: JAX_PLATFORMS=cpu python {sys.argv[0]} --regenerate")
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, **compute())
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
