"""Token policies: how the decode loop picks, drafts and verifies tokens.

A policy only builds device graph; nothing is read on the host. Tokens a
policy cannot choose (non-finite logits) come out as INVALID. `step` is the
cycle a call belongs to (0 for the prefill; a device scalar inside compiled
steps): the sampled policy derives its uniforms from (seed, row, step, call,
draft position), so serial, pipelined, eager and compiled runs draw the same
numbers, and a stream's draws do not depend on the other streams.

Per-stream device state (penalty counts, keys) lives in plain attributes
listed in `state_attrs`: the pipelined loop checkpoints them with the caches,
and compiled steps take and return them.

Constraints (`engine.constraint`): `mask`, when set, is a [B, K + 1, W]
int32 bitmask that `pick` (position 0) and `verify` (every position) apply to
the target logits before anything else, so it is part of the target
distribution; drafts are never masked (q stays what they were drawn from).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from mtplx_ext._checks import as_seed, as_seeds
from mtplx_ext.decode import bundle as chain
from mtplx_ext.decode.constraint import apply_bitmask
from mtplx_ext.ops.sampled_verify import sample_tokens, sampler_params, verify_sampled_chain
from mtplx_ext.sampling import SamplerConfig, pack_logit_bias
from mtplx_ext.ops.greedy_verify import COL_ACCEPT, COL_SECOND, INVALID, verify_greedy, verify_greedy_chain

#: The two attributes of a policy that hold its rows' padded logit bias.
BIAS_ATTRS = ("bias_ids", "bias_values")


class _BiasRows:
    """The rows' logit bias on the device: [B, M] ids (-1 pads) and values, or None for no bias.

    The kernels add it to the target and the draft logits alike; a batch
    keeps M fixed (`width`) so that its compiled steps stay valid when other
    requests' rows are loaded.
    """

    bias_ids: mx.array | None = None
    bias_values: mx.array | None = None

    def set_bias(self, samplers: Sequence[SamplerConfig] | None, width: int | None = None) -> None:
        packed = None if samplers is None else pack_logit_bias(list(samplers), width)
        if packed is None:
            self.bias_ids = self.bias_values = None
        else:
            self.bias_ids, self.bias_values = mx.array(packed[0]), mx.array(packed[1])

    def reload_bias(self, samplers: Sequence[SamplerConfig]) -> None:
        """Loads the rows' biases at this policy's width (no-op for a policy without a bias)."""
        if self.bias_ids is not None:
            self.set_bias(samplers, int(self.bias_ids.shape[1]))

    @property
    def logit_bias(self) -> tuple[mx.array, mx.array] | None:
        if self.bias_ids is None or self.bias_values is None:
            return None
        return self.bias_ids, self.bias_values

    def biased(self, logits: mx.array) -> mx.array:
        """[B, V] logits with the bias added (float32), for a plain argmax draft."""
        bias = self.logit_bias
        if bias is None:
            return logits
        ids, values = bias
        rows = mx.arange(logits.shape[0])[:, None]
        return logits.astype(mx.float32).at[rows, mx.maximum(ids, 0)].add(mx.where(ids >= 0, values, 0.0))


class TokenPolicy(Protocol):
    """The pluggable token choice and verification of the decode cycle."""

    state_attrs: tuple[str, ...]

    def pick(self, logits: mx.array, step: Any) -> mx.array:
        """[B, V] target logits -> [B] int32 token (prefill, repair, plain decoding)."""

    def draft(self, head_logits: mx.array, step: Any, position: int, prefix: Sequence[mx.array]) -> tuple[mx.array, Any]:
        """[B, V] head logits of draft `position` (1..K) -> ([B] draft, what `verify` needs of it).

        `prefix` holds the tokens before it in this cycle: x0, d_1..d_{position-1}.
        """

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: Any, step: Any) -> mx.array:
        """[B, K+1, V] logits at (x0, d_1..d_K), [B, K+1] tokens -> [B, K+3] chain bundle."""

    def commit(self, bundle: mx.array, count: mx.array | int) -> None:
        """Records that each stream committed x0 and c_1..c_count (count: [B] or one int)."""

    def set_next(self, x0: mx.array) -> None:
        """The next cycle's x0 (decided, not committed yet)."""


class GreedyPolicy(_BiasRows):
    """Temperature 0: argmax choices, drafts accepted while they equal the argmax.

    With a logit bias (`samplers` holding one, or `slots(B, width)`) every
    argmax is that of the biased logits: the fused kernels add it.
    """

    state_attrs: tuple[str, ...] = (*BIAS_ATTRS, "mask")
    mask: mx.array | None = None

    def __init__(self, samplers: Sequence[SamplerConfig] | None = None):
        # One config is shared by every row: its bias is packed for B rows at
        # the first call, when B is known.
        self._pending = list(samplers) if samplers is not None else None

    def _rows(self, B: int) -> None:
        if self._pending is not None:
            cs = self._pending * B if len(self._pending) == 1 else self._pending
            if len(cs) != B:
                raise ValueError(f"sampler has {len(cs)} SamplerConfigs for {B} prompts")
            self.set_bias(cs)
            self._pending = None

    @classmethod
    def slots(cls, B: int, bias_width: int | None = None) -> "GreedyPolicy":
        """A policy for B rows loaded later; `bias_width` gives it a [B, width] bias (no entries yet)."""
        policy = cls()
        if bias_width is not None:
            policy.set_bias([SamplerConfig(temperature=0.0)] * B, bias_width)
        return policy

    def pick(self, logits: mx.array, step: Any = 0) -> mx.array:
        self._rows(logits.shape[0])
        logits = masked_pick(self.mask, logits)
        bias = self.logit_bias
        if bias is not None:
            # The chain primitive as a NaN-safe biased argmax: c_1 is the
            # argmax of row 0 whatever the draft, n is -1 when it is unusable.
            b = verify_greedy_chain(
                mx.stack([logits, logits], axis=1), mx.zeros((logits.shape[0], 2), mx.int32), logit_bias=bias
            )
            return mx.where(b[:, chain.COL_N] < 0, INVALID, b[:, chain.COL_TOKENS])
        # The fused verify primitive doubles as a NaN-safe argmax: x1 is the
        # argmax of the first row, accept is -1 when that row is unusable.
        b = verify_greedy(mx.stack([logits, logits], axis=1), mx.zeros((logits.shape[0], 2), mx.int32))
        return mx.where(b[:, COL_ACCEPT] < 0, INVALID, b[:, COL_SECOND])

    def draft(
        self, head_logits: mx.array, step: Any = 0, position: int = 1, prefix: Sequence[mx.array] = ()
    ) -> tuple[mx.array, Any]:
        # A plain argmax (of the biased head logits: a draft the bias
        # forces is likelier to be accepted): a draft from unusable head
        # logits is only a wrong proposal, which verification rejects.
        self._rows(head_logits.shape[0])
        return mx.argmax(self.biased(head_logits), axis=-1).astype(mx.int32), None

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: Any, step: Any = 0) -> mx.array:
        self._rows(verify_logits.shape[0])
        return verify_greedy_chain(masked_verify(self.mask, verify_logits), tokens, logit_bias=self.logit_bias)

    def commit(self, bundle: mx.array, count: mx.array | int) -> None:
        pass

    def set_next(self, x0: mx.array) -> None:
        pass

    def load_rows(self, seeds: Sequence[int], samplers: Sequence[Any], step_base: Sequence[int],
                  x0: mx.array, counts: mx.array | None) -> None:
        """Greedy rows carry no per-stream device state but their logit bias."""
        self.reload_bias(samplers)

    def unload_rows(self) -> None:
        """Greedy rows carry no per-stream device state."""
        return None


def masked_pick(mask: mx.array | None, logits: mx.array) -> mx.array:
    """[B, V] logits under position 0 of a constraint mask (unchanged without one)."""
    return logits if mask is None else apply_bitmask(logits, mask[:, 0])


def masked_verify(mask: mx.array | None, logits: mx.array) -> mx.array:
    """[B, T, V] verification logits under a constraint mask's first T positions."""
    return logits if mask is None else apply_bitmask(logits, mask[:, : logits.shape[1]])


#: Uniform streams of a sampled decode: one key per (row, step, call, position).
_CALL_PICK, _CALL_DRAFT, _CALL_ACCEPT, _CALL_RESAMPLE = range(4)
#: Odd constant that separates the key words of draft positions 2..K.
_POSITION_WORD = 0x9E3779B9


def row_keys(seeds: Sequence[int]) -> mx.array:
    """[B, 2] uint32 keys of rows with these seeds (the same in any batch).

    Through threefry: mx.random.key(s) is just the seed's two words, so for
    nearby seeds the (step, call) counter xor-ed into the low word would hand
    one row's uniforms to another row.
    """
    words = np.array(list(seeds), dtype=np.uint64)
    raw = mx.array(np.stack([(words >> 32).astype(np.uint32), (words & 0xFFFFFFFF).astype(np.uint32)], axis=1))
    return mx.vmap(lambda k: mx.random.split(k, 2)[0])(raw)


def derived_row_seeds(seed: int | None, n: int) -> list[int]:
    """The n streams' seeds a batch sampled with `seed` alone uses (stream i's from (seed, i); None: fresh)."""
    return [int(x) for x in np.random.default_rng(seed).integers(0, 2**63, size=n)]


class SampledPolicy(_BiasRows):
    """Exact speculative sampling for `SamplerConfig`s (one shared, or one per stream).

    x0 and the drafts come from `sample_tokens`; verification accepts draft
    i with probability min(1, p_i / q_i), in order, and at the first
    rejection draws from normalise(max(p_i - q_i, 0)); with every draft
    accepted the bonus is drawn from p_{K+1} (`mtplx_ext.sampling` defines
    the rule). Committed tokens follow the target's sampled distribution
    whatever the head proposes.

    Randomness: row b's uniform for (step, call, position) comes from its own
    key, so a stream's tokens depend only on its seed and its own logits. The
    bonus drawn at cycle s and the x0 a repair forward picks for cycle s + 1
    use the same uniform. Depth 1 draws exactly the numbers of the
    single-draft decoder.

    Penalty counts (generated tokens only) live on the device as a [B, V]
    int32 array updated from each bundle, kept only when some stream has a
    penalty; draft position i sees them plus x0 and d_1..d_{i-1}.

    Logit bias (`SamplerConfig.logit_bias`): a [B, M] padded pair on the
    device when some stream has one; x0, the drafts and both sides of the
    verification (p and q) are computed from the biased logits, so q is the
    distribution each draft was drawn from and the commits follow the biased
    target.
    """

    state_attrs = ("counts", "x0", "_keys", "_params", "step_base", *BIAS_ATTRS, "mask")

    def __init__(
        self,
        sampler: SamplerConfig | Sequence[SamplerConfig],
        seed: int | None = None,
        row_seeds: Sequence[int] | None = None,
    ):
        if isinstance(sampler, SamplerConfig):
            self._configs: list[SamplerConfig] | None = None
            self._shared: SamplerConfig | None = sampler
        else:
            configs = list(sampler)
            for i, c in enumerate(configs):
                if not isinstance(c, SamplerConfig):
                    raise TypeError(f"sampler[{i}] must be a SamplerConfig, got {type(c).__name__}")
            if not configs:
                raise ValueError("sampler is an empty list: give one SamplerConfig per stream")
            self._configs = configs
            self._shared = None
        self._seed = as_seed("seed", seed)
        self._row_seeds = as_seeds("row_seeds", row_seeds)
        self._ready = False
        # Device state (checkpointed by the pipelined loop with the caches).
        self.counts: mx.array | None = None
        self.x0: mx.array | None = None
        self.x0_is_bonus = False
        # [B] uint32 cycle each row counts its steps from (None: the decode's
        # own cycle). A scheduler that admits a stream at cycle g sets g - 1,
        # so the stream draws the numbers it would draw decoded alone.
        self.step_base: mx.array | None = None
        # [B, K + 1, W] constraint bitmask of the next step, or None.
        self.mask: mx.array | None = None

    @property
    def configs(self) -> list[SamplerConfig] | SamplerConfig:
        return self._configs if self._configs is not None else self._shared  # type: ignore[return-value]

    @property
    def is_plain_greedy(self) -> bool:
        """True when every stream is greedy without penalties."""
        cs = self._configs if self._configs is not None else [self._shared]
        return all(c.greedy and not c.has_penalties for c in cs)

    @property
    def penalties(self) -> bool:
        """Whether the policy keeps token counts (some row has penalties; a scheduler's slots: as asked)."""
        return bool(getattr(self, "_penalties", False))

    def prepare(self, B: int, V: int, penalties: bool | None = None) -> None:
        """Sizes the policy for B rows of a V-token vocabulary (once; later calls do nothing).

        `penalties` overrides whether counts are kept (a scheduler's slots
        keep them for rows loaded later); None: whether some row has penalties.
        """
        if self._ready:
            return
        if self._configs is not None and len(self._configs) != B:
            raise ValueError(f"sampler has {len(self._configs)} SamplerConfigs for {B} prompts")
        seeds = self._row_seeds
        if seeds is None:
            seeds = derived_row_seeds(self._seed, B)
        elif len(seeds) != B:
            raise ValueError(f"row_seeds has {len(seeds)} entries for {B} prompts")
        self._keys = row_keys(seeds)
        self._params = sampler_params(self.configs, B)
        cs = self._configs if self._configs is not None else [self._shared]
        self._penalties = any(c.has_penalties for c in cs) if penalties is None else bool(penalties)
        self.set_bias(self._configs if self._configs is not None else [self._shared] * B)
        self._ready = True

    @classmethod
    def slots(cls, B: int, vocab: int, penalties: bool, bias_width: int | None = None) -> "SampledPolicy":
        """A policy for B rows whose streams are loaded later (`load_rows`), as a scheduler uses it.

        Its arrays have their final shapes from the start, so a step compiled
        with it stays valid when other streams' rows are loaded;
        `bias_width` gives it a [B, width] logit bias.
        """
        policy = cls([SamplerConfig()] * B, row_seeds=[0] * B)
        policy.prepare(B, vocab, penalties)
        if bias_width is not None:
            policy.set_bias([SamplerConfig()] * B, bias_width)
        return policy

    def load_rows(
        self,
        seeds: Sequence[int],
        samplers: Sequence[SamplerConfig],
        step_base: Sequence[int],
        x0: mx.array,
        counts: mx.array | None,
    ) -> None:
        """Makes row b draw as stream b decoded alone: its seed's key, its sampler, its own step count.

        Args:
            seeds: each row's seed (the key `row_keys` derives, as `prepare` does).
            samplers: each row's `SamplerConfig`.
            step_base: the cycle each row's own step count starts from.
            x0: [B] each row's next x0 (not counted yet).
            counts: [B, V] int32 penalty counts, or None without penalties.
        """
        B = len(seeds)
        if len(samplers) != B or len(step_base) != B:
            raise ValueError(f"load_rows: {B} seeds, {len(samplers)} samplers, {len(step_base)} step bases")
        self._keys = row_keys(seeds)
        self._params = sampler_params(list(samplers), B)
        self.reload_bias(samplers)
        self.step_base = mx.array([s % 2**32 for s in step_base], dtype=mx.uint32)
        self.x0 = x0
        self.counts = counts if self._penalties else None

    def unload_rows(self) -> mx.array | None:
        """The rows' penalty counts (or None); drops this policy's references to its rows."""
        counts = self.counts
        self.counts = self.x0 = None
        return counts

    def uniforms(self, step: Any, calls: Sequence[int], position: int = 1) -> mx.array:
        """[B, len(calls)] float32: row b's uniform of (step, call, draft position).

        `step` may be a device scalar (an input of a compiled decode step):
        the keys are derived on the device either way, so both agree.
        Position 1 uses the single-draft decoder's keys.
        """
        step = step.astype(mx.uint32) if isinstance(step, mx.array) else mx.array(step, dtype=mx.uint32)
        if self.step_base is not None:
            step = step - self.step_base
        hi = self._keys[:, 0]
        if position > 1:
            hi = hi ^ mx.array((_POSITION_WORD * (position - 1)) & 0xFFFFFFFF, dtype=mx.uint32)
        cols = []
        for c in calls:
            key = mx.stack([hi, self._keys[:, 1] ^ ((step << 2) | c)], axis=1)
            cols.append(mx.vmap(lambda kk: mx.random.uniform(shape=(), key=kk))(key))
        return mx.stack(cols, axis=1)

    @staticmethod
    def _add(counts: mx.array, tok: mx.array) -> mx.array:
        # Invalid (-1) tokens count nothing and are never used as an index.
        rows = mx.arange(tok.shape[0])
        return counts.at[rows, mx.maximum(tok, 0)].add((tok >= 0).astype(mx.int32))

    def pick(self, logits: mx.array, step: Any = 0) -> mx.array:
        B, V = logits.shape
        self.prepare(B, V)
        if self._penalties:
            if self.counts is None:
                self.counts = mx.zeros((B, V), mx.int32)
            if self.x0 is not None and not self.x0_is_bonus:
                # Plain decoding: the previous pick is now committed.
                self.counts = self._add(self.counts, self.x0)
        u = self.uniforms(step, [_CALL_PICK])[:, 0]
        logits = masked_pick(self.mask, logits)
        tok = sample_tokens(logits, u, self._params, token_counts=self.counts, logit_bias=self.logit_bias)
        self.x0, self.x0_is_bonus = tok, False
        return tok

    def draft(
        self, head_logits: mx.array, step: Any = 0, position: int = 1, prefix: Sequence[mx.array] = ()
    ) -> tuple[mx.array, mx.array]:
        B, V = head_logits.shape
        self.prepare(B, V)
        u = self.uniforms(step, [_CALL_DRAFT], position)[:, 0]
        extra = mx.stack(list(prefix), axis=1) if self._penalties and len(prefix) else None
        d = sample_tokens(
            head_logits, u, self._params, token_counts=self.counts, extra_tokens=extra, logit_bias=self.logit_bias
        )
        return d, head_logits

    def verify(self, verify_logits: mx.array, tokens: mx.array, draft_info: mx.array, step: Any = 0) -> mx.array:
        B, T, V = verify_logits.shape
        K = T - 1
        self.prepare(B, V)
        accepts = [self.uniforms(step, [_CALL_ACCEPT], i) for i in range(1, K + 1)]
        u = mx.concatenate(
            accepts + [self.uniforms(step, [_CALL_RESAMPLE]), self.uniforms(step + 1, [_CALL_PICK])], axis=1
        )
        verify_logits = masked_verify(self.mask, verify_logits)
        return verify_sampled_chain(
            verify_logits, draft_info, tokens, u, self._params, token_counts=self.counts, logit_bias=self.logit_bias
        )

    def commit(self, bundle: mx.array, count: mx.array | int) -> None:
        """Counts x0 and c_1..c_count as generated; the next x0 is not counted yet."""
        if self._penalties and self.counts is not None:
            counts = self._add(self.counts, bundle[:, chain.COL_X0])
            c = chain.committed_tokens(bundle)
            K = c.shape[1] - 1
            for j in range(K if isinstance(count, mx.array) else int(count)):
                tok = c[:, j] if not isinstance(count, mx.array) else mx.where(j < count, c[:, j], INVALID)
                counts = self._add(counts, tok)
            self.counts = counts
        self.x0_is_bonus = True

    def set_next(self, x0: mx.array) -> None:
        """The next cycle's x0 (the bonus or a stream's own token), not counted yet."""
        self.x0 = x0


def make_policy(sampler: Any = None, seed: int | None = None, row_seeds: Sequence[int] | None = None) -> Any:
    """The token policy for a sampler setting.

    Args:
        sampler: None; a `SamplerConfig` or one per stream (exact sampled
            speculative decoding: `SampledPolicy`); or any object with
            `temperature` 0 (greedy).
        seed, row_seeds: random seeds of the sampled path; row_seeds (one
            per stream) make each stream independent of the batch.

    Raises:
        NotImplementedError: temperature > 0 without a SamplerConfig.
        TypeError / ValueError: for an unusable sampler.
    """
    if sampler is None:
        return GreedyPolicy()
    if isinstance(sampler, SamplerConfig) or (
        isinstance(sampler, Sequence) and len(sampler) > 0 and all(isinstance(c, SamplerConfig) for c in sampler)
    ):
        sampled = SampledPolicy(sampler, seed=seed, row_seeds=row_seeds)
        if not sampled.is_plain_greedy:
            return sampled
        cs = [sampler] if isinstance(sampler, SamplerConfig) else list(sampler)
        return GreedyPolicy(cs) if any(c.has_bias for c in cs) else GreedyPolicy()
    temperature = getattr(sampler, "temperature", None)
    if temperature is None:
        raise TypeError(f"sampler must be None or have a temperature, got {type(sampler).__name__}")
    temperature = float(temperature)
    if not temperature >= 0.0:
        raise ValueError(f"sampler.temperature must be >= 0, got {temperature}")
    if temperature == 0.0:
        return GreedyPolicy()
    raise NotImplementedError("sampled decoding (temperature > 0) takes a mtplx_ext.SamplerConfig (or one per stream)")
