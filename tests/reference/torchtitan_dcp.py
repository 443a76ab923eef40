"""A torchtitan-style torch.distributed.checkpoint, written by PyTorch, and PyTorch continuing from it
(used by tests/unit/trainer/dcp_checkpoint_test.cpp).

IN.safetensors holds the initial weights (param.<name>, torchtitan's names), titan's first batches of the
run that will continue (batch.tokens, batch.labels: (M, B, S)) and, as JSON metadata "config", the model's
configuration (llama3_reference.py's) with a "train" object: lr, beta1, beta2, eps, weight_decay,
max_norm, warmup_steps, decay_ratio, min_lr_factor, total_steps, saved_steps, ranks, batch, seq_len, loader.

The script trains `saved_steps` steps from the initial weights on random batches, as torchtitan's
single-device step does (mean cross-entropy, clip_grad_norm_, AdamW, a LambdaLR warmup-stable-decay
schedule with linear decay), then saves with torch.distributed.checkpoint.save the state dict torchtitan
saves: the model's parameters at the top level, "optimizer" through get_optimizer_state_dict with
flatten_optimizer_state_dict=True, "lr_scheduler" (the LambdaLR's state dict), "train_state"
({step, ntokens_seen}, one rank's count; with ranks == 1 as the 0-d tensors older torchtitan saved), a
complex64 "freqs_cis" buffer (older torchtitan's) and a "dataloader" entry (with the data-parallel
degree as the train object's "loader" says). With ranks > 1 the save runs in that
many Gloo processes, every real tensor of one or more dimensions sharded on dim 0 as FSDP does (DTensor
Shard(0), one file per rank, uneven chunks where dim 0 does not divide). Then it continues M steps on the given
batches from the same state and writes their losses (OUT.safetensors: "losses", float64).

usage: torchtitan_dcp.py IN.safetensors DCP_DIR OUT.safetensors
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file, safe_open, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_reference import forward, loss_fn, rope_freqs  # noqa: E402


def module_of(params):
    """An nn.Module whose named_parameters() are `params` (dotted names), for the state-dict API."""
    root = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(p))
    return root


def schedule(t):
    """The warmup-stable-decay factor of 0-based scheduler step s (linear decay)."""
    total, warmup = t["total_steps"], min(t["warmup_steps"], t["total_steps"])
    if t.get("decay_ratio") is None:
        decay = total - warmup
    else:
        decay = min(round(total * t["decay_ratio"]), total - warmup)
    stable = total + 1 - warmup - decay

    def factor(s):
        if s < warmup:
            return (s + 1) / warmup
        if s < warmup + stable:
            return 1.0
        p = min((s + 1 - warmup - stable) / decay, 1.0)
        return t["min_lr_factor"] + (1 - t["min_lr_factor"]) * (1 - p)

    return factor


def save_rank(rank, world, store, state_path, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    flat = torch.load(state_path, weights_only=False)

    def shard(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.is_floating_point():
            return distribute_tensor(v, mesh, [Shard(0)])
        if isinstance(v, dict):
            return {k: shard(x) for k, x in v.items()}
        return v

    dcp.save(shard(flat), checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


def read_inputs(path):
    """IN.safetensors: the configuration (with its "train" object), the parameters by name, the batches."""
    with safe_open(path, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    data = load_file(path)
    tokens, labels = data.pop("batch.tokens"), data.pop("batch.labels")
    params = {k[len("param."):]: v for k, v in data.items() if k.startswith("param.")}
    return cfg, params, tokens, labels


def main():
    inp, out_dir, out = sys.argv[1:4]
    cfg, params, tokens, labels = read_inputs(inp)
    t = cfg["train"]
    model = module_of({k: v.clone() for k, v in params.items()})
    named = dict(model.named_parameters())
    freqs = rope_freqs(cfg)
    angles = torch.outer(torch.arange(t["seq_len"]).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)

    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"],
                            weight_decay=t["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(t))

    def train_step(tok, lab):
        opt.zero_grad()
        loss = loss_fn(forward(named, cfg, tok, cis), lab)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_norm"], foreach=True)
        opt.step()
        sched.step()
        return loss.item()

    gen = torch.Generator().manual_seed(5)
    vocab = cfg["vocab_size"]
    for _ in range(t["saved_steps"]):
        seq = torch.randint(vocab, (t["batch"], t["seq_len"] + 1), generator=gen)
        train_step(seq[:, :-1], seq[:, 1:])

    # torchtitan's state dict: the model flattened to the top level, then the other parts by name.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["lr_scheduler"] = sched.state_dict()
    # torchtitan counts the tokens of one data-parallel rank (each of `ranks` took an equal part).
    seen = t["saved_steps"] * t["batch"] * t["seq_len"] // t["ranks"]
    state["train_state"] = {"step": t["saved_steps"], "ntokens_seen": seen}
    if t["ranks"] == 1:  # as older torchtitan saved them: 0-d tensors
        state["train_state"] = {"step": torch.tensor(t["saved_steps"], dtype=torch.int32), "ntokens_seen": torch.tensor(seen)}
    # Older torchtitan kept its RoPE table as a persistent buffer: complex, and not titan's to read.
    angles_all = torch.outer(torch.arange(2 * t["seq_len"]).float(), freqs)
    state["freqs_cis"] = torch.polar(torch.ones_like(angles_all), angles_all)
    # Its data loader's state: one entry per data-parallel rank, and the data-parallel degree as the
    # version named by "loader" records it: "grain" (from 2026-08) as "dp_world_size" with a version,
    # "stateful" (before) as "world_size", "none" not at all.
    state["dataloader"] = {"dp_rank_0": b"torchtitan's data loader state (titan does not read it)"}
    if t["loader"] == "grain":
        state["dataloader"].update({"version": 1, "dp_world_size": t["ranks"]})
    elif t["loader"] == "stateful":
        state["dataloader"]["world_size"] = t["ranks"]
    if t["ranks"] == 1:
        dcp.save(state, checkpoint_id=out_dir, no_dist=True)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "state.pt")
            torch.save(state, path)
            mp.spawn(save_rank, args=(t["ranks"], os.path.join(tmp, "store"), path, out_dir), nprocs=t["ranks"])

    losses = [train_step(tokens[i], labels[i]) for i in range(tokens.shape[0])]
    save_file({"losses": torch.tensor(losses, dtype=torch.float64)}, out)


if __name__ == "__main__":
    main()
