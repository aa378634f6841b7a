"""Grammar engines side by side: per-token mask time on a JSON-schema grammar.

For llguidance, xgrammar and outlines-core (whichever are installed): the
time to build the grammar for one JSON schema, then the median time per
token to compute the next-token mask while consuming a schema-valid
answer token by token (the work a constrained decode does per position).
Two vocabularies: the shipped model's tokenizer (2048 tokens) and a
synthetic byte-level vocabulary of 151,643 tokens (the shipped tokenizer's
tokens plus frequent words and word pieces of Python sources, with and
without a leading space) standing in for a Qwen-sized vocabulary, since no
such tokenizer is available offline here.

Then the engine's own per-cycle host work on each vocabulary
(`RowConstraints.probe` at depth 3: K + 1 masks, forced drafts, roll back).
The engine's current choice weighs the install too: `grammar_choice.py`.

    python bench/scripts/grammar_engines.py [--big-vocab 151643]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engine", "notes"],
                     "address": {"city": "London", "zip": "W1"}})
SHIPPED = Path(__file__).resolve().parents[2] / "python/mtplx_ext/assets/tiny-qwen3-mtp/tokenizer.json"


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def shipped_tokens() -> list[bytes]:
    tok = json.loads(SHIPPED.read_text())
    dec = byte_decoder()
    vocab = tok["model"]["vocab"]
    out = [b""] * len(vocab)
    for s, i in vocab.items():
        out[i] = bytes(dec[c] for c in s)
    for a in tok.get("added_tokens", []):
        out[a["id"]] = a["content"].encode()
    return out


def synthetic_tokens(n: int) -> list[bytes]:
    base = shipped_tokens()
    seen = set(base)
    counts: collections.Counter[bytes] = collections.Counter()
    root = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(root.rglob("*.py"))[:6000]:
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for w in re.findall(rb"[A-Za-z_]{2,16}|[0-9]{1,3}|[^\sA-Za-z0-9]{1,3}", text):
            counts[w] += 1
            counts[b" " + w] += 1
            if len(w) > 4:
                counts[w[: len(w) // 2]] += 1
    out = list(base)
    for w, _ in counts.most_common():
        if len(out) >= n:
            break
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


_INDEX: dict[int, tuple[dict[bytes, int], int]] = {}


def greedy_ids(tokens: list[bytes], text: str) -> list[int]:
    """Longest-match tokenization of `text` over the vocabulary (a valid token path).

    The index is built once per vocabulary: llguidance calls this for the
    text it forces, and rebuilding a 151k-entry index per call (about 40 ms)
    once passed for llguidance's own mask time here.
    """
    if id(tokens) not in _INDEX:
        idx = {t: i for i, t in enumerate(tokens) if t and i != 0}
        _INDEX[id(tokens)] = idx, max(len(t) for t in idx)
    index, longest = _INDEX[id(tokens)]
    data, ids, i = text.encode(), [], 0
    while i < len(data):
        for L in range(min(longest, len(data) - i), 0, -1):
            j = index.get(data[i : i + L])
            if j is not None:
                ids.append(j)
                i += L
                break
        else:
            raise ValueError(f"byte {data[i]} has no token")
    return ids


def bench_llguidance(tokens: list[bytes], ids: list[int]) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    class Tok:
        eos_token_id, bos_token_id, special_token_ids = 0, None, [0]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: bytes | str) -> list[int]:
            return greedy_ids(tokens, s.decode() if isinstance(s, bytes) else s)

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llguidance.LLMatcher(lt, grammar)
    t2 = time.perf_counter()
    mask = lnp.allocate_token_bitmask(1, len(tokens))
    per = []
    for t in ids:
        s = time.perf_counter()
        lnp.fill_next_token_bitmask(m, mask)
        per.append(time.perf_counter() - s)
        assert m.consume_token(t), m.get_error()
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_ms": [x * 1e3 for x in per]}


def bench_xgrammar(tokens: list[bytes], ids: list[int]) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    comp = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, len(tokens))
    per = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - s)
        assert m.accept_token(t)
    del torch
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_ms": [x * 1e3 for x in per]}


def bench_outlines(tokens: list[bytes], ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if i != 0 and t:
            mapping.setdefault(t, []).append(i)
    vocab = Vocabulary(0, mapping)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    g = Guide(index)
    t2 = time.perf_counter()
    per = []
    for t in ids:
        s = time.perf_counter()
        allowed = g.get_tokens()
        per.append(time.perf_counter() - s)
        assert t in allowed
        g.advance(t)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_ms": [x * 1e3 for x in per]}


def bench_probe(tokens: list[bytes], ids: list[int], depth: int = 3) -> list[float]:
    """ms per cycle of the engine's host mask work (`RowConstraints.probe`, llguidance) at depth K, one row.

    Cycles walk the answer: each probes the next K + 1 tokens (masks for
    every position, forced drafts, roll back) and commits two of them.
    """
    import llguidance
    import numpy as np

    from mtplx_ext.decode.constraint import JSON_LAYOUT, GrammarConstraint, RowConstraints

    class Tok:
        eos_token_id, bos_token_id, special_token_ids = 0, None, [0]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: bytes | str) -> list[int]:
            return greedy_ids(tokens, s.decode() if isinstance(s, bytes) else s)

    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_LAYOUT)
    rows = RowConstraints([GrammarConstraint(lt, grammar)], len(tokens), depth + 1)
    compact = greedy_ids(tokens, json.dumps(json.loads(ANSWER), separators=(", ", ": ")))
    per, i = [], 0
    while i + depth + 1 <= len(compact):
        t = time.perf_counter()
        rows.probe(np.array([compact[i : i + depth + 1]]))
        per.append((time.perf_counter() - t) * 1e3)
        rows.commit(0, compact[i : i + 2])
        i += 2
    return per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-vocab", type=int, default=151643)
    args = ap.parse_args()
    vocabs = {"shipped (2048)": shipped_tokens(), f"synthetic ({args.big_vocab})": synthetic_tokens(args.big_vocab)}
    for name, tokens in vocabs.items():
        ids = greedy_ids(tokens, ANSWER)
        print(f"vocab {name}: {len(tokens)} tokens, answer {len(ids)} tokens")
        for eng, fn in [("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)]:
            try:
                r = fn(tokens, ids)
            except Exception as e:  # an engine that is missing or fails is reported, not fatal
                print(f"  {eng:14s} failed: {type(e).__name__}: {e}")
                continue
            ms = r["mask_ms"]
            print(f"  {eng:14s} vocab setup {r['tokenizer_s']*1e3:8.1f} ms  grammar {r['compile_s']*1e3:8.1f} ms  "
                  f"mask/token median {statistics.median(ms):.3f} ms  p90 {sorted(ms)[int(0.9*len(ms))]:.3f} ms")
        try:
            per = bench_probe(tokens, ids)
            print(f"  engine probe (llguidance, K = 3): median {statistics.median(per):.3f} ms/cycle, "
                  f"max {max(per):.3f} ms ({len(per)} cycles)")
        except Exception as e:  # noqa: BLE001
            print(f"  engine probe failed: {type(e).__name__}: {e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
