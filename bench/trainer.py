"""Fine-tuning through Hugging Face's Trainer on one GPU: eager, Liger, torch.compile and solforge (issue 31).

    python bench/trainer.py [--model qwen3-1.7b] [--layers N] [--modes full,lora]
                            [--variants eager,liger,compile,solforge] [--batch 2] [--seq 2048] [--accum 2]
                            [--steps 12] [--warmup 4] [--budget 60] [--families F,..] [--db FILE]
                            [--timeout 900] [--stop-after S] [--device cuda|cpu] [--tiny] [--out FILE.jsonl]

The model is a Qwen3 architecture from its published dimensions (`--model`: qwen3-0.6b,
qwen3-1.7b, qwen3-4b; the 0.6B and 4B ones are solforge.zoo.hf's) with `--layers` layers
(default: the model's own), seeded random weights in bf16, sdpa attention; nothing is downloaded.
The data is a deterministic set of random tokens (input_ids, labels = input_ids). Trainer runs with
its default arguments (AdamW fused, linear schedule, learning rate 5e-5, gradient clipping at 1.0)
but for the size of the run (`--batch` per device, `--accum` micro-batches a step,
`max_steps = --warmup + --steps`), `logging_steps=1` (the loss of every step), and what a
benchmark must not do (`report_to="none"`, `save_strategy="no"`, no progress bar). The weights are
bf16 already, so `bf16=False`: `bf16=True` would add autocast, which changes nothing a bf16 model
computes in its matmuls but runs some ops (pow, rsqrt, the loss) in fp32 and traces other graphs.

Modes: `full` trains every parameter; `lora` trains PEFT's LoRA adapters (r 16, alpha 32, on q, k,
v, o, gate, up and down projections; PEFT's default init and no dropout), the base frozen. The
LoRA rows say so and are skipped when peft is not installed.

Variants, each (mode, variant) in a process of its own (clean memory and compile state; Liger
swaps module-level functions too), a crash or a timeout being a row with its error:
- eager: the model as built;
- liger: `TrainingArguments(use_liger_kernel=True)`, Trainer's own switch, which applies
  Liger-Kernel's default Qwen3 patch to the instance (rope, RMSNorm, SwiGLU and the fused linear
  cross-entropy, whose forward skips the logits in training); a row saying so when liger_kernel is
  not installed or off the GPU;
- compile: `TrainingArguments(torch_compile=True)`, Trainer's own switch: accelerate wraps the model
  in torch.compile (inductor, default mode) when it prepares it;
- solforge: `solforge.optimize(model, example, mode="train", budget=--budget)` in place before the
  Trainer is made, the example a batch shaped like a micro-batch with labels (the model called with
  input_ids and labels by position, as its forward names them); Trainer's own calls (keyword
  arguments, `num_items_in_batch`) compile their graphs at the first step;
- solforge-skip (not in the default list): the same with `skip_logits=True` (docs/usage.md: the
  head and the loss fused without the logits, as Liger does).

Each row: the median, p20 and p80 optimizer-step time over the `--steps` steps after `--warmup`
(a TrainerCallback: synchronize and perf_counter at on_step_begin and on_step_end, so the step's
forward, backward, clipping and optimizer update of every micro-batch; the data of a step is
fetched before on_step_begin), tokens per second at the median, the first step's time (torch.compile
and solforge compile there), the peak allocated and reserved memory over the timed steps (the
caching allocator emptied and the peaks reset at the end of the warm-up; for solforge, again at
the step its CUDA-graph captures settled if that came later: `settled_step`, with the peaks before it
as `judging_peak_*`), every step's loss and
gradient norm (`losses`, `grad_norms`) and, from the parent, the largest difference of the losses
from eager's of the same mode (the same seed, data, init and order). solforge's rows add
optimize's wall time, `report.returned` and `why`, the end-to-end check, the kernels by family and
whether the training step replays from CUDA graphs.

The output is JSON lines, appended to `--out` as each row ends (a cut-off run keeps what it
measured): first a meta row (device, versions, date, command, arguments), then one row per (mode,
variant). `--stop-after S` starts no row after S seconds and gives a running one only what is left
(rows not run say so), so that a run fits a device call of fixed length.

`--tiny --device cpu`: one layer, hidden 64, a 128-token vocabulary, seq 16, 1 + 2 steps, through
Triton's interpreter: the smoke run tests/test_bench_trainer.py makes (with `--in-process`: every
row in the parent process, sparing each row's import of Trainer). Its timings mean nothing.

One H100, every variant and both modes of Qwen3-1.7B's dimensions sized for a 10-minute device
call (8 of its 28 layers: torch.compile's and solforge's compiles grow with the layers):

    python bench/trainer.py --layers 8 --timeout 300 --stop-after 540 --out $OUT/trainer-h100.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("eager", "liger", "compile", "solforge", "solforge-skip")
DEFAULT_VARIANTS = ("eager", "liger", "compile", "solforge")
MODES = ("full", "lora")
# Qwen3's published configs (huggingface.co/Qwen/<name>/config.json; solforge.zoo.hf has two):
# what the three share, then their dimensions. Written here so that the rows of other variants
# import nothing of solforge's.
BASE: dict[str, Any] = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, hidden_act="silu",
                            attention_bias=False, attention_dropout=0.0, tie_word_embeddings=True, use_cache=False,
                            bos_token_id=151643, eos_token_id=151645)
MODELS: dict[str, dict[str, int]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(model: str, layers: int | None, tiny: bool) -> Any:
    import transformers

    d = {**BASE, **(TINY if tiny else MODELS[model])}
    if layers is not None:
        d["num_hidden_layers"] = layers
    return transformers.Qwen3Config(**d, max_window_layers=d["num_hidden_layers"])


def build(model: str, layers: int | None, tiny: bool, device: str) -> Any:
    """The Qwen3 causal LM: seeded random bf16 weights on `device`, sdpa, train mode."""
    import torch
    import transformers

    cfg = config(model, layers, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        lm = transformers.Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return lm.train()


def lora(model: Any) -> Any:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS,
                                                      task_type="CAUSAL_LM"))


def data(n: int, seq: int, vocab: int) -> list[dict[str, Any]]:
    """`n` rows of random tokens, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def example(model: Any, ids: Any) -> tuple[Any, ...]:
    """The model's arguments by position up to `labels`, ids for input_ids and labels, None for the
    rest: solforge.optimize takes positional inputs, and the forward of a causal LM (or of PEFT's
    wrapper) names input_ids first and labels a few places later."""
    names = list(inspect.signature(model.forward).parameters)
    return tuple(ids if n in ("input_ids", "labels") else None for n in names[:names.index("labels") + 1])


def clock(device: str, warmup: int, settled: Callable[[], bool] | None = None) -> Any:
    """A TrainerCallback timing each optimizer step, the peaks reset once the warm-up is over, and
    again once `settled()` (solforge: every step graph's CUDA-graph capture judged, StepGraph.settled)
    first holds after it: the judgement runs steps as they are beside the capture's pool, memory the
    steps after it do not hold (2026-11-27: 53 GB read over steps 5-16 of a full fine-tuning run,
    39 GB after step 12). `settled_at` is the step it first held at; `judging_peaks` the peaks
    (allocated, reserved) of the timed steps before it, where there were any."""
    import torch
    import transformers

    cuda = device == "cuda"

    class StepClock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0
            self.settled_at: int | None = None
            self.judging_peaks: tuple[int, int] | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            step = state.global_step
            if cuda and step == warmup:
                torch.cuda.empty_cache()  # what tuning and compiling left cached goes: the reserved peak is the steps'
                torch.cuda.reset_peak_memory_stats()
            if settled is not None and self.settled_at is None and settled():
                self.settled_at = step
                if cuda and step > warmup:
                    self.judging_peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()

    return StepClock()


def optimize(model: Any, variant: str, a: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """solforge.optimize in place on a micro-batch's shape; what it returned and why."""
    import torch

    import solforge

    ids = torch.stack([r["input_ids"] for r in rows[:a.batch]]).to(a.device)
    # --tiny: one candidate a workload, no profile; the database only where one is named
    tiny = dict(max_candidates=1, db=a.db or False, profile="off") if a.tiny else {"db": a.db or True}
    t = time.perf_counter()
    out, rep = solforge.optimize(model, example(model, ids), mode="train", budget=a.budget,
                                 skip_logits=variant == "solforge-skip", name=f"{a.model}-trainer",
                                 families=a.families.split(",") if a.families else None, **tiny)
    e2e = rep.e2e
    families: dict[str, int] = {}
    for r in rep.regions:
        if r.integrated:
            families[r.family] = families.get(r.family, 0) + r.count
    stats = getattr(model, "solforge_stats", None)
    return {"optimize_s": round(time.perf_counter() - t, 1), "returned": rep.returned, "why": rep.why,
            "e2e": None if e2e is None else {k: getattr(e2e, k, None) for k in (
                "passed", "note", "max_rel_err", "grad_max_rel_err", "baseline_ms", "optimized_ms", "speedup")},
            "families": families, "stage_s": dict(getattr(rep, "extra", {}).get("stage_seconds", {})),
            "notes": list(rep.notes)[:20],
            "_stats": stats}


def row(mode: str, variant: str, a: argparse.Namespace) -> dict[str, Any]:
    """One (mode, variant): build, adapt, optimize, train; in this process."""
    if variant.startswith("solforge"):  # before transformers imports triton: off the GPU the interpreter is
        import solforge  # noqa: F401  (decided then)
    import torch
    import transformers

    model = build(a.model, a.layers, a.tiny, a.device)
    out: dict[str, Any] = {"mode": mode, "variant": variant, "model": a.model if not a.tiny else "qwen3-tiny",
                           "layers": model.config.num_hidden_layers, "batch": a.batch, "seq": a.seq,
                           "accum": a.accum, "tokens_per_step": a.batch * a.seq * a.accum}
    if mode == "lora":
        model = lora(model)
    out["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 3)
    out["trainable_M"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 3)
    steps = a.warmup + a.steps
    rows = data(steps * a.batch * a.accum, a.seq, model.config.vocab_size)
    stats = None
    if variant.startswith("solforge"):
        got = optimize(model, variant, a, rows)
        stats = got.pop("_stats")
        out |= got
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, bf16=False,
            use_cpu=a.device == "cpu", torch_compile=variant == "compile", use_liger_kernel=variant == "liger")
        if a.device == "cuda":  # one GPU: on a host of several, Trainer would wrap the model in DataParallel
            _ = args.device  # (sets n_gpu to the host's count, once)
            args._n_gpu = 1
        graphs = getattr(stats, "step_graphs", None)
        timer = clock(a.device, a.warmup, None if graphs is None else lambda: all(g.settled for g in graphs))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[timer])
        if variant == "liger":  # what the patch changed (a Liger without Qwen3 support warns and patches nothing)
            out["liger_forwards"] = liger_forwards(model)
        t = time.perf_counter()
        trainer.train()
        out["train_s"] = round(time.perf_counter() - t, 1)
    out["optim"] = str(getattr(args.optim, "value", args.optim))
    out["trainer_args"] = {k: v if isinstance(v, int | float | bool | None) else str(getattr(v, "value", v))
                           for k, v in vars(args).items() if k in (
        "learning_rate", "lr_scheduler_type", "max_grad_norm", "weight_decay", "bf16", "torch_compile",
        "torch_compile_backend", "torch_compile_mode", "use_liger_kernel", "seed")}
    # what Trainer ran: the model itself, or what accelerate wrapped it in (torch.compile: OptimizedModule)
    out["trained"] = type(trainer.model_wrapped).__name__
    out["dynamo_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # compiled in this process
    times = [1e3 * s for s in timer.times]
    timed = times[a.warmup:] or times
    q = statistics.quantiles(timed, n=10, method="inclusive") if len(timed) > 1 else timed * 9
    out |= {"step_ms": round(statistics.median(timed), 2), "p20_ms": round(q[1], 2), "p80_ms": round(q[7], 2),
            "timed_steps": len(timed), "first_step_s": round(times[0] / 1e3, 2),
            "tokens_per_s": round(out["tokens_per_step"] / (statistics.median(timed) / 1e3)),
            "step_times_ms": [round(x, 2) for x in times]}
    if a.device == "cuda":  # solforge: over the steps after its captures settled, where that was after the warm-up
        out["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 3)
        if timer.judging_peaks is not None:
            out["judging_peak_allocated_gb"] = round(timer.judging_peaks[0] / 1e9, 3)
            out["judging_peak_reserved_gb"] = round(timer.judging_peaks[1] / 1e9, 3)
    if stats is not None:
        out["settled_step"] = timer.settled_at  # None: a capture was still being judged at the last step
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out["losses"] = [h["loss"] for h in logs]
    out["grad_norms"] = [h.get("grad_norm") for h in logs]
    if stats is not None:  # whether the steps replayed from CUDA graphs (runtime/traingraphs.py), kernels a step
        out["kernels"] = getattr(stats, "total", None)
        out["step_graphs"] = [s.summary() for s in getattr(stats, "step_graphs", ())]
    return out


def liger_forwards(model: Any) -> dict[str, int]:
    """The modules whose forward Liger replaced, by the replacement: it binds its own forward to each
    instance (the classes keep their names); the rotary embedding is a module-level function it
    swaps, not seen here."""
    found: dict[str, int] = {}
    for m in model.modules():
        f = getattr(m.__dict__.get("forward"), "__func__", None)
        if f is not None and f.__module__.startswith("liger_kernel"):
            found[f.__qualname__] = found.get(f.__qualname__, 0) + 1
    return found


def skipped(mode: str, variant: str, a: argparse.Namespace) -> str | None:
    """Why a row cannot run here, or None."""
    if mode == "lora" and importlib.util.find_spec("peft") is None:
        return "peft is not installed: no LoRA rows"
    if variant == "liger":
        if a.device != "cuda":
            return "Liger-Kernel runs on CUDA only"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed"
    return None


def command(mode: str, variant: str, a: argparse.Namespace) -> list[str]:
    """The command line of one row's process: this script with --one and the run's settings."""
    return [sys.executable, __file__, "--one", f"{mode}:{variant}", "--model", a.model, "--batch", str(a.batch),
            "--seq", str(a.seq), "--accum", str(a.accum), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--budget", str(a.budget), "--device", a.device, *(["--layers", str(a.layers)] if a.layers else []),
            *(["--db", a.db] if a.db else []), *(["--families", a.families] if a.families else []),
            *(["--tiny"] if a.tiny else [])]


def compare(r: dict[str, Any], eager: dict[str, Any] | None) -> None:
    """The largest difference of a row's losses from eager's, step by step (the same data)."""
    if eager is None or r is eager or not r.get("losses") or not eager.get("losses"):
        return
    pairs = list(zip(r["losses"], eager["losses"], strict=False))
    r["loss_max_abs_diff_vs_eager"] = max(abs(x - y) for x, y in pairs)
    r["loss_max_rel_diff_vs_eager"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def emit(r: dict[str, Any], out: str | None) -> None:
    line = json.dumps(r, default=str)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")
    brief = {k: v for k, v in r.items() if k not in ("step_times_ms", "grad_norms", "notes", "step_graphs", "versions")}
    print(json.dumps(brief, default=str), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", choices=tuple(MODELS))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 16)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 12; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="optimizer steps before the timing (default 4; --tiny 1)")
    p.add_argument("--budget", type=float, default=60.0, help="solforge's tuning budget (s)")
    p.add_argument("--families", default=None, help="solforge's kernel families, comma-separated (default: all)")
    p.add_argument("--db", default=None, help="solforge's kernel database (default: its own, "
                   "~/.cache/solforge/kernels.db or $SOLFORGE_DB; --tiny: none)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="1 layer, hidden 64, vocabulary 128: a smoke run of the script")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed to each row")
    p.add_argument("--stop-after", type=float, default=None, help="start no row after this many seconds")
    p.add_argument("--out", default=None, help="JSON-lines file the rows are appended to")
    p.add_argument("--in-process", action="store_true",
                   help="every row in this process (a smoke run's shortcut: memory and compile state are shared)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: MODE:VARIANT in this process
    a = p.parse_args(argv)
    a.seq = a.seq or (16 if a.tiny else 2048)
    a.steps = a.steps if a.steps is not None else (2 if a.tiny else 12)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 4)
    return a


def main() -> int:
    a = parse()
    modes, variants = a.modes.split(","), a.variants.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bench/trainer.py: unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}", file=sys.stderr)
        return 2
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"bench/trainer.py: unknown variant(s) {', '.join(bad)}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if a.steps < 1 or a.warmup < 0:
        print("bench/trainer.py: --steps must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2
    if a.in_process and any(v.startswith("solforge") for v in variants):
        import solforge  # noqa: F401  (before transformers imports triton, as row() does)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/trainer.py needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    if a.one:
        mode, variant = a.one.split(":")
        print("RESULT " + json.dumps(row(mode, variant, a), default=str), flush=True)
        return 0
    from e2e import provenance, run_one

    started = time.monotonic()
    meta = {"row": "meta", "what": "Hugging Face Trainer fine-tuning step: eager, Liger, torch.compile, solforge",
            "model": "qwen3-tiny" if a.tiny else a.model, **provenance(),
            "args": {k: v for k, v in vars(a).items() if k != "one"}}
    if a.device == "cpu":  # provenance names the host's GPU, which a --device cpu run does not use
        meta["device"] = "cpu"
    for mod in ("peft", "accelerate"):
        meta["versions"][mod] = _version(mod)
    emit(meta, a.out)
    variants = sorted(variants, key=lambda v: v != "eager")  # eager first: the others' losses are compared with it
    for mode in modes:
        eager = None
        for variant in variants:
            what = {"mode": mode, "variant": variant}
            left = None if a.stop_after is None else a.stop_after - (time.monotonic() - started)
            why = skipped(mode, variant, a)
            if why is None and left is not None and left <= 0:
                why = f"not started: --stop-after {a.stop_after:g} s reached"
            if why is not None:
                emit({**what, "skipped": why}, a.out)
                continue
            t = time.monotonic()
            if a.in_process:
                try:
                    r = row(mode, variant, a)
                except Exception as e:  # a row's failure is its record, as a subprocess's is
                    r = {**what, "error": f"{type(e).__name__}: {e}"}
            else:
                r = run_one(command(mode, variant, a), a.timeout if left is None else min(a.timeout, left), what)
            r["row_s"] = round(time.monotonic() - t, 1)
            if variant == "eager" and "error" not in r:
                eager = r
            compare(r, eager)
            emit(r, a.out)
    return 0


def _version(mod: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(mod)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
