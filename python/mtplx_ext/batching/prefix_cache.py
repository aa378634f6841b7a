"""Prompt prefix cache: a request whose prompt starts like an earlier one reuses that prefix's caches.

Agents and chat clients resend the whole conversation every turn; without
this every turn prefills everything again. After a prefill the engine stores
the prompt's caches, and when a request finishes, its prompt's and reply's;
a later prompt sharing its first L tokens with a stored sequence gets the
first m <= L - 1 positions loaded into its fresh caches and prefills only
the rest. m stops at least one short of L because the head's next pair needs
the trunk's hidden state at position m, which the resumed forward computes;
the head's stored pairs (hidden at t, token t + 1) for t < m are those of
the shared tokens (slot t of every KV layer depends on tokens up to t + 1).

Storage is shared in blocks (`prefix_blocks`): overlapping conversations
store their common blocks once. Attention-only trunks with a one-module head
resume at any m. Trunks with recurrent layers (GatedDeltaNet hybrids) and
heads of several MTP modules (whose per-depth carries are state too) resume
only at a boundary where a `State` was kept: the end of a stored prompt or
reply. A Gemma 4 drafter reads the trunk's KV and needs nothing more. With a
directory (`prefix_disk`) every block and state is also written to disk and
read back when the RAM tier lacks it, after a restart too.

Only the engine's thread calls `resume` and `store`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from mtplx_ext._checks import as_int
from mtplx_ext.batching.prefix_blocks import BlockStore, Node, State, block_key, root_key
from mtplx_ext.batching.prefix_disk import DiskTier, check_dir
from mtplx_ext.cache.rows import RowState, fit_capacity, split_layers
from mtplx_ext.decode.autodepth import weights_fingerprint

#: Cache slots per block.
DEFAULT_BLOCK_TOKENS = 32
#: Most child nodes read from disk when looking for a partly matching block.
DISK_CHILD_READS = 8


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mtplx-ext")
    except metadata.PackageNotFoundError:
        return "-"


@dataclass
class Plan:
    """A resume: the chain's nodes covering slots [0, m) and the recurrent state at m (None: not needed)."""

    nodes: list[Node]
    m: int
    state: State | None


def layout(cache_lists: Sequence[Sequence[Any]]) -> str:
    """What must agree between a stored block and the caches it is loaded into: the layer kinds,
    quantization and recurrent leaf counts, per cache list (a head of several modules keeps one
    cache per draft depth, so a decode at another depth has another layout)."""
    parts = []
    for cl in cache_lists:
        parts.append(",".join(
            f"{type(c).__name__}:{getattr(c, 'bits', '')}:{getattr(c, 'group_size', '')}"
            f":{len(c.cache) if isinstance(c, ArraysCache) else ''}" for c in cl))
    return "|".join(parts)


class PrefixCache:
    """Block-shared store of prompt caches, within `max_bytes` of RAM (and `disk_bytes` on disk).

    Args:
        max_bytes: most bytes kept in RAM (0 turns the cache off).
        min_tokens: the least shared prefix worth loading instead of prefilling.
        block_tokens: cache slots per block.
        fingerprint: the weights' fingerprint (`decode.autodepth.weights_fingerprint`): every key
            starts from it, so another model's blocks never match.
        disk_dir, disk_bytes: the disk tier's directory and cap (None: no disk tier).
        state_interval: tokens between the recurrent states a prefill keeps on the way (`checkpoint`); a
            multiple of `block_tokens` (and of the engine's prefill chunk, where the checkpoints fall).
    """

    def __init__(self, max_bytes: int, min_tokens: int = 8, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 fingerprint: str = "", disk_dir: Any = None, disk_bytes: int = 0, state_interval: int = 512):
        self.max_bytes = as_int("prefix_cache_bytes", max_bytes, lo=0)
        self.min_tokens = as_int("min_tokens", min_tokens, lo=1)
        self.block = as_int("prefix_block_tokens", block_tokens, lo=1)
        self.fingerprint = str(fingerprint)
        self.ram = BlockStore(self.max_bytes, as_int("state_interval", state_interval, lo=1))
        self.disk: DiskTier | None = None
        if disk_dir is not None and self.max_bytes > 0:
            self.disk = DiskTier(disk_dir, as_int("prefix_cache_disk_bytes", disk_bytes, lo=0), self.fingerprint)
        #: False while the engine warms up: what it decodes then is not worth a file.
        self.disk_writes = True
        self.stats = {"prefix_lookups": 0, "prefix_hits": 0, "prefix_tokens_reused": 0}

    @classmethod
    def for_runtime(cls, runtime: Any, max_bytes: int, disk_dir: Any = None, disk_bytes: int = 4 << 30,
                    block_tokens: int = DEFAULT_BLOCK_TOKENS) -> "PrefixCache":
        """The engine's cache: keys start from the runtime's weights fingerprint (when the cache is on).

        Raises:
            TypeError / ValueError: naming the bad argument (`prefix_cache_bytes`, `prefix_cache_dir`,
                `prefix_cache_disk_bytes`, `prefix_block_tokens`).
        """
        max_bytes = as_int("prefix_cache_bytes", max_bytes, lo=0)
        disk_bytes = as_int("prefix_cache_disk_bytes", disk_bytes, lo=0)
        block_tokens = as_int("prefix_block_tokens", block_tokens, lo=1)
        if disk_dir is not None:
            disk_dir = check_dir(disk_dir)
        # The libraries too: a file written by another MLX computed its arrays with other kernels.
        fp = f"{weights_fingerprint(runtime)}-mlx{mx.__version__}-mtplx{_version()}" if max_bytes > 0 else ""
        return cls(max_bytes, block_tokens=block_tokens, fingerprint=fp, disk_dir=disk_dir, disk_bytes=disk_bytes)

    @staticmethod
    def supported(runtime: Any) -> bool:
        """Whether this runtime's caches can be resumed from a stored prefix: every runtime the engine
        decodes (attention and GatedDeltaNet layers, heads of one or several modules, a frozen-KV drafter)."""
        return runtime is not None

    # -- tiers ---------------------------------------------------------------

    def _root(self, cache_lists: Sequence[Sequence[Any]]) -> bytes:
        return root_key(self.fingerprint, str(self.block), layout(cache_lists))

    def _node(self, key: bytes) -> Node | None:
        n = self.ram.node(key)
        if n is None and self.disk is not None:
            got = self.disk.read("n", key)
            if isinstance(got, Node):
                self.ram.put(got)
                n = got
        return n

    def _state(self, key: bytes) -> State | None:
        s = self.ram.state(key)
        if s is None and self.disk is not None:
            got = self.disk.read("s", key)
            if isinstance(got, State):
                self.ram.put(got)
                s = got
        return s

    def _children(self, key: bytes) -> list[Node]:
        kids = self.ram.child_nodes(key)
        if self.disk is not None:
            have = {n.key for n in kids}
            for k in self.disk.child_keys(key)[:DISK_CHILD_READS]:
                if k not in have and (n := self._node(k)) is not None:
                    kids.append(n)
        return kids

    def _settle(self) -> None:
        """Evicts down to the RAM cap; what was dropped for good leaves the disk too."""
        self.ram.evict(keep_disk=self.disk is not None)
        if self.disk is not None:
            for tag, key in self.ram.dropped:
                self.disk.delete(tag, key)
        self.ram.dropped.clear()

    # -- lookup and load -----------------------------------------------------

    def lookup(self, prompt: Sequence[int], cache_lists: Sequence[Sequence[Any]]) -> Plan | None:
        """The longest stored prefix of `prompt` these caches can resume from, or None (counted, and the
        prefix's blocks marked recently used)."""
        if self.max_bytes <= 0:
            return None
        self.stats["prefix_lookups"] += 1
        best = self._find(prompt, cache_lists)
        if best is None:
            return None
        self.ram.touch([*([("s", best.state.key)] if best.state is not None else []),
                        *(("n", n.key) for n in reversed(best.nodes))])
        self.stats["prefix_hits"] += 1
        self.stats["prefix_tokens_reused"] += best.m
        return best

    def peek(self, prompt: Sequence[int], runtime: Any, depth: int, mtp: bool) -> bool:
        """Whether a one-row prefill of `prompt` at `depth` would resume from the cache (not counted): the
        engine prefills such a prompt alone rather than in a group."""
        if self.max_bytes <= 0:
            return False
        # The caches a one-row prefill makes (`batch.prefill_cycle`): only their layout matters here.
        caches = [runtime.make_cache([0], ragged=True, capacity=1)]
        if mtp:
            caches.append(runtime.make_head_cache([0], ragged=True, capacity=1, depth=max(depth, 1)))
        return self._find(prompt, caches) is not None

    def _find(self, prompt: Sequence[int], cache_lists: Sequence[Sequence[Any]]) -> Plan | None:
        p = np.asarray(prompt, dtype=np.int64)
        T, B = len(p), self.block
        need_state = bool(split_layers(cache_lists)[2])
        key, pos, path = self._root(cache_lists), 0, []
        best: Plan | None = None
        while pos + B + 1 <= T:
            node = self._node(block_key(key, p[pos : pos + B + 1]))
            if node is None:
                break
            path.append(node)
            pos, key = pos + B, node.key
            if need_state and (st := self._state(key)) is not None:
                best = Plan(list(path), pos, st)
        if not need_state and pos:
            best = Plan(list(path), pos, None)
        for child in self._children(key):  # the level where the prompt leaves the chain (or ends)
            L = len(child.tokens)
            if need_state:
                if pos + L <= T and np.array_equal(child.tokens, p[pos : pos + L]) and (
                        st := self._state(child.key)) is not None and (best is None or best.m < pos + child.slots):
                    best = Plan([*path, child], pos + child.slots, st)
            else:
                n = min(L, T - pos)
                diff = np.flatnonzero(child.tokens[:n] != p[pos : pos + n])
                m = pos + (int(diff[0]) if diff.size else n) - 1
                if m > (best.m if best else 0):
                    best = Plan([*path, child], m, None)
        self._settle()
        return None if best is None or best.m < self.min_tokens else best

    @staticmethod
    def load(plan: Plan, cache_lists: Sequence[Sequence[Any]], capacity: int) -> None:
        """Makes fresh one-row caches hold the plan's first m slots (KV buffers of `capacity` slots) and,
        where the caches have recurrent layers, the state at m."""
        positions, kv, rec = split_layers(cache_lists)
        m = plan.m
        layers = []
        for i, c in enumerate(kv):
            parts = []
            for j in range(len(plan.nodes[0].kv[i])):
                a = mx.concatenate([n.kv[i][j] for n in plan.nodes], axis=2) if len(plan.nodes) > 1 \
                    else plan.nodes[0].kv[i][j]
                parts.append(fit_capacity(a[:, :, :m], capacity))
            layers.append(parts)
        leaves = [list(c.cache) for c in rec]
        if rec:
            if plan.state is None or plan.state.boundary != m:
                raise ValueError(f"a resume at {m} of caches with recurrent layers needs their state there")
            leaves = [list(parts) for parts in plan.state.leaves]
        RowState(ends=[mx.array([m], dtype=mx.int32) for _ in positions], kv=layers, rec=leaves).load_into(
            cache_lists, 1, capacity)

    def resume(self, prompt: Sequence[int], cache_lists: Sequence[Sequence[Any]], capacity: int) -> int:
        """Looks `prompt` up and loads what matched into fresh one-row caches; the slots loaded (0: none)."""
        plan = self.lookup(prompt, cache_lists)
        if plan is None:
            return 0
        self.load(plan, cache_lists, capacity)
        return plan.m

    # -- store ---------------------------------------------------------------

    def store(self, tokens: Sequence[int], cache_lists: Sequence[Sequence[Any]], row: int = 0) -> None:
        """Keeps row `row`'s caches of `tokens` (blocks not stored yet are copied).

        `tokens` are the row's prompt and committed tokens; slot t of every KV
        layer must hold what token t (and t + 1, the head's pair) gave, for t
        below the layers' end slots. The n slots all layers hold are stored,
        with the n + 1 tokens they cover. With recurrent layers the state is
        stored only when every layer ends at n (then it is the state at n), and
        nothing is stored otherwise: blocks past the last state could not be
        resumed from.
        """
        if self.max_bytes <= 0:
            return
        positions, kv, rec = split_layers(cache_lists)
        ends = [int(np.array(p.ends)[row]) for p in positions]
        n = min([*ends, len(tokens) - 1])
        if n < self.min_tokens or (rec and any(e != n for e in ends)):
            return
        toks = np.asarray(list(tokens)[: n + 1], dtype=np.int64)
        key, pos, path, shadowed, new = self._root(cache_lists), 0, [], [], []
        while pos < n:
            s = min(self.block, n - pos)
            t = toks[pos : pos + s + 1]
            k = block_key(key, t)
            node = self.ram.node(k)
            if node is None:
                # Copies (a slice would keep the whole capacity-sized buffer alive).
                node = Node(k, key, pos, t, [[mx.contiguous(a[row : row + 1, :, pos : pos + s]) for a in c.buffers]
                                             for c in kv])
                new.append(node)
            shadowed += [c for c in self.ram.child_nodes(key) if c.key != k and len(c.tokens) < len(t)
                         and np.array_equal(c.tokens, t[: len(c.tokens)])]
            path.append(node)
            key, pos = k, pos + s
        mx.eval([a for node in new for parts in node.kv for a in parts])
        for node in new:
            self.ram.put(node)
            if self.disk is not None and self.disk_writes and not self.disk.has("n", node.key):
                self.disk.write(node)
        if rec:
            state = State(key, n, [[mx.contiguous(a[row : row + 1]) for a in c.cache] for c in rec])
            mx.eval([a for parts in state.leaves for a in parts])
            self.ram.put(state)
            if self.disk is not None and self.disk_writes:
                self.disk.write(state)
        self.ram.thin_states(path, n, shadowed)
        self.ram.touch([*(("s", key),) * bool(rec), *(("n", node.key) for node in reversed(path))])
        self._settle()

    def store_finished(self, reqs: Sequence[Any], cache_lists: Sequence[Sequence[Any]]) -> None:
        """Stores the prompt and reply of each request of a batch (row i: `reqs[i]`) that finished by a stop or
        its length (not a cancelled or failed one: its reply is not what a client resends)."""
        for i, r in enumerate(reqs):
            if r.finish_reason in ("stop", "length"):
                self.store(list(r.prompt) + list(r.tokens), cache_lists, i)

    def checkpoint(self, prompt: Sequence[int], done: int, cache_lists: Sequence[Sequence[Any]]) -> None:
        """Between prefill chunks (`done` prompt tokens in the caches): with recurrent layers, at each
        multiple of `state_interval`, stores the prompt so far and the state there (a ladder's rung)."""
        if self.max_bytes > 0 and done < len(prompt) and done % self.ram.state_interval == 0 and \
                split_layers(cache_lists)[2]:
            self.store(list(prompt[: done + 1]), cache_lists)

    # -- housekeeping --------------------------------------------------------

    def reset(self) -> None:
        """Forgets the RAM tier and the counters (the disk tier keeps its files) and writes to disk again."""
        self.ram.clear()
        self.ram.evictions = 0
        self.disk_writes = True
        self.stats = dict.fromkeys(self.stats, 0)
        if self.disk is not None:
            self.disk.flush()
            self.disk.stats = dict.fromkeys(self.disk.stats, 0)

    def flush(self) -> None:
        """Waits for the disk tier's queued writes (a no-op without one)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Finishes the disk tier's queued writes and stops its writer."""
        if self.disk is not None:
            self.disk.close()

    def metrics(self) -> dict[str, Any]:
        """Counters, blocks, states, bytes per tier and the hit rate (hits / lookups). A key naming a tier
        (`prefix_bytes_disk`, `prefix_disk_hits`) is that tier's; the others are the RAM tier's."""
        s = self.stats
        out = {**s, "prefix_evictions": self.ram.evictions, "prefix_entries": self.ram.counts["n"],
               "prefix_states": self.ram.counts["s"], "prefix_bytes": self.ram.bytes,
               "prefix_hit_rate": s["prefix_hits"] / s["prefix_lookups"] if s["prefix_lookups"] else 0.0,
               "prefix_disk_hits": 0, "prefix_disk_writes": 0, "prefix_disk_skipped": 0, "prefix_disk_evictions": 0,
               "prefix_bytes_disk": 0, "prefix_entries_disk": 0}
        if self.disk is not None:
            out.update(self.disk.metrics())
        return out


__all__ = ["DEFAULT_BLOCK_TOKENS", "Plan", "PrefixCache", "layout"]
