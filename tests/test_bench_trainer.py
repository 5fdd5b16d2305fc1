"""bench/trainer.py's smoke run (`--tiny --device cpu`): eager and solforge through Hugging Face's
Trainer, full fine-tuning and LoRA (when peft is here, where the whole sweeps run), each row in a
process of its own, the rows' fields, finite losses, solforge's losses as eager's step by step,
and a clear error for an unknown variant. The rows run in the test's process (`--in-process`: each
process would import transformers' Trainer again, 5-10 s), one step of one micro-batch after one
of warm-up (the Triton interpreter's share); the processes' command lines are checked apart, by
parsing them back."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FULL_SWEEPS

pytest.importorskip("accelerate")  # Trainer needs it
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "trainer.py"
LORA = importlib.util.find_spec("peft") is not None


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # the runs are --device cpu: on a GPU machine too, the kernels run in Triton's interpreter
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_tiny_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    # LoRA's two rows where the whole sweeps run (a GPU machine, SOLFORGE_FULL_SWEEPS=1; the rows are
    # --device cpu there too); CPU CI samples full fine-tuning (tests/test_peft.py trains LoRA there)
    modes = "full,lora" if LORA and FULL_SWEEPS else "full"
    proc = _run("--tiny", "--device", "cpu", "--modes", modes, "--variants", "solforge,eager", "--batch", "2",
                "--seq", "8", "--accum", "1", "--steps", "1", "--warmup", "1", "--budget", "1",
                "--db", str(tmp_path / "kernels.db"), "--out", str(out), "--in-process",
                # the families whose kernels the assertions name: the generated regions' tuning in
                # the interpreter is the rest of optimize's time here (tested on their own elsewhere)
                "--families", "rmsnorm,add_rmsnorm,swiglu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    meta, rows = rows[0], rows[1:]
    assert meta["row"] == "meta" and meta["device"] == "cpu" and "--tiny" in meta["command"]
    assert {"torch", "transformers", "peft", "accelerate"} <= set(meta["versions"])
    # eager runs first whatever the order asked: the others' losses are compared with its
    want = [(m, v) for m in modes.split(",") for v in ("eager", "solforge")]
    assert [(r["mode"], r["variant"]) for r in rows] == want
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["layers"] == 1 and r["tokens_per_step"] == 2 * 8 * 1 and r["timed_steps"] == 1
        assert 0 < r["p20_ms"] <= r["step_ms"] <= r["p80_ms"] and r["tokens_per_s"] > 0
        assert len(r["step_times_ms"]) == 2 and r["first_step_s"] > 0
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        # a fresh causal LM over 128 tokens: its loss starts near ln(128)
        assert abs(r["losses"][0] - math.log(128)) < 0.5, r["losses"]
        # the model trained is the one built (PEFT's wrapper in LoRA), not wrapped by Trainer
        assert r["trained"] == ("PeftModelForCausalLM" if r["mode"] == "lora" else "Qwen3ForCausalLM")
        if r["mode"] == "lora":  # adapters only: a small part of the model trains
            assert 0 < r["trainable_M"] < r["params_M"] / 2
        else:
            assert r["trainable_M"] == r["params_M"]
        if r["variant"] == "solforge":
            assert r["returned"] == "optimized" and r["e2e"]["passed"], (r["returned"], r["why"])
            assert r["kernels"] > 0 and {"rmsnorm", "swiglu", "swiglu_bwd"} <= set(r["families"]), r["families"]
            assert r["optimize_s"] > 0
            # off the GPU no step is captured: every step graph has settled at the first step
            assert r["settled_step"] == 1 and "judging_peak_allocated_gb" not in r
            # the same data, init and order as eager: the losses differ by bf16 rounding alone
            eager = next(e for e in rows if e["mode"] == r["mode"] and e["variant"] == "eager")
            assert r["loss_max_abs_diff_vs_eager"] == max(
                abs(x - y) for x, y in zip(r["losses"], eager["losses"], strict=True))
            assert r["loss_max_abs_diff_vs_eager"] < 5e-3, (r["losses"], eager["losses"])
    # the tolerance above is finer than a step: the second step's loss (another batch, after an
    # update) is a further 5e-3 from the first
    assert all(abs(r["losses"][1] - r["losses"][0]) > 5e-3 for r in rows)


def test_unknown_variant_is_one_line() -> None:
    proc = _run("--tiny", "--device", "cpu", "--variants", "eager,nope", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["bench/trainer.py: unknown variant(s) nope; known: eager, liger, "
                                                "compile, solforge, solforge-skip"]


def _bench():  # bench/ holds scripts, not a package; trainer.py imports only the standard library at the top
    sys.path.insert(0, str(ROOT / "bench"))
    import trainer

    return trainer


def test_row_command_round_trips() -> None:
    """A row's process gets the run's settings: its command line parses back to them."""
    trainer = _bench()
    a = trainer.parse(["--model", "qwen3-4b", "--layers", "6", "--batch", "3", "--seq", "100", "--accum", "4",
                       "--steps", "5", "--warmup", "2", "--budget", "7", "--device", "cpu", "--db", "/x/k.db",
                       "--families", "rmsnorm,swiglu"])
    cmd = trainer.command("lora", "compile", a)
    assert cmd[:2] == [sys.executable, trainer.__file__]
    b = trainer.parse(cmd[2:])
    assert b.one == "lora:compile"
    assert {k: v for k, v in vars(b).items() if k != "one"} == {k: v for k, v in vars(a).items() if k != "one"}
    tiny = trainer.parse(["--tiny", "--device", "cpu"])
    assert trainer.parse(trainer.command("full", "eager", tiny)[2:]).tiny
    assert (tiny.seq, tiny.steps, tiny.warmup) == (16, 2, 1)


def test_configs_are_the_published_ones() -> None:
    """The 0.6B config built here is solforge.zoo.hf's (the published one) but for the layers asked."""
    from solforge.zoo.hf import qwen3_0_6b_config, qwen3_4b_config

    trainer = _bench()
    for name, ref in (("qwen3-0.6b", qwen3_0_6b_config()), ("qwen3-4b", qwen3_4b_config())):
        got = trainer.config(name, 3, False).to_dict()
        want = ref.to_dict()
        diff = {k for k in set(got) | set(want) if got.get(k) != want.get(k)}
        assert diff == {"num_hidden_layers", "max_window_layers", "layer_types"}, diff
        assert got["num_hidden_layers"] == got["max_window_layers"] == len(got["layer_types"]) == 3


def test_stop_after_skips_rows(tmp_path: Path) -> None:
    """Past --stop-after no row starts: each says so in the file, after the meta row; Liger off the GPU too."""
    out = tmp_path / "rows.jsonl"
    proc = _run("--tiny", "--device", "cpu", "--modes", "full", "--variants", "liger,eager", "--stop-after", "0",
                "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["row"] == "meta" and rows[0]["model"] == "qwen3-tiny"
    assert rows[1:] == [{"mode": "full", "variant": "eager", "skipped": "not started: --stop-after 0 s reached"},
                        {"mode": "full", "variant": "liger", "skipped": "Liger-Kernel runs on CUDA only"}]
