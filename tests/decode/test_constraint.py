"""Grammar-constrained decoding with MTP kept on (`engine.constraint`).

Greedy: constrained MTP decoding at depths 1-3 commits exactly the tokens of
constrained plain decoding, and both equal a reference that runs the trunk
over the whole sequence at every step and takes the argmax over the tokens
an independent matcher of the same grammar allows (float64). Unconstrained
rows of the same batch equal their unconstrained decoding. The answers
validate against their JSON schema (jsonschema).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import _seed

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

import mtplx_ext  # noqa: E402
import llguidance.numpy  # noqa: E402

from mtplx_ext.decode.constraint import (  # noqa: E402
    JSON_LAYOUT, GrammarVocab, RowConstraints, apply_bitmask, mask_words)
from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL, eos_ids  # noqa: E402


@pytest.fixture(scope="module")
def shipped():
    rt = mtplx_ext.load(SHIPPED_MODEL)
    eos = list(eos_ids(rt.tokenizer))
    return rt, GrammarVocab(rt.tokenizer, rt.vocab_size, eos), eos


def random_schema(rng: np.random.Generator) -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, {"enum": ["red", "green", "blue"]}]
    names = rng.choice(["name", "id", "value", "path", "items", "ok", "size"], size=int(rng.integers(1, 4)), replace=False)
    props = {str(n): kinds[int(rng.integers(len(kinds)))] for n in names}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def matcher(gv: GrammarVocab, schema: dict):
    """A bare llguidance matcher of `schema` (the layout `GrammarVocab` uses), independent of the adapter."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    return llguidance.LLMatcher(gv.tokenizer, grammar, log_level=0)


def reference_greedy(rt, gv: GrammarVocab, schema: dict, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """Masked argmax of full trunk forwards, with its own llguidance matcher (float64)."""
    m = matcher(gv, schema)
    bits = np.zeros((1, mask_words(rt.vocab_size)), np.int32)
    out: list[int] = []
    for _ in range(n):
        logits = np.array(rt.trunk(mx.array([prompt + out]))[0, -1].astype(mx.float32), np.float64)
        llguidance.numpy.fill_next_token_bitmask(m, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: rt.vocab_size].astype(bool)
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(t)
        if t in eos:
            break
        assert m.consume_token(t)
    return out


def test_apply_bitmask_forbids_exactly_the_cleared_bits():
    rng = _seed.rng()
    V = int(rng.integers(33, 300))
    allowed = rng.random((3, 2, V)) < 0.4
    padded = np.zeros((3, 2, mask_words(V) * 32), bool)
    padded[..., :V] = allowed
    words = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)
    logits = rng.standard_normal((3, 2, V)).astype(np.float32)
    got = np.array(apply_bitmask(mx.array(logits), mx.array(words)))
    assert np.array_equal(got, np.where(allowed, logits, -np.inf))


def test_greedy_constrained_mtp_equals_plain_constrained_decoding_and_the_reference(shipped):
    rt, gv, eos = shipped
    rng = _seed.rng()
    tok = rt.tokenizer
    prompts = [tok.encode(str(rng.choice(BENCH_PROMPTS))).ids for _ in range(4)]
    schemas = [random_schema(rng), None, random_schema(rng), None]  # mixed rows
    n = 48

    def run(mtp: bool, depth: int, constrained: bool = True):
        cons = [gv.json_schema(s) if s is not None and constrained else None for s in schemas]
        return mtplx_ext.generate_batched(rt, prompts, max_new_tokens=n, use_mtp_draft=mtp, depth=depth,
                                          stop_token_ids=eos, constraints=cons)

    plain = run(False, 1)
    free = run(True, 2, constrained=False)
    for i, s in enumerate(schemas):
        toks = plain.streams[i].tokens
        if s is None:
            assert toks == free.streams[i].tokens, f"unconstrained row {i} changed"
            continue
        assert toks == reference_greedy(rt, gv, s, prompts[i], n, eos), f"row {i} off the masked argmax"
        if toks[-1] in eos:
            jsonschema.validate(json.loads(tok.decode(toks[:-1])), s)
    for depth in (1, 2, 3):
        mtp = run(True, depth)
        assert 0 < mtp.accepted < mtp.drafted, "both paths of the cycle must be taken"
        assert mtp.cycles < plain.cycles
        for i in range(len(prompts)):
            assert mtp.streams[i].tokens == plain.streams[i].tokens, f"depth {depth}, row {i}"
        # One blocking read per cycle, plus the drafts of the first verification of the batch and of each
        # compacted one that still holds a constrained row.
        assert mtp.cycles + 1 <= mtp.host_syncs <= mtp.cycles + 1 + mtp.compactions


def test_row_constraints_probe_leaves_the_state_unchanged_and_masks_each_prefix(shipped):
    rt, gv, eos = shipped
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = '{"a": 12}'
    ids = rt.tokenizer.encode(text).ids
    guide = RowConstraints([gv.json_schema(schema)], rt.vocab_size, len(ids))
    before = np.array(guide.current())[0, 0]
    masks = np.array(guide.probe(np.array([ids]), force=False)[0])[0]
    assert np.array_equal(np.array(guide.current())[0, 0], before)  # rolled back
    m = matcher(gv, {**schema, "additionalProperties": False})  # json_schema is strict by default
    want = np.zeros((1, mask_words(rt.vocab_size)), np.int32)
    for j, t in enumerate(ids):
        assert m.consume_token(t)
        llguidance.numpy.fill_next_token_bitmask(m, want)
        assert np.array_equal(masks[j], want[0]), f"position {j}"


def test_constraints_are_checked_before_decoding(shipped):
    rt, gv, eos = shipped
    with pytest.raises(ValueError, match="constraints"):
        mtplx_ext.generate_batched(rt, [[1, 2]], max_new_tokens=4, constraints=[None, None], depth=1)
    with pytest.raises(ValueError, match="constraints"):
        mtplx_ext.generate_batched(rt, [[1, 2]], max_new_tokens=4, enforce_eager=True,
                                   constraints=[gv.json_object()], depth=1)
    with pytest.raises(ValueError, match="schema"):
        gv.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})


def test_strict_schema_refuses_exactly_the_unlisted_properties_at_every_level():
    from mtplx_ext.decode.constraint import strict_schema

    rng = _seed.rng()
    # Property names that are also keywords: a map of subschemas must not be read as a schema.
    names = ["properties", "type", "items", "a", "enum"]
    inner = {"type": "object", "properties": {str(n): {"type": "integer"} for n in rng.choice(names, 2, replace=False)}}
    schema = {"type": "object", "properties": {"properties": inner, "type": {"type": "string"},
                                               "list": {"type": "array", "items": inner}},
              "$defs": {"x": inner}, "enum": None}
    schema.pop("enum")
    strict = strict_schema(schema)
    inner_ok = {k: 1 for k in inner["properties"]}
    ok = {"properties": inner_ok, "type": "t", "list": [inner_ok, {}]}
    jsonschema.validate(ok, schema)
    jsonschema.validate(ok, strict)  # what the schema lists stays allowed
    extra = str(rng.choice(["zz", "additionalProperties", "required"]))
    for bad in ({**ok, extra: 1}, {**ok, "properties": {**inner_ok, extra: 1}},
                {**ok, "list": [{**inner_ok, extra: 1}]}):
        jsonschema.validate(bad, schema)  # the plain schema allows more
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, strict)
    assert strict_schema({"enum": [{"type": "object"}]}) == {"enum": [{"type": "object"}]}  # data stays data
