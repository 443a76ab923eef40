"""PyTorch reference for titan's optimizer and learning-rate schedule tests.

  optim_reference.py lr IN.json OUT.json
      IN: list of {"warmup_steps", "decay_ratio" (or null), "decay_type", "min_lr_factor", "steps", "lr"}.
      OUT: for each, the lr torch.optim.lr_scheduler.LambdaLR gives at training steps 1..steps, with the
      warmup-stable-decay factor written from its definition.
  optim_reference.py adam IN.safetensors OUT.safetensors
      IN: "param.<i>" initial values, "grad.<k>.<i>" the gradient at step k, metadata "config"
      {"name": "AdamW"|"Adam", "lr", "beta1", "beta2", "eps", "weight_decay", "fused": bool, "steps",
      "max_norm"}: before each step, torch.nn.utils.clip_grad_norm_ when max_norm > 0.
      OUT: "param.<i>" after the steps, "exp_avg.<i>", "exp_avg_sq.<i>".
"""

import json
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def wsd_factor(step, warmup, stable, decay, kind, min_factor):
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    progress = (step + 1 - warmup - stable) / decay
    shape = {"linear": 1 - progress,
             "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]
    return min_factor + (1 - min_factor) * shape


def lrs(cfg):
    total = cfg["steps"]
    warmup = min(int(cfg["warmup_steps"]), total)
    if cfg["decay_ratio"] is not None:
        decay = min(round(total * cfg["decay_ratio"]), total - warmup)
    else:
        decay = total - warmup
    stable = total + 1 - warmup - decay
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: wsd_factor(s, warmup, stable, decay, cfg["decay_type"], cfg["min_lr_factor"]))
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def adam(inp, out):
    with safe_open(inp, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    t = load_file(inp)
    n = len([k for k in t if k.startswith("param.")])
    params = [torch.nn.Parameter(t[f"param.{i}"].clone()) for i in range(n)]
    cls = torch.optim.AdamW if cfg["name"] == "AdamW" else torch.optim.Adam
    opt = cls(params, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
              weight_decay=cfg["weight_decay"], fused=cfg["fused"], foreach=False if not cfg["fused"] else None)
    for k in range(cfg["steps"]):
        for i, p in enumerate(params):
            p.grad = t[f"grad.{k}.{i}"].clone()
        if cfg.get("max_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg["max_norm"], foreach=True)
        opt.step()
    res = {}
    for i, p in enumerate(params):
        res[f"param.{i}"] = p.detach().clone()
        res[f"exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
        res[f"exp_avg_sq.{i}"] = opt.state[p]["exp_avg_sq"].clone()
    save_file(res, out)


if __name__ == "__main__":
    mode, inp, out = sys.argv[1:4]
    if mode == "lr":
        with open(inp) as f:
            cfgs = json.load(f)
        with open(out, "w") as f:
            json.dump([lrs(c) for c in cfgs], f)
    else:
        adam(inp, out)
