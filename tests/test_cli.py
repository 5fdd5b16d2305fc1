"""The main job end to end (CLI and API), the report's schema, and bad input."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

from solforge.cli import main
from solforge.records import Report, from_dict

REGION_KEYS = {"family", "workload", "count", "baseline_us", "best_us", "speedup", "backend", "config",
               "verified", "max_rel_err"}
E2E_KEYS = {"baseline_ms", "optimized_ms", "speedup", "max_abs_err", "max_rel_err", "argmax_agree", "passed"}


def test_optimize_qwen3_tiny_writes_a_passing_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # on the CPU the default: each workload's heuristic config alone (the interpreter's times rank nothing)
    # (--profile on: off the GPU, auto skips the profile; this run checks it); off the GPU 16 tokens,
    # not the default 128: the interpreter's kernels cost by the row (nothing here depends on the length)
    rc = main(["optimize", "qwen3-tiny", "--device", DEVICE, "--out", str(tmp_path), "--quiet", "--profile", "on",
               *(["--max-candidates", "2"] if DEVICE == "cuda" else ["--seq", "16"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "report.json").read_text())
    assert {"model", "device", "dtype", "mode", "versions", "regions", "e2e"} <= set(data)
    assert data["model"] == "qwen3-tiny" and data["dtype"] == "bf16" and data["mode"] == "inference"
    assert {"torch", "triton", "python"} <= set(data["versions"])
    # qwen3-tiny: 2 layers -> 4 hidden norms + the final one (all but the first after a residual
    # add); 2 (q, k) pairs of norm + rope, fused; 2 MLPs -> 2 SwiGLUs
    # (and what they leave, regions of the generator's: plan/generated.py, test_generated.py)
    assert sorted((r["family"], r["count"]) for r in data["regions"] if r["family"] != "generated") == [
        ("add_rmsnorm", 4), ("rmsnorm", 1), ("rope", 2), ("swiglu", 2)]
    for r in data["regions"]:
        assert REGION_KEYS <= set(r)
        assert r["verified"] is True and r["backend"] == "triton"
        assert r["max_rel_err"] < 0.02 and r["best_us"] > 0 and r["config"]
    e2e = data["e2e"]
    assert E2E_KEYS <= set(e2e)
    assert e2e["passed"] is True and e2e["argmax_agree"] >= 0.99
    assert e2e["max_rel_err"] < 0.05
    # the guarantee: verified (and, on a GPU, not slower), so the optimized model is what was returned
    assert data["returned"] == "optimized" and data["why"] and data["attempts"][0]["dropped"] == []
    if DEVICE == "cpu":
        assert data["timings_meaningful"] is False
        assert any("means nothing" in n for n in data["notes"])
        assert all(r["candidates"] == r["timed"] == 1 for r in data["regions"])
    report = from_dict(Report, data)  # the file round-trips into the record
    assert {r.family for r in report.regions} - {"generated"} == {"add_rmsnorm", "rmsnorm", "rope", "swiglu"}
    # the profile stage: baseline and optimized model, traces and the page
    assert report.profile is not None and report.profile.complete and report.profile_after is not None
    # the swapped-in solforge ops, profiled as regions of their own (no aten chain left but those of
    # the regions left as the model ran them: on a GPU, one whose kernel was not faster than it)
    fams = ("rmsnorm", "add_rmsnorm", "rope", "swiglu")
    after = [r for r in report.profile_after.regions if r.family in fams]
    # a region whose generated alternative won (on a GPU) runs a "generated" op, which the profile
    # may still class under the family's name: between the family-won count and all integrated
    integrated = sum(r.count for r in report.regions if r.family in fams and r.integrated)
    family_won = sum(r.count for r in report.regions if r.family in fams and r.integrated and r.won != "generated")
    left = {r.workload for r in report.regions if r.family in fams and not r.integrated}
    swapped = sum(r.count for r in after if not r.workload)
    assert integrated > 0 and family_won <= swapped <= integrated, (after, report.notes)
    assert {r.workload for r in after if r.workload} <= left, (after, report.notes)
    if DEVICE == "cpu":  # speed is not judged there: every region got its kernel
        assert integrated == 9 and not left
    # tuned in the order of the Amdahl ranking (largest end-to-end saving first)
    saving = {r.workload: r.saving_us for r in report.profile.regions if r.workload}
    assert set(saving) == {r.workload for r in report.regions}
    order = [saving[r.workload] for r in report.regions]
    assert order == sorted(order, reverse=True)
    for name in ("trace_baseline.json", "trace_optimized.json", "report.html"):
        assert (tmp_path / name).stat().st_size > 0
    assert "qwen3-tiny" in out and "passed" in out


def test_api_returns_a_model_called_like_the_original() -> None:
    from solforge import optimize
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, batch=1, seq=16)
    ref = copy.deepcopy(lm.model)  # the model is optimized in place: the original is a copy made before
    opt, report = optimize(lm.model, lm.example_inputs, budget=5, max_candidates=1, make_inputs=lm.make_inputs)
    assert report.e2e is not None and report.e2e.passed and opt is lm.model
    ids = lm.make_inputs(7)[0]
    with torch.no_grad():
        a, b = opt(ids), ref(ids)
    assert type(a) is type(b) and a.keys() == b.keys()
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


MODEL_FILE = """
import torch
class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
    def forward(self, x):
        return torch.relu(self.lin(x))
def get_inputs():
    return [torch.randn(4, 8)]
def get_init_inputs():
    return [8]
"""


def test_model_with_nothing_to_optimize_still_gets_a_report(tmp_path: Path) -> None:
    f = tmp_path / "plain.py"
    f.write_text(MODEL_FILE)
    rc = main(["optimize", str(f), "--device", DEVICE, "--dtype", "fp32", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    assert data["regions"] == [] and data["e2e"] is None and data["returned"] == "original"
    assert any("nothing to optimize" in n for n in data["notes"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["optimize", "qwen9-huge"], "unknown model"),
        (["optimize", "qwen3-tiny", "--dtype", "int8"], "unsupported dtype"),
        (["optimize", "does/not/exist.py"], "exist"),
        (["optimize", "qwen3-tiny", "--budget", "0"], "budget"),
        (["optimize", "qwen3-tiny", "--budget", "nan"], "--budget must be a positive, finite number"),
        (["optimize", "qwen3-tiny", "--budget", "inf"], "--budget must be a positive, finite number"),
        (["optimize", "qwen3-tiny", "--budget", "-5"], "--budget must be a positive, finite number"),
        (["optimize", "qwen3-tiny", "--timeout", "nan"], "--timeout must be a positive, finite number"),
        (["optimize", "qwen3-tiny", "--batch", "0"], "batch"),
        (["profile", "qwen3-tiny", "--mode", "train"], "forward"),
        (["optimize", "qwen3-tiny", "--families", "rmsnorm,conv3d"], "unknown kernel families"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    rc = main([*argv, "--device", DEVICE, "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err.lower(), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kw", [{"budget": float("nan")}, {"budget": float("inf")}, {"budget": -1.0},
                                {"timeout": float("nan")}, {"timeout": float("inf")}])
def test_api_refuses_a_time_limit_that_is_no_number_of_seconds(kw: dict[str, float]) -> None:
    from solforge import optimize
    from solforge.errors import UserError

    model = torch.nn.Linear(4, 4)
    with pytest.raises(UserError) as e:
        optimize(model, (torch.randn(2, 4),), db=False, **kw)
    flag = next(iter(kw))
    text = str(e.value)
    assert text.startswith(f"--{flag} must be a positive, finite number of seconds") and "\n" not in text


CPU_API = """
import os, sys
{first}
import torch
import solforge
from solforge.errors import UserError

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(24))
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

torch.manual_seed(0)
try:
    _, rep = solforge.optimize(Model(), (torch.randn(5, 7, 24),), budget=5, max_candidates=1, db=False,
                               profile="off")
except UserError as e:
    print("refused:", e)
    sys.exit(2)
print("regions", [(r.family, r.verified) for r in rep.regions], "e2e", rep.e2e.status, rep.e2e.passed)
"""


@pytest.mark.parametrize("interpret, triton_first, expect", [
    (None, False, None),
    (None, True, "import solforge before triton"),
    ("0", False, "(TRITON_INTERPRET=0): set TRITON_INTERPRET=1"),
])
def test_api_on_the_cpu_needs_no_setting_or_says_what_to_set(interpret: str | None, triton_first: bool,
                                                             expect: str | None) -> None:
    """From Python, a model on the CPU: without TRITON_INTERPRET set, `import solforge` switches
    Triton's interpreter on (no GPU here), and the kernels run. Where that cannot work (set to 0;
    triton imported first: its own library is then compiled code), optimize refuses in one line
    saying what to do (it was every candidate failing, with a report saying the kernels ran in the
    interpreter)."""
    from solforge import has_gpu_device

    if interpret is None and has_gpu_device():
        pytest.skip("with a GPU, import solforge leaves TRITON_INTERPRET alone")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    code = CPU_API.format(first="import triton" if triton_first else "")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if expect is None:
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == "regions [('rmsnorm', True)] e2e passed True"
    else:
        assert p.returncode == 2, p.stderr
        (line,) = p.stdout.strip().splitlines()
        assert line.startswith("refused: the model is on the CPU") and expect in line


NONE_FILE = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(24))
        self.register_buffer("out", torch.zeros(5, 7, 24))

    def forward(self, x):  # an RMSNorm written into a buffer; returns None
        self.out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w)

def get_inputs():
    return [torch.randn(5, 7, 24)]

def get_init_inputs():
    return []
"""


def test_a_model_returning_none_is_nothing_to_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was "passed" with 0 outputs compared: now the record, the report and the exit code say
    nothing was validated."""
    f = tmp_path / "none.py"
    f.write_text(NONE_FILE)
    rc = main(["optimize", str(f), "--device", DEVICE, "--dtype", "fp32", "--out", str(tmp_path / "o"), "--quiet",
               "--no-db", "--max-candidates", "1", "--profile", "off"])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [r["family"] for r in data["regions"]] == ["rmsnorm"] and data["regions"][0]["verified"]
    e2e = data["e2e"]
    assert e2e["status"] == "nothing to validate" and e2e["passed"] is False and e2e["outputs_compared"] == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("end to end")]
    assert "nothing to validate" in line and "passed" not in line
    assert rc == 1  # not a success: the optimized model is unverified


PARAMETERLESS_FILE = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5)

def get_inputs():
    return [torch.randn(2, 8, 4, 4)]

def get_init_inputs():
    return []
"""


def test_train_mode_without_anything_to_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A KernelBench operator (no parameters, plain inputs) in --mode train: said at once, before any
    tuning, in one line (it was a traceback from the validation, after the tuning)."""
    f = tmp_path / "op.py"
    f.write_text(PARAMETERLESS_FILE)
    rc = main(["optimize", str(f), "--device", DEVICE, "--mode", "train", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--mode train" in err and "--mode inference" in err
    assert not (tmp_path / "o" / "report.json").exists()


def test_file_without_model_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "nomodel.py"
    f.write_text("def get_inputs():\n    return []\n")
    assert main(["optimize", str(f), "--device", DEVICE, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Model" in err and "get_init_inputs" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", "qwen3-tiny", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err


def test_unwritable_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["optimize", "qwen3-tiny", "--device", DEVICE, "--out", str(blocker / "sub"), "--quiet",
               "--max-candidates", "1", "--budget", "1"])
    assert rc == 2
    assert "cannot write" in capsys.readouterr().err


def test_help_says_the_timeout_is_the_process_runners(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "with --runner process or ray only" in out and "the local runner (the default) has no timeout" in out
    assert "without --timeout: a candidate that hangs stalls the run and one that crashes ends it" in out


def test_console_script_help() -> None:
    exe = Path(sys.executable).parent / "solforge"
    out = subprocess.run([str(exe), "optimize", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--device", "--mode", "--batch", "--seq", "--dtype", "--budget", "--out", "--weights"):
        assert flag in out


def test_console_script_exit_codes_and_output() -> None:
    """The console script leaves through os._exit: its messages must still be flushed and its exit
    code kept, for errors (2) and for success (0, with output on stdout)."""
    exe = Path(sys.executable).parent / "solforge"
    bad = subprocess.run([str(exe), "optimize", "no-such-model", "--device", "cpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no-such-model" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run([str(exe), "db", "list", "--db", "/nonexistent/dir/k.db"], capture_output=True, text=True)
    assert ok.returncode == 0 and "no kernel database" in ok.stdout + ok.stderr


def test_help_lists_every_family_in_matching_order():
    from solforge.cli import _FAMILIES, _parser
    from solforge.kernels import registry
    from solforge.plan import _matchers

    assert _FAMILIES == tuple(_matchers())
    text = " ".join(_parser()._subparsers._group_actions[0].choices["optimize"].format_help().split())
    assert all(f in text for f in registry.names())  # --families lists the forward ones, --mode the backward
    assert ", ".join(_FAMILIES) in text and ", ".join(registry.backward_names()) in text
