"""The training script's depth-K objective, frozen-trunk fine-tuning and arguments."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext import train
from _ragged import fresh_seed
import _seed


def _ce(logits: mx.array, targets: mx.array) -> float:
    """Mean cross-entropy in float64 from the logits (numpy)."""
    z = np.array(logits.astype(mx.float32), np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    t = np.array(targets)
    return float(-np.take_along_axis(logp, t[..., None], -1).mean())


@pytest.mark.parametrize("depth", [1, 3])
def test_the_depth_loss_is_the_mean_ce_of_the_head_applied_k_times_to_its_own_state(depth):
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed(), vocab_size=64)
    seq = mx.array(_seed.rng().integers(0, 64, size=(2, 17)).astype(np.int32))
    loss, (trunk_ce, head_ce1) = train.joint_loss(rt, seq, 1.0, 0.0, depth, train_trunk=False)
    # By hand: depth k sees the state of depth k - 1 and the true token t + k.
    inputs, targets = seq[:, :-1], seq[:, 1:]
    logits, h = rt.forward(inputs)
    ces = []
    for k in range(1, depth + 1):
        n = targets.shape[1] - k
        head_logits, h = rt.head_forward(h[:, :n], targets[:, k - 1 : k - 1 + n], return_hidden=True)
        ces.append(_ce(head_logits, targets[:, k : k + n]))
    assert abs(loss.item() - np.mean(ces)) < 1e-4
    assert abs(head_ce1.item() - ces[0]) < 1e-4 and abs(trunk_ce.item() - _ce(logits, targets)) < 1e-4


def test_with_several_mtp_modules_depth_k_trains_module_k_minus_1_and_each_gets_a_gradient():
    rt = mtplx_ext.init_random("deepseek_v3", seed=fresh_seed(), vocab_size=64, num_nextn_predict_layers=2)
    seq = mx.array(_seed.rng().integers(0, 64, size=(2, 13)).astype(np.int32))
    loss, _ = train.joint_loss(rt, seq, 1.0, 0.0, 3, train_trunk=False)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    _, hidden = rt.forward(inputs)

    def by_hand(modules):
        h, ces = hidden, []
        for k, module in zip(range(1, 4), modules):
            n = targets.shape[1] - k
            head_logits, h = rt.head_forward(h[:, :n], targets[:, k - 1 : k - 1 + n], return_hidden=True, module=module)
            ces.append(_ce(head_logits, targets[:, k : k + n]))
        return np.mean(ces)

    assert abs(loss.item() - by_hand([0, 1, 0])) < 1e-4
    assert abs(loss.item() - by_hand([0, 0, 0])) > 1e-3  # the first module alone is another objective
    rt.trunk.freeze()
    _, grads = nn.value_and_grad(rt, lambda s: train.joint_loss(rt, s, 1.0, 0.0, 2, train_trunk=False)[0])(seq)
    for top in ("head", "more_modules"):
        assert any(k.startswith(top + ".") and float(mx.abs(g).max()) > 0 for k, g in tree_flatten(grads)), top


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "mimo"])
def test_added_mtp_modules_start_as_copies_of_the_last_and_train_on_their_own(tmp_path, family):
    from mtplx_ext.checkpoints import add_mtp_modules

    rt = mtplx_ext.init_random(family, seed=fresh_seed(), vocab_size=64)
    add_mtp_modules(rt, 3)
    assert len(rt.mtp_modules) == 3
    x = mx.array(_seed.rng().integers(0, 64, size=(2, 7)))
    _, h = rt.forward(x)
    first = rt.head_forward(h, x)
    assert all(mx.array_equal(first, rt.head_forward(h, x, module=i)).item() for i in (1, 2))
    # Copies, not shared arrays: changing one module leaves the others.
    name, w = next((k, v) for k, v in tree_flatten(rt.mtp_modules[1].parameters()) if "layers" in k or "block" in k)
    rt.mtp_modules[1].load_weights([(name, w + 1.0)], strict=False)
    assert mx.array_equal(first, rt.head_forward(h, x)).item()
    assert not mx.array_equal(first, rt.head_forward(h, x, module=1)).item()
    rt.save(tmp_path)
    assert len(mtplx_ext.load(tmp_path).mtp_modules) == 3
    with pytest.raises(ValueError, match="count"):
        add_mtp_modules(rt, 2)
    q = mtplx_ext.init_random(family, seed=fresh_seed(), quantize={"bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="quantized"):
        add_mtp_modules(q, 2)


def test_a_frozen_trunk_gets_no_gradient_and_the_head_does():
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed(), vocab_size=64)
    rt.trunk.freeze()
    seq = mx.array(_seed.rng().integers(0, 64, size=(2, 9)).astype(np.int32))
    _, grads = nn.value_and_grad(rt, lambda s: train.joint_loss(rt, s, 1.0, 0.5, 2, train_trunk=False)[0])(seq)
    names = [k for k, _ in tree_flatten(grads)]
    assert names and all(k.startswith("head.") for k in names), names[:5]
    assert any(float(mx.abs(g).max()) > 0 for _, g in tree_flatten(grads))


def test_a_hybrid_trunk_can_be_built_for_training():
    cfg = train.TrainConfig(out="", vocab_size=64, hidden=32, layers=4, heads=2, kv_heads=1, intermediate=64,
                            trunk="qwen3_next", full_attention_interval=2)
    rt = train.build_runtime(cfg, tokenizer=None)
    assert rt.has_recurrent_layers and rt.has_mtp
    cfg.mtp_layers = 2
    assert len(train.build_runtime(cfg, tokenizer=None).mtp_modules) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--depth", "9"], "--depth"),
        (["--freeze-trunk", "1"], "--freeze-trunk"),
        (["--trunk", "llama"], "--trunk"),
        (["--mtp-layers", "0"], "--mtp-layers"),
        (["--self-distill", "1.5", "--init", "m"], "--self-distill"),
        (["--self-distill", "0.5"], "--self-distill"),
        (["--self-windows", "0"], "--self-windows"),
    ],
)
def test_bad_training_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--out", "x", *argv])
    assert message in capsys.readouterr().err
