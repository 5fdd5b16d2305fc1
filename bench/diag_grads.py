"""GPU diagnostic: per-family parameter-gradient error of solforge's train mode against eager on a
2-layer Qwen3-4B-width model (bf16, B1 S4096), one family at a time.

    python bench/diag_grads.py
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from transformers import Qwen3ForCausalLM

    from solforge.integrate import integrate
    from solforge.validate import _step
    from solforge.zoo import zoo_config

    cfg = zoo_config("qwen3-4b")
    cfg.num_hidden_layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        body = Qwen3ForCausalLM(cfg).to(torch.bfloat16).model.train()
    ids = torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda")
    params = [(n, p) for n, p in body.named_parameters() if p.requires_grad]
    _, ref = _step(body, (ids,), params)
    _, ref2 = _step(body, (ids,), params)  # eager against itself: the noise floor
    print("eager vs eager", max(float((ref2[n].float() - g.float()).norm() / g.float().norm()) for n, g in ref.items()))
    import solforge.capture as cap

    real_pass = cap.restore_causal_attention
    for fams, attention_pass in (((), True), ((), False), (None, False), (None, True)):
        cap.restore_causal_attention = real_pass if attention_pass else (lambda gm: 0)
        torch.compiler.reset()
        opt, stats = integrate(body, {}, families=fams)
        _, got = _step(opt, (ids,), params)
        errs = sorted(((float((got[n].float() - g.float()).norm() / g.float().norm()), n) for n, g in ref.items()),
                      reverse=True)
        print(fams, "attention pass" if attention_pass else "no attention pass", stats.total,
              [(round(e, 4), n) for e, n in errs[:3]], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
