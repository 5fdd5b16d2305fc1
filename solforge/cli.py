"""`solforge` command line: maps flags onto api calls, draws progress and tables; nothing else."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from solforge.errors import UserError

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
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solforge", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    o = sub.add_parser("optimize", help="capture, tune, verify and swap in kernels; validate end to end",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    o.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="where to run (default: cuda when a GPU is present, else cpu through Triton's "
                        "interpreter: correct but slow, and its timings mean nothing)")
    o.add_argument("--mode", default="inference", choices=["inference"],
                   help="what to optimize for (training comes with the backward kernels)")
    o.add_argument("--batch", type=int, default=None, help="batch size of a zoo model's inputs (default 1)")
    o.add_argument("--seq", type=int, default=None, help="sequence length of a zoo model's inputs (default 128)")
    o.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    o.add_argument("--weights", default=None, metavar="DIR",
                   help="load a zoo model's real weights from a local Hugging Face directory")
    o.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="tuning time across all kernels (default 120 on a GPU, 60 on the CPU)")
    o.add_argument("--max-candidates", type=int, default=None, metavar="N",
                   help="measure at most N configs per workload (default: all on a GPU, 4 on the CPU)")
    o.add_argument("--out", default="solforge-out", metavar="DIR",
                   help="where report.json goes (default ./solforge-out)")
    o.add_argument("--seed", type=int, default=0, help="seed for random weights and inputs (default 0)")
    o.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        if args.command == "optimize":
            return _optimize(args)
    except UserError as e:
        print(f"solforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("solforge: interrupted", file=sys.stderr)
        return 130
    return 2


def _optimize(args: argparse.Namespace) -> int:
    if args.device == "cpu" or (args.device is None and not _has_cuda()):
        # must be set before triton is imported anywhere
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from solforge.api import check_device, optimize
    from solforge.numerics import parse_dtype
    from solforge.zoo import load_model

    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("--device cpu needs Triton's interpreter: unset TRITON_INTERPRET or set it to 1")
    dtype = parse_dtype(args.dtype)
    budget = args.budget if args.budget is not None else (120.0 if device == "cuda" else 60.0)
    max_cands = args.max_candidates if args.max_candidates is not None else (None if device == "cuda" else 4)
    if max_cands is not None and max_cands < 1:
        raise UserError("--max-candidates must be at least 1")

    from rich.console import Console

    console = Console(stderr=True, quiet=args.quiet)
    with console.status(f"loading {args.model}"):
        loaded = load_model(args.model, device=device, dtype=dtype, batch=args.batch, seq=args.seq,
                            weights=args.weights, seed=args.seed)
    from solforge.report.terminal import RichReporter, print_report

    with RichReporter(console) as reporter:
        _, report = optimize(
            loaded.model, loaded.example_inputs, mode=args.mode, budget=budget, out_dir=Path(args.out),
            make_inputs=loaded.make_inputs, is_language_model=loaded.is_language_model, name=loaded.name,
            max_candidates=max_cands, reporter=reporter, command="solforge " + " ".join(sys.argv[1:]),
        )
    print_report(report, Console())
    print(f"report: {Path(args.out) / 'report.json'}")
    if report.e2e is not None and not report.e2e.passed:
        return 1
    return 0


def _has_cuda() -> bool:
    # without importing torch (and so triton) before TRITON_INTERPRET is decided
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
