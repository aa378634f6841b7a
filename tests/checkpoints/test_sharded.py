"""`load(..., group=...)` argument checks and splits refused before any collective runs (one process).

The 2-rank runs themselves are in tests/distributed/.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext import CheckpointError
from mtplx_ext.checkpoints import sharded
import _seed

TWO = SimpleNamespace(size=lambda: 2, rank=lambda: 0)  # a group of 2, for the checks made before splitting


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "qwen3"
    mtplx_ext.init_random("qwen3", seed=int(_seed.rng().integers(0, 2**31))).save(path)
    return path


def test_a_group_of_one_loads_the_whole_model(folder, rng):
    whole = mtplx_ext.load(folder, fuse_cpu_ops=False)
    one = mtplx_ext.load(folder, fuse_cpu_ops=False, group=mx.distributed.init(), parallel="tensor")
    a, b = dict(tree_flatten(whole.parameters())), dict(tree_flatten(one.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    prompts = [[int(t) for t in rng.integers(0, whole.vocab_size, 5)]]
    assert (mtplx_ext.generate_greedy_batched(one, prompts, max_new_tokens=8, depth=1).streams[0].tokens
            == mtplx_ext.generate_greedy_batched(whole, prompts, max_new_tokens=8, depth=1).streams[0].tokens)


@pytest.mark.parametrize("kw,needle", [({"parallel": "data"}, "parallel must be one of"),
                                       ({"head": "half"}, "head must be one of")])
def test_unknown_modes_are_refused_naming_the_argument(folder, kw, needle):
    with pytest.raises(ValueError, match=needle):
        mtplx_ext.load(folder, **kw)
    with pytest.raises(ValueError, match=needle):
        mtplx_ext.load(folder, group=mx.distributed.init(), **kw)


def test_splits_mlx_lm_cannot_make_are_refused_naming_the_family_or_field():
    with pytest.raises(CheckpointError, match="qwen3 has no pipeline"):
        sharded.shard_runtime(mtplx_ext.init_random("qwen3"), TWO, "pipeline")
    with pytest.raises(CheckpointError, match="num_attention_heads = 3 does not split over 2"):
        sharded.shard_runtime(mtplx_ext.init_random("qwen3", num_attention_heads=3, num_key_value_heads=1,
                                                    head_dim=16), TWO, "tensor")
    with pytest.raises(ValueError, match="head='shard' needs tensor parallel"):
        sharded.shard_runtime(mtplx_ext.init_random("deepseek_v3"), TWO, "pipeline", head="shard")


def test_a_stage_count_above_the_layer_count_is_refused():
    three = SimpleNamespace(size=lambda: 3, rank=lambda: 0)
    with pytest.raises(CheckpointError, match="2 trunk layers cannot make 3 pipeline stages"):
        sharded.shard_runtime(mtplx_ext.init_random("deepseek_v3"), three, "pipeline")


def test_the_default_head_is_sharded_in_tensor_parallel_and_replicated_pipelined():
    assert sharded.resolve_head("tensor", None) == "shard"
    assert sharded.resolve_head("pipeline", None) == "replicate"
    assert sharded.resolve_head("tensor", "replicate") == "replicate"
    # The default split really reaches the head: its attention keeps half the heads on each of 2 ranks.
    rt = mtplx_ext.init_random("qwen3")
    before = {k: v.shape for k, v in tree_flatten(rt.mtp_modules[0].parameters())}
    sharded.shard_runtime(rt, TWO, "tensor")
    after = {k: v.shape for k, v in tree_flatten(rt.mtp_modules[0].parameters())}
    assert any(after[k] != before[k] for k in before)
