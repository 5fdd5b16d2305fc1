"""End to end on the other architectures issue 4 names: eager vs torch.compile vs Liger-Kernel vs solforge.

    python bench/archs.py [--archs llama-3.2-1b,gemma-2b,phi-3-mini,gpt2-medium,mistral-7b,phi-3-medium]
                          [--modes fwd,train] [--variants eager,compile,liger,solforge,solforge-noreplay]
                          [--budget 30] [--out bench/results/NAME.json]

Each model is built with transformers from its published dimensions (written out below, as the
zoo does for Qwen3), with seeded random bf16 weights and sdpa attention; no solforge code knows
any of them. Each variant runs in its own process (Liger patches classes):
- fwd: the model body's forward (`model.base_model`, no lm_head) in inference_mode, at --batch x
  --seq (GPT-2: its 1024 positions at most), like bench/e2e.py's Qwen3-4B forward. Variant "fp32"
  is eager with the same bf16-rounded weights computed in fp32: the accuracy reference. Each
  variant's last hidden state is compared with eager's and fp32's (`err_vs_eager`, `err_vs_fp32`:
  solforge/validate's norm-relative error), and its next-token argmax through the lm_head with eager's
  (`argmax_agree_vs_eager`, also at positions where eager's top-1/top-2 margin exceeds a
  threshold: random weights make near-ties).
- train: BASELINES.md's training step (B1, loss = mean of the squared last hidden state, forward
  + backward) with its peak memory; solforge optimizes with mode "train". `--checkpointing` turns
  on transformers' gradient checkpointing (non-reentrant torch.utils.checkpoint around each
  decoder layer) in every variant's training step.
Each row has the median of triton's do_bench (L2 flushed), the SM clock and board power during
it, and a profile of two steps run back to back (kernel time by kind: GEMM, attention, solforge,
other). solforge's row has its optimize time, regions and its own end-to-end check (`validate`).
Variant "solforge-noreplay" is solforge with its training replays off (traingraphs.py), to tell
their share of a step's time and memory on one machine.
GPT-2's dropouts are set to 0 (every variant): a step must compute one function to be compared.
Liger-Kernel has no GPT-2 patch; that row is skipped.

`--tiny --device cpu` runs every stage at 2 layers and hidden 64 through Triton's interpreter: a
check that the script works, with timings that mean nothing.

Writes one JSON file with device, versions, date, command and every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import GpuSampler, provenance, run_one, spread, steady_profile, write_json  # noqa: E402


@dataclass(frozen=True)
class Arch:
    config: str  # transformers config class
    dims: dict[str, Any]  # the published dimensions
    liger: str | None  # liger_kernel.transformers patch function, None: Liger has none
    liger_kw: dict[str, bool] = field(default_factory=dict)
    max_seq: int | None = None


_LIGER_RMS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False}
ARCHS: dict[str, Arch] = {
    # meta-llama/Llama-3.2-1B (its rope_scaling "llama3" left out: the default rope, same kernels)
    "llama-3.2-1b": Arch("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                             head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                                             max_position_embeddings=131072, tie_word_embeddings=True),
                         "apply_liger_kernel_to_llama", _LIGER_RMS),
    # google/gemma-2b: offset-weight RMSNorm, gelu(tanh) gate, one K/V head of 256
    "gemma-2b": Arch("GemmaConfig", dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384,
                                         num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                                         head_dim=256, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                                         max_position_embeddings=8192),
                     "apply_liger_kernel_to_gemma", {**{k: v for k, v in _LIGER_RMS.items() if k != "swiglu"},
                                                     "geglu": True}),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv and gate_up projections
    "phi-3-mini": Arch("Phi3Config", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                          rms_norm_eps=1e-5, max_position_embeddings=4096, pad_token_id=32000,
                                          bos_token_id=1, eos_token_id=32000),
                       "apply_liger_kernel_to_phi3", _LIGER_RMS, max_seq=4096),
    # microsoft/Phi-3-medium-4k-instruct: 14B, grouped K/V (10 heads)
    "phi-3-medium": Arch("Phi3Config", dict(vocab_size=32064, hidden_size=5120, intermediate_size=17920,
                                            num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                                            rms_norm_eps=1e-5, max_position_embeddings=4096, pad_token_id=32000,
                                            bos_token_id=1, eos_token_id=32000),
                         "apply_liger_kernel_to_phi3", _LIGER_RMS, max_seq=4096),
    # mistralai/Mistral-7B-v0.1 (sliding window 4096: causal at 4096 tokens)
    "mistral-7b": Arch("MistralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                             rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                                             max_position_embeddings=32768),
                       "apply_liger_kernel_to_mistral", _LIGER_RMS),
    # openai-community/gpt2-medium: LayerNorm with bias, gelu(tanh) without a gate, learned positions
    "gpt2-medium": Arch("GPT2Config", dict(vocab_size=50257, n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                        None, max_seq=1024),
}
_TINY = {"GPT2Config": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4),
         "*": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)}


def build(arch: str, tiny: bool, device: str) -> torch.nn.Module:
    a = ARCHS[arch]
    dims = {**a.dims, **((_TINY.get(a.config) or _TINY["*"]) if tiny else {})}
    if tiny and a.config == "Phi3Config":
        dims.pop("head_dim")  # Phi-3 derives it
    return from_dims(a.config, dims, device)


def from_dims(config: str, dims: dict[str, Any], device: str, model_class: str = "AutoModelForCausalLM",
              attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A transformers model of class `model_class` built from the config class `config` with `dims`,
    seeded random bf16 weights, made on `device`."""
    import transformers

    cfg = getattr(transformers, config)(use_cache=False, **dims)
    torch.manual_seed(seed)
    cls = getattr(transformers, model_class)
    with torch.device(device):
        make = cls.from_config if model_class.startswith("Auto") else cls._from_config
        return make(cfg, dtype=torch.bfloat16, attn_implementation=attn)


def _time_ms(fn: Any, device: str, warmup: int, rep: int) -> list[float]:
    if device == "cuda":
        import triton

        return sorted(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all"))
    fn()
    out = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)


def variant(arch: str, name: str, mode: str, batch: int, seq: int, budget: float, tiny: bool,
            device: str, checkpointing: bool = False) -> dict[str, Any]:
    """One variant of one model, forward (fwd) or training step (train), in this process."""
    a = ARCHS[arch]
    if name == "liger":
        import liger_kernel.transformers as lk

        getattr(lk, a.liger)(**a.liger_kw)
    model = build(arch, tiny, device)
    if name == "fp32":  # the same bf16-rounded weights, computed in fp32: the accuracy reference
        model = model.float()
    if checkpointing and mode == "train":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    body = model.base_model.eval() if mode == "fwd" else model.base_model.train()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    out: dict[str, Any] = {"arch": arch, "variant": name, "mode": mode, "batch": batch, "seq": seq,
                           "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    if mode == "train":
        out["checkpointing"] = checkpointing
    t0 = time.time()
    if name in ("solforge", "solforge-noreplay"):
        from solforge import settings
        from solforge.api import optimize

        if name == "solforge-noreplay":  # the training replays off (SOLFORGE_TRAIN_GRAPHS=0): their share
            os.environ["SOLFORGE_TRAIN_GRAPHS"] = "0"  # for this process, as a user would set it
            settings.reload()

        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            f, rep = optimize(body, (ids,), budget=budget, is_language_model=False, inplace=False,
                              max_candidates=2 if tiny else None, mode="inference" if mode == "fwd" else "train")
        out["optimize_s"] = round(time.time() - t0, 1)
        out["regions"] = [{"workload": r.workload, "count": r.count, "baseline_us": r.baseline_us,
                           "best_us": r.best_us, "speedup": r.speedup, "verified": r.verified}
                          for r in rep.regions]
        out["validate"] = ({"passed": rep.e2e.passed, "max_rel_err": rep.e2e.max_rel_err,
                            "grad_max_rel_err": rep.e2e.grad_max_rel_err, "note": rep.e2e.note} if rep.e2e else None)
    elif name == "compile":
        f = torch.compile(body)
    else:
        f = body
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        # what tuning left cached goes first: the reserved peak is then the steps' own footprint
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if mode == "train":
        def step() -> None:
            f(ids).last_hidden_state.float().square().mean().backward()
        call: Any = step
    else:
        def call() -> Any:
            with torch.inference_mode():
                return f(ids)
    t1 = time.time()
    first = call()
    sync()
    out["first_call_s"] = round(time.time() - t1, 1)
    with GpuSampler() as gpu:
        times = _time_ms(call, device, 200 if mode == "fwd" else 300, 1000 if mode == "fwd" else 1500)
    key = "fwd_ms" if mode == "fwd" else "train_step_ms"
    out[key] = round(statistics.median(times), 2)
    out["during_do_bench"] = {**(gpu.summary() if device == "cuda" else {}), **spread(times)}
    stats = getattr(f, "solforge_stats", None)
    if stats is not None:  # what the CUDA-graph replays did (stepgraphs.py, traingraphs.py)
        out["step_graphs"] = [s.summary() for s in stats.step_graphs]
    if device == "cuda":
        out["peak_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20)
        # a CUDA graph's pool keeps the memory of tensors freed after its capture: allocated memory
        # does not count it, reserved memory does (the figure to compare a replayed step by)
        out["peak_reserved_MiB"] = round(torch.cuda.max_memory_reserved() / 2**20)
        prof = steady_profile(call)
        out["kernel_ms_by_kind"] = prof.get("by_kind_ms_per_step")
        out["top_other_ms"] = prof.get("top_other_ms_per_step")
        out["span_ms"] = prof.get("span_ms_per_step")
    if mode == "fwd":
        with torch.inference_mode():
            logits = model.lm_head(first.last_hidden_state)
            top2 = logits.topk(2, dim=-1).values.float()
        torch.save({"argmax": logits.argmax(-1).cpu(), "margin": (top2[..., 0] - top2[..., 1]).cpu(),
                    "hidden": first.last_hidden_state.cpu()}, f"/tmp/archs_out_{arch}_{name}.pt")
    return out


def norm_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out - ref‖ / ‖ref‖ in float64: solforge/validate's end-to-end measure."""
    d = out.double() - ref.double()
    return float(d.norm() / ref.double().norm())


def agreement(rows: list[dict[str, Any]], arch: str) -> None:
    """Each variant against eager bf16 and against eager in fp32 (variant "fp32", when it ran):
    the last hidden state's norm-relative error (`err_vs_eager`, `err_vs_fp32`: whether a variant
    is less accurate than the original, or only rounds differently), and the next-token argmax
    agreement with eager's, at all positions and where eager's top-1/top-2 margin exceeds a
    threshold (random weights make near-ties)."""
    refs = {}
    for ref_name in ("eager", "fp32"):
        try:
            refs[ref_name] = torch.load(f"/tmp/archs_out_{arch}_{ref_name}.pt")
        except FileNotFoundError:
            continue
    for row in rows:
        try:
            other = torch.load(f"/tmp/archs_out_{arch}_{row['variant']}.pt")
        except FileNotFoundError:
            continue
        for ref_name, ref in refs.items():
            row[f"err_vs_{ref_name}"] = round(norm_rel(other["hidden"], ref["hidden"]), 5)
        if "eager" not in refs:
            continue
        ref = refs["eager"]
        same = other["argmax"] == ref["argmax"]
        row["argmax_agree_vs_eager"] = round(float(same.float().mean()), 5)
        for m in (0.1, 0.25):
            sel = ref["margin"] > m
            row[f"argmax_agree_vs_eager_margin_gt_{m}"] = round(float(same[sel].float().mean()), 5)
            row[f"positions_margin_gt_{m}"] = round(float(sel.float().mean()), 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=",".join(a for a in ARCHS if a not in ("mistral-7b", "phi-3-medium")),
                   help=f"comma-separated, of: {', '.join(ARCHS)}")
    p.add_argument("--modes", default="fwd,train", help="fwd, train or both")
    p.add_argument("--variants", default="eager,fp32,compile,liger,solforge")
    p.add_argument("--train-variants", default=None, help="variants for train (default: --variants)")
    p.add_argument("--batch", type=int, default=2, help="forward batch (train: 1)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (capped at the model's positions)")
    p.add_argument("--budget", type=float, default=30.0, help="solforge's tuning budget per model and mode (s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a smoke test of this script")
    p.add_argument("--checkpointing", action="store_true",
                   help="train: gradient checkpointing (non-reentrant) around each decoder layer")
    p.add_argument("--out", default=None)
    p.add_argument("--variant-timeout", type=float, default=900.0, help="seconds allowed to each variant")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: ARCH:VARIANT:MODE in this process
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/archs.py needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    archs = a.archs.split(",")
    unknown = [x for x in archs if x not in ARCHS]
    if unknown:
        print(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(ARCHS)}", file=sys.stderr)
        return 2
    if a.one:
        arch, name, mode = a.one.split(":")
        seq = min(a.seq, ARCHS[arch].max_seq or a.seq)
        row = variant(arch, name, mode, a.batch if mode == "fwd" else 1, seq, a.budget, a.tiny, a.device,
                      a.checkpointing)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    result: dict[str, Any] = {**provenance(), "tiny": a.tiny, "rows": []}
    for arch in archs:
        for mode in a.modes.split(","):
            rows: list[dict[str, Any]] = []
            names = (a.train_variants or a.variants) if mode == "train" else a.variants
            for name in names.split(","):
                if name == "fp32" and mode == "train":
                    continue
                if name == "liger" and (ARCHS[arch].liger is None or a.device != "cuda"
                                        or result["versions"]["liger_kernel"] == "not installed"):
                    continue
                cmd = [sys.executable, __file__, "--one", f"{arch}:{name}:{mode}", "--batch", str(a.batch),
                       "--seq", str(a.seq), "--budget", str(a.budget), "--device", a.device,
                       *(["--tiny"] if a.tiny else []), *(["--checkpointing"] if a.checkpointing else [])]
                row = run_one(cmd, a.variant_timeout, {"arch": arch, "variant": name, "mode": mode})
                print(json.dumps(row), flush=True)
                rows.append(row)
            if mode == "fwd":
                agreement(rows, arch)
            result["rows"] += rows
            write_json(result, a.out)  # after each model and mode: a cut-off run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
