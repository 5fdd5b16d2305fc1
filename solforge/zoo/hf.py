"""Built-in zoo: Hugging Face transformers architectures from their published configurations.

A new architecture is a config function and a ZOO line: the model is built with AutoModelForCausalLM,
so no per-model code lives here (docs/design.md, Capture and integration: a new architecture needs no new code).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from solforge.errors import UserError
from solforge.zoo.base import LoadedModel, one_line, seeded

DEFAULT_BATCH = 1
DEFAULT_SEQ = 128

# The fields that decide the shapes of every weight: a checkpoint that differs in any of them is a
# different model, and loading it under this zoo name would be a mistake (or crash deep inside HF).
ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def transformers_module() -> ModuleType:
    """Import transformers, or say how to get it: it is an optional dependency (solforge[hf])."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            "the model zoo needs Hugging Face transformers: pip install 'solforge[hf]'"
        ) from None
    return transformers


def _qwen3(**arch: Any) -> Any:
    """A Qwen3Config with the settings every zoo Qwen3 shares, plus the given architecture."""
    transformers = transformers_module()
    rope_theta = arch.pop("rope_theta", 1_000_000.0)
    return transformers.Qwen3Config(
        # transformers 5 takes RoPE settings as rope_parameters (rope_theta alone is the 4.x spelling).
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        hidden_act="silu",
        attention_bias=False,
        # No KV cache: the forward returns only logits, so capture and validation compare one tensor
        # and the graph has no cache-update ops that inference without generation never needs.
        use_cache=False,
        **arch,
    )


def qwen3_tiny_config() -> Any:
    """Qwen3 shrunk to run in milliseconds on a CPU: the same ops and GQA layout, tiny sizes."""
    return _qwen3(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        max_window_layers=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def qwen3_0_6b_config() -> Any:
    """Qwen/Qwen3-0.6B config.json (huggingface.co/Qwen/Qwen3-0.6B)."""
    return _qwen3(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        max_window_layers=28,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def qwen3_4b_config() -> Any:
    """Qwen/Qwen3-4B config.json (huggingface.co/Qwen/Qwen3-4B)."""
    return _qwen3(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        max_window_layers=36,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


@dataclass(frozen=True)
class ZooEntry:
    description: str
    config: Callable[[], Any]  # -> transformers PretrainedConfig; imports transformers only when called


ZOO: dict[str, ZooEntry] = {
    "qwen3-tiny": ZooEntry("Qwen3, 2 layers, hidden 64, random weights: for tests", qwen3_tiny_config),
    "qwen3-0.6b": ZooEntry("Qwen3-0.6B (28 layers, hidden 1024)", qwen3_0_6b_config),
    "qwen3-4b": ZooEntry("Qwen3-4B (36 layers, hidden 2560)", qwen3_4b_config),
}


def zoo_config(name: str) -> Any:
    """The transformers config of a zoo model, without building any weights."""
    entry = ZOO.get(name.lower())
    if entry is None:
        raise UserError(f"unknown zoo model {name!r}: use one of {', '.join(ZOO)}")
    return entry.config()


def _load_pretrained(
    name: str, expected: Any, weights: str, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    transformers = transformers_module()
    path = Path(weights).expanduser()
    how = "pass --weights a local Hugging Face model directory (config.json and *.safetensors)"
    if not path.is_dir():
        raise UserError(f"weights directory {str(path)!r} does not exist: {how}")
    if not (path / "config.json").is_file():
        raise UserError(f"weights directory {str(path)!r} has no config.json: {how}")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # any failure to parse the user's file is bad input, not a solforge bug
        raise UserError(f"cannot read {str(path / 'config.json')!r}: {one_line(exc)}") from None
    diffs = [
        f"{field} {getattr(config, field, None)} != {getattr(expected, field)}"
        for field in ARCH_FIELDS
        if getattr(config, field, None) != getattr(expected, field)
    ]
    if diffs:
        raise UserError(
            f"weights in {str(path)!r} are not a {name} checkpoint ({'; '.join(diffs)}): "
            f"pass the zoo name that matches them (one of {', '.join(ZOO)})"
        )
    config.use_cache = False
    kwargs: dict[str, Any] = {
        "config": config,
        "dtype": dtype,
        "attn_implementation": "sdpa",
        "local_files_only": True,
    }
    # transformers puts weights straight on a GPU only through accelerate's device_map (it refuses a
    # torch.device context without it). Without accelerate, load on the CPU in the target dtype
    # (8 GB for qwen3-4b in bf16, not 16 GB in fp32) and move once.
    if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = {"": str(device)}
    try:
        # Seeded: weights missing from the checkpoint are initialised randomly, reproducibly.
        with seeded(seed, device):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as exc:  # missing or corrupt weight files are the user's to fix
        raise UserError(f"cannot load weights from {str(path)!r}: {one_line(exc)}") from None
    return model.to(device)


def load_zoo(
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch: int | None,
    seq: int | None,
    weights: str | None,
    seed: int,
) -> LoadedModel:
    """Build a zoo model (seeded random weights, or `weights` from a local HF directory) and token inputs."""
    transformers = transformers_module()
    name = name.lower()
    batch = DEFAULT_BATCH if batch is None else batch
    seq = DEFAULT_SEQ if seq is None else seq
    config = zoo_config(name)
    if seq > config.max_position_embeddings:
        raise UserError(
            f"--seq {seq} is longer than {name}'s context ({config.max_position_embeddings}): "
            f"use --seq {config.max_position_embeddings} or less"
        )
    if weights is None:
        # Built directly on the device in the target dtype (from_config sets and restores the default
        # dtype): qwen3-4b materialized in fp32 on the CPU first would take 16 GB and a slow copy.
        with seeded(seed, device), torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa"
            )
    else:
        model = _load_pretrained(name, config, weights, device, dtype, seed)
    model.eval()
    vocab = int(model.config.vocab_size)

    example: list[torch.Tensor] = []

    def make_inputs(s: int) -> tuple[Any, ...]:
        # Drawn on the CPU from a private generator: the same ids on every device, and the caller's
        # random stream is untouched.
        gen = torch.Generator().manual_seed(s)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu")
        # A small vocab and a one-token input can repeat the example draw (p = 1/vocab): redraw from
        # the same generator, so another seed always means other ids (and stays deterministic).
        for _ in range(16):
            if not example or s == seed or not torch.equal(ids, example[0]):
                break
            ids = torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu")
        return (ids.to(device),)

    inputs = make_inputs(seed)
    example.append(inputs[0].cpu())
    return LoadedModel(
        name=name, model=model, example_inputs=inputs, make_inputs=make_inputs, is_language_model=True
    )
