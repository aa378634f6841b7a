import time, numpy as np
import mtplx_ext
from mtplx_ext.batching import Engine
rt = mtplx_ext.load('bench/models/tiny-qwen3-next-mtp')
rng = np.random.default_rng(0)
V = rt.vocab_size
def conv(eng, turns=4):
    hist = rng.integers(0, V, 100).tolist(); out=[]
    r0 = np.random.default_rng(1)
    for t in range(turns):
        p = hist + r0.integers(0, V, 60).tolist()
        r = eng.submit(p, max_tokens=16); eng.run_until_idle()
        out.append(r.tokens); hist = p + r.tokens
    return out
rng = np.random.default_rng(0); a = conv(Engine(rt, max_batch=1, depth=2))
rng = np.random.default_rng(0); e = Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64<<20); b = conv(e)
print(a==b); print(e.metrics())
