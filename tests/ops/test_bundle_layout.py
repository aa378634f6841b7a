"""The bundle layouts the Python names give are the ones the kernels write.

`mtplx_ext.ops.greedy_verify` reads its column indices from the extension
(metal/mtplx_rules.h, the one definition the CPU and Metal kernels share).
These tests read every column by its meaning, on the CPU primitives and on
the Metal kernels in the emulator: names bound to the wrong column, or a
kernel that writes a column of its own, fail here. Every token of a case is
distinct (and none is 0 or 1, the accept values), so a swap of any two
columns shows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.decode.bundle import COL_N, COL_TOKENS, accepted_count, committed_tokens
from mtplx_ext.decode.bundle import COL_X0 as BUNDLE_COL_X0
from mtplx_ext.ops.greedy_verify import (
    BUNDLE_COLUMNS,
    CHAIN_COL_ACCEPTED,
    CHAIN_COL_FIRST,
    CHAIN_COL_X0,
    COL_ACCEPT,
    COL_BONUS,
    COL_DRAFT,
    COL_SECOND,
    COL_X0,
    INVALID,
)
from mtplx_ext.sampling import SamplerConfig, pack_params

V = 16


def _peaked(argmaxes: list[list[int]]) -> np.ndarray:
    """[B, T, V] float32 logits whose row (b, t) peaks at argmaxes[b][t]."""
    out = np.zeros((len(argmaxes), len(argmaxes[0]), V), np.float32)
    for b, row in enumerate(argmaxes):
        for t, a in enumerate(row):
            out[b, t, a] = 5.0
    return out


# verify_greedy: stream 0's draft is the target's argmax (accepted), stream
# 1's is not. Expected rows by meaning, one dict per stream.
TOKENS = np.array([[3, 5], [9, 11]], np.int32)
TARGET = _peaked([[5, 7], [12, 14]])  # argmax of the rows at x0 and at the draft
PAIR = [
    {"x0": 3, "draft": 5, "second": 5, "accept": 1, "bonus": 7},
    {"x0": 9, "draft": 11, "second": 12, "accept": 0, "bonus": 14},
]
# verify_sampled with greedy rows: the same, but a rejected draft draws no
# bonus token.
SAMPLED = [PAIR[0], {**PAIR[1], "bonus": INVALID}]

# verify_greedy_chain, K = 3: stream 0 accepts two drafts (the third differs
# from a_2 = 9), stream 1 none (d_1 = 4 differs from a_0 = 8).
K = 3
CHAIN_TOKENS = np.array([[2, 5, 6, 10], [3, 4, 11, 12]], np.int32)
CHAIN_TARGET = _peaked([[5, 6, 9, 13], [8, 15, 7, 14]])
CHAIN = [
    {"x0": 2, "n": 2, "tokens": [5, 6, 9, INVALID]},
    {"x0": 3, "n": 0, "tokens": [8, INVALID, INVALID, INVALID]},
]


def _check_pair(bundle: np.ndarray, expected: list[dict[str, int]] = PAIR) -> None:
    assert bundle.shape == (len(expected), len(BUNDLE_COLUMNS))
    cols = {"x0": COL_X0, "draft": COL_DRAFT, "second": COL_SECOND, "accept": COL_ACCEPT, "bonus": COL_BONUS}
    for b, want in enumerate(expected):
        assert {name: int(bundle[b, col]) for name, col in cols.items()} == want, bundle[b]


def _check_chain(bundle: np.ndarray) -> None:
    assert bundle.shape == (len(CHAIN), K + 3)
    for b, want in enumerate(CHAIN):
        got = {
            "x0": int(bundle[b, CHAIN_COL_X0]),
            "n": int(bundle[b, CHAIN_COL_ACCEPTED]),
            "tokens": [int(t) for t in bundle[b, CHAIN_COL_FIRST : CHAIN_COL_FIRST + K + 1]],
        }
        assert got == want, bundle[b]


def test_the_column_names_are_a_layout():
    cols = [COL_X0, COL_DRAFT, COL_SECOND, COL_ACCEPT, COL_BONUS]
    assert sorted(cols) == list(range(len(BUNDLE_COLUMNS)))
    assert [BUNDLE_COLUMNS[c] for c in cols] == ["x0", "draft", "second", "accept", "bonus"]
    assert sorted([CHAIN_COL_X0, CHAIN_COL_ACCEPTED]) == list(range(CHAIN_COL_FIRST))
    # The engine's reading of the chain bundle uses the same columns.
    assert (BUNDLE_COL_X0, COL_N, COL_TOKENS) == (CHAIN_COL_X0, CHAIN_COL_ACCEPTED, CHAIN_COL_FIRST)


def test_cpu_verify_primitives_write_the_named_columns():
    _check_pair(np.array(mtplx_ext.verify_greedy(mx.array(TARGET), mx.array(TOKENS))))
    # Greedy rows through the sampled primitive: the draft head peaks at the
    # draft, so the bundle is verify_greedy's but for the rejected row's bonus.
    draft = _peaked([[5], [11]])[:, 0]
    uniforms = mx.full((len(PAIR), 3), 0.5)
    greedy = SamplerConfig(temperature=0.0)
    out = mtplx_ext.verify_sampled(mx.array(TARGET), mx.array(draft), mx.array(TOKENS), uniforms, greedy)
    _check_pair(np.array(out), SAMPLED)


def test_cpu_chain_primitive_writes_the_named_columns_and_the_engine_reads_them():
    bundle = mtplx_ext.verify_greedy_chain(mx.array(CHAIN_TARGET), mx.array(CHAIN_TOKENS))
    _check_chain(np.array(bundle))
    assert np.array(accepted_count(bundle)).tolist() == [c["n"] for c in CHAIN]
    assert np.array(committed_tokens(bundle)).tolist() == [c["tokens"] for c in CHAIN]


def _scalar(x: int) -> np.ndarray:
    return np.array([x], np.int32)


def test_metal_pair_kernels_write_the_named_columns_on_the_emulator(emu):
    pair = np.full((len(PAIR), len(BUNDLE_COLUMNS)), -7, np.int32)
    _check_pair(emu.verify_greedy(TARGET, "float32", TOKENS.copy(), pair, threads=32))
    # The sampled kernel with greedy rows, as on the CPU above (the target
    # logits stand in for the counts, which it does not read).
    pair = np.full((len(PAIR), len(BUNDLE_COLUMNS)), -7, np.int32)
    draft = _peaked([[5], [11]])[:, 0].copy()
    params = pack_params(SamplerConfig(temperature=0.0), len(PAIR))
    uniforms = np.full((len(PAIR), 3), 0.5, np.float32)
    args = [TARGET, draft, TOKENS.copy(), uniforms, params, TARGET, pair, _scalar(V), _scalar(0)]
    emu.launch("verify_sampled_float32_int32", (len(PAIR),), 32, args)
    _check_pair(pair, SAMPLED)


@pytest.mark.parametrize("biased", [False, True])
def test_metal_chain_kernels_write_the_named_columns_on_the_emulator(emu, biased):
    chain = np.full((len(CHAIN), K + 3), -7, np.int32)
    args = [CHAIN_TARGET, CHAIN_TOKENS.copy(), chain, _scalar(V), _scalar(K)]
    if biased:  # a zero bias: the same commits through the biased instantiation
        args.append(np.zeros((len(CHAIN), V), np.float32))
    name = "verify_greedy_chain_biased" if biased else "verify_greedy_chain"
    emu.launch(f"{name}_float32_int32", (len(CHAIN),), 32, args)
    _check_chain(chain)
