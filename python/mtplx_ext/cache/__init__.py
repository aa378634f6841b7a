"""Decode caches: ragged per-stream KV, rollback and commit, row state, compiled steps.

* `ragged`: `RaggedKVCache` / `RaggedPositions`, a KV cache whose streams each
  keep their own end slot (per-stream rollback is moving that end), and
  `QuantizedRaggedKVCache`, the same with keys and values stored quantized;
* `rollback`: undoing a verification forward on mlx-lm cache lists (recurrent
  snapshots, KV trim, per-stream commit of captured recurrent states);
* `rows`: a batch's device row state as one typed object: taken out of a
  cache list, gathered with other rows, loaded into another batch's caches;
* `compiled_step`: a decode step traced once and replayed (`CompiledStep`).
"""

from mtplx_ext.cache.compiled_step import CompiledStep, mlx_kernel_cache_dir
from mtplx_ext.cache.ragged import QuantizedRaggedKVCache, RaggedKVCache, RaggedPositions, check_kv_quantization

__all__ = [
    "CompiledStep",
    "QuantizedRaggedKVCache",
    "RaggedKVCache",
    "RaggedPositions",
    "check_kv_quantization",
    "mlx_kernel_cache_dir",
]
