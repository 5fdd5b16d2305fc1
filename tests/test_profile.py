"""Profile: kernel -> region attribution, counts per family, roofline/Amdahl arithmetic, ceilings
cache, report.html in a real headless Chromium, and the `solforge profile` command's bad input."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE, requires_gpu

from solforge import settings
from solforge.cli import main
from solforge.profile import profile_model, summarize
from solforge.profile import roofline as rl
from solforge.profile.ceilings import cache_file, get_ceilings
from solforge.profile.regions import Region
from solforge.profile.trace import attribute
from solforge.records import Ceilings, E2EReport, Profile, RegionReport, Report, from_dict, to_dict
from solforge.report.html import render

# H100-like numbers (BASELINES.md), so hand computations below are readable
H100 = Ceilings(device="test", copy_gbs=3000.0, bf16_tflops=750.0, fp32_tflops=50.0)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    from solforge.zoo import load_model

    torch.compiler.reset()
    lm = load_model("qwen3-tiny", device=DEVICE, batch=1, seq=24)
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    # RMSNorm as the only kernel family: the residual adds then show as the residual_add
    # pseudo-family (with every family, add_rmsnorm claims them: see the command's test)
    return profile_model(lm.model, lm.example_inputs, device=DEVICE, name="qwen3-tiny", ceilings=H100,
                         trace_path=trace, families=("rmsnorm",))


# ----------------------------------------------------------------------------------------------
# attribution on qwen3-tiny (2 layers)


def test_qwen3_tiny_counts_per_family(tiny_profile: Profile) -> None:
    counts = {f: n for f, n, _ in tiny_profile.by_family}
    # 2 layers: 4 hidden norms + the final one, 2 q-norms + 2 k-norms; q and k RoPE of a layer are one
    # application; 7 projections per layer + lm_head + the rotary embedding's inv_freq bmm
    assert counts["rmsnorm"] == 9 and counts["rope"] == 2 and counts["silu_mul"] == 2
    assert counts["residual_add"] == 4 and counts["attention"] == 2 and counts["gemm"] == 16
    rms = {r.module: r.count for r in tiny_profile.regions if r.family == "rmsnorm"}
    assert rms == {"model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm": 5,
                   "model.layers.*.self_attn.q_norm": 2, "model.layers.*.self_attn.k_norm": 2}
    q = next(r for r in tiny_profile.regions if r.module == "model.layers.*.self_attn.q_norm")
    assert q.modules == ("model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.q_norm")
    assert q.workload is not None and q.workload.startswith("rmsnorm[") and q.label == "1x24x4x16 bf16"
    gemms = {r.module for r in tiny_profile.regions if r.family == "gemm"}
    assert {"model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj", "lm_head"} <= gemms


def test_qwen3_tiny_time_adds_up(tiny_profile: Profile) -> None:
    p = tiny_profile
    assert p.complete and p.kernels > 100 and p.outside_us == 0.0
    region_sum = sum(r.time_us for r in p.regions)
    assert region_sum == pytest.approx(p.attributed_us, rel=1e-9)
    assert p.attributed_us + p.outside_us == pytest.approx(p.busy_us, rel=1e-9)
    assert p.attributed_us >= 0.95 * p.busy_us
    assert p.busy_us + p.idle_us == pytest.approx(p.span_us, rel=1e-6)
    assert sum(v for _, v in p.by_kind) == pytest.approx(region_sum, rel=1e-9)
    # every region that computes something got its ops (views only may have none)
    assert all(r.kernels > 0 for r in p.regions if r.family != "view")
    assert [r.rank for r in p.regions] == list(range(1, len(p.regions) + 1))
    assert all(a.saving_us >= b.saving_us for a, b in zip(p.regions, p.regions[1:], strict=False))


def test_qwen3_tiny_bytes_and_flops_from_shapes(tiny_profile: Profile) -> None:
    by = {(r.family, r.module): r for r in tiny_profile.regions}
    # q_proj: x (24x64) @ W^T (64x64) in bf16: 2*24*64*64 FLOPs; read x and W, write y
    q = by[("gemm", "model.layers.*.self_attn.q_proj")]
    assert q.flops == 2 * 24 * 64 * 64 and q.bytes == (24 * 64 + 64 * 64 + 24 * 64) * 2
    # residual add of two 1x24x64 bf16 activations: read 2, write 1
    add = by[("residual_add", "model.layers.*")]
    assert add.count == 4 and add.bytes == 3 * 24 * 64 * 2 and add.kind == "pointwise"
    # causal attention, 4 heads, S 24, D 16: (QK^T + PV) halved
    att = by[("attention", "model.layers.*.self_attn")]
    assert att.flops == 2 * 4 * 24 * 24 * (16 + 16) // 2


def test_trace_is_a_chrome_trace_with_region_ranges(tiny_profile: Profile) -> None:
    assert tiny_profile.trace is not None
    events = json.loads(Path(tiny_profile.trace).read_text())["traceEvents"]
    names = {e.get("name", "") for e in events if e.get("cat") == "user_annotation"}
    assert "solforge:step" in names
    assert any(n.endswith("|rmsnorm|model.layers.1.self_attn.k_norm") for n in names)


# ----------------------------------------------------------------------------------------------
# the GPU path of the attribution, on hand-made events shaped like the profiler's Chrome trace


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 10 if cat != "kernel" else 0,
            "tid": tid, "args": dict(args)}


def test_gpu_kernels_follow_their_launch_into_the_range() -> None:
    events = [
        _x("user_annotation", "solforge:step", 0, 100),
        _x("user_annotation", "solforge:0|rmsnorm|model.layers.0.input_layernorm", 10, 10),
        _x("user_annotation", "solforge:1|gemm|model.layers.0.mlp.up_proj", 30, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 1, correlation=1),
        _x("cuda_driver", "cuLaunchKernelEx", 15, 1, correlation=5),  # a Triton launch
        _x("cuda_runtime", "cudaLaunchKernel", 35, 1, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 60, 1, correlation=3),  # in the step, outside regions
        _x("cuda_runtime", "cudaLaunchKernel", 200, 1, correlation=4),  # after the step
        # kernels run later, on the GPU's own clock and thread
        _x("kernel", "pow_kernel", 100, 8, tid=7, correlation=1),
        _x("kernel", "triton_rmsnorm", 109, 2, tid=7, correlation=5),
        _x("kernel", "sm90_gemm", 115, 30, tid=7, correlation=2),
        _x("kernel", "copy_kernel", 150, 5, tid=7, correlation=3),
        _x("kernel", "late_kernel", 300, 1, tid=7, correlation=4),
    ]
    # no launch event, but the External id of the op that launched it: still found
    fallback = [_x("cpu_op", "solforge::rmsnorm", 16, 2, **{"External id": 42}),
                _x("kernel", "rms_kernel", 112, 1, tid=7, correlation=77, **{"External id": 42})]
    assert attribute([*events, *fallback], gpu=True).region_us[0] == 11.0
    att = attribute(events, gpu=True)
    assert att.region_us == {0: 10.0, 1: 30.0} and att.region_kernels == {0: 2, 1: 1}
    assert att.outside_us == 5.0 and att.outside_kernels == 1 and att.kernels == 4
    assert att.busy_us == 45.0 and att.span_us == 55.0 and att.unlinked == 0  # 100 .. 155
    assert att.kernel_names[0] == ["pow_kernel", "triton_rmsnorm"]

    regions = [Region(0, 0, "rmsnorm", "normalization", "m", [], bytes=3_000_000, dtype="bf16", key="a"),
               Region(1, 0, "gemm", "gemm", "m", [], bytes=1, flops=7_500_000, dtype="bf16", key="b")]
    # 5 of 45 us outside every region (11%): not complete
    assert not summarize(regions, att, H100, name="t", device="cuda", forward_us=55.0).complete
    inside = [e for e in events if e["args"].get("correlation") != 3]
    assert summarize(regions, attribute(inside, gpu=True), H100, name="t", device="cuda", forward_us=55.0).complete
    # a kernel whose launch is missing makes the profile partial, never complete
    lost = attribute([*inside, _x("kernel", "orphan", 160, 1, tid=7, correlation=99)], gpu=True)
    assert lost.unlinked == 1
    partial = summarize(regions, lost, H100, name="t", device="cuda", forward_us=55.0)
    assert not partial.complete and any("partial" in n for n in partial.notes)


def test_cpu_ops_nested_in_ops_count_once() -> None:
    events = [
        _x("user_annotation", "solforge:step", 0, 100),
        _x("user_annotation", "solforge:3|gemm|lm_head", 5, 50),
        _x("cpu_op", "Torch-Compiled Region: 0/0", 2, 90),  # dynamo's span encloses everything
        _x("cpu_op", "aten::linear", 10, 20),
        _x("cpu_op", "aten::mm", 11, 18),  # inside aten::linear: not counted again
        _x("cpu_op", "aten::add", 40, 5),
        _x("cpu_op", "aten::copy_", 70, 4),  # outside every region range
    ]
    att = attribute(events, gpu=False)
    assert att.region_us == {3: 25.0} and att.outside_us == 4.0 and att.kernels == 3


# ----------------------------------------------------------------------------------------------
# roofline and Amdahl arithmetic, by hand


def test_speed_of_light_by_hand() -> None:
    # RMSNorm of Qwen3-4B's hidden states, B2 S8192: read x + weight, write y (bf16)
    nbytes = 2 * 16384 * 2560 * 2 + 2560 * 2  # 167,777,280
    assert rl.memory_us(nbytes, H100) == pytest.approx(55.9258, rel=1e-5)  # / 3000 GB/s
    assert rl.sol_us(nbytes, 4 * 16384 * 2560, H100, "bf16") == pytest.approx(55.9258, rel=1e-5)
    assert rl.bound(nbytes, 4 * 16384 * 2560, 658.0 / 7, H100, "bf16") == "memory"
    assert rl.saving_us(73 * 658.0, 73, 55.9258) == pytest.approx(73 * (658.0 - 55.9258), rel=1e-6)
    assert rl.pct_of_sol(55.9258, 73, 73 * 658.0) == pytest.approx(8.4994, rel=1e-4)
    # q_proj GEMM: 16384 x 2560 @ 2560 x 4096 bf16: 343.6 GFLOP -> 458.1 us at 750 TFLOP/s
    flops = 2 * 16384 * 4096 * 2560
    gemm_bytes = (16384 * 2560 + 2560 * 4096 + 16384 * 4096) * 2
    assert rl.sol_us(gemm_bytes, flops, H100, "bf16") == pytest.approx(458.1298, rel=1e-6)
    assert rl.sol_us(gemm_bytes, flops, H100, "fp32") == pytest.approx(6871.948, rel=1e-6)  # 50 TFLOP/s
    assert rl.bound(gemm_bytes, flops, 520.0, H100, "bf16") == "compute"
    assert rl.bound(gemm_bytes, flops, 3.0, H100, "bf16") == "launch"  # 3 us a kernel: launches dominate
    gbs, tflops = rl.achieved(gemm_bytes, flops, 36, 36 * 520.0)
    assert tflops == pytest.approx(flops / 520.0 / 1e6) and gbs == pytest.approx(gemm_bytes / 520.0 / 1e3)
    assert rl.saving_us(10.0, 4, 3.0) == 0.0  # already faster than our estimate: nothing to save


def test_ranking_is_by_saving_not_by_time() -> None:
    from solforge.profile.trace import Attribution

    # A: 1000 us, speed of light 900 us -> saves 100; B: 500 us (2 x 250), sol 2 x 50 -> saves 400
    regions = [Region(0, 0, "gemm", "gemm", "a", [], bytes=2_700_000_000, dtype="bf16", key="A"),
               Region(1, 0, "rmsnorm", "normalization", "model.layers.0.b", [], bytes=150_000_000, dtype="bf16",
                      key="B", workload="rmsnorm[w]"),
               Region(2, 0, "rmsnorm", "normalization", "model.layers.1.b", [], bytes=150_000_000, dtype="bf16",
                      key="B", workload="rmsnorm[w]")]
    att = Attribution(region_us={0: 1000.0, 1: 250.0, 2: 250.0}, region_kernels={0: 1, 1: 5, 2: 5},
                      busy_us=1500.0, span_us=1500.0, kernels=11, steps=1)
    p = summarize(regions, att, H100, name="t", device="cuda", forward_us=1500.0)
    assert [r.key for r in p.regions] == ["B", "A"] and [r.rank for r in p.regions] == [1, 2]
    b, a = p.regions
    assert b.count == 2 and b.sol_us == pytest.approx(50.0) and b.saving_us == pytest.approx(400.0)
    assert a.sol_us == pytest.approx(900.0) and a.saving_us == pytest.approx(100.0)
    assert b.module == "model.layers.*.b" and b.modules == ("model.layers.0.b", "model.layers.1.b")
    assert b.achieved_gbs == pytest.approx(2 * 150_000_000 / 500.0 / 1e3) and b.pct_of_sol == pytest.approx(20.0)
    assert p.complete and p.attributed_us == 1500.0
    from solforge.profile import ranking

    assert ranking(p)("rmsnorm[w]") == pytest.approx(400.0) and ranking(p)("other") == 0.0
    assert from_dict(Profile, json.loads(json.dumps(to_dict(p)))) == p  # the record round-trips


# ----------------------------------------------------------------------------------------------
# ceilings cache


@pytest.fixture
def ceilings_dir(tmp_path: Path) -> Iterator[Path]:
    """SOLFORGE_CEILINGS_DIR for one test: a folder of its own."""
    with settings.override(ceilings_dir=tmp_path / "ceilings") as s:
        assert s.ceilings_dir is not None
        yield s.ceilings_dir


def test_ceilings_are_measured_once_and_cached(ceilings_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import solforge.profile.ceilings as ceilings

    first = get_ceilings("cpu")
    path = cache_file("cpu")
    assert path.parent == ceilings_dir and path.is_file()
    assert first.copy_gbs > 0 and first.bf16_tflops > 0 and first.fp32_tflops > 0 and not first.meaningful

    def no_measure(device: str) -> Ceilings:
        raise AssertionError("measured again")

    monkeypatch.setattr(ceilings, "measure", no_measure)
    assert get_ceilings("cpu") == first  # from the cache
    # the argument beats the environment; a damaged file is measured again
    other = tmp_path / "arg"
    other.mkdir()
    cache_file("cpu", other).write_text("{not json")
    monkeypatch.setattr(ceilings, "measure", lambda device: H100)
    assert get_ceilings("cpu", cache=other) == H100
    assert from_dict(Ceilings, json.loads(cache_file("cpu", other).read_text())) == H100


# ----------------------------------------------------------------------------------------------
# report.html in a real headless Chromium


def _chromium() -> str | None:
    """A Chromium binary; while make setup's background install runs (its log is there, its exit
    status not yet), wait for it."""
    root = Path(__file__).resolve().parents[1]
    status, log = root / ".chromium-install", root / ".chromium-install.log"
    deadline = time.monotonic() + 900
    while log.exists() and not status.exists() and time.monotonic() < deadline:
        time.sleep(2)
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _headless(exe: str, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1000,1400", *flags, url], capture_output=True, text=True, timeout=120)


def _png_pixels(path: Path) -> np.ndarray:
    """The (h, w, channels) pixels of an 8-bit RGB/RGBA PNG (no imaging library needed)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, bpp = 8, b"", 0, 0, 3
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride = zlib.decompress(idat), w * bpp
    out = np.zeros((h, stride), np.uint8)
    prev = np.zeros(stride, np.int64)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if f == 1:  # sub: a running sum per channel
            line = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif f == 2:  # up
            line = (line + prev) % 256
        elif f in (3, 4):  # average, Paeth: byte by byte
            cur = line.tolist()
            up = prev.tolist()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b, c = up[i], (up[i - bpp] if i >= bpp else 0)
                if f == 3:
                    pred = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                cur[i] = (cur[i] + pred) % 256
            line = np.array(cur, np.int64)
        out[y] = line
        prev = line
    return out.reshape(h, w, bpp)


def _report(prof: Profile) -> Report:
    region = RegionReport(family="rmsnorm", workload="rmsnorm[24x64]", count=5, baseline_us=30.0, best_us=10.0,
                          speedup=3.0, backend="triton", config={"variant": "row"}, verified=True, max_rel_err=2e-3,
                          candidates=4, rejected=1, label="1x24x64 bf16", config_text="row:bs=64")
    e2e = E2EReport(baseline_ms=2.0, optimized_ms=1.5, speedup=1.33, max_abs_err=0.01, max_rel_err=0.002,
                    argmax_agree=1.0, passed=True, outputs_compared=1)
    return Report(model="qwen3-tiny <&>", device="cpu", dtype="bf16", mode="inference", versions={"torch": "x"},
                  regions=(region,), e2e=e2e, timings_meaningful=False, profile=prof, profile_after=prof)


def test_report_html_renders_in_chromium(tiny_profile: Profile, tmp_path: Path) -> None:
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium binary (make setup installs Debian's chromium where apt is available)")
    page = tmp_path / "report.html"
    page.write_text(render(_report(tiny_profile)))
    text = page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert "qwen3-tiny &lt;&amp;&gt;" in text  # escaped
    dom = _headless(exe, page.as_uri(), "--dump-dom").stdout
    points = sum(1 for r in tiny_profile.regions if r.time_us > 0 and r.bytes > 0)
    assert f'data-rendered="roofline:{points} bars:' in dom, dom[:400]
    assert "data-error" not in dom
    assert 'id="before-after"' in dom and "row:bs=64" in dom and "passed" in dom
    shot = tmp_path / "shot.png"
    _headless(exe, page.as_uri(), f"--screenshot={shot}")
    px = _png_pixels(shot)[:, :, :3]
    assert px.shape == (1400, 1000, 3)
    ink = float((px.min(axis=2) < 235).mean())  # share of pixels that are not (near) white
    colors = len(np.unique(px[::4, ::4].reshape(-1, 3), axis=0))
    assert ink > 0.03 and colors > 20, (ink, colors)
    # the roofline's points carry the kinds' colours (gemm blue, normalization red)
    for hex_color in ("#4e79a7", "#e15759"):
        rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
        assert (np.abs(px.astype(int) - rgb).max(axis=2) < 40).any(), hex_color


def test_chromium_check_catches_a_script_error(tmp_path: Path) -> None:
    """The marker the test above relies on really reports a broken page."""
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium binary (make setup installs Debian's chromium where apt is available)")
    from solforge.report.html import SCRIPT

    page = tmp_path / "broken.html"
    page.write_text(f"<!doctype html><html><body><svg width='10' height='10'><rect width='5' height='5'/></svg>"
                    f"<script>{SCRIPT}</script><script>undefinedFunction();</script></body></html>")
    dom = _headless(exe, page.as_uri(), "--dump-dom").stdout
    assert "data-error=" in dom and "undefinedFunction" in dom


# ----------------------------------------------------------------------------------------------
# the command


def test_profile_command_writes_report_trace_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      ceilings_dir: Path) -> None:
    rc = main(["profile", "qwen3-tiny", "--device", DEVICE, "--seq", "16", "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    prof = from_dict(Report, data).profile
    assert prof is not None and prof.complete and prof.regions and data["regions"] == []
    assert json.loads((tmp_path / "o" / "trace_baseline.json").read_text())["traceEvents"]
    assert (tmp_path / "o" / "report.html").read_text().startswith("<!doctype html>")
    assert "rope model.layers.*.self_attn" in out and "counts:" in out and "complete" in out
    # every kernel family: the residual add + norm pairs are add_rmsnorm regions, the q/k norms are
    # inside the rope regions; counts still add up
    counts = {f: n for f, n, _ in prof.by_family}
    assert counts.get("add_rmsnorm", 0) + counts.get("residual_add", 0) == 4
    assert counts.get("add_rmsnorm", 0) + counts["rmsnorm"] == 5 and counts["rope"] == 2


FAILING = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return torch.mm(x, x.t()[:3])  # shape error at run time
def get_inputs():
    return [torch.randn(4, 8)]
def get_init_inputs():
    return []
"""

IDLE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.randn(4, 8)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(("source", "message"), [(FAILING, "failed to run"), (IDLE, "holds no")])
def test_profile_bad_models(source: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "m.py"
    f.write_text(source)
    rc = main(["profile", str(f), "--device", DEVICE, "--dtype", "fp32", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "report.json").exists()  # nothing partial is reported


def test_profile_unwritable_out_and_unknown_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["profile", "qwen3-tiny", "--device", DEVICE, "--out", str(blocker / "sub"), "--quiet"]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert main(["profile", "qwen9-huge", "--device", DEVICE, "--out", str(tmp_path), "--quiet"]) == 2
    assert "unknown model" in capsys.readouterr().err


@requires_gpu
def test_cuda_profile_attributes_kernels_to_regions() -> None:
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device="cuda", batch=2, seq=256)
    p = profile_model(lm.model, lm.example_inputs, device="cuda", name="qwen3-tiny")
    counts = {f: n for f, n, _ in p.by_family}
    # every family: 4 residual add + norm pairs, the first layer's input norm, 2 q/k norm + rope, 2 SwiGLUs
    assert counts["add_rmsnorm"] == 4 and counts["rmsnorm"] == 1 and counts["rope"] == 2 and counts["swiglu"] == 2
    assert p.complete and p.meaningful and p.ceilings.meaningful
    assert p.attributed_us >= 0.95 * p.busy_us and p.outside_us < 0.05 * p.busy_us
    assert all(r.kernels > 0 for r in p.regions
               if r.family in ("rmsnorm", "add_rmsnorm", "swiglu", "gemm", "attention", "rope"))


def test_profile_command_with_one_family_splits_the_fused_patterns(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    ceilings_dir: Path) -> None:
    """--families rmsnorm: the residual adds, RoPE and SiLU·mul show as their own regions."""
    rc = main(["profile", "qwen3-tiny", "--device", DEVICE, "--seq", "16", "--families", "rmsnorm",
               "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 0, capsys.readouterr().out
    prof = from_dict(Report, json.loads((tmp_path / "o" / "report.json").read_text())).profile
    assert prof is not None
    counts = {f: n for f, n, _ in prof.by_family}
    assert counts["rmsnorm"] == 9 and counts["residual_add"] == 4 and counts["rope"] == 2 and counts["silu_mul"] == 2
