"""The depth calibration's cache key: it changes with the weights, the CPU model and the
libraries, and a requested recalibration measures anew once per key and process."""

from __future__ import annotations

from importlib import metadata

import mlx.core as mx
import pytest

import mtplx_ext
from mtplx_ext.decode import autodepth
from mtplx_ext.decode.autodepth import DepthCosts


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Every test calibrates into its own folder, from an empty memory, with no recalibration asked for."""
    monkeypatch.setenv("MTPLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MTPLX_RECALIBRATE", raising=False)
    monkeypatch.setattr(autodepth, "_MEMORY", {})
    monkeypatch.setattr(autodepth, "_REMEASURED", set())
    monkeypatch.setattr(autodepth, "_FORCE", False)


@pytest.fixture()
def counted(monkeypatch):
    """`calibrate` replaced by a fake that records the batch sizes it was asked to measure."""
    calls: list[int] = []

    def fake(runtime, batch, decode, max_depth=autodepth.MAX_AUTO_DEPTH, tokens=autodepth.CALIBRATION_TOKENS):
        calls.append(batch)
        return DepthCosts(batch=batch, cycle_s={"0": 1.0, "1": 1.2, "2": 1.4}, acceptance=[0.8, 0.6])

    monkeypatch.setattr(autodepth, "calibrate", fake)
    return calls


def _no_decode(prompts, n, k):
    raise AssertionError("the fake calibration decodes nothing")


def test_models_differing_only_in_weights_get_different_keys():
    a, b, a_again = (mtplx_ext.init_random("qwen3", seed=s) for s in (1, 2, 1))
    assert a.config == b.config
    assert autodepth.calibration_key(a) == autodepth.calibration_key(a_again)
    assert autodepth.weights_fingerprint(a) != autodepth.weights_fingerprint(b)
    assert autodepth.calibration_key(a) != autodepth.calibration_key(b)


def test_a_new_head_alone_changes_the_key():
    """A self-distilled head on the same trunk: the trunk's weights, config and size are unchanged."""
    rt = mtplx_ext.init_random("qwen3", seed=3)
    before = autodepth.calibration_key(rt)
    name, w = next((n, v) for n, v in _flat(rt.head.parameters()) if v.ndim == 2)
    _set(rt.head, name, w * 1.01)
    assert autodepth.calibration_key(rt) != before


def test_the_cpu_model_and_mlx_lm_version_are_in_the_key(monkeypatch):
    rt = mtplx_ext.init_random("qwen3", seed=4)
    before = autodepth.calibration_key(rt)
    monkeypatch.setattr(autodepth, "cpu_model", lambda: "Another CPU @ 1.0GHz")
    other_cpu = autodepth.calibration_key(rt)
    assert other_cpu != before
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "0.0.1-other" if d == "mlx-lm" else real(d))
    assert autodepth.calibration_key(rt) not in (before, other_cpu)


def test_the_cpu_model_is_named_here():
    assert isinstance(autodepth.cpu_model(), str)


def test_recalibration_via_the_environment_measures_again_once(shipped, counted, monkeypatch):
    autodepth.depth_costs(shipped, 2, _no_decode)
    autodepth.depth_costs(shipped, 2, _no_decode)
    assert counted == [2]  # memory
    monkeypatch.setattr(autodepth, "_MEMORY", {})
    autodepth.depth_costs(shipped, 2, _no_decode)
    assert counted == [2]  # the cache file
    monkeypatch.setenv("MTPLX_RECALIBRATE", "1")
    assert autodepth.recalibration_requested()
    autodepth.depth_costs(shipped, 2, _no_decode)
    assert counted == [2, 2]  # measured anew despite memory and file
    autodepth.depth_costs(shipped, 2, _no_decode)
    assert counted == [2, 2]  # once per key and process, not on every call
    autodepth.depth_costs(shipped, 3, _no_decode)
    assert counted == [2, 2, 3]


def test_request_recalibration_ignores_the_cached_file(shipped, counted, monkeypatch):
    autodepth.depth_costs(shipped, 1, _no_decode)
    assert autodepth.calibration_file(autodepth.calibration_key(shipped), 1).is_file()
    monkeypatch.setattr(autodepth, "_MEMORY", {})
    monkeypatch.setenv("MTPLX_RECALIBRATE", "0")
    assert not autodepth.recalibration_requested()
    autodepth.request_recalibration()
    assert autodepth.recalibration_requested()
    autodepth.depth_costs(shipped, 1, _no_decode)
    assert counted == [1, 1]


def test_a_remembered_calibration_is_not_measured_again_under_recalibration(shipped, counted):
    """Distributed ranks share rank 0's costs through `remember`: a recalibration must not replace them."""
    autodepth.request_recalibration()
    shared = DepthCosts(batch=4, cycle_s={"0": 1.0, "1": 0.9}, acceptance=[0.9])
    autodepth.remember(shipped, 4, shared)
    assert autodepth.depth_costs(shipped, 4, _no_decode) is shared
    assert counted == []


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def _set(module, name: str, value: mx.array) -> None:
    from mlx.utils import tree_unflatten

    module.update(tree_unflatten([(name, value)]))
    mx.eval(module.parameters())
