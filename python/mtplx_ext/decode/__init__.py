"""The decode cycle: token policies, the cycle (draft -> verify -> commit), the loop, fixed-batch generation.

Modules, in the order a decode uses them:

* `policies`: how tokens are picked, drafted and verified (greedy, exact
  sampled) and the per-stream device state they keep;
* `cycle`: one cycle's device graph (K chained drafts, one [B, K + 1]
  verification, per-stream commit or uniform repair) and its compiled steps;
* `bundle`: the chain bundle, the one array a cycle reads on the host;
* `streams`: host bookkeeping of what each stream commits;
* `loop`: serial or pipelined cycles;
* `generate`: the reference fixed-batch loop (`mtplx_ext.generate_batched` runs on the engine).
"""

from mtplx_ext.decode.generate import generate_greedy_reference, generate_reference
from mtplx_ext.decode.results import BatchedDecodeResult, StreamResult

__all__ = ["BatchedDecodeResult", "StreamResult", "generate_greedy_reference", "generate_reference"]


def __getattr__(name: str):  # the names this package exported before fixed batches moved onto the engine
    if name in ("generate_batched", "generate_greedy_batched"):
        import warnings

        warnings.warn(f"mtplx_ext.decode.{name} is the reference loop now; mtplx_ext.{name} runs on the engine",
                      DeprecationWarning, stacklevel=2)
        return generate_reference if name == "generate_batched" else generate_greedy_reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
