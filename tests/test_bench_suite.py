"""bench/suite.py on the CPU: its rows, limits, resume and table (the smoke path the GPU run takes).

One subprocess test runs the suite itself on a KernelBench-format checkout written here: a problem
that runs, one that raises and one that hangs, side by side, with a skipped level-3 problem; the
others call its functions in this process. Timings on the CPU mean nothing and are not asserted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import suite  # noqa: E402  (bench/ holds scripts, not a package)
import suite_table  # noqa: E402

OK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return torch.softmax(torch.relu(x) * self.scale, dim=-1)

rows = 37
cols = 24

def get_inputs():
    return [torch.randn(rows, cols)]

def get_init_inputs():
    return [cols]
"""
CRASH = OK.replace("return torch.softmax",
                   "raise RuntimeError('deliberate failure in forward')\n        return torch.softmax")
HANG = OK.replace("return torch.softmax", "import time; time.sleep(600)\n        return torch.softmax")


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "kb"
    (root / "level1").mkdir(parents=True)
    (root / "level3").mkdir()
    (root / "level1" / "1_Ok.py").write_text(OK)
    (root / "level1" / "2_Crash.py").write_text(CRASH)
    (root / "level1" / "3_Hang.py").write_text(HANG)
    (root / "level3" / "1_MLP.py").write_text(OK)  # named as KernelBench's GEMM-bound one: skipped
    return root


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "suite.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_suite_rows_errors_timeouts_resume_and_table(tmp_path: Path) -> None:
    root, out = _checkout(tmp_path), tmp_path / "rows.jsonl"
    # the smoke mode (--tiny), on every problem of the checkout (a --problems glob: not --tiny's own pick)
    args = ["--kernelbench", str(root), "--levels", "1,3", "--skip-gemm-bound", "--variants", "eager", "--tiny",
            "--problems", "*_*", "--out", str(out), "--timeout", "20", "--gpus", "0,1,2"]
    t0 = time.monotonic()
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 110  # the hang was cut at its limit, side by side with the others
    rows = {r["key"]: r for r in suite.read_rows(out) if r["suite"] != "meta"}
    ok, crash, hang = (rows[f"kernelbench/1/{n}/fwd/eager"] for n in ("1_Ok", "2_Crash", "3_Hang"))
    assert "error" not in ok and ok["err"] == 0.0 and ok["allclose"] is True and ok["dtype"] == "fp32"
    assert ok["shapes"] == [[suite.TINY_INT, suite.TINY_INT]]  # 37 x 24, cut by --tiny
    assert "deliberate failure in forward" in crash["error"]
    assert hang["timed_out"] is True and hang["error"] == "timed out after 20 s"
    (meta,) = [r for r in suite.read_rows(out) if r["suite"] == "meta"]
    assert all(r.get("commit") == meta["commit"] for r in (ok, crash, hang))  # None outside a git checkout
    skip = rows["kernelbench/3/1_MLP/fwd/-"]
    assert skip["skipped"].startswith("GEMM/conv-bound: a stack of Linear")
    n = len(suite.read_rows(out))

    # --resume: every row is there, nothing runs again
    proc = _run([*args, "--resume"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 of 3 rows to run" in proc.stdout
    assert len(suite.read_rows(out)) == n

    table = suite_table.render(suite.read_rows(out))
    assert "| 1_Ok | " in table and "| 2_Crash | error |" in table and "| 3_Hang | timeout |" in table
    assert "deliberate failure in forward" in table
    assert "| level 3 1_MLP | GEMM/conv-bound:" in table
    assert "Errors (incl. timeouts): eager 2." in table


def test_stop_after_defers_cut_rows_and_starts_none_late(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "MIN_ROW_S", 1.0)
    root, out = _checkout(tmp_path), tmp_path / "rows.jsonl"
    hang = suite.Task("kernelbench", "3_Hang", "eager", level=1, path=str(root / "level1" / "3_Hang.py"))
    opts = {"device": "cpu", "tiny": False, "budget": 1.0, "dtype": None, "profile": False}
    counts = suite.run_suite([hang, hang], opts, out, timeouts={"default": 300.0}, stop_after=0.0, gpus=[None])
    assert counts == {"written": 0, "errors": 0, "deferred": 0, "not_started": 2} and not out.exists()
    # 3 s left past the start threshold: the hang runs 3 s, is cut by --stop-after, and is not written
    # (--resume runs it again)
    t0 = time.monotonic()
    counts = suite.run_suite([hang], opts, out, timeouts={"default": 300.0}, stop_after=suite.MIN_ROW_S + 3,
                             gpus=[None])
    assert counts["deferred"] == 1 and counts["written"] == 0 and not out.exists()
    assert time.monotonic() - t0 < 15


def test_compare_nans_infs_and_tolerance() -> None:
    ref = torch.tensor([1.0, float("nan"), float("inf"), -4.0])
    assert suite.compare(ref.clone(), ref, 1e-4) == {"err": 0.0, "max_abs_err": 0.0, "allclose": True}
    off = ref.clone()
    off[3] = -4.001
    got = suite.compare(off, ref, 1e-4)
    assert got["allclose"] is False and got["max_abs_err"] == pytest.approx(1e-3, rel=1e-2)
    assert got["err"] == pytest.approx(1e-3 / 4, rel=1e-2)  # over the largest finite |eager|
    assert suite.compare(off, ref, 1e-2)["allclose"] is True
    nan_only_in_out = ref.clone()
    nan_only_in_out[0] = float("nan")
    assert suite.compare(nan_only_in_out, ref, 1e-2)["err"] == float("inf")
    assert suite.compare([ref, ref[:2]], [ref], 1e-2)["allclose"] is False
    # several tensors (a loss and gradients): err over them all, and the worst one's own
    big, tiny = torch.full((4,), 10.0), torch.full((3,), 1e-3)
    got = suite.compare([big, tiny + 1e-4], [big, tiny], 1e-2)
    assert got["err"] == pytest.approx(1e-4 / 10, rel=1e-2) and got["err_worst_tensor"] == pytest.approx(0.1, rel=1e-2)


def test_compare_in_chunks_matches_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 13, generator=g)[:, ::2]  # strided
    out = ref + 1e-3 * torch.randn(ref.shape, generator=g)
    whole = suite.compare(out, ref, 1e-3)
    monkeypatch.setattr(suite, "CHUNK", 5)
    assert suite.compare(out, ref, 1e-3) == whole
    d = (out - ref).abs().max().item()
    assert whole["max_abs_err"] == pytest.approx(d, rel=1e-2)
    assert whole["err"] == pytest.approx(d / ref.abs().max().item(), rel=1e-2)


def test_tiny_shrinks_integer_globals_and_loads_on_the_device(tmp_path: Path) -> None:
    f = tmp_path / "p.py"
    f.write_text(OK.replace("rows = 37", "rows = 4000").replace("cols = 24", "cols = 3\nshape = (rows, cols)")
                 .replace("torch.randn(rows, cols)", "torch.randn(shape)"))
    model, inputs, dt = suite.load_problem(str(f), "cpu", None, tiny=False)
    assert dt == "fp32" and inputs[0].shape == (4000, 3) and not model.training  # official: as the file says
    model, inputs, dt = suite.load_problem(str(f), "cpu", None, tiny=True)
    assert dt == "fp32" and inputs[0].shape == (suite.TINY_INT, 3) and not model.training
    model2, inputs2, _ = suite.load_problem(str(f), "cpu", "bf16", tiny=True)
    assert inputs2[0].dtype == torch.bfloat16 and torch.equal(inputs2[0], inputs[0].bfloat16())  # seeded


def test_tiny_arch_rows_forward_and_train_in_process() -> None:
    opts = {"device": "cpu", "tiny": True, "budget": 1.0, "dtype": None, "profile": False}
    fwd = suite.one(suite.Task("arch", "llama-3.2-1b", "eager"), opts)
    assert fwd["err"] == 0.0 and fwd["allclose"] and fwd["layers"] == 2 and fwd["dtype"] == "bf16"
    train = suite.one(suite.Task("arch", "gpt2-medium", "eager", mode="train"), opts)
    assert train["err"] == 0.0 and train["seq"] == 16 and train["batch"] == 2


def test_kernelbench_listing_and_gemm_bound_list() -> None:
    """Every name in the skip list is a level-3 problem of the checkout (when one is here), and
    the selection is every other file of the chosen levels."""
    skips = suite.gemm_bound()["level3"]
    assert all(reason.strip() for reason in skips.values())
    root = suite.DEFAULT_KERNELBENCH
    if not (root / "level3").is_dir():
        pytest.skip(f"no KernelBench checkout at {root}")
    files = {f.stem for f in (root / "level3").glob("*.py")}
    assert set(skips) <= files
    run, skipped = suite.list_problems(root, [1, 2, 3], "*", skip_gemm_bound=True)
    per_level = {lv: sum(1 for level, _ in run if level == lv) for lv in (1, 2, 3)}
    assert per_level == {1: len(list((root / "level1").glob("*.py"))), 2: len(list((root / "level2").glob("*.py"))),
                         3: len(files) - len(skips)}
    assert {s["problem"] for s in skipped} == set(skips)
    tiny, _ = suite.list_problems(root, [1, 2, 3], "*", skip_gemm_bound=True, tiny=True)
    assert [f.stem for _, f in tiny] == [p for lv in (1, 2, 3) for p in suite.TINY_PROBLEMS[lv]]


def test_the_summary_also_compares_with_compile_where_compile_is_within_the_tolerance() -> None:
    """torch.compile outside the tolerance (fp32 convolutions in TF32) is a speed not to match: the
    summary gives solforge/compile over every row and over the rows where compile's output is allclose."""
    def row(problem: str, variant: str, us: float, allclose: bool = True) -> dict[str, object]:
        return {"suite": "kernelbench", "level": 2, "problem": problem, "variant": variant, "mode": "fwd",
                "key": f"kernelbench/2/{problem}/fwd/{variant}", "us": us, "err": 0.0, "allclose": allclose}

    rows = [row("1_A", "eager", 100.0), row("1_A", "compile", 50.0, allclose=False), row("1_A", "solforge", 80.0),
            row("2_B", "eager", 100.0), row("2_B", "compile", 80.0), row("2_B", "solforge", 40.0)]
    table = suite_table.render(rows)
    assert "solforge/compile 0.894 (n=2)" in table  # sqrt(1.6 x 0.5)
    assert "solforge/compile where compile is allclose 0.500 (n=1)" in table
    assert "Outside the tolerance vs eager: compile 1." in table
