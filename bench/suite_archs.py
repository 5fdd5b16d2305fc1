"""The architectures of bench/suite.py --archs: published dimensions, layers cut to a stated number.

Every model is built with seeded random bf16 weights (no download), in eval mode for the forward
and train mode for the training step, dropouts at 0 (a step must compute one function to be
compared). transformers models are cut to `layers` layers (LAYERS unless the spec says otherwise)
so that one variant fits a 10-minute device call with room for torch.compile and solforge's
tuning; timm's image models (pretrained=False) keep their published depth (they are small).
The measured output is the last hidden state (transformers: `last_hidden_state`; timm:
the pooled features, num_classes=0); the training step's loss is the mean of its squares in fp32
(archs.py's and BASELINES.md's B1 step).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS, from_dims  # noqa: E402  (bench/ holds scripts, not a package)

LAYERS = 8  # transformers models' layer count here (the published count is in `dims`, overridden)


@dataclass(frozen=True)
class Spec:
    source: str  # "transformers" or "timm"
    config: str  # transformers: the config class; timm: the model name
    dims: dict[str, Any] = field(default_factory=dict)  # published dimensions (timm: create_model kwargs)
    tiny: dict[str, Any] = field(default_factory=dict)  # --tiny: what replaces them
    model_class: str = "AutoModel"  # transformers class built from the config (the body, no head)
    layers_key: str = "num_hidden_layers"
    layers: int = LAYERS
    batch: int = 2  # forward; the training step runs batch 1
    seq: int = 2048  # tokens (timm: image side)
    attn: str = "sdpa"
    kind: str = "decoder"  # decoder | encoder | vision (the table groups by it)


_TINY_DEC = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_NO_DROP = dict(attention_dropout=0.0)

SPECS: dict[str, Spec] = {
    # archs.py's published dimensions, reused
    "llama-3.2-1b": Spec("transformers", "LlamaConfig", ARCHS["llama-3.2-1b"].dims, _TINY_DEC),
    "gemma-2b": Spec("transformers", "GemmaConfig", ARCHS["gemma-2b"].dims, _TINY_DEC),
    "phi-3-mini": Spec("transformers", "Phi3Config", ARCHS["phi-3-mini"].dims,
                       {k: v for k, v in _TINY_DEC.items() if k != "head_dim"}),
    "mistral-7b": Spec("transformers", "MistralConfig", ARCHS["mistral-7b"].dims, _TINY_DEC),
    "gpt2-medium": Spec("transformers", "GPT2Config", ARCHS["gpt2-medium"].dims,
                        dict(vocab_size=128, n_embd=64, n_head=4, bos_token_id=1, eos_token_id=2),
                        layers_key="n_layer", batch=4, seq=1024),
    # Qwen/Qwen3-1.7B: q/k RMSNorm per head
    "qwen3-1.7b": Spec("transformers", "Qwen3Config",
                       dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
                       _TINY_DEC),
    # google/gemma-2-2b: pre- and post-norms around each block, logit soft-capping (eager attention:
    # sdpa has no soft-capping), scaled embeddings
    "gemma2-2b": Spec("transformers", "Gemma2Config",
                      dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                           hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                           final_logit_softcapping=30.0, attn_logit_softcapping=50.0, max_position_embeddings=8192,
                           **_NO_DROP),
                      {**_TINY_DEC, "query_pre_attn_scalar": 16}, attn="eager"),
    # ibm-granite/granite-3.0-2b-base: scaled residuals (residual_multiplier), scaled embeddings
    # and attention
    "granite-3.0-2b": Spec("transformers", "GraniteConfig",
                           dict(vocab_size=49155, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                                embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                logits_scaling=8.0, max_position_embeddings=4096, tie_word_embeddings=True,
                                **_NO_DROP),
                           {k: v for k, v in _TINY_DEC.items() if k != "head_dim"}),
    # mistralai/Mixtral-8x7B-v0.1: a mixture of experts (8 experts, top 2); 4 layers: 5.6 B
    # parameters of experts still
    "mixtral-8x7b": Spec("transformers", "MixtralConfig",
                         dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                              num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
                              max_position_embeddings=32768, **_NO_DROP),
                         {**_TINY_DEC, "num_local_experts": 4}, layers=4),
    # facebook/opt-350m: post-norm (LayerNorm after each residual add), ReLU, projected embeddings
    "opt-350m": Spec("transformers", "OPTConfig",
                     dict(vocab_size=50272, hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
                          num_attention_heads=16, word_embed_proj_dim=512, max_position_embeddings=2048,
                          do_layer_norm_before=False, activation_function="relu", dropout=0.0,
                          attention_dropout=0.0, layerdrop=0.0),
                     dict(vocab_size=128, hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=32,
                          pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    # google-bert/bert-base-uncased: an encoder, post-norm, GELU, 512 positions
    "bert-base": Spec("transformers", "BertConfig",
                      dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, max_position_embeddings=512, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0),
                      dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4),
                      batch=8, seq=512, kind="encoder"),
    # google-t5/t5-base, its encoder: RMS-style T5LayerNorm (no mean, no bias), relative
    # position buckets, ReLU
    "t5-base-encoder": Spec("transformers", "T5Config",
                            dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                                 relative_attention_num_buckets=32, dropout_rate=0.0, feed_forward_proj="relu",
                                 is_encoder_decoder=False),
                            dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_heads=4),
                            model_class="T5EncoderModel", layers_key="num_layers", batch=8, seq=512, kind="encoder"),
    # timm, pretrained=False: a vision transformer, a CNN with BatchNorm, a ConvNeXt (depthwise
    # conv + LayerNorm over channels); images of 224 x 224
    "vit_base_patch16_224": Spec("timm", "vit_base_patch16_224", {}, dict(img_size=32, embed_dim=64, depth=2,
                                                                          num_heads=4),
                                 layers=0, batch=64, seq=224, kind="vision"),
    "resnet50": Spec("timm", "resnet50", {}, dict(layers=(1, 1, 1, 1)), layers=0, batch=64, seq=224, kind="vision"),
    "convnext_tiny": Spec("timm", "convnext_tiny", {}, dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
                          layers=0, batch=64, seq=224, kind="vision"),
}
# the decoders whose training step is timed too (--arch-modes train)
TRAIN = ("llama-3.2-1b", "qwen3-1.7b", "gemma-2b", "gpt2-medium")
# --tiny without --archs: a few that run on the CPU in seconds
TINY_DEFAULT = ("llama-3.2-1b", "gpt2-medium", "bert-base")
TINY_LAYERS = 2


def timm_available() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def shape(name: str, tiny: bool, mode: str) -> tuple[int, int]:
    """(batch, tokens or image side) of a forward or training step."""
    spec = SPECS[name]
    if tiny:
        return 2, 32 if spec.source == "timm" else 16
    return (1 if mode == "train" else spec.batch), spec.seq


def build(name: str, tiny: bool, device: str, mode: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model (body, no head: what the benchmark calls) and its inputs, seeded."""
    spec = SPECS[name]
    batch, seq = shape(name, tiny, mode)
    if spec.source == "timm":
        import timm

        torch.manual_seed(0)
        with torch.device(device):
            model = timm.create_model(spec.config, pretrained=False, num_classes=0,
                                      **{**spec.dims, **(spec.tiny if tiny else {})}).to(torch.bfloat16)
        x = torch.randn(batch, 3, seq, seq, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
        return model, (x,)
    dims = {**spec.dims, **(spec.tiny if tiny else {}), spec.layers_key: TINY_LAYERS if tiny else spec.layers}
    model = from_dims(spec.config, dims, device, model_class=spec.model_class, attn=spec.attn)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, (ids,)


def hidden(out: Any) -> torch.Tensor:
    """The last hidden state of a model's output."""
    if isinstance(out, torch.Tensor):
        return out
    h = getattr(out, "last_hidden_state", None)
    return h if h is not None else out[0]


def loss_of(out: Any) -> torch.Tensor:
    return hidden(out).float().square().mean()
