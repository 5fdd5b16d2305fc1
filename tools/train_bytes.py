"""probe: trains a zoo model on local bytes, for the argmax check on weights that predict something.

Weights that predict something, for issue 4's argmax check: train a zoo model from its seeded
random init on the bytes of local text, then save its weights and a held-out batch.

    python tools/train_bytes.py [--model qwen3-4b] [--seconds 120] [--seq 8192] [--lr 4e-4]
                                [--weights /tmp/trained.pt] [--ids /tmp/eval_ids.pt]
                                [--eval-batch 2] [--eval-seq 8192] [--out bench/results/NAME.json]

Random weights give logits full of near-ties, so bf16 variants of one model disagree on the argmax
wherever bf16 rounding decides (eager bf16 agrees with its own fp32 computation at ~88% of
Qwen3-4B's positions). A trained model's predictions have margins. No trained weights reach the
device (no network), so this trains the published architecture on what the machine has: the
Python standard library's `.py` files, read as bytes (token id = byte value, ids 0-255 of the
model's vocabulary), the first 98% for training and the rest held out.

Training is eager PyTorch in bf16 (the reference, no solforge), AdamW (betas 0.9/0.95, weight decay
0.1, `--warmup` steps of linear warm-up then constant, gradient norm clipped at 1), one sequence of
`--seq` bytes a step, gradient checkpointing on a GPU of under 100 GB, for `--seconds` of wall
clock. It writes the state dict to `--weights`, a held-out
batch (`--eval-batch` x `--eval-seq` bytes) to `--ids`, and a JSON record of the loss curve and
the corpus. Then `bench/e2e.py --what qwen3 --weights W --ids I` runs every variant on them.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402

HELD_OUT = 0.02


def corpus(root: Path | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The bytes of every `.py` file under the standard library (or `root`), sorted by path, joined
    by blank lines, as int64 ids; and where they came from."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no .py files under {root}")
    data = b"\n\n".join(p.read_bytes() for p in files)
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    return ids, {"root": str(root), "files": len(files), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}


def unigram_entropy(ids: torch.Tensor) -> float:
    """The loss of a model that knows only each byte's frequency (nats a byte)."""
    p = ids.bincount(minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-4b", help="a zoo name (default qwen3-4b)")
    p.add_argument("--seconds", type=float, default=120.0, help="wall clock to train for")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--seq", type=int, default=8192, help="bytes a training step")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up")
    p.add_argument("--weights", default="/tmp/trained.pt")
    p.add_argument("--ids", default="/tmp/eval_ids.pt")
    p.add_argument("--eval-batch", type=int, default=2)
    p.add_argument("--eval-seq", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    from solforge.zoo import zoo_config

    ids, source = corpus()
    split = int(len(ids) * (1 - HELD_OUT))
    train, held = ids[:split], ids[split:]
    need = a.eval_batch * (a.eval_seq + 1)
    if len(held) < need or len(train) < a.seq + 1:
        raise SystemExit(f"corpus too small: {len(ids)} bytes for --seq {a.seq} and {need} held-out bytes")
    cfg = zoo_config(a.model)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # bench/e2e.py's initialization
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.train()
    if a.device == "cuda" and torch.cuda.get_device_properties(0).total_memory < 100e9:
        model.gradient_checkpointing_enable()  # an H100's 80 GB; an H200 holds the step without it
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=a.device == "cuda")
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    t0 = time.time()
    step = 0
    while time.time() - t0 < a.seconds and step < a.max_steps:
        for group in opt.param_groups:
            group["lr"] = a.lr * min(1.0, (step + 1) / a.warmup)
        start = int(torch.randint(0, len(train) - a.seq - 1, (1,), generator=gen))
        x = train[start:start + a.seq + 1].to(a.device)[None]
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[0, 1:])
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        step += 1
        if step % 10 == 0:
            print(f"step {step} loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)", flush=True)
    train_s = time.time() - t0
    del opt
    # the held-out batch: eval_batch windows of eval_seq bytes, evenly spaced over the held-out part
    gap = (len(held) - a.eval_seq) // max(1, a.eval_batch - 1) if a.eval_batch > 1 else 0
    eval_ids = torch.stack([held[i * gap:i * gap + a.eval_seq] for i in range(a.eval_batch)])
    with torch.no_grad():
        model.eval()
        x = eval_ids.to(a.device)
        logits = model(input_ids=x).logits[:, :-1].float()
        eval_loss = float(logits.log_softmax(-1).gather(-1, x[:, 1:, None]).neg().mean())
        top2 = logits.topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]
        pred = logits.argmax(-1)
        del logits
        # whether the predictions follow the context, not only the bytes' frequencies
        accuracy = float((pred == x[:, 1:]).float().mean())
        counts = pred.flatten().bincount()
    torch.save({k: v.to("cpu") for k, v in model.state_dict().items()}, a.weights)
    torch.save(eval_ids, a.ids)
    result = {**provenance(), "model": a.model, "corpus": source, "held_out_fraction": HELD_OUT,
              "seq": a.seq, "lr": a.lr, "steps": step, "train_s": round(train_s, 1),
              "loss_first_10": [round(v, 3) for v in losses[:10]],
              "loss_every_10": [round(v, 3) for v in losses[::10]],
              "loss_last_10_mean": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
              "eval": {"batch": a.eval_batch, "seq": a.eval_seq, "loss_nats_per_byte": round(eval_loss, 4),
                       "next_byte_accuracy": round(accuracy, 4), "argmax_distinct": int((counts > 0).sum()),
                       "argmax_most_common_share": round(float(counts.max()) / pred.numel(), 4),
                       "unigram_entropy_nats": round(unigram_entropy(train), 4),
                       "margin_median": round(float(margin.median()), 3),
                       **{f"positions_margin_gt_{m}": round(float((margin > m).float().mean()), 4)
                          for m in (0.05, 0.1, 0.25, 1.0)}},
              "weights": a.weights, "ids": a.ids}
    print(result["eval"], flush=True)
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
