"""The grammar engine of structured outputs, chosen again with the install weighed beside the mask time.

For llguidance and xgrammar (whichever are installed), on the shipped
model's tokenizer (its real `tokenizer.json`):

* mask time: grammar build, then the median / p90 / max time per token (`--repeats` walks
  pooled) of
  the next-token mask while a valid answer is consumed token by token (the
  work a constrained decode does at every verified position), for two
  grammars the server builds: a realistic `json_schema` (nested object,
  enum, bounded array, integer range) and a forced tool call (the
  `<tool_call>` markers around `{"name", "arguments"}` of one of two tools);
* for llguidance also the engine's own per-cycle host work through
  `GrammarConstraint` (`RowConstraints.probe` at depth 3: K + 1 masks,
  forced drafts, roll back), which is what MTP pays per cycle;
* install size: the files each engine and every distribution it requires
  (transitively) put in site-packages, and the part of that not already
  brought by mtplx-ext and the rest of its `serve` extra.

With `--big-vocab 151643` also the json_schema walk for both engines on a
synthetic byte-level vocabulary of that size (no Qwen-sized tokenizer is
available offline here).

    PYTHONPATH=python python bench/scripts/grammar_choice.py --big-vocab 151643 --json bench/results/grammar_choice.json

An engine that is not installed is reported as such (its install size
needs it installed: sizes are read from the installed distributions).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)
import numpy as np
import tokenizers

from mtplx_ext.benchmark.provenance import provenance
from mtplx_ext.decode.constraint import JSON_LAYOUT, GrammarVocab, RowConstraints, mask_words, strict_schema
from mtplx_ext.serve.tools import forced_call_schema, tool_format
from mtplx_ext.shipped import SHIPPED_MODEL, eos_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "role": "editor", "tags": ["math", "engine"],
          "address": {"city": "London", "zip": "W1"}, "active": True}
TOOLS = [
    {"type": "function", "function": {"name": "Bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                         "description": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "Read", "parameters": {
        "type": "object", "properties": {"file_path": {"type": "string"}, "offset": {"type": "integer"},
                                         "limit": {"type": "integer"}}, "required": ["file_path"]}}},
]
CALL = {"name": "Bash", "arguments": {"command": "ls -la src/mtplx_ext", "description": "List the package"}}
#: mtplx-ext's own dependencies and the rest of its serve extra: what any engine's install adds to.
BASE = ["mlx", "mlx-lm", "numpy", "safetensors", "tokenizers", "starlette", "uvicorn", "transformers", "jsonschema"]


def _req_name(req: str) -> str | None:
    """The distribution a requirement names, None when its marker needs an extra."""
    if "extra ==" in req or "extra==" in req:
        return None
    return re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]


def closure(names: list[str]) -> dict[str, int]:
    """Installed distributions `names` require transitively: name -> bytes of their files (0 when absent)."""
    out: dict[str, int] = {}
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in out:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out[name] = 0
            continue
        size = 0
        for f in dist.files or []:
            p = Path(dist.locate_file(f))
            if p.is_file():
                size += p.stat().st_size
        out[name] = size
        todo += [n for n in (_req_name(r) for r in dist.requires or []) if n]
    return out


def install_size(engine: str) -> dict:
    mine = closure([engine])
    base = closure(BASE)
    added = {n: s for n, s in mine.items() if n not in base}
    return {"engine_mb": mine.get(engine, 0) / 1e6, "with_requirements_mb": sum(mine.values()) / 1e6,
            "added_to_serve_mb": sum(added.values()) / 1e6,
            "added": {n: round(s / 1e6, 1) for n, s in sorted(added.items(), key=lambda kv: -kv[1])}}


def summary(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"median_ms": statistics.median(s), "p90_ms": s[int(0.9 * (len(s) - 1))], "max_ms": s[-1], "tokens": len(s)}


def texts() -> dict[str, tuple[dict, str, str, str]]:
    """grammar -> (JSON schema, prefix, suffix, a valid answer's text)."""
    fmt = tool_format(None)
    call_schema = forced_call_schema(TOOLS, "required")
    sep = {"separators": (", ", ": ")}
    return {"json_schema": (SCHEMA, "", "", json.dumps(ANSWER, **sep)),
            "tool_call": (call_schema, fmt.prefix, fmt.suffix, fmt.prefix + json.dumps(CALL, **sep) + fmt.suffix)}


def bench_llguidance(tok: tokenizers.Tokenizer, vocab: int, eos: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    gv = GrammarVocab(tok, vocab, eos)
    out: dict = {"version": metadata.version("llguidance"), "vocab_setup_ms": (time.perf_counter() - t0) * 1e3}
    for name, (schema, prefix, suffix, answer) in texts().items():
        ids = tok.encode(answer).ids
        t0 = time.perf_counter()
        if prefix:
            body = {**strict_schema(schema), "x-guidance": JSON_LAYOUT}
            lark = f"start: {json.dumps(prefix)} call {json.dumps(suffix)}\ncall: %json {json.dumps(body)}"
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema), overrides=JSON_LAYOUT)
        m = llguidance.LLMatcher(gv.tokenizer, grammar, log_level=0)
        build = (time.perf_counter() - t0) * 1e3
        assert not m.is_error(), m.get_error()
        bits = np.zeros((1, mask_words(vocab)), np.int32)
        per: list[float] = []
        for _ in range(repeats):
            m = llguidance.LLMatcher(gv.tokenizer, grammar, log_level=0)
            for t in ids:
                s = time.perf_counter()
                lnp.fill_next_token_bitmask(m, bits)
                per.append((time.perf_counter() - s) * 1e3)
                assert m.consume_token(t), (name, m.get_error())
        cycles = [ms for _ in range(repeats)
                  for ms in probe(gv.wrapped_json(prefix, schema, suffix) if prefix else gv.json_schema(schema), ids, vocab)]
        out[name] = {"grammar_ms": build, **summary(per), "probe_k3": summary(cycles)}
    return out


def probe(c: Any, ids: list[int], vocab: int, depth: int = 3) -> list[float]:
    """ms per cycle of `RowConstraints.probe` at depth K walking `ids`, two tokens committed per cycle."""
    rows = RowConstraints([c], vocab, depth + 1)
    per, i = [], 0
    while i + depth + 1 <= len(ids):
        t = time.perf_counter()
        rows.probe(np.array([ids[i : i + depth + 1]]))
        per.append((time.perf_counter() - t) * 1e3)
        rows.commit(0, ids[i : i + 2])
        i += 2
    return per


def bench_xgrammar(tok: tokenizers.Tokenizer, vocab: int, eos: list[int], repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab,
                                              stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    out: dict = {"version": metadata.version("xgrammar"), "vocab_setup_ms": (time.perf_counter() - t0) * 1e3}
    for name, (schema, prefix, suffix, answer) in texts().items():
        ids = tok.encode(answer).ids
        t0 = time.perf_counter()
        g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if prefix:
            g = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"), g,
                                   xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
        compiled = compiler.compile_grammar(g)
        build = (time.perf_counter() - t0) * 1e3
        bits = np.zeros((1, mask_words(vocab)), np.int32)
        per: list[float] = []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            for t in ids:
                s = time.perf_counter()
                m.fill_next_token_bitmask(bits)
                per.append((time.perf_counter() - s) * 1e3)
                assert m.accept_token(t), name
        out[name] = {"grammar_ms": build, **summary(per)}
    return out


def walk(new_matcher: Callable[[], Any], fill: Callable[[Any], None], consume: Callable[[Any, int], bool],
         ids: list[int], repeats: int) -> list[float]:
    """ms per mask over `repeats` walks of `ids`, each with a fresh matcher."""
    per: list[float] = []
    for _ in range(repeats):
        m = new_matcher()
        for t in ids:
            s = time.perf_counter()
            fill(m)
            per.append((time.perf_counter() - s) * 1e3)
            assert consume(m, t)
    return per


def bench_big_vocab(n: int, repeats: int) -> dict:
    """The json_schema walk on a synthetic byte-level vocabulary of n tokens (`grammar_engines.synthetic_tokens`).

    No Qwen-sized tokenizer is available offline here; this stands in for
    one. Its tokenizer callback (longest match, for llguidance's forced
    tokens) uses a prebuilt index, so the figures are the engines' own.
    """
    from grammar_engines import synthetic_tokens

    toks = synthetic_tokens(n)
    index = {t: i for i, t in enumerate(toks) if t and i != 0}
    longest = max(len(t) for t in index)

    def encode(text: bytes | str) -> list[int]:
        data, ids, i = text.encode() if isinstance(text, str) else text, [], 0
        while i < len(data):
            j = next(index[data[i:i + L]] for L in range(min(longest, len(data) - i), 0, -1) if data[i:i + L] in index)
            ids.append(j)
            i += len(toks[j])
        return ids

    ids = encode(json.dumps(ANSWER, separators=(", ", ": ")))
    bits = np.zeros((1, mask_words(len(toks))), np.int32)
    out: dict = {"tokens": len(toks)}
    try:
        import llguidance
        import llguidance.numpy as lnp

        class Vocab:
            eos_token_id, bos_token_id, special_token_ids, tokens = 0, None, [0], toks
            __call__ = staticmethod(encode)

        t0 = time.perf_counter()
        lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))
        setup = (time.perf_counter() - t0) * 1e3
        g = llguidance.LLMatcher.grammar_from_json_schema(strict_schema(SCHEMA), overrides=JSON_LAYOUT)
        per = walk(lambda: llguidance.LLMatcher(lt, g, log_level=0), lambda m: lnp.fill_next_token_bitmask(m, bits),
                   lambda m, t: m.consume_token(t), ids, repeats)
        out["llguidance"] = {"vocab_setup_ms": setup, **summary(per)}
    except ImportError as e:
        out["llguidance"] = {"missing": str(e)}
    try:
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(toks, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0]))
        setup = (time.perf_counter() - t0) * 1e3
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
        per = walk(lambda: xgr.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bits),
                   lambda m, t: m.accept_token(t), ids, repeats)
        out["xgrammar"] = {"vocab_setup_ms": setup, **summary(per)}
    except ImportError as e:
        out["xgrammar"] = {"missing": str(e)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures (with provenance) to this file")
    ap.add_argument("--repeats", type=int, default=5, help="walks of each answer (fresh matchers), pooled")
    ap.add_argument("--big-vocab", type=int, default=0, help="also the json_schema walk on a synthetic vocabulary "
                    "of this many tokens (151643: Qwen-sized; 0: skip)")
    args = ap.parse_args()
    tok = tokenizers.Tokenizer.from_file(str(Path(SHIPPED_MODEL) / "tokenizer.json"))
    vocab = int(json.loads((Path(SHIPPED_MODEL) / "config.json").read_text())["vocab_size"])
    eos = list(eos_ids(tok))
    report: dict = {"vocab": vocab, "repeats": args.repeats, "engines": {}, "provenance": provenance([str(SHIPPED_MODEL)])}
    for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            r = fn(tok, vocab, eos, args.repeats)
        except ImportError as e:
            report["engines"][engine] = {"missing": str(e), "install": install_size(engine)}
            print(f"{engine}: not installed ({e})")
            continue
        r["install"] = install_size(engine)
        report["engines"][engine] = r
        inst = r["install"]
        print(f"{engine} {r['version']}: vocab setup {r['vocab_setup_ms']:.1f} ms; install {inst['engine_mb']:.1f} MB, "
              f"{inst['with_requirements_mb']:.0f} MB with its requirements, {inst['added_to_serve_mb']:.0f} MB "
              f"beyond mtplx-ext[serve]'s other packages: {inst['added']}")
        for g in ("json_schema", "tool_call"):
            x = r[g]
            line = (f"  {g:11s} grammar {x['grammar_ms']:7.2f} ms  mask/token median {x['median_ms']:.4f} ms  "
                    f"p90 {x['p90_ms']:.4f}  max {x['max_ms']:.4f}  ({x['tokens']} tokens)")
            if "probe_k3" in x:
                line += f"  probe K=3 median {x['probe_k3']['median_ms']:.3f} ms/cycle, max {x['probe_k3']['max_ms']:.3f}"
            print(line)
    if args.big_vocab:
        big = report["big_vocab"] = bench_big_vocab(args.big_vocab, args.repeats)
        for engine in ("llguidance", "xgrammar"):
            x = big[engine]
            if "missing" not in x:
                print(f"synthetic {big['tokens']}-token vocab, {engine}: setup {x['vocab_setup_ms']:.0f} ms, json_schema "
                      f"mask/token median {x['median_ms']:.4f} ms  p90 {x['p90_ms']:.4f}  max {x['max_ms']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
