"""What one MTP cycle costs, by part, in units of one plain decode step.

With the shipped model (or --model), compiled steps over fixed-capacity
ragged caches as the decode loop runs them, after a 64-token prefill (or
`--prefill`, over float or `--kv-bits` KV):

* plain: trunk forward of [B, 1] + greedy pick (one plain decode step);
* verify: trunk forward of [B, 2] + `verify_greedy` (a cycle's verification;
  `--width` K + 1: the forward of [B, K + 1] and its argmax);
* head: the MTP head over 2 positions + draft argmax;
* cycle: verify, head and the per-stream rollback in one compiled step.

MTP decoding can beat plain decoding by at most (1 + acceptance) / (cycle /
plain): this is the floor the end-to-end table in RESULTS.md runs into.
Parts are timed with one `mx.eval` each, in interleaved rounds; medians.

Run: python bench/scripts/cycle_costs.py [--batch 1,8] [--rounds 7] [--steps 40] [--prefill 3000]
     [--width 4] [--kv-bits 8]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtplx_ext.cache import rollback as cache_state
from mtplx_ext.cache.compiled_step import CompiledStep
from mtplx_ext.models.mlx_lm_patches import patch_mlx_lm_ops
from mtplx_ext.ops.greedy_verify import COL_ACCEPT, COL_BONUS, COL_SECOND, verify_greedy

MODEL = Path(mtplx_ext.__file__).parent / "assets" / "tiny-qwen3-mtp"
PREFILL = 64


class Parts:
    """Compiled parts of a cycle for one batch size, on freshly prefilled caches."""

    def __init__(self, rt, batch: int, steps: int, prefill: int = PREFILL, width: int = 2, kv_bits: int | None = None):
        self.rt, self.B, self.width = rt, batch, width
        cap = prefill + 2 * steps + 8
        kv = {"kv_bits": kv_bits}
        self.cache = rt.make_cache([0] * batch, ragged=True, capacity=cap, **kv)
        self.head_cache = rt.make_head_cache([0] * batch, ragged=True, capacity=cap, **kv)
        prompt = mx.random.randint(0, rt.vocab_size, (batch, prefill + 1)).astype(mx.int32)
        for s in range(0, prefill, 512):  # in chunks: a long prompt's attention scores stay small
            _, hidden = rt.forward(prompt[:, s : min(s + 512, prefill)], self.cache)
            rt.head_forward(hidden, prompt[:, s + 1 : min(s + 512, prefill) + 1], self.head_cache)
            mx.eval([c.state for c in self.cache + self.head_cache])
        mx.eval([c.state for c in self.cache + self.head_cache])
        self.hidden = mx.random.normal((batch, 2, hidden.shape[-1]))
        self.steps = {
            "plain": CompiledStep(self._plain, [self.cache]),
            "verify": CompiledStep(self._verify, [self.cache]),
            "head": CompiledStep(self._head, [self.head_cache]),
            "cycle": CompiledStep(self._cycle, [self.cache, self.head_cache]),
        }

    def _plain(self, tokens: mx.array) -> mx.array:
        logits, _ = self.rt.forward(tokens[:, :1], self.cache)
        cache_state.rollback_streams(self.cache, mx.ones((self.B,), mx.int32))  # stay at the prefill
        return mx.argmax(logits[:, -1], axis=-1)

    def _verify(self, tokens: mx.array) -> mx.array:
        logits, _ = self.rt.forward(tokens, self.cache)
        cache_state.rollback_streams(self.cache, mx.full((self.B,), tokens.shape[1], mx.int32))
        return verify_greedy(logits, tokens) if tokens.shape[1] == 2 else mx.argmax(logits, axis=-1)

    def _head(self, tokens: mx.array) -> mx.array:
        logits = self.rt.head_forward(self.hidden, tokens, self.head_cache)
        cache_state.rollback_streams(self.head_cache, mx.full((self.B,), 2, mx.int32))
        return mx.argmax(logits[:, -1], axis=-1)

    def _cycle(self, tokens: mx.array) -> mx.array:
        logits, hidden = self.rt.forward(tokens, self.cache)
        b = verify_greedy(logits, tokens)
        accepted = b[:, COL_ACCEPT] == 1
        pair = mx.stack([b[:, COL_SECOND], b[:, COL_BONUS]], axis=1)
        head_logits = self.rt.head_forward(hidden, mx.maximum(pair, 0), self.head_cache)
        draft = mx.argmax(mx.where(accepted[:, None], head_logits[:, 1], head_logits[:, 0]), axis=-1)
        for c in (self.cache, self.head_cache):
            cache_state.rollback_streams(c, mx.full((self.B,), 2, mx.int32))  # stay at the prefill
        return mx.stack([b[:, 0], draft.astype(mx.int32)], axis=1)

    def time(self, name: str, steps: int) -> float:
        step = self.steps[name]
        width = self.width if name == "verify" else 2
        tokens = mx.random.randint(0, self.rt.vocab_size, (self.B, width)).astype(mx.int32)
        times = []
        for i in range(steps + 3):
            t = time.perf_counter()
            mx.eval(step(tokens))
            if i >= 3:  # the first calls trace and warm up
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--acceptance", type=float, default=0.84, help="for the last column (shipped model: 0.84)")
    ap.add_argument("--prefill", type=int, default=PREFILL, help="context the parts run at")
    ap.add_argument("--width", type=int, default=2, help="tokens per row of the verification (K + 1)")
    ap.add_argument("--kv-bits", type=int, default=None, help="quantized KV (default: float)")
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    names = ("plain", "verify", "head", "cycle")
    print(
        "| batch | plain step ms | verify / plain | head / plain | cycle / plain | "
        f"best MTP x plain at acc. {args.acceptance:.2f} |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    with patch_mlx_lm_ops():
        for batch in (int(b) for b in args.batch.split(",")):
            parts = Parts(rt, batch, args.steps, args.prefill, args.width, args.kv_bits)
            rounds = [{n: parts.time(n, args.steps) for n in names} for _ in range(args.rounds)]
            ratio = {n: statistics.median(r[n] / r["plain"] for r in rounds) for n in names}
            plain_ms = statistics.median(r["plain"] for r in rounds) * 1e3
            print(
                f"| {batch} | {plain_ms:.2f} | {ratio['verify']:.2f} | {ratio['head']:.2f} | "
                f"{ratio['cycle']:.2f} | {(1 + args.acceptance) / ratio['cycle']:.2f} |"
            )


if __name__ == "__main__":
    main()
