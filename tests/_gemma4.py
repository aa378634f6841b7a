"""Small random Gemma 4 targets and assistants, built with transformers and saved as HF folders.

`make_pair(folder, seed, ...)` writes `folder/target` (Gemma4ForCausalLM, sliding
and full layers, the last two KV-shared, window `WINDOW`) and `folder/assistant`
(Gemma4AssistantForCausalLM with a sliding and a full layer). With
`repeat=s` both lean towards repeating the last token (the sandwich norms after
attention and MLP scaled by s, the assistant reading the token embedding
through an identity `pre_projection`): greedy targets then mix runs and
changes, so a decode accepts some drafts and rejects others.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

WINDOW = 8
TARGET_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def target_config(vocab: int = 256, hidden: int = 64, **kw) -> Gemma4TextConfig:
    base = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, sliding_window=WINDOW, layer_types=TARGET_TYPES, use_double_wide_mlp=False,
        max_position_embeddings=512, final_logit_softcapping=30.0,
    )
    return Gemma4TextConfig(**{**base, **kw})


def assistant_config(vocab: int = 256, backbone: int = 64, hidden: int = 32, centroids: int = 0, **kw) -> Gemma4AssistantConfig:
    text = dict(
        model_type="gemma4_text", vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        use_double_wide_mlp=False, max_position_embeddings=512,
    )
    text.update(kw)
    extra = dict(use_ordered_embeddings=True, num_centroids=centroids, centroid_intermediate_top_k=4) if centroids else {}
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone, **extra)


def _randomize_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    # transformers initialises norms to 1 and layer scalars to 1: perturb them so a mixed-up weight shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layer_scalar"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def make_pair(
    folder: Path, seed: int, *, vocab: int = 256, repeat: float | None = None, centroids: int = 0,
    target_kw: dict | None = None, assistant_kw: dict | None = None,
) -> tuple[Path, Path]:
    """Writes `folder/target` and `folder/assistant` (see the module docstring); returns both paths."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tc = target_config(vocab, **(target_kw or {}))
    hidden = tc.hidden_size if repeat is not None else 32
    target = Gemma4ForCausalLM(tc).eval()
    assistant = Gemma4AssistantForCausalLM(
        assistant_config(vocab, tc.hidden_size, hidden, centroids, **(assistant_kw or {}))
    ).eval()
    if repeat is None:
        _randomize_norms(target, gen)
        _randomize_norms(assistant, gen)
    else:
        H = tc.hidden_size
        with torch.no_grad():
            for m in (target, assistant):
                for n, p in m.named_parameters():
                    if n.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                        p.mul_(repeat)
            assistant.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            assistant.pre_projection.weight.zero_()
            assistant.pre_projection.weight[:, :H].copy_(torch.eye(H))
    if centroids:
        with torch.no_grad():
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=gen))
    t_path, a_path = folder / "target", folder / "assistant"
    target.save_pretrained(t_path)
    assistant.save_pretrained(a_path)
    return t_path, a_path


def wrap_target(t_path: Path, out: Path, seed: int) -> Path:
    """`t_path`'s text model inside a multimodal Gemma4ForConditionalGeneration (`model_type` gemma4, as Gemma 4
    targets are published), with a small random vision tower, saved to `out`."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    torch.manual_seed(seed)
    text = Gemma4ForCausalLM.from_pretrained(t_path).eval()
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    cfg = Gemma4Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    wrapped = Gemma4ForConditionalGeneration(cfg).eval()
    wrapped.model.language_model.load_state_dict(text.model.state_dict())
    wrapped.save_pretrained(out)
    return out
