import numpy as np
import mtplx_ext
from mtplx_ext.batching import Engine, prefix_cache
from mtplx_ext.cache.rows import split_layers
real = prefix_cache.PrefixCache.store
def spy(self, tokens, cl, row=0):
    pos, kv, rec = split_layers(cl)
    print("store", len(tokens), [int(np.array(p.ends)[row]) for p in pos])
    return real(self, tokens, cl, row)
prefix_cache.PrefixCache.store = spy
rt = mtplx_ext.load('bench/models/tiny-qwen3-next-mtp')
rng = np.random.default_rng(0); V = rt.vocab_size
e = Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64<<20)
hist = rng.integers(0, V, 100).tolist()
for t in range(3):
    p = hist + rng.integers(0, V, 60).tolist()
    r = e.submit(p, max_tokens=16); e.run_until_idle(); print(len(p), len(r.tokens), r.finish_reason)
    hist = p + r.tokens
