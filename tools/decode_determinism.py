"""Showed that greedy decode differs from run to run only through cuDNN's SDPA decode kernel
(bench/results/2026-11-25-h100-session11.md).

Run-to-run determinism of 200-token greedy decode on a GPU: transformers' eager generate twice
and solforge's optimized generate three times with its graphs run from Python (no CUDA graphs),
the logits of every step compared, with cuDNN's SDPA backend on or off.

    python tools/decode_determinism.py cudnn|nocudnn

Run as scratch/det.py (this file before line wrapping) on 2026-11-25: results in
bench/results/2026-11-25-h100-session11.md."""
import sys

import torch

import solforge
import solforge.runtime.generation as g
from solforge.zoo import load_model

if sys.argv[1] == "nocudnn":
    torch.backends.cuda.enable_cudnn_sdp(False)
lm = load_model("qwen3-0.6b", device="cuda", dtype="bf16", batch=1, seq=128)
model, ids = lm.model, lm.example_inputs[0]
model.config.use_cache = True
model.generation_config.use_cache = True
kw = {"max_new_tokens": 200, "min_new_tokens": 200, "do_sample": False, "cache_implementation": "static",
      "return_dict_in_generate": True, "output_logits": True}
runs = {}
with torch.no_grad():
    for name in ("eager", "eager2"):
        runs[name] = torch.stack(model.generate(ids, disable_compile=True, **kw).logits).float()
    opt, rep = solforge.optimize(model, (ids,), budget=10)
    real = g.step_graphs
    g.step_graphs = lambda enabled=True: real(False)
    for name in ("plain", "plain2", "plain3"):
        runs[name] = torch.stack(opt.generate(ids, **kw).logits).float()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.generate(ids, **{**kw, "max_new_tokens": 3, "min_new_tokens": 3})
    words = ("sdpa", "attention", "flash", "fmha")
    print(sys.argv[1], [e.key[:60] for e in prof.key_averages() if any(w in e.key.lower() for w in words)])
for a, b in (("eager", "eager2"), ("plain", "plain2"), ("plain", "plain3")):
    d = (runs[a] - runs[b]).abs().amax(dim=(1, 2))
    print(sys.argv[1], a, b, "max", round(d.max().item(), 4), "first diff step",
          (d > 0).nonzero()[:3].flatten().tolist())
