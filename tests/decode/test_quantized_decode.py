"""Decoding quantized models on the CPU's quantized GEMM (`pack_cpu_quantized`) stays lossless.

The runtime is quantized as `convert -q` quantizes and packed as `load`
packs it. The kernel's rows are independent of the call, so greedy MTP must
commit exactly the tokens of plain decoding at the same bits (no near-tie
allowance), with drafts that are accepted and rejected (a scripted head).
Against mlx-lm's own quantized layers the logits may differ only by the
int8 rounding of the activations: within 2 % relative L2 (the stated
tolerance), and at 4 bits far less than what quantizing the weights
already costs against the float model.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import generate_greedy_batched
from mtplx_ext.models.packed_quantized import PackedQuantizedEmbedding, PackedQuantizedLinear, unpack_cpu_quantized
from _greedy import _prompts, _rng, check_counters, check_scripted_depths


def _quantized(model_type: str, seed: int, bits: int, packed: bool):
    return mtplx_ext.init_random(
        model_type, seed=seed, fuse_cpu_ops=packed, quantize={"bits": bits, "group_size": 32}
    )


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_greedy_mtp_equals_plain_decoding_at_the_same_bits(model_type: str, bits: int, B: int) -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    print(f"model seed {seed}")
    rt = _quantized(model_type, seed, bits, packed=True)
    kinds = {type(m) for m in rt.modules()}
    assert PackedQuantizedLinear in kinds and mx.default_device() == mx.cpu
    prompts = _prompts(rng, rt.vocab_size, B, max_len=14)
    cap = int(rng.integers(8, 14))
    plain = generate_greedy_batched(rt, prompts, max_new_tokens=cap, use_mtp_draft=False)
    check_counters(plain, False)
    want = [s.tokens for s in plain.streams]
    runs = {1: ("mixed", "oracle", "own"), 2: ("mixed", "wrong"), 3: ("mixed", "oracle"), 4: ("mixed", "wrong", "own")}
    check_scripted_depths(rt, prompts, want, cap, runs, rng)


@pytest.mark.parametrize("bits", [4, 8])
def test_logits_stay_within_the_activation_rounding_of_mlx_lm_quantized(bits: int) -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    print(f"model seed {seed}")
    packed = _quantized("qwen3", seed, bits, packed=True)
    mlx_q = _quantized("qwen3", seed, bits, packed=False)
    dense = mtplx_ext.init_random("qwen3", seed=seed)
    assert not any(isinstance(m, PackedQuantizedLinear) for m in mlx_q.modules())
    tokens = mx.array([rng.integers(0, packed.vocab_size, size=24).tolist()])
    logits = [np.array(r.trunk(tokens).astype(mx.float32), np.float64) for r in (packed, mlx_q, dense)]
    ours = np.linalg.norm(logits[0] - logits[1]) / np.linalg.norm(logits[1])
    weights = np.linalg.norm(logits[1] - logits[2]) / np.linalg.norm(logits[1])
    # The stated tolerance: 2 % relative L2 (int8 activations per group of 32 give about 0.6 % per product).
    assert ours <= 0.02, f"packed vs mlx-lm: relative L2 {ours:.3g}"
    if bits == 4:  # at 4 bits the weights' own rounding dominates by far
        assert ours <= 0.25 * weights, f"packed vs mlx-lm {ours:.3g}; mlx-lm's 4-bit quantization itself {weights:.3g}"


def test_tied_embedding_lookup_is_mlx_lm_s_bit_for_bit_and_unpacking_restores_the_layers() -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    packed = _quantized("qwen3", seed, 4, packed=True)
    mlx_q = _quantized("qwen3", seed, 4, packed=False)
    emb = packed.trunk.model.embed_tokens
    assert isinstance(emb, PackedQuantizedEmbedding)
    ids = mx.array(rng.integers(0, packed.vocab_size, size=(3, 7)))
    assert mx.array_equal(emb(ids), mlx_q.trunk.model.embed_tokens(ids)).item()
    n = unpack_cpu_quantized(packed)
    assert n > 0 and not any(isinstance(m, (PackedQuantizedLinear, PackedQuantizedEmbedding)) for m in packed.modules())
    for (k, a), (k2, b) in zip(
        sorted(tree_flatten(packed.parameters())), sorted(tree_flatten(mlx_q.parameters()))
    ):
        assert k == k2 and mx.array_equal(a, b).item(), k

