"""Device-side snapshot and restore of recurrent decode state."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import require_array


def _leaves(name: str, arrays: Sequence[mx.array]) -> list[mx.array]:
    if isinstance(arrays, mx.array) or not isinstance(arrays, Sequence):
        raise TypeError(f"{name} must be a list of mx.array")
    return [require_array(f"{name}[{i}]", a) for i, a in enumerate(arrays)]


def snapshot_state(
    arrays: Sequence[mx.array],
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> list[mx.array]:
    """Copies every leaf of a state on the device, in one primitive.

    Args:
        arrays: the state leaves (e.g. conv tails and delta-rule states of a
            hybrid model), any shapes and dtypes.
        stream: MLX stream or device to run on.

    Returns:
        Fresh arrays, bit-identical to the inputs.
    """
    return _ext.snapshot_state(_leaves("arrays", arrays), stream=stream)


def restore_state(
    live: Sequence[mx.array],
    snapshot: Sequence[mx.array],
    row_mask: mx.array | None = None,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> list[mx.array]:
    """Rolls state leaves back to a snapshot, for all rows or marked rows.

    Args:
        live: current leaves, each [B, ...].
        snapshot: leaves from `snapshot_state`, same shapes and dtypes.
        row_mask: optional [B] bool; rows marked True take the snapshot's
            values, the others keep the live values.
        stream: MLX stream or device to run on.

    Returns:
        The restored leaves (new arrays; the inputs are unchanged).

    Raises:
        TypeError / ValueError: naming the mismatching argument.
    """
    live_l = _leaves("live", live)
    snap_l = _leaves("snapshot", snapshot)
    if row_mask is not None:
        require_array("row_mask", row_mask)
    return _ext.restore_state(live_l, snap_l, row_mask, stream=stream)
