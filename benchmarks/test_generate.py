"""Generation throughput: cached incremental decoding vs recomputing the full forward pass for every token.

Both decode 512 new tokens greedily after a 16-token prompt with the same compile-once loop of
``nash_mhc.generate_tokens`` (one jitted step per token, fixed context of 1024): ``use_cache=True`` runs one
``decode_step`` over the KV / coarse-block cache, ``use_cache=False`` the full forward pass over the padded
context. Compilation is excluded; tokens/s of both and their ratio go to ``extra_info``.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from nash_mhc import LanguageModel, ModelConfig, generate_tokens

NEW_TOKENS = 512
PROMPT = np.frombuffer(b"def main(argv):\n", np.uint8).astype(np.int32)  # 16 byte tokens
CONTEXT = 1024


@pytest.mark.parametrize("preset", ["tiny"])
def test_cached_decoding_is_faster_than_recomputing_the_forward(benchmark, preset):
    config = ModelConfig.preset(preset, seq_len=CONTEXT)
    model = LanguageModel(config, key=jax.random.key(0))

    def run(use_cache: bool) -> np.ndarray:
        return generate_tokens(model, PROMPT, max_new_tokens=NEW_TOKENS, temperature=0, use_cache=use_cache)

    for use_cache in (True, False):  # compile both programs outside the timed region
        generate_tokens(model, PROMPT, max_new_tokens=2, temperature=0, use_cache=use_cache)
    start = time.perf_counter()
    uncached = run(False)  # one round: it takes about a minute on a 2-core CPU
    uncached_s = time.perf_counter() - start
    cached = benchmark.pedantic(lambda: run(True), rounds=3, iterations=1)
    cached_s = benchmark.stats.stats.mean
    np.testing.assert_array_equal(cached, uncached)
    cached_tps, uncached_tps = NEW_TOKENS / cached_s, NEW_TOKENS / uncached_s
    ratio = cached_tps / uncached_tps
    benchmark.extra_info.update(cached_tokens_per_second=round(cached_tps, 1),
                                uncached_tokens_per_second=round(uncached_tps, 1), speedup=round(ratio, 1),
                                new_tokens=NEW_TOKENS, context=CONTEXT)
    print(f"\n{preset} (context {CONTEXT}): cached {cached_tps:,.1f} tokens/s, full recompute "
          f"{uncached_tps:,.1f} tokens/s, speed-up {ratio:.1f}x")
    assert ratio >= 5, f"cached decoding is only {ratio:.1f}x faster than recomputing the forward pass"
