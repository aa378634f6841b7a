"""mtplx_ext: fast, exact batched MTP speculative decoding on MLX."""

from mtplx_ext._abi import check_extension as _check_extension

_check_extension()

from mtplx_ext.state import restore_state, snapshot_state  # noqa: E402
from mtplx_ext.verify import verify_greedy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "restore_state",
    "snapshot_state",
    "verify_greedy",
]
