"""A Hugging Face training step with labels: the LM head and the loss, logits returned or not.

    python bench/headloss.py [--variants eager,compile,compile-skip,liger,solforge,solforge-skip]
                             [--layers 4] [--batch 2] [--seq 2048] [--budget 60] [--out bench/results/NAME.json]

One small decoder with a large vocabulary: Qwen3-0.6B's dimensions (hidden 1024, vocabulary
151936, tied embeddings) at --layers layers, seeded random bf16 weights, sdpa. The step is what a
training loop runs: `model(input_ids=ids, labels=ids).loss.backward()` (transformers shifts the
labels and takes the mean cross-entropy), gradients set to None before each. At B2 S2048 the fp32
logits alone are 2.5 GB. Variants, each in its own process (Liger patches classes):
- eager; compile: torch.compile(model); both return the logits, as the model's forward does;
- compile-skip: torch.compile of the model's call with the logits dropped from its output (what
  solforge's option does, runtime/logits.py), so Inductor may leave them unmaterialized too;
- liger: Liger-Kernel's Qwen3 patch (rope, rms_norm, swiglu, fused_linear_cross_entropy): its
  forward skips the logits in training with labels (`skip_logits`); skipped when not installed;
- solforge: solforge.optimize(mode="train") on the example step (labels given); logits returned;
- solforge-skip: the same with skip_logits=True: logits None, the head and the loss one fused op.
Each row: the median step time (triton's do_bench), the step's peak memory above what was allocated
before it (weights and inputs: `step_peak_MiB`, activations, logits and gradients), the peak
allocated and reserved over the timing (a CUDA graph's pool is counted by the reserved one only),
the first step's loss (`loss_vs_eager`: its difference from eager's) and whether logits came back.

`--tiny --device cpu` runs every variant but liger at 2 layers and hidden 64 through Triton's
interpreter: a check that the script works, with timings that mean nothing and no memory figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import _time_ms, from_dims  # noqa: E402
from e2e import provenance, run_one, spread, write_json  # noqa: E402

VARIANTS = ("eager", "compile", "compile-skip", "liger", "solforge", "solforge-skip")
# Qwen3-0.6B's dimensions (its published config), the depth set by --layers
DIMS = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def variant(name: str, layers: int, batch: int, seq: int, budget: float, tiny: bool, device: str) -> dict[str, Any]:
    """One variant's training step, in this process."""
    if name.startswith("solforge"):  # before transformers imports triton: off the GPU the interpreter is decided then
        import solforge  # noqa: F401
    if name == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    dims = {**(TINY if tiny else DIMS), "num_hidden_layers": 2 if tiny else layers}
    model = from_dims("Qwen3Config", dims, device).train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    out: dict[str, Any] = {"variant": name, "layers": dims["num_hidden_layers"], "batch": batch, "seq": seq,
                           "vocab": vocab, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                           "logits_fp32_MiB": round(batch * seq * vocab * 4 / 2**20)}
    f: Any = model
    if name.startswith("solforge"):
        from solforge.api import optimize

        t0 = time.time()
        # labels by position: forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels)
        _, rep = optimize(model, (ids, None, None, None, None, ids), mode="train", budget=budget,
                          skip_logits=name == "solforge-skip", max_candidates=2 if tiny else None)
        out["optimize_s"] = round(time.time() - t0, 1)
        out["returned"] = rep.returned
        out["regions"] = [{"family": r.family, "workload": r.workload, "count": r.count, "integrated": r.integrated,
                           "speedup": r.speedup} for r in rep.regions]
        out["validate"] = ({"passed": rep.e2e.passed, "max_rel_err": rep.e2e.max_rel_err,
                            "grad_max_rel_err": rep.e2e.grad_max_rel_err, "note": rep.e2e.note} if rep.e2e else None)
    elif name == "compile":
        f = torch.compile(model)
    elif name == "compile-skip":
        from solforge.runtime.logits import without_logits

        f = torch.compile(lambda **kw: without_logits(model(**kw)))

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        o = f(input_ids=ids, labels=ids)
        o.loss.backward()
        return o

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t1 = time.time()
    first = step()
    sync()
    out["first_call_s"] = round(time.time() - t1, 1)
    out["loss"] = float(first.loss)
    out["logits_returned"] = first.logits is not None
    del first
    if device == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what tuning left cached goes: the reserved peak is then the steps' own
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        out["step_peak_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
        out["allocated_before_step_MiB"] = round(base / 2**20)
    times = _time_ms(step, device, 100, 1000)
    out["train_step_ms"] = round(statistics.median(times), 2)
    out["spread"] = spread(times)
    if device == "cuda":
        out["peak_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20)
        out["peak_reserved_MiB"] = round(torch.cuda.max_memory_reserved() / 2**20)
    stats = getattr(model, "solforge_stats", None)
    if stats is not None:  # whether the step replayed from CUDA graphs (traingraphs.py)
        out["step_graphs"] = [s.summary() for s in stats.step_graphs]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--budget", type=float, default=60.0, help="solforge's tuning budget (s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a smoke test of this script")
    p.add_argument("--out", default=None)
    p.add_argument("--variant-timeout", type=float, default=900.0, help="seconds allowed to each variant")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one variant in this process
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/headloss.py needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if a.one:
        row = variant(a.one, a.layers, a.batch, a.seq, a.budget, a.tiny, a.device)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    result: dict[str, Any] = {**provenance(), "tiny": a.tiny, "rows": []}
    for name in names:
        if name == "liger" and (a.device != "cuda" or result["versions"]["liger_kernel"] == "not installed"):
            continue
        cmd = [sys.executable, __file__, "--one", name, "--layers", str(a.layers), "--batch", str(a.batch),
               "--seq", str(a.seq), "--budget", str(a.budget), "--device", a.device, *(["--tiny"] if a.tiny else [])]
        row = run_one(cmd, a.variant_timeout, {"variant": name})
        result["rows"].append(row)
        eager = next((r for r in result["rows"] if r["variant"] == "eager" and "loss" in r), None)
        if eager is not None and "loss" in row:
            row["loss_vs_eager"] = abs(row["loss"] - eager["loss"])
        print(json.dumps({k: v for k, v in row.items() if k not in ("regions", "step_graphs", "spread")}), flush=True)
        write_json(result, a.out)  # after each variant: a cut-off run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
