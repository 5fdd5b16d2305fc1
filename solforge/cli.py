"""`solforge` command line: maps flags onto api calls, draws progress and tables; nothing else."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from solforge import settings
from solforge.db.cli import add_db_parser, run_db
from solforge.errors import UserError
from solforge.kernels import registry

if TYPE_CHECKING:
    from rich.console import Console

    from solforge.zoo import LoadedModel

DESCRIPTION = """\
solforge makes PyTorch models faster on NVIDIA GPUs by itself: it captures the model's graph,
finds regions worth fusing, generates and tunes Triton kernels for them on the real device,
verifies each winner against a reference, swaps the winners into the model (no change to the
model's code) and validates the result end to end.
"""

MODEL_HELP = """\
the model: a zoo name (qwen3-tiny, qwen3-0.6b, qwen3-4b), a path/to/file.py defining Model,
get_inputs() and get_init_inputs(), or package.module:function returning (model, example_inputs)
"""

EPILOG = """\
examples:
  solforge optimize qwen3-tiny --device cpu            # every stage, through Triton's interpreter
  solforge optimize qwen3-4b --batch 2 --seq 8192 --budget 300 --out out/qwen3-4b
  solforge optimize path/to/model.py --dtype fp16
  solforge profile qwen3-4b --batch 2 --seq 8192 --out out/qwen3-4b-profile
  solforge db list                                     # the tuned kernels kept across runs
"""


# the kernel families, in matching order, and the backward families (the registry's table: importing
# it needs no torch, so --help stays quick)
_FAMILIES = registry.forward_names()
_BACKWARD = registry.backward_names()


def _model_args(p: argparse.ArgumentParser) -> None:
    """The model options shared by every command that runs a model (optimize, profile)."""
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="where to run (default: cuda when a GPU is present, else cpu through Triton's "
                        "interpreter: correct but slow, and its timings mean nothing)")
    p.add_argument("--mode", default="inference", choices=["inference", "train"],
                   help="inference (default): forward only; train: forward and backward, validated on "
                        "parameter gradients too, timed as whole training steps; the fused ops' backward "
                        "kernels are tuned too (families " + ", ".join(_BACKWARD) + ")")
    p.add_argument("--batch", type=int, default=None, help="batch size of a zoo model's inputs (default 1)")
    p.add_argument("--seq", type=int, default=None, help="sequence length of a zoo model's inputs (default 128)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="load a zoo model's real weights from a local Hugging Face directory")
    p.add_argument("--families", default=None, metavar="LIST",
                   help="kernel families to match, comma-separated (default: all of " + ", ".join(_FAMILIES)
                        + "); e.g. rmsnorm alone to see the residual adds, q/k norms and RoPE as separate regions")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and inputs (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solforge", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    o = sub.add_parser("optimize", help="capture, tune, verify and swap in kernels; validate end to end",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(o)
    o.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="tuning time across all kernels (default 120 on a GPU, 60 on the CPU)")
    o.add_argument("--max-candidates", type=int, default=None, metavar="N",
                   help="measure at most N configs per workload (default: all on a GPU; on the CPU the heuristic "
                        "config alone, its time meaning nothing)")
    o.add_argument("--out", default="solforge-out", metavar="DIR",
                   help="where report.json, report.html and the traces go (default ./solforge-out)")
    o.add_argument("--keep-slower", action="store_true",
                   help="keep the model with every verified kernel even when it fails the end-to-end check or "
                        "is slower than the original (for analysis: the report and the profile after describe "
                        "it); by default the original, or the faster subset of kernels, is what optimize returns")
    o.add_argument("--skip-logits", action="store_true",
                   help="--mode train: a call whose output has a loss (a causal LM given labels) returns logits=None, "
                        "so the LM head and the loss fuse and the logits are never materialized (Liger's "
                        "skip_logits); eval calls and calls without labels are unchanged")
    t = o.add_argument_group("tuning", "how candidates are searched, measured and remembered")
    t.add_argument("--search", default="auto", choices=["auto", "exhaustive", "evolutionary"],
                   help="auto (default): every config of a small space, an evolutionary search guided by a cost "
                        "model on a large one")
    t.add_argument("--runner", default=None, metavar="RUNNER",
                   help="local (default: in this process, without --timeout: a candidate that hangs stalls the "
                        "run and one that crashes ends it), process (one worker process per GPU of --gpus: a "
                        "candidate that crashes or hangs is recorded and the tune goes on), or ray[:ADDRESS] "
                        "(the GPUs of a Ray cluster; needs pip install 'solforge[ray]')")
    t.add_argument("--gpus", default=None, metavar="LIST",
                   help="GPU indices to tune on, e.g. 0,1 (implies --runner process); timings of a GPU's "
                        "candidates are taken one at a time")
    t.add_argument("--build-workers", type=int, default=0, metavar="N",
                   help="processes that compile candidates ahead of the measuring worker (default 0)")
    t.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --runner process or ray only: a candidate still running after this is killed and "
                        "recorded as hung (default 120); the local runner (the default) has no timeout")
    t.add_argument("--db", default=None, metavar="PATH",
                   help="kernel database (default $SOLFORGE_DB or ~/.cache/solforge/kernels.db): what it knows "
                        "is not tuned again")
    t.add_argument("--no-db", action="store_true", help="neither read nor write the kernel database")
    t.add_argument("--retune", action="store_true",
                   help="tune every workload again, even those the database knows (the results are stored)")
    t.add_argument("--resume", action="store_true",
                   help="go on with searches an earlier run's budget cut short (what it measured is reused; "
                        "candidates that failed other than in compiling are measured again)")
    t.add_argument("--profile", default="auto", choices=["auto", "on", "off"],
                   help="profile before and after (auto: on a GPU, unless every kernel comes from the database)")
    pr = sub.add_parser("profile", help="where the GPU time goes: regions, roofline, Amdahl ranking, traces",
                        description="Profile one forward: every kernel attributed to a graph region and module, "
                        "each region against the device's measured ceilings, ranked by the end-to-end time it "
                        "would save at speed of light.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(pr)
    pr.add_argument("--out", default="solforge-out", metavar="DIR",
                    help="where report.json, report.html and trace_baseline.json go (default ./solforge-out)")
    pr.add_argument("--top", type=int, default=15, metavar="N", help="regions in the table (default 15)")
    add_db_parser(sub)  # solforge db list|show|export|import|prune (solforge/db/cli.py)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        settings.current()  # a bad SOLFORGE_* value: one line, before --help's defaults read them
    except UserError as e:
        print(f"solforge: error: {e}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "db":
            return run_db(args)
    except UserError as e:
        print(f"solforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("solforge: interrupted", file=sys.stderr)
        return 130
    return 2


def _device(args: argparse.Namespace) -> str:
    if args.device == "cpu":  # must be set before triton is imported anywhere (without a GPU,
        # `import solforge` has set it already: solforge/__init__.py)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from solforge.api import check_device

    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("--device cpu needs Triton's interpreter: unset TRITON_INTERPRET or set it to 1")
    return device


def _load(args: argparse.Namespace, device: str, console: Console) -> LoadedModel:
    from solforge.numerics import parse_dtype
    from solforge.zoo import load_model

    dtype = parse_dtype(args.dtype)
    with console.status(f"loading {args.model}"):
        return load_model(args.model, device=device, dtype=dtype, batch=args.batch, seq=args.seq,
                          weights=args.weights, seed=args.seed)


def _optimize(args: argparse.Namespace) -> int:
    device = _device(args)
    from solforge.api import check_seconds, optimize

    if args.budget is not None:  # before the model loads: a bad flag costs no minute of loading
        check_seconds("--budget", args.budget)
    budget = args.budget if args.budget is not None else (120.0 if device == "cuda" else 60.0)
    max_cands = args.max_candidates  # None: the whole space on a GPU, the heuristic alone on the CPU (optimize)
    if max_cands is not None and max_cands < 1:
        raise UserError("--max-candidates must be at least 1")
    if args.no_db and args.db:
        raise UserError("--db and --no-db contradict each other: give one")
    if args.build_workers < 0:
        raise UserError(f"--build-workers must be 0 or more (got {args.build_workers})")
    check_seconds("--timeout", args.timeout)
    from solforge.tune.runners import check_spec, parse_gpus

    gpus = parse_gpus(args.gpus)
    runner = args.runner or ("process" if gpus else "local")
    check_spec(runner)

    from rich.console import Console

    console = Console(stderr=True, quiet=args.quiet)
    loaded = _load(args, device, console)
    _freeze_heap()
    from solforge.report.terminal import RichReporter, print_profile, print_report

    with RichReporter(console) as reporter:
        _, report = optimize(
            loaded.model, loaded.example_inputs, mode=args.mode, budget=budget, out_dir=Path(args.out),
            families=_families(args),
            make_inputs=loaded.make_inputs, is_language_model=loaded.is_language_model, name=loaded.name,
            max_candidates=max_cands, reporter=reporter, command="solforge " + " ".join(sys.argv[1:]),
            db=False if args.no_db else (args.db or True), runner=runner, gpus=gpus, strategy=args.search,
            build_workers=args.build_workers, timeout=args.timeout, retune=args.retune, resume=args.resume,
            profile=args.profile, keep_slower=args.keep_slower, skip_logits=args.skip_logits,
        )
    if report.profile is not None:
        print_profile(report.profile, _stdout_console(), top=8)
    print_report(report, _stdout_console())
    print(f"report: {Path(args.out) / 'report.json'}, {Path(args.out) / 'report.html'}")
    if report.e2e is not None and not report.e2e.passed:
        return 1
    return 0


def _freeze_heap() -> None:
    """What this process holds once the model is loaded (torch, transformers, the model) lives until
    the command ends, so it leaves the garbage collector's full scans (gc.freeze): without it each
    full scan during and after the capture walks ~0.4-0.6M objects (0.2-0.4 s each on the CPU dev
    box, up to 1.2 s on the H100 hosts). capture() also holds full scans off while it traces."""
    gc.freeze()


def _families(args: argparse.Namespace) -> list[str] | None:
    return [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None


def _profile(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UserError("--top must be at least 1")
    if args.mode != "inference":
        raise UserError("solforge profile measures the forward (--mode inference); the backward is not "
                        "attributed to regions yet")
    device = _device(args)
    from rich.console import Console

    from solforge.api import profile
    from solforge.report.terminal import RichReporter, print_profile

    console = Console(stderr=True, quiet=args.quiet)
    loaded = _load(args, device, console)
    _freeze_heap()
    with RichReporter(console) as reporter:
        report = profile(loaded.model, loaded.example_inputs, out_dir=Path(args.out), name=loaded.name,
                         families=_families(args),
                         reporter=reporter, command="solforge " + " ".join(sys.argv[1:]))
    assert report.profile is not None
    print_profile(report.profile, _stdout_console(), top=args.top)
    out = Path(args.out)
    print(f"report: {out / 'report.json'}, {out / 'report.html'}; trace (Perfetto): {out / 'trace_baseline.json'}")
    return 0 if report.profile.complete else 1


def _stdout_console() -> Console:
    from rich.console import Console

    # piped into a log or a file, rich would fold the wide tables into 80 columns
    return Console() if sys.stdout.isatty() else Console(width=170)


def entry() -> None:
    """The console script: `main`, then a fast exit. Everything solforge writes (report, kernel
    database) is closed by then; what is left is tearing down the CUDA context, the model and the
    compiled graphs, which took ~2 s of a 32 s warm `optimize qwen3-4b` on the H100 host
    (2026-11-22) and gives the user nothing. Outputs are flushed first."""
    import logging

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
