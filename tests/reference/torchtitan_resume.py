"""PyTorch resuming from what `titan convert to-dcp` writes, as torchtitan's checkpoint manager does
(used by tests/unit/trainer/dcp_checkpoint_test.cpp).

IN.safetensors holds the model's parameters (param.<name>, torchtitan's names; their values are
replaced by the checkpoint's), the batches of the steps after the checkpoint (batch.tokens,
batch.labels: (M, B, S)) and, as JSON metadata "config", the model's configuration
(llama3_reference.py's) with a "train" object: lr, beta1, beta2, eps, weight_decay, max_norm,
warmup_steps, decay_ratio, min_lr_factor, total_steps, implementation.

As torchtitan builds its state and loads (checkpoint.initial_load_path with
initial_load_model_only = false and the data loader excluded from loading): the model's state dict
at the top level, "optimizer" from get_optimizer_state_dict(flatten_optimizer_state_dict=True) of
an AdamW built as torchtitan builds it (fused / foreach as the implementation says), "lr_scheduler"
the LambdaLR's state dict, "train_state" {step, ntokens_seen}; torch.distributed.checkpoint.load
fills them (failing on any key the folder lacks), then each part's load_state_dict. It trains the M
steps as torchtitan's single-device step does and writes OUT.json: the losses, the learning rate of
each step, and the loaded step, ntokens_seen and last_epoch.

usage: torchtitan_resume.py IN.safetensors DCP_DIR OUT.json
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_reference import forward, loss_fn, rope_freqs  # noqa: E402
from torchtitan_dcp import module_of, read_inputs, schedule  # noqa: E402


def main():
    inp, dcp_dir, out = sys.argv[1:4]
    cfg, params, tokens, labels = read_inputs(inp)
    t = cfg["train"]
    model = module_of({k: torch.zeros_like(v) for k, v in params.items()})
    named = dict(model.named_parameters())
    angles = torch.outer(torch.arange(tokens.shape[-1]).float(), rope_freqs(cfg))
    cis = torch.polar(torch.ones_like(angles), angles)

    impl = t["implementation"]
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"],
                            weight_decay=t["weight_decay"], fused=impl == "fused", foreach=impl == "foreach")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(t))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    state = dict(model.state_dict())
    model_keys = list(state)
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": 0, "ntokens_seen": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=dcp_dir, no_dist=True)
    model.load_state_dict({k: state[k] for k in model_keys})
    set_optimizer_state_dict(model, opt, state["optimizer"], options=flat)
    sched.load_state_dict(state["lr_scheduler"])

    losses, lrs = [], []
    for i in range(tokens.shape[0]):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        loss = loss_fn(forward(named, cfg, tokens[i], cis), labels[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_norm"], foreach=True)
        opt.step()
        sched.step()
        losses.append(loss.item())
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    with open(out, "w") as f:
        json.dump({"losses": losses, "lrs": lrs, "step": state["train_state"]["step"],
                   "ntokens_seen": state["train_state"]["ntokens_seen"],
                   "last_epoch": state["lr_scheduler"]["last_epoch"],
                   "group": {k: v if isinstance(v, (int, float, bool, type(None))) else list(v) for k, v in group.items()}},
                  f)


if __name__ == "__main__":
    main()
