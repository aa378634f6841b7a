"""The decode cycle: token policies, the cycle (draft -> verify -> commit), the loop, fixed-batch generation.

Modules, in the order a decode uses them:

* `policies`: how tokens are picked, drafted and verified (greedy, exact
  sampled) and the per-stream device state they keep;
* `cycle`: one cycle's device graph (K chained drafts, one [B, K + 1]
  verification, per-stream commit or uniform repair) and its compiled steps;
* `bundle`: the chain bundle, the one array a cycle reads on the host;
* `streams`: host bookkeeping of what each stream commits;
* `loop`: serial or pipelined cycles;
* `generate`: fixed-batch `generate_batched` / `generate_greedy_batched`.
"""

from mtplx_ext.decode.generate import generate_batched, generate_greedy_batched
from mtplx_ext.decode.results import BatchedDecodeResult, StreamResult

__all__ = ["BatchedDecodeResult", "StreamResult", "generate_batched", "generate_greedy_batched"]
