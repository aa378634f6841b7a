"""Shared helpers of the greedy decoding tests: mlx-lm references, stream checks, scripted heads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import mtplx_ext
import _seed

#: Top-2 gap (nats) below which a batched/single-stream argmax flip is a tie.
TIE_TOL = 1e-4

#: (trunk, reject_mode): per-stream rollback (attention-only trunk), the
#: uniform repair of the same trunk, and per-stream commit of a hybrid
#: (captured recurrent states).
MODES = [("qwen3", "repair"), ("qwen3", "reforward"), ("qwen3_next", "repair")]


def rolls_back(model_type: str, reject_mode: str) -> bool:
    """Whether the loop commits streams on their own (no repair forward):
    "repair" on every trunk family (hybrids select captured states)."""
    return reject_mode == "repair"


def _rng() -> np.random.Generator:
    return _seed.rng()


def _runtime(model_type: str, rng: np.random.Generator, **kw):
    return mtplx_ext.init_random(model_type, seed=int(rng.integers(1 << 30)), **kw)


def _prompts(rng: np.random.Generator, vocab: int, B: int, max_len: int = 12) -> list[list[int]]:
    lengths = rng.integers(1, max_len + 1, size=B)
    if B > 1:
        lengths[0], lengths[1] = 1, max_len  # always ragged, extremes included
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def reference(rt, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm greedy decoding of one prompt: tokens and top-2 logit gaps."""
    tokens, gaps = [], []
    for tok, logprobs in generate_step(mx.array(prompt), rt.trunk, max_tokens=n, sampler=_argmax):
        top = np.sort(np.array(logprobs, dtype=np.float64))[-2:]
        tokens.append(int(tok))
        gaps.append(float(top[1] - top[0]))
    return tokens, gaps


def expected(ref: list[int], stops: set[int], cap: int) -> list[int]:
    out = []
    for t in ref[:cap]:
        out.append(t)
        if t in stops:
            break
    return out


def check_stream(i: int, stream, ref: list[int], gaps: list[float], stops: set[int], cap: int) -> bool:
    """Asserts one stream matches its reference; False if it left it at a near tie."""
    got = stream.tokens
    assert len(got) <= cap
    assert all(t not in stops for t in got[:-1]), f"stream {i} went on after a stop token"
    exp = expected(ref, stops, cap)
    for j, (g, e) in enumerate(zip(got, exp)):
        if g != e:
            assert gaps[j] < TIE_TOL, (
                f"stream {i}, token {j}: got {g}, reference {e}; reference top-2 gap "
                f"{gaps[j]:.3g} is not a near tie"
            )
            if stream.finish_reason == "length":
                assert len(got) == cap and got[-1] not in stops
            else:
                assert stream.finish_reason == "stop" and got[-1] in stops
            return False
    assert got == exp, f"stream {i}: got {got}, expected {exp}"
    assert stream.finish_reason == ("stop" if exp[-1] in stops else "length")
    return True


def check_counters(r, mtp: bool) -> None:
    assert r.host_syncs == r.cycles
    assert r.prefill_s > 0 and r.decode_s > 0
    if mtp:
        assert r.forwards == r.cycles + r.repair_cycles
        assert 0 <= r.accepted <= r.drafted
    else:
        assert r.repair_cycles == r.drafted == r.accepted == 0
        assert r.forwards == r.cycles
        assert r.cycles == max(len(s.tokens) for s in r.streams) - 1


class ScriptedHead:
    """A runtime whose head drafts scripted tokens instead of its own.

    The head still runs (so its cache is exercised); only its logits are
    replaced, at every position (with per-stream rollback a rejecting stream
    drafts from the first of a cycle's two positions). The drafted index
    comes from the head cache's per-row offset, on the device, so the
    wrapper adds no host read and pipelining stays real.

    Modes: "oracle" drafts the reference's token (always right), "wrong" a
    different one (always wrong), "mixed" one or the other by a fixed coin
    per position, "pattern" (depth 1) by cycle, "period" right except at
    generated indices divisible by `period` (with per-stream commit: right
    for exactly the first period - 1 drafts of every cycle).
    """

    def __init__(
        self, rt, refs: list[list[int]], prompts: list[list[int]], mode: str, rng, pattern=None, period: int = 0
    ):
        self.rt = rt
        V = rt.vocab_size
        width = max(len(r) for r in refs) + 4
        table = np.zeros((len(refs), width), np.int32)
        for i, ref in enumerate(refs):
            right = np.ones(len(ref), bool) if mode == "oracle" else np.zeros(len(ref), bool)
            if mode == "mixed":
                right = rng.random(len(ref)) < 0.5
            if mode == "pattern":  # pattern[c]: cycle c's draft (generated index 2c + 1) is right
                right[1::2] = np.asarray(pattern, bool)[: len(right[1::2])]
            if mode == "period":
                right = np.arange(len(ref)) % period != 0
            table[i, : len(ref)] = np.where(right, ref, (np.array(ref) + 1) % V)
        self.table = mx.array(table)
        self.lengths = mx.array([len(p) for p in prompts])

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def keep_rows(self, rows: mx.array) -> "ScriptedHead":
        """This head for the rows a compacted batch keeps (`engine.compaction`)."""
        kept = object.__new__(ScriptedHead)
        kept.__dict__.update(self.__dict__)
        kept.table, kept.lengths = self.table[rows], self.lengths[rows]
        return kept

    def head_states(self, hidden, next_tokens, head_cache):
        chained, normed = self.rt.head_states(hidden, next_tokens, head_cache)
        # The head cache's offset was advanced by T in the call above; head
        # position j of the call drafts generated index offset - T + j + 2 - len.
        # That index rides in the normed states (which the cycle gathers per
        # stream) to `head_logits`.
        T = next_tokens.shape[1]
        g = head_cache[0].offset[:, None] - T + mx.arange(T)[None] + 2 - self.lengths[:, None]
        g = mx.clip(g, 0, self.table.shape[1] - 1)
        return chained, mx.zeros_like(normed) + g[..., None].astype(normed.dtype) + 0 * normed

    def head_logits(self, normed):
        want = mx.take_along_axis(self.table, normed[..., 0].astype(mx.int32), axis=1)
        V = self.rt.vocab_size
        return (mx.arange(V)[None, None] == want[..., None]).astype(normed.dtype) * 30.0


def check_scripted_depths(rt, prompts, want, cap: int, runs: dict, rng, **kw) -> None:
    """Greedy MTP at each depth of `runs` ({depth: head modes}) commits `want` (plain decoding's tokens).

    Modes: ScriptedHead's "mixed" / "oracle" / "wrong", or "own" (the runtime's head).
    Every oracle draft is accepted and every wrong one rejected, so both commit
    paths run deterministically. `kw` goes to `generate_greedy_batched`.
    """
    heads = {mode: ScriptedHead(rt, want, prompts, mode, rng) for mode in ("mixed", "oracle", "wrong")}
    for depth, modes in runs.items():
        for mode in modes:
            r = mtplx_ext.generate_greedy_batched(heads.get(mode, rt), prompts, max_new_tokens=cap, depth=depth, **kw)
            assert [s.tokens for s in r.streams] == want, f"depth {depth}, {mode} head"
            check_counters(r, True)
            if mode == "oracle":
                assert 0 < r.accepted == r.drafted
            if mode == "wrong":
                assert r.accepted == 0 < r.drafted
