"""The prefix cache's RAM tier: hashed block chains, boundary states, least recently used out.

A stored token sequence is cut into blocks of `block` cache slots. Slot s of
every KV layer depends on the tokens up to s + 1 at most (the trunk's on
token s, the MTP head's pair (hidden at s, token s + 1); a head of several
modules keeps depth j's pair of the same slot with the token at s + 1 too:
`decode.drafter.ModuleChain`), so a block of slots [a, a + block) is named by
its parent's key and its block + 1 tokens a..a + block (the last one, the
lookahead, is the next block's first). Two prompts that start alike walk the
same keys and share those blocks: ten turns of a conversation store the
first turn's blocks once. The end of a stored sequence that does not fill a
block is a partial node (fewer slots, same naming); it has no children.

Recurrent layers (a hybrid trunk's conv and GatedDeltaNet state, the carries
of a head of several modules) cannot be cut back to an earlier slot, so a
resume at slot m needs their state *at* m: a `State` hangs on the node that
ends at its boundary. States are kept where a stored prompt or reply ends
and, during a cold prefill, every `state_interval` tokens (a ladder: a
prompt that shares only a long system prompt with a stored one resumes from
the last rung inside it). When a later state of the same chain is stored,
the earlier ones that are not rungs are dropped: the later one serves every
prompt that extends it.

Nodes and states live in one least-recently-used order within `max_bytes`;
a hit touches its path leaf first, so a chain's root is the last to go. Only
the engine's thread touches the store.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


def block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The 16-byte name of a node: its parent's key and its tokens (slots + the lookahead)."""
    h = hashlib.blake2b(parent, digest_size=16)
    toks = np.ascontiguousarray(tokens, dtype="<i8")
    h.update(len(toks).to_bytes(4, "little"))
    h.update(toks.tobytes())
    return h.digest()


def root_key(*parts: str) -> bytes:
    """The key every chain starts from: what the stored arrays depend on besides the tokens
    (the weights, the caches' layout, the block size)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


@dataclass
class Node:
    """Slots [start, start + slots) of a chain: their tokens (slots + 1) and every KV layer's arrays.

    Attributes:
        kv: per KV layer, its stored parts (keys and values, or their
            quantized parts), [1, H, slots, X] each.
    """

    key: bytes
    parent: bytes
    start: int
    tokens: np.ndarray
    kv: list[list[mx.array]]
    nbytes: int = 0

    @property
    def slots(self) -> int:
        return len(self.tokens) - 1

    @property
    def end(self) -> int:
        return self.start + self.slots


@dataclass
class State:
    """The recurrent layers' leaves after `boundary` slots (the end of node `key`), [1, ...] each."""

    key: bytes
    boundary: int
    leaves: list[list[mx.array]]
    nbytes: int = 0


def nbytes_of(arrays: Iterable[list[mx.array]]) -> int:
    return sum(a.nbytes for parts in arrays for a in parts)


@dataclass
class BlockStore:
    """Nodes and states within `max_bytes`, least recently used first out.

    `evicted` collects what went out since the caller last cleared it (the
    disk tier keeps nodes; a dropped state is gone).
    """

    max_bytes: int
    state_interval: int = 1024
    items: OrderedDict[tuple[str, bytes], Node | State] = field(default_factory=OrderedDict)
    children: dict[bytes, set[bytes]] = field(default_factory=dict)
    bytes: int = 0
    evictions: int = 0
    #: Items held per kind ("n", "s"): kept up to date, so metrics read from other threads never iterate `items`.
    counts: dict[str, int] = field(default_factory=lambda: {"n": 0, "s": 0})
    dropped: list[tuple[str, bytes]] = field(default_factory=list)

    def node(self, key: bytes) -> Node | None:
        n = self.items.get(("n", key))
        return n if isinstance(n, Node) else None

    def state(self, key: bytes) -> State | None:
        s = self.items.get(("s", key))
        return s if isinstance(s, State) else None

    def child_nodes(self, key: bytes) -> list[Node]:
        return [n for k in self.children.get(key, ()) if (n := self.node(k)) is not None]

    def put(self, item: Node | State) -> None:
        """Adds (or replaces) a node or state, as the most recently used."""
        tag = "n" if isinstance(item, Node) else "s"
        self.remove(tag, item.key, dropped=False)
        item.nbytes = nbytes_of(item.kv if isinstance(item, Node) else item.leaves)
        self.items[(tag, item.key)] = item
        self.bytes += item.nbytes
        self.counts[tag] += 1
        if isinstance(item, Node):
            self.children.setdefault(item.parent, set()).add(item.key)

    def remove(self, tag: str, key: bytes, dropped: bool = True) -> None:
        """Removes a node or state (`dropped`: for good, from the disk tier too)."""
        item = self.items.pop((tag, key), None)
        if item is None:
            return
        self.bytes -= item.nbytes
        self.counts[tag] -= 1
        if isinstance(item, Node):
            kids = self.children.get(item.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.children[item.parent]
        if dropped:
            self.dropped.append((tag, key))

    def touch(self, keys: Iterable[tuple[str, bytes]]) -> None:
        """Marks items most recently used, in the given order (give a path leaf first)."""
        for k in keys:
            if k in self.items:
                self.items.move_to_end(k)

    def evict(self, keep_disk: bool) -> None:
        """Drops least recently used items until within `max_bytes`.

        Without a disk tier a dropped node takes its descendants along (no
        walk can reach them any more); with one they stay reachable through
        the parent's file.
        """
        while self.bytes > self.max_bytes and self.items:
            (tag, key), item = next(iter(self.items.items()))
            self.remove(tag, key, dropped=False)
            self.evictions += 1
            if tag == "n" and not keep_disk:
                self.remove("s", key, dropped=False)
                stack = list(self.children.get(key, ()))
                while stack:
                    k = stack.pop()
                    stack.extend(self.children.get(k, ()))
                    self.remove("n", k, dropped=False)
                    self.remove("s", k, dropped=False)

    def thin_states(self, path: list[Node], boundary: int, shadowed: list[Node]) -> None:
        """After a state at `boundary` on `path`: drops the earlier states of the same chain but the ladder's
        rungs (multiples of `state_interval`), and the `shadowed` partial nodes (prefixes of path nodes) left
        without a state."""
        for n in [*path, *shadowed]:
            if n.end < boundary and n.end % self.state_interval and self.state(n.key) is not None:
                self.remove("s", n.key)
        for n in shadowed:
            if self.state(n.key) is None:
                self.remove("n", n.key)

    def clear(self) -> None:
        self.items.clear()
        self.children.clear()
        self.bytes = 0
        self.counts = {"n": 0, "s": 0}
        self.dropped.clear()



__all__ = ["BlockStore", "Node", "State", "block_key", "nbytes_of", "root_key"]
