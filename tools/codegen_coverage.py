"""Coverage audit of generated regions over KernelBench: which memory-bound ATen ops stay out, and why.

    PYTHONPATH=$PWD python tools/codegen_coverage.py [--levels 1,2,3] [--problems GLOB] [--all-level3]
                                                     [--out tools/codegen_coverage.md] [--json PATH]

For every problem file (level3's GEMM/conv-bound ones, bench/kernelbench_gemm_bound.json, only with
--all-level3): the module's integer size globals are shrunk (batch-like names to a smaller cap than every other
int above a cap to the cap; a few caps are tried, odd first, until the model builds and runs), the
model and inputs are made on the CPU in fp32, captured under no_grad (solforge.capture.capture) and
planned (plan.find_matches, the families then the generated matcher). Capture and plan only: no
tuning, no kernel is built.

Each call_function node of each graph is then one of:
  family     in a region a hand-written family claimed
  generated  in a generated region
  anchor     legitimately out: matmul, convolution, attention, recurrent cells, random ops, mutations,
             custom ops
  dead       read by nothing
  view       a view, getitem or empty tensor outside every region (index arithmetic or an allocation:
             no data moved)
  left out   memory-bound and in no region, with the reason: "no lowering for OP", a lowering error,
             a region refused (`worth`, `_to_match`), "dropped from its region" (an output its loop
             cannot store), ...

Bytes: the shrunk sizes make every region tiny, so the generated matcher's MIN_BYTES floor is set to
0 here (at the official sizes those regions clear it); "one pointwise op" refusals are reported as
their own row, as are layout copies alone (eager's kernel is already one pass: not a coverage gap).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import json
import operator
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from solforge.capture import op_name  # noqa: E402

# (batch cap, other cap), tried in turn: odd first, then sizes that divide by common group/head counts,
# (48: twelve heads), then batch tied to the rest (a loss broadcasting (B, N) against (B,) needs B == N);
# level 3 last tries batch 1 at full size (networks whose image size is fixed in their code)
CAPS = ((3, 17), (3, 32), (3, 48), (3, 64), (17, 17), (32, 32), (48, 48), (64, 64))
FULL = (1, 1 << 62)
PER_PROBLEM_S = 120

# op bases (aten.<base>.<overload>) that are legitimately outside every memory-bound region
ANCHOR_BASES = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "dot", "mv", "addmv", "linear", "einsum", "tensordot",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "mkldnn_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
    "slow_conv3d", "slow_conv_transpose2d", "slow_conv_transpose3d", "_slow_conv2d_forward",
    "slow_conv_dilated2d", "slow_conv_dilated3d", "_mkldnn_transpose",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math", "_flash_attention_forward",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
}
VIEW_BASES = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "expand",
              "permute", "transpose", "t", "slice", "select", "alias", "detach", "as_strided", "split",
              "split_with_sizes", "unbind", "chunk", "narrow", "view_as", "expand_as", "lift_fresh", "unfold",
              "_reshape_alias", "diagonal", "squeeze_copy", "t_copy", "empty", "empty_strided", "empty_like"}


def base(node: fx.Node) -> str:
    name = op_name(node.target)
    parts = name.split(".")
    return parts[1] if len(parts) == 3 else name


# ------------------------------------------------------------------------------------------------
# loading a problem small


def _shrink(module: Any, batch: int, cap: int) -> None:
    def small(k: str, v: Any) -> Any:
        lim = batch if "batch" in k.lower() else cap
        if type(v) is int:
            return min(v, lim)
        if isinstance(v, tuple | list) and v and all(type(x) is int for x in v):
            return type(v)(min(x, cap) for x in v)
        return v

    for k, v in list(vars(module).items()):
        if not k.startswith("_"):
            setattr(module, k, small(k, v))


def load_small(path: Path, level: int = 1) -> tuple[torch.nn.Module, tuple[Any, ...], tuple[int, int]]:
    """The problem's model and inputs at the first cap that builds and runs (fp32, CPU, eval)."""
    from solforge.zoo.loaders import import_file

    last: Exception | None = None
    for cap in CAPS + ((FULL,) if level == 3 else ()):
        module = import_file(str(path))
        _shrink(module, *cap)
        try:
            torch.manual_seed(0)
            model = module.Model(*module.get_init_inputs()).eval()
            torch.manual_seed(1)
            raw = module.get_inputs()
            inputs = tuple(raw) if isinstance(raw, list | tuple) else (raw,)
            inputs = tuple(x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                           for x in inputs)
            model = model.float()
            with torch.no_grad():
                model(*inputs)
            return model, inputs, cap
        except Exception as e:  # noqa: BLE001 - a cap too small for the model: try the next
            last = e
    why = (str(last).strip() or repr(last))[:160]
    raise RuntimeError(f"does not build at caps {CAPS}: {type(last).__name__}: {why}")


# ------------------------------------------------------------------------------------------------
# auditing one graph


def _alone_error(node: fx.Node) -> str | None:
    """Why `node` alone does not lower (None: it does, alone)."""
    from solforge.codegen import ir as IR
    from solforge.codegen.lower import LowerError, analyze, lower

    try:
        kg = lower(IR.from_nodes([node], [node]))
    except (LowerError, ValueError) as e:
        return f"lowering error: {e}"
    an = analyze(kg)
    if an.error is not None:
        return f"loop error: {an.error}"
    if an.bad_outputs:
        return "loop cannot store its output"
    return None


def _scratch_reason(n: fx.Node, region_reason: dict[fx.Node, str], in_region: set[fx.Node]) -> str:
    """Why scratch node `n` is in no accepted region."""
    from solforge.codegen.regions import anchor_reason

    if n in region_reason:
        return region_reason[n]
    why = anchor_reason(n)
    if why == "unknown to the generator":
        return f"no lowering for {op_name(n.target)}"
    if why == "dtype or empty value":
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        return "dtype " + ",".join(str(getattr(v, "dtype", type(v).__name__)).removeprefix("torch.") for v in vals)
    if why is not None:
        return why
    if n in in_region:
        return "in a refused region"
    err = _alone_error(n)
    return err or "dropped from its region (an output its loop cannot store, or a view-only region)"


def audit_graph(graph: fx.Graph) -> dict[str, Any]:
    from solforge.codegen import regions as RG
    from solforge.plan import find_matches
    from solforge.plan import generated as GEN
    from solforge.plan.sharing import Sharing

    matches = find_matches(graph)
    family: set[fx.Node] = set()
    gen: set[fx.Node] = set()
    for m in matches:
        (gen if m.family == "generated" else family).update(m.nodes)
    # the generated matcher's view of the graph, with the reason each region was refused
    sc, excluded = GEN.scratch(graph, family)
    order = {n: i for i, n in enumerate(graph.nodes)}
    region_reason: dict[fx.Node, str] = {}
    in_region: set[fx.Node] = set()
    sharing = Sharing(graph)
    for fr in RG.form_regions(sc.graph, excluded):
        in_region.update(fr.nodes)
        m = GEN._to_match(fr, sc, graph, order)
        if isinstance(m, str):
            why = f"region refused: {m}"
        else:
            nodes, inputs, outputs, composite = m
            why = GEN.worth(fr, nodes, composite)
            if why is not None:
                why = "not worth a kernel: " + ("one pointwise op" if why.startswith("one pointwise") else why)
            elif GEN.stale_reads(graph, nodes, outputs, order):
                why = "region refused: a value it reads is written while it runs"
            elif not sharing.allows(nodes, outputs, inputs):
                why = "region refused: shares inner nodes (plan/sharing.py)"
            elif not set(nodes) <= gen:
                why = "region refused by find_matches (overlap)"
        if why is not None:
            for n in fr.nodes:
                region_reason.setdefault(n, why)
    # scratch copies of each original node
    copies: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for s, o in sc.origin.items():
        copies[o].append(s)

    counts = collections.Counter()
    left: list[dict[str, str]] = []
    anchors: collections.Counter[str] = collections.Counter()
    single: collections.Counter[str] = collections.Counter()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n in family:
            counts["family"] += 1
            continue
        if n in gen:
            counts["generated"] += 1
            continue
        b = base(n)
        if n.target is operator.getitem or b in VIEW_BASES:
            counts["view"] += 1
            continue
        t = n.target
        if b in ANCHOR_BASES or not isinstance(t, torch._ops.OpOverload) or t.namespace not in ("aten", "prims") \
                or torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable:
            counts["anchor"] += 1
            anchors[op_name(t) if isinstance(t, torch._ops.OpOverload) else str(t)] += 1
            continue
        if not n.users:
            counts["dead"] += 1  # nothing reads it: no kernel runs for it in a compiled graph either
            continue
        counts["left"] += 1
        if n in sc.pieces:  # a composite, decomposed in the scratch graph
            live = sc.pieces[n]
            reasons = [_scratch_reason(p, region_reason, in_region) for p in live
                       if p.target is not operator.getitem and base(p) not in VIEW_BASES]
            why = "composite: " + (reasons[0] if reasons else "no live pieces")
        elif n.target in GEN._table():
            why = "composite whose decomposition does not trace"
        else:
            scs = [s for s in copies.get(n, []) if s.graph is sc.graph and s.op == "call_function"]
            why = _scratch_reason(scs[0], region_reason, in_region) if scs else "no scratch copy"
        if why.startswith(("not worth a kernel: one pointwise op", "not worth a kernel: no compute op")):
            # one pointwise op, or a layout copy (a permuted view's clone) between anchors: eager's
            # kernel is one pass already, not a coverage gap
            counts["left"] -= 1
            counts["single"] += 1
            single[op_name(n.target)] += 1
            continue
        left.append({"op": op_name(n.target), "why": why})
    return {"counts": dict(counts), "left": left, "anchors": dict(anchors), "single": dict(single)}


# ------------------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(_sig: int, _frame: Any) -> None:
    raise _Timeout()


def audit_problem(level: int, path: Path) -> dict[str, Any]:
    from solforge.capture import capture

    row: dict[str, Any] = {"level": level, "problem": path.stem}
    t0 = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_PROBLEM_S)
    try:
        model, inputs, cap = load_small(path, level)
        row["cap"] = cap
        torch._dynamo.reset()
        with torch.no_grad():
            cap_b = capture(model, inputs)
        graphs = [audit_graph(g.aten.graph) for g in cap_b.graphs]
        row["graphs"] = graphs
        if cap_b.errors:
            row["capture_errors"] = [str(e)[:200] for e in cap_b.errors]
    except _Timeout:
        row["error"] = f"timed out after {PER_PROBLEM_S} s"
    except Exception as e:  # noqa: BLE001 - one problem's failure is a row, not the end of the audit
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        row["trace"] = traceback.format_exc()[-1500:]
    finally:
        signal.alarm(0)
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _problems(root: Path, levels: list[int], pattern: str, all_level3: bool) -> list[tuple[int, Path]]:
    from suite import _number, gemm_bound

    skips = {} if all_level3 else gemm_bound().get("level3", {})
    out = []
    for level in levels:
        for f in sorted((root / f"level{level}").glob("*.py"), key=lambda f: (_number(f.stem), f.stem)):
            if not (fnmatch.fnmatch(f.stem, pattern) or fnmatch.fnmatch(f"level{level}/{f.stem}", pattern)):
                continue
            if level == 3 and f.stem in skips:
                continue
            out.append((level, f))
    return out


def table(rows: list[dict[str, Any]], command: str) -> str:
    total: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    by_reason: collections.Counter[tuple[str, str]] = collections.Counter()
    problems_of: dict[str, set[str]] = collections.defaultdict(set)
    anchors: collections.Counter[str] = collections.Counter()
    single: collections.Counter[str] = collections.Counter()
    per_problem = []
    for r in rows:
        name = f"L{r['level']}/{r['problem']}"
        c: collections.Counter[str] = collections.Counter()
        for g in r.get("graphs", []):
            c.update(g["counts"])
            anchors.update(g["anchors"])
            single.update(g.get("single", {}))
            for lo in g["left"]:
                by_op[lo["op"]] += 1
                by_reason[(lo["op"], lo["why"])] += 1
                problems_of[lo["op"]].add(name)
        total.update(c)
        per_problem.append((name, c, r.get("error")))
    errs = [p for p in per_problem if p[2]]
    with_left = sum(1 for p in per_problem if p[1]["left"])
    lines = [
        "# Generated-region coverage over KernelBench",
        "",
        f"Date: {datetime.date.today().isoformat()} (UTC). Command: `{command}`",
        "",
        "Capture + plan only, at shrunk sizes on the CPU (tools/codegen_coverage.py explains how; the",
        "MIN_BYTES floor is off, so refusals for size do not show). Counts are ATen call_function nodes.",
        "",
        f"Problems: {len(rows)} ({len(errs)} failed to load or capture); with a memory-bound node left out: "
        f"{with_left}.",
        "",
        "| family | generated | anchor | view/alloc (outside) | dead | single op or copy | left out |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {total['family']} | {total['generated']} | {total['anchor']} | {total['view']} | {total['dead']} "
        f"| {total['single']} | {total['left']} |",
        "",
        "A single pointwise op, or a layout copy (clone of a permuted view), with no fusible neighbour stays",
        "an eager op on purpose (its kernel is one pass already): counted apart, not a gap. A lone average",
        "pool, and a lone max pool whose indices nothing reads (eager writes them), is a region.",
        "",
        "## Left-out ops by count",
        "",
        "| op | nodes | problems | reasons (nodes) |",
        "|---|---:|---:|---|",
    ]
    for op, n in by_op.most_common():
        reasons = sorted(((k[1], v) for k, v in by_reason.items() if k[0] == op), key=lambda t: -t[1])
        why = "; ".join(f"{w} ({v})" for w, v in reasons[:3]) + (" ..." if len(reasons) > 3 else "")
        lines.append(f"| {op} | {n} | {len(problems_of[op])} | {why.replace('|', '/')} |")
    lines += ["", "## Single pointwise ops and layout copies (not gaps)", "", "| op | nodes |", "|---|---:|"]
    lines += [f"| {op} | {n} |" for op, n in single.most_common()]
    lines += ["", "## Anchors by count", "", "| op | nodes |", "|---|---:|"]
    lines += [f"| {op} | {n} |" for op, n in anchors.most_common()]
    if errs:
        lines += ["", "## Problems that did not load or capture", "", "| problem | error |", "|---|---|"]
        lines += [f"| {p} | {e.replace('|', '/')} |" for p, _, e in errs]
    lines += ["", "## Per problem (those with nodes left out)", "", "| problem | family | generated | anchor | left |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {p} | {c['family']} | {c['generated']} | {c['anchor']} | {c['left']} |"
              for p, c, e in per_problem if c["left"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    from suite import DEFAULT_KERNELBENCH

    # a worktree sits one level deeper than the main checkout: look beside its parent too
    default = next((d for d in (DEFAULT_KERNELBENCH, REPO.parent.parent / "shared" / "kernelbench") if d.is_dir()),
                   DEFAULT_KERNELBENCH)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernelbench", default=str(default))
    p.add_argument("--levels", default="1,2,3")
    p.add_argument("--problems", default="*", help="glob over problem stems or levelN/stem")
    p.add_argument("--all-level3", action="store_true", help="also level 3's GEMM/conv-bound problems")
    p.add_argument("--out", default=str(REPO / "tools" / "codegen_coverage.md"))
    p.add_argument("--json", default=None, help="also write every row (per graph, per node) here")
    a = p.parse_args()

    from solforge.plan import generated as GEN

    GEN.MIN_BYTES = 0
    torch.set_num_threads(1)
    if not Path(a.kernelbench).is_dir():
        raise SystemExit(f"no KernelBench checkout at {a.kernelbench}: pass --kernelbench PATH")
    probs = _problems(Path(a.kernelbench), [int(x) for x in a.levels.split(",")], a.problems, a.all_level3)
    rows = []
    for level, f in probs:
        row = audit_problem(level, f)
        left = sum(len(g["left"]) for g in row.get("graphs", []))
        print(f"L{level} {f.stem}: {row.get('error') or f'{left} left out'} ({row['seconds']} s)", flush=True)
        rows.append(row)
    command = "PYTHONPATH=$PWD python tools/codegen_coverage.py " + " ".join(sys.argv[1:])
    Path(a.out).write_text(table(rows, command.strip()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
