"""`EngineOptions`: one record of an `Engine`'s settings, equal to the keywords it replaces."""

from __future__ import annotations

import dataclasses

import pytest

import mtplx_ext
from mtplx_ext.batching import Engine, EngineOptions

#: The settings `Engine.__init__` took as keywords, with the defaults it documented.
DOCUMENTED = dict(max_batch=8, depth="auto", use_mtp=True, max_kv_slots=None, prefill_chunk=256, context=None,
                  prefix_cache_bytes=0, prefix_cache_dir=None, prefix_cache_disk_bytes=4 << 30,
                  prefix_block_tokens=32, kv_bits=None, kv_group_size=64, launch_ahead=True, compact_rows=True,
                  detokenize=True, first_token_at_prefill=True)


def _resolved(eng: Engine) -> dict:
    return dict(max_batch=eng.max_batch, depth=eng.depth, mtp=eng.mtp, context=eng.context,
                max_kv_slots=eng.max_kv_slots, prefill_chunk=eng.prefill_chunk, prefix=eng.prefix.max_bytes,
                launch_ahead=eng.launch_ahead, compact_rows=eng.compact_rows, options=eng.options)


def test_the_options_defaults_are_the_documented_keyword_defaults():
    assert {f.name for f in dataclasses.fields(EngineOptions)} == set(DOCUMENTED)
    assert dataclasses.asdict(EngineOptions()) == DOCUMENTED
    assert mtplx_ext.EngineOptions is EngineOptions and "EngineOptions" in mtplx_ext.__all__


def test_options_and_keywords_build_the_same_engine(shipped):
    # depth="auto" would calibrate: every other default as documented, built three ways.
    kw = {**DOCUMENTED, "depth": 2}
    by_options = _resolved(Engine(shipped, EngineOptions(depth=2)))
    assert _resolved(Engine(shipped, depth=2)) == by_options == _resolved(Engine(shipped, **kw))
    assert by_options["options"] == EngineOptions(**kw)
    eng = Engine(shipped, EngineOptions(depth={1: 2, 4: 1}, max_batch=4, launch_ahead=False, compact_rows=False))
    assert (eng.max_batch, eng.launch_ahead, eng.compact_rows) == (4, False, False)


def test_wrong_settings_raise_naming_them(shipped):
    with pytest.raises(TypeError, match="not both.*max_batch"):
        Engine(shipped, EngineOptions(depth=2), max_batch=2)
    with pytest.raises(TypeError, match="max_btach"):
        Engine(shipped, depth=2, max_btach=2)
    with pytest.raises(TypeError, match="EngineOptions"):
        Engine(shipped, {"depth": 2})
    with pytest.raises(ValueError, match="max_batch"):
        Engine(shipped, EngineOptions(depth=2, max_batch=0))
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(shipped, depth=2, prefill_chunk=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineOptions().max_batch = 2  # type: ignore[misc]


def test_an_engine_without_detokenizing_commits_the_same_tokens_and_no_text(shipped, rng):
    prompt = [int(t) for t in rng.integers(0, shipped.vocab_size, size=8)]
    runs = {}
    for text in (True, False):
        eng = Engine(shipped, depth=2, detokenize=text)
        req = eng.submit(prompt, max_tokens=12)
        eng.run_until_idle()
        runs[text] = req
    assert runs[True].tokens == runs[False].tokens and len(runs[False].tokens) == 12
    assert runs[True].text == shipped.tokenizer.decode(runs[True].tokens) and runs[False].text == ""
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Engine(shipped, depth=2, detokenize=False).submit(prompt, max_tokens=4, stop=["x"])
