"""Decoding with packed Linear layers (the CPU decode GEMM) stays lossless.

The runtime is packed as `load` packs it (`fuse_cpu_ops=True`); the oracle
is mlx-lm's greedy decoding of the same weights unpacked, so none of the
package's kernels is in the reference. The near-tie rule of the other
greedy tests applies.
"""

from __future__ import annotations

import pytest

import mtplx_ext
from mtplx_ext import generate_greedy_batched
from mtplx_ext.models.packed_linear import packing_available
from _greedy import ScriptedHead, _prompts, _rng, check_counters, check_stream, reference

pytestmark = pytest.mark.skipif(not packing_available(), reason="no vector FMA kernel on this CPU")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("B", [1, 8])
def test_packed_mtp_equals_mlx_lm_on_the_unpacked_weights(model_type: str, B: int) -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    packed = mtplx_ext.init_random(model_type, seed=seed, fuse_cpu_ops=True)
    plain = mtplx_ext.init_random(model_type, seed=seed)
    assert packed.linears_packed and not plain.linears_packed
    prompts = _prompts(rng, plain.vocab_size, B, max_len=14)
    cap = int(rng.integers(10, 20))
    refs = [reference(plain, p, cap) for p in prompts]
    head = ScriptedHead(packed, [r[0] for r in refs], prompts, "mixed", rng)
    r0 = generate_greedy_batched(packed, prompts, max_new_tokens=cap, use_mtp_draft=False)
    for i, s in enumerate(r0.streams):
        check_stream(i, s, *refs[i], set(), cap)
    check_counters(r0, False)
    for depth in (1, 3, 5):
        for runtime in (head, packed):
            r = generate_greedy_batched(runtime, prompts, max_new_tokens=cap, depth=depth)
            for i, s in enumerate(r.streams):
                check_stream(i, s, *refs[i], set(), cap)
            check_counters(r, True)
