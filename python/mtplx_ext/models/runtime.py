"""MTPRuntime: an mlx-lm trunk plus its MTP head, with the calls decoding needs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from mtplx_ext._checks import as_int, as_int_list, require_token_batch
from mtplx_ext.cache import rollback
from mtplx_ext.cache.ragged import check_kv_quantization
from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import MTPHead
from mtplx_ext.models.fused_modules import fuse_cpu_ops
from mtplx_ext.models.packed_linear import PackedLinear, pack_cpu_linears, packing_available
from mtplx_ext.models.packed_quantized import PackedQuantizedLinear, link_prefetch, pack_cpu_quantized, product_order


def _check_left_padding(left_padding: object) -> list[int]:
    # int(p) would truncate 1.5 silently: only ints (NumPy's too) pass.
    pads = as_int_list("left_padding", left_padding, lo=0)
    if not pads:
        raise ValueError("left_padding is empty: give one pad count per stream")
    return pads


def _check_capacity(capacity: object) -> int | None:
    return None if capacity is None else as_int("capacity", capacity, lo=1)


class MTPRuntime(nn.Module):
    """An mlx-lm trunk and its MTP head (or none), as one trainable module.

    Attributes:
        trunk: the mlx-lm `Model` of the trunk family (its own call works).
        head: the MTP head, or None when the checkpoint has no MTP weights.
        mtp_modules: every MTP module of the checkpoint, `head` first
            (DeepSeek-style sequential modules: module i drafts the
            (i + 1)-th token of a cycle); empty without a head.
        model_type: trunk family, e.g. "qwen3" or "qwen3_next".
        head_layout: "qwen3_next", "deepseek", "mimo" or None.
        config: the full config.json contents.
        tokenizer: a `tokenizers.Tokenizer`, or None.
        vocab_size: vocabulary size of the logits.
    """

    #: Writes a runtime to a folder (`save`); installed by `mtplx_ext.checkpoints`.
    writer: Any = None

    def __init__(
        self,
        trunk: nn.Module,
        head: MTPHead | None,
        config: dict,
        tokenizer: Any = None,
        more_modules: list[MTPHead] | None = None,
    ):
        super().__init__()
        self.trunk = trunk
        if head is not None:
            self["head"] = head
            if more_modules:
                self["more_modules"] = list(more_modules)
        # Plain attributes: nn.Module would treat a dict as a parameter tree.
        object.__setattr__(self, "_config", dict(config))
        self.tokenizer = tokenizer
        self.model_type = str(config["model_type"])
        self.head_layout = head.layout if head is not None else None
        self.vocab_size = int(trunk_lib.text_config(config)["vocab_size"])
        self.group: Any = None  # the distributed group its layers are split across (`checkpoints.sharded`), or None
        object.__setattr__(self, "_cpu_ops_fused", False)
        object.__setattr__(self, "_kv", (None, 64))

    @property
    def kv_bits(self) -> int | None:
        """Bits per stored key/value of the caches this runtime makes (None: float KV)."""
        return self._kv[0]

    @property
    def kv_group_size(self) -> int:
        """Values per scale and bias of quantized KV."""
        return self._kv[1]

    def set_kv_quantization(self, bits: int | None, group_size: int = 64) -> None:
        """Makes later caches store keys and values quantized (`QuantizedRaggedKVCache`), or float (None).

        Args:
            bits: 2, 3, 4, 5, 6 or 8 (mlx-lm's `--kv-bits`), or None.
            group_size: 32, 64 or 128 (mlx-lm's `--kv-group-size`).

        Raises:
            ValueError / TypeError: naming `kv_bits` / `kv_group_size`.
        """
        kv = (None, as_int("kv_group_size", group_size)) if bits is None else check_kv_quantization(bits, group_size)
        object.__setattr__(self, "_kv", kv)

    @contextmanager
    def kv_quantization(self, bits: int | None, group_size: int = 64) -> Iterator[None]:
        """`set_kv_quantization` for the caches made inside a `with` block (the setting before comes back after)."""
        before = self._kv
        self.set_kv_quantization(bits, group_size)
        try:
            yield
        finally:
            object.__setattr__(self, "_kv", before)

    @property
    def config(self) -> dict:
        return self._config

    @property
    def cpu_ops_fused(self) -> bool:
        """Whether `fuse_cpu_ops` ran (decoding then routes attention too)."""
        return self._cpu_ops_fused

    def fuse_cpu_ops(self, pack_linears: bool = True) -> int:
        """Swaps RMSNorm / RoPE modules of trunk and head for fused ones, in place.

        On MLX's CPU backend `mx.fast.rms_norm`, `rope` and attention expand
        into graphs of 8-20 nodes each, and a small decode forward is bound
        by per-node overhead; the fused modules are one node each (on a GPU
        stream they run `mx.fast`). Decoding also routes mlx-lm's attention
        through the fused op while it runs. With `pack_linears`, when the
        default device is the CPU and the CPU has vector FMAs, the float32
        Linear layers are packed for the CPU decode GEMM (`pack_cpu_linears`),
        and on a CPU default device the affine-quantized layers (embedding
        and LM head included) are repacked for the CPU's quantized GEMM
        (`pack_cpu_quantized`; results within the int8 rounding of the
        activations of mlx's quantized matmul).

        Returns:
            The number of modules swapped.
        """

        n = fuse_cpu_ops(self)
        object.__setattr__(self, "_cpu_ops_fused", True)
        if pack_linears and mx.default_device() == mx.cpu:
            if packing_available():
                n += pack_cpu_linears(self)
            packed = pack_cpu_quantized(self)
            if packed:
                n += packed
                link_prefetch(product_order(self._one_cycle))
        return n

    def _one_cycle(self) -> None:
        """A one-token trunk step and, with an MTP head, its draft (the order a cycle multiplies in).

        A drafter that is not an MTP head (a Gemma 4 assistant reads the
        target's KV) is left out: its products keep no prefetch link.
        """
        tokens = mx.zeros((1, 1), mx.int32)
        _, hidden = self.forward(tokens, self.make_cache([0], ragged=True, capacity=8))
        if isinstance(self.head, MTPHead):
            self.head_forward(hidden, tokens, self.make_head_cache([0], ragged=True, capacity=8))

    @property
    def linears_packed(self) -> bool:
        """Whether any Linear layer (float or quantized) is packed for a CPU decode GEMM."""
        return any(isinstance(m, (PackedLinear, PackedQuantizedLinear)) for m in self.modules())

    @property
    def has_mtp(self) -> bool:
        return "head" in self

    @property
    def head(self) -> MTPHead | None:  # type: ignore[override]
        return self.get("head")

    @property
    def mtp_modules(self) -> list[MTPHead]:
        """The head's MTP modules in checkpoint order (one for most checkpoints)."""
        if not self.has_mtp:
            return []
        return [self.head] + list(self.get("more_modules", []))

    @property
    def hidden_source(self) -> str | None:
        """"pre_norm" or "post_norm": where the head taps the trunk; None without a head."""
        return self.head.args.hidden_source if self.has_mtp else None

    # -- caches ------------------------------------------------------------

    def _kv_args(self, kv_bits: int | None, kv_group_size: int | None) -> tuple[int | None, int]:
        """This call's (bits, group size): the arguments where given, else the runtime's setting."""
        if kv_bits is None:
            return self.kv_bits, self.kv_group_size
        return check_kv_quantization(kv_bits, self.kv_group_size if kv_group_size is None else kv_group_size)

    def make_cache(
        self,
        left_padding: list[int],
        ragged: bool = False,
        capacity: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
    ) -> list:
        """Batch-aware trunk caches, one per layer.

        Args:
            left_padding: per-row count of pad tokens on the left of the
                prompts (its length is the batch size).
            ragged: attention layers get a `RaggedKVCache` (each stream can
                be rolled back on its own) instead of mlx-lm's `BatchKVCache`.
            capacity: with `ragged`, a fixed slot count per stream (buffers
                allocated once, shapes fixed: decode steps can be compiled).
            kv_bits, kv_group_size: store keys and values quantized
                (`QuantizedRaggedKVCache`, always ragged); default: the
                runtime's `set_kv_quantization`.

        Returns:
            `BatchKVCache` (or `RaggedKVCache`) for attention layers,
            `ArraysCache(2, left_padding=...)` for recurrent layers.
        """
        return trunk_lib.make_trunk_cache(
            self.trunk, _check_left_padding(left_padding), ragged, _check_capacity(capacity),
            self._kv_args(kv_bits, kv_group_size),
        )

    def make_head_cache(
        self,
        left_padding: list[int],
        ragged: bool = False,
        capacity: int | None = None,
        depth: int = 1,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
    ) -> list:
        """Batch-aware caches for the head's attention layer(s) (see `make_cache`).

        With one MTP module: its layer's caches (the module is applied
        recursively for every draft). With several: a decode of `depth`
        drafts per cycle keeps one cache per draft position j = 0..depth-1
        (module j % modules at sequential depth j; its left padding grows by
        j, since position t of depth j pairs the token at t + 1 + j) and,
        after them, depth - 1 one-leaf `ArraysCache`s carrying each depth's
        output at its last committed position (`engine.drafter`).
        A frozen-KV drafter (a Gemma 4 assistant) keeps no cache: [].
        """
        pads = _check_left_padding(left_padding)
        if not self.has_mtp:
            raise ValueError("this model has no MTP head (head_layout is None)")
        cap = _check_capacity(capacity)
        if getattr(self.head, "frozen_kv", False):
            return []  # a frozen-KV drafter (Gemma 4 assistant) reads the trunk's caches
        mods = self.mtp_modules
        kvq = self._kv_args(kv_bits, kv_group_size)
        if len(mods) == 1:
            return trunk_lib.make_layer_caches(self.head.layer_list(), pads, ragged, cap, kvq)
        depth = as_int("depth", depth, lo=1)
        kv = [
            c
            for j in range(depth)
            for c in trunk_lib.make_layer_caches(
                mods[j % len(mods)].layer_list(), [p + j for p in pads], ragged, cap, kvq
            )
        ]
        return kv + [ArraysCache(1) for _ in range(depth - 1)]

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether the trunk has recurrent (non-trimmable) layers."""
        return any(trunk_lib.is_recurrent(l) for l in trunk_lib.local_layers(self.trunk))

    def check_tokens(self, tokens: object, name: str = "tokens") -> None:
        """Host-side check that token ids are in the vocabulary (one sync).

        Raises:
            TypeError / ValueError: naming `name` and the first bad id.
        """
        tokens = require_token_batch(name, tokens)
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bool(bad.any().item()):
            first = tokens.reshape(-1)[mx.argmax(bad.reshape(-1))].item()
            raise ValueError(
                f"{name} holds token id {first} outside the vocabulary [0, {self.vocab_size})"
            )

    # -- forwards ----------------------------------------------------------

    def forward(
        self,
        tokens: mx.array,
        cache: list | None = None,
        *,
        last_logits_only: bool = False,
    ) -> tuple[mx.array, mx.array]:
        """Trunk forward returning logits and the hidden states the head consumes.

        Args:
            tokens: [B, T] int token ids.
            cache: caches from `make_cache`, or None (differentiable).
            last_logits_only: project only the last position (logits
                [B, 1, V]), e.g. for a prefill whose other logits are unused;
                head_hidden still covers all T positions.

        Returns:
            (logits [B, T, V], head_hidden [B, T, H]); head_hidden is taken
            before or after the final norm as the head layout says (after it
            when there is no head). A token id outside the vocabulary makes
            its row's logits NaN (no host sync here; see `check_tokens`).
        """
        tokens = require_token_batch("tokens", tokens)
        embeds = trunk_lib.safe_embed(self.trunk, tokens, self.vocab_size)
        pre = trunk_lib.trunk_hidden(self.trunk, tokens, cache, embeds)
        post = trunk_lib.final_norm(self.trunk, pre)
        logits = trunk_lib.project(self.trunk, post[:, -1:] if last_logits_only else post)
        return logits, (pre if self.hidden_source == "pre_norm" else post)

    def __call__(self, tokens: mx.array, cache: list | None = None) -> tuple[mx.array, mx.array]:
        return self.forward(tokens, cache)

    def head_forward(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        head_cache: list | None = None,
        *,
        return_hidden: bool = False,
        module: int = 0,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """The MTP head's logits for the token after next.

        Args:
            hidden: [B, T, H] head_hidden from `forward` at positions t, or
                the hidden this method returned (chained drafting).
            next_tokens: [B, T] the tokens at positions t + 1.
            head_cache: caches from `make_head_cache`, or None.
            return_hidden: also return the head's own hidden states, of the
                kind the head consumes (before or after the final norm, as
                the trunk's `head_hidden`): fed back with the head's draft,
                they draft the token after that (depth > 1, as vLLM's MTP
                proposer applies one MTP layer recursively).
            module: which of `mtp_modules` runs. Module i of a checkpoint
                with several is trained on module i - 1's hidden states
                (`return_hidden`) at t and the token at t + 1 + i, and
                predicts the token at t + 2 + i.

        Returns:
            [B, T, V] logits for the tokens at t + 2; with return_hidden,
            (logits, [B, T, H] hidden).
        """
        if not self.has_mtp:
            raise ValueError("this model has no MTP head (head_layout is None)")
        module = as_int("module", module, lo=0, hi=len(self.mtp_modules))
        next_tokens = require_token_batch("next_tokens", next_tokens)
        if not isinstance(hidden, mx.array) or hidden.ndim != 3:
            raise ValueError("hidden must be an mx.array of shape [B, T, H]")
        if tuple(hidden.shape[:2]) != tuple(next_tokens.shape):
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and next_tokens {tuple(next_tokens.shape)} "
                "must agree on [B, T]"
            )
        chained, normed = self.head_states(hidden, next_tokens, head_cache, module)
        logits = self.head_logits(normed, module)
        return (logits, chained) if return_hidden else logits

    def head_states(
        self, hidden: mx.array, next_tokens: mx.array, head_cache: list | None = None, module: int = 0
    ) -> tuple[mx.array, mx.array]:
        """The head's states without the vocabulary projection (no argument checks).

        Args:
            module: which of `mtp_modules` runs.

        Returns:
            ([B, T, H] hidden to chain the head on, [B, T, H] normed states
            for `head_logits`): a decode cycle projects only the positions
            it drafts from.
        """
        embeds = trunk_lib.safe_embed(self.trunk, next_tokens, self.vocab_size)
        pre, post = self.mtp_modules[module].states(hidden, embeds, head_cache)
        return (pre if self.hidden_source == "pre_norm" else post), post

    def head_logits(self, normed: mx.array, module: int = 0) -> mx.array:
        """[B, T, V] head logits from `head_states`' normed states (of MTP module `module`)."""
        return self.mtp_modules[module].logits(normed, self.trunk)

    # -- rollback (the decode loop's repair; see mtplx_ext.cache.rollback) --------------

    def snapshot(self, cache: list) -> Any:
        """Device copy of the recurrent (non-trimmable) state of `cache`, in one primitive."""
        return rollback.snapshot_recurrent(cache)

    def restore(self, cache: list, snapshot: Any) -> None:
        """Writes a `snapshot` back into `cache`, in one primitive."""
        rollback.restore_recurrent(cache, snapshot)

    def trim(self, cache: list, n: int) -> None:
        """Drops the last `n` tokens of every KV (trimmable) layer of `cache`."""
        rollback.trim_kv(cache, n)

    # -- persistence -------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Writes an HF-style folder (config.json, model.safetensors, mtp.safetensors, tokenizer.json).

        The writer is `mtplx_ext.checkpoints.save_runtime`, installed by the
        checkpoint layer (which `import mtplx_ext` loads): this layer does not
        know file formats.
        """
        if self.writer is None:
            raise RuntimeError("MTPRuntime.save needs mtplx_ext.checkpoints (import mtplx_ext)")
        self.writer(self, path)
