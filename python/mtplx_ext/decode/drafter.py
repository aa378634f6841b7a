"""How a cycle's K drafts come out of the MTP head, and how the head's caches follow commits.

Three schemes, one interface (`pairs` then `draft`):

* `Recursive` (a checkpoint with one MTP module, as the published Qwen3-Next,
  Qwen3.5, DeepSeek-V3 and GLM-4.5 checkpoints have): the module is
  applied K times, each step fed its own output state and its own draft at
  the next position (vLLM's MTP proposer does the same). Its KV cache holds
  the committed (hidden at t, token t + 1) pairs; the chained steps' slots
  are dropped after drafting.
* `ModuleChain` (several modules, DeepSeek-style sequential MTP): draft i
  comes from module (i - 1) % M at sequential depth i - 1, exactly as such
  modules are trained: depth j at position t combines depth j - 1's output
  state at t (the trunk's hidden for j = 0) with the token at t + 1 + j and
  predicts the token at t + 2 + j, attending over depth j's own states at
  earlier positions. Each depth keeps its own KV cache of committed
  positions and a carry: its output at its last committed position, which
  depth j + 1 needs next cycle (the same per-request state TensorRT-LLM's
  MTP keeps as past hidden states). A commit runs every depth once over the
  K + 1 verified pairs, and each stream keeps its first n + 1 (n accepted);
  drafting then runs depth j over its j newest positions (the committed
  carry and depth j - 1's draft states), whose slots are dropped after.
  Depth j's cache is left-padded j slots more than the trunk's: its first j
  entries pair positions before the prompt (zero carries) and stay masked.
* `FrozenKV` (a Gemma 4 assistant): no cache of its own; every draft step
  of a cycle queries the target's KV at x0's position.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtplx_ext.cache import rollback
from mtplx_ext.models import gemma4_assistant, gemma4_trunk
from mtplx_ext.models import trunk as trunk_lib


def model_tokens(tokens: mx.array) -> mx.array:
    """Token ids safe to embed: INVALID (-1) rows only occur for finished or
    failing streams, and the raw ids still go to verification, which flags them."""
    return mx.maximum(tokens, 0)


def _at(x: mx.array, at: mx.array | None) -> mx.array:
    """[B, 1, H]: x at index at[b] of stream b (default: the last index)."""
    if at is None:
        return x[:, -1:]
    return mx.take_along_axis(x, at[:, None, None], axis=1)


def _finish(x0: mx.array, drafts: list[mx.array], infos: list[Any]) -> tuple[mx.array, Any]:
    info = None if infos[0] is None else mx.stack(infos, axis=1)
    return mx.stack([x0] + drafts, axis=1), info


class Recursive:
    """One MTP module applied K times (see the module docstring)."""

    def __init__(self, runtime: Any, policy: Any, head_cache: list, depth: int):
        self.rt, self.policy, self.head_cache, self.depth = runtime, policy, head_cache, depth

    def pairs(self, hidden: mx.array, nxt: mx.array, at: mx.array | None = None, dropped: mx.array | None = None):
        """The head over (hidden_j, nxt_j) pairs; its start state at index `at` per stream (default: the last).

        `dropped`: per-stream count of trailing pairs to roll back (per-stream commit).
        """
        chained, normed = self.rt.head_states(hidden, model_tokens(nxt), self.head_cache)
        if dropped is not None:
            rollback.rollback_streams(self.head_cache, dropped)
        return _at(chained, at), _at(normed, at)

    def draft(self, start: Any, x0: mx.array, step: Any) -> tuple[mx.array, Any]:
        """K chained head steps from the start state at x0's position.

        Returns:
            ([B, K + 1] (x0, d_1..d_K), the drafts' info stacked [B, K, ...] or None).
        """
        chained, normed = start
        prefix = [x0]
        d, info = self.policy.draft(self.rt.head_logits(normed)[:, 0], step, 1, prefix)
        drafts, infos = [d], [info]
        for i in range(2, self.depth + 1):
            chained, normed = self.rt.head_states(chained, model_tokens(d)[:, None], self.head_cache)
            prefix.append(d)
            d, info = self.policy.draft(self.rt.head_logits(normed)[:, 0], step, i, prefix)
            drafts.append(d)
            infos.append(info)
        if self.depth > 1:
            # The chained steps' slots: the next cycle writes the true pairs there.
            rollback.trim_kv(self.head_cache, self.depth - 1)
        return _finish(x0, drafts, infos)


class ModuleChain:
    """Draft i from MTP module (i - 1) % M at sequential depth i - 1 (see the module docstring).

    `head_cache` is `MTPRuntime.make_head_cache(..., depth=K)` of a runtime
    with several modules: K one-layer caches, then K - 1 carries.
    """

    def __init__(self, runtime: Any, policy: Any, head_cache: list, depth: int):
        self.rt, self.policy, self.depth = runtime, policy, depth
        self.modules = len(runtime.mtp_modules)
        if len(head_cache) != 2 * depth - 1:
            raise ValueError(
                f"head_cache has {len(head_cache)} entries; a depth-{depth} decode with {self.modules} MTP modules "
                f"needs {2 * depth - 1} (make_head_cache(..., depth={depth}))"
            )
        self.kv = [[c] for c in head_cache[:depth]]
        self.carries = head_cache[depth:]

    def _carry(self, j: int, like: mx.array) -> mx.array:
        c = self.carries[j][0]
        return mx.zeros_like(like[:, :1]) if c is None else c

    def _run(self, j: int, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        return self.rt.head_states(hidden, model_tokens(tokens), self.kv[j], j % self.modules)

    def pairs(self, hidden: mx.array, nxt: mx.array, at: mx.array | None = None, dropped: mx.array | None = None):
        """Every depth over the newest pairs: depth 0 over (hidden_j, nxt_j), depth j over
        (depth j - 1's carry and outputs but the last, nxt_j), one position behind depth j - 1.

        Returns:
            (each depth's [B, 1, H] output at index `at`, depth 0's normed
            state there): the new carries and the first draft's input.
        """
        prev, outs, normed0 = hidden, [], None
        for j in range(self.depth):
            x = prev if j == 0 else mx.concatenate([self._carry(j - 1, prev), prev[:, :-1]], axis=1)
            prev, normed = self._run(j, x, nxt)
            outs.append(_at(prev, at))
            if j == 0:
                normed0 = _at(normed, at)
        if dropped is not None:
            for kv in self.kv:
                rollback.rollback_streams(kv, dropped)
        # After the loop: depth j + 1 read depth j's carry from before this commit.
        for c, out in zip(self.carries, outs):
            c[0] = out
        return outs, normed0

    def draft(self, start: Any, x0: mx.array, step: Any) -> tuple[mx.array, Any]:
        """Depth 0's draft from the commit, then depth j over its j newest positions."""
        outs, normed = start
        prefix = [x0]
        d, info = self.policy.draft(self.rt.head_logits(normed, 0)[:, 0], step, 1, prefix)
        drafts, infos = [d], [info]
        window = None  # depth j - 1's states at its draft positions
        for j in range(1, self.depth):
            x = outs[j - 1] if window is None else mx.concatenate([outs[j - 1], window], axis=1)
            window, normed = self._run(j, x, mx.stack(drafts, axis=1))
            prefix.append(d)
            d, info = self.policy.draft(self.rt.head_logits(normed[:, -1:], j % self.modules)[:, 0], step, j + 1, prefix)
            drafts.append(d)
            infos.append(info)
        for j in range(1, self.depth):
            rollback.trim_kv(self.kv[j], j)
        return _finish(x0, drafts, infos)


class FrozenKV:
    """A Gemma 4 assistant: K draft steps at x0's position over the target's own KV.

    The assistant has no cache (`models.gemma4_assistant`): `pairs` only
    picks each stream's start state, the trunk's final-normed hidden state
    at its last committed position (index `at`), and `draft` reads the
    trunk's caches after the commit (each stream's end slot already rolled
    back), so a per-stream commit needs nothing else. The position anchor
    is per row: x0's position, ends - left_padding.
    """

    def __init__(self, runtime: Any, policy: Any, cache: list, depth: int):
        if cache is None:
            raise ValueError("a frozen-KV drafter needs the trunk's caches")
        self.rt, self.policy, self.cache, self.depth = runtime, policy, cache, depth

    def pairs(self, hidden: mx.array, nxt: mx.array, at: mx.array | None = None, dropped: mx.array | None = None):
        return _at(hidden, at)

    def draft(self, start: Any, x0: mx.array, step: Any) -> tuple[mx.array, Any]:
        """K assistant steps, each fed its own state and its own draft (q: the drafts' distributions)."""
        a, trunk = self.rt.head, self.rt.trunk
        frozen = gemma4_assistant.frozen_kv(trunk, self.cache, a.layer_types, a.args.text.sliding_window)
        h, tok, prefix = start, x0, [x0]
        drafts, infos = [], []
        for i in range(1, self.depth + 1):
            e = trunk_lib.safe_embed(trunk, model_tokens(tok)[:, None], self.rt.vocab_size)
            logits, h = a.step(gemma4_trunk.scaled_embed(trunk, e), h, frozen)
            tok, info = self.policy.draft(logits[:, 0], step, i, prefix)
            drafts.append(tok)
            infos.append(info)
            prefix.append(tok)
        return _finish(x0, drafts, infos)


def make_drafter(
    runtime: Any, policy: Any, head_cache: list, depth: int, cache: list | None = None
) -> Recursive | ModuleChain | FrozenKV:
    """The drafting scheme of a runtime's head (several MTP modules: `ModuleChain`; a
    frozen-KV assistant: `FrozenKV`, which reads the trunk's `cache`)."""
    if getattr(getattr(runtime, "head", None), "frozen_kv", False):
        return FrozenKV(runtime, policy, cache, depth)
    if len(getattr(runtime, "mtp_modules", ())) > 1:
        return ModuleChain(runtime, policy, head_cache, depth)
    return Recursive(runtime, policy, head_cache, depth)
