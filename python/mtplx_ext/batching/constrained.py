"""Per-request constraints (grammars) in the continuous-batching engine.

A request submitted with a `Constraint` has its target distribution masked
at every position (`mtplx_ext.decode.constraint`), with MTP kept on. The
engine's share of the work, kept here:

* the prefill picks x0 under the constraint's initial mask;
* a running batch with a constrained row is a batch of its own (`BatchShape.masked`:
  its compiled steps take the [B, K + 1, W] mask as an input); rows without a
  constraint get all-ones masks, so their logits are unchanged;
* such a batch runs one cycle at a time (no launch ahead): after each
  cycle's bundle is read (with the next x0 and drafts, in the same
  evaluation), each constrained row's matcher commits its accepted tokens
  and probes the next ones, and the next cycle is launched with the new
  mask. On a recomposition the merged batch's next tokens are read once.

With MTP a row's matcher consumes x0 when the cycle that verifies it
commits (x0 and the accepted drafts from the bundle); in plain decoding the
picked token is consumed when it is read (the prefill's x0 at the prefill's
end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.decode.constraint import Constraint, RowConstraints, forced_drafts

def check_constraint(constraint: Any) -> Constraint | None:
    """The `constraint` argument of `Engine.submit`, checked (TypeError naming it)."""
    if constraint is None:
        return None
    for name in ("advance", "rollback", "fill_mask", "is_terminated"):
        if not callable(getattr(constraint, name, None)):
            raise TypeError(f"constraint must be a mtplx_ext.decode.constraint.Constraint (it has no {name}())")
    return constraint


def start_prefill(cyc: Any, r: Any, vocab: int, positions: int) -> None:
    """Masks the prefill's x0 pick with the request's constraint (if any)."""
    if getattr(r, "constraint", None) is not None:
        cyc.policy.mask = RowConstraints([r.constraint], vocab, positions).current()


def finish_prefill(r: Any, x0: int, mtp: bool) -> None:
    """Plain decoding consumes the prefill's x0 now (with MTP its first cycle's bundle does)."""
    if getattr(r, "constraint", None) is not None and not mtp:
        r.constraint.advance([x0])


def guide(reqs: Sequence[Any], vocab: int, positions: int) -> RowConstraints | None:
    """The rows' constraints of a recomposed batch, or None when no row has one."""
    rows = [getattr(r, "constraint", None) for r in reqs]
    return RowConstraints(rows, vocab, positions) if any(c is not None for c in rows) else None


def recomposed(reqs: Sequence[Any], policy: Any, vocab: int, positions: int, mtp: bool, nxt: Any, info: Any
               ) -> tuple[RowConstraints | None, Any, Any]:
    """A recomposed batch's constraints (None without any), with its first mask set on `policy`.

    One read of the batch's next tokens `nxt`. Returns (constraints, next
    tokens, draft logits), forced drafts put in.
    """
    g = guide(reqs, vocab, positions)
    if g is None:
        return None, nxt, info
    return (g, *mask_next(g, policy, np.array(nxt), [True] * len(reqs), mtp, nxt, info))


def mask_next(g: RowConstraints, policy: Any, host: np.ndarray, live: Sequence[bool], mtp: bool, nxt: Any,
              info: Any) -> tuple[Any, Any]:
    """Sets the policy's mask for the step fed `nxt` (`host`: its values; [B, K + 1] x0 and drafts, plain [B, 1]).

    Returns that step's (tokens, draft logits), with forced drafts put in.
    """
    if not mtp:
        policy.mask = g.current()
        return nxt, info
    policy.mask, toks, forced = g.probe(np.asarray(host), live)
    return (nxt, info) if forced is None else forced_drafts(nxt, info, toks, forced)


def read_bundle(p: Any, g: RowConstraints | None) -> np.ndarray:
    """The cycle's one host read; with constraints the next x0 and drafts are evaluated with the bundle."""
    if g is not None and p.next_tokens is not None:
        mx.eval(p.bundle, p.next_tokens)
    return np.array(p.bundle)


def live_rows(reqs: Sequence[Any], st: Any) -> list[bool]:
    """Rows still decoding (not finished, cancelled or failed)."""
    return [r.finish_reason is None and not st.done[i] for i, r in enumerate(reqs)]


def after_cycle(g: RowConstraints, policy: Any, p: Any, b: np.ndarray, live: Sequence[bool], still: Sequence[bool],
                mtp: bool, nxt: Any, info: Any) -> tuple[Any, Any]:
    """After a cycle's read (bundle `b` of pending cycle `p`): the rows `live` before it commit, the rows
    `still` live get the next mask on `policy`. Returns the next (tokens, draft logits), forced drafts put in.
    """
    commit_cycle(g, b, live, mtp)
    host = np.array(p.next_tokens) if mtp else b
    return mask_next(g, policy, host, still, mtp, nxt, info)


def commit_cycle(g: RowConstraints, b: np.ndarray, live: Sequence[bool], mtp: bool) -> None:
    """Each live row's matcher consumes what the cycle of bundle `b` committed."""
    if mtp:
        g.commit_bundle(b, live)
        return
    for i in range(b.shape[0]):
        if live[i]:
            g.commit(i, [int(b[i, 0])])


__all__ = ["after_cycle", "check_constraint", "commit_cycle", "finish_prefill",
           "guide", "live_rows", "mask_next", "recomposed", "read_bundle", "start_prefill"]
