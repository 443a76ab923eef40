"""Independent PyTorch reference for titan's MoE layer (tests/unit/models/moe_test.cpp).

Written from the routing formulas (docs/moe.md, torchtitan's order), token by token: no sorting and
no grouped matmul. Reads IN.safetensors (x (T, D), gate (E, D), w1/w3 (E, F, D), w2 (E, D, F),
optional shared_w1/shared_w3 (Fs, D), shared_w2 (D, Fs), optional expert_bias (E), grad_out (T, D);
metadata "options": JSON with top_k, score_func, route_norm, route_scale, n_groups, topk_groups,
aux_weight and force_load_balance, torchtitan's debug routing) and writes y (T, D), ids (T, K), weights (T, K), counts (E), the auxiliary load-balancing
loss "aux" = E * sum_e f_e P_e (f_e: the share of the T tokens routed to expert e, counted once per
copy; P_e: the mean over the tokens of e's probability, the softmax score, or the sigmoid score over
the token's sum of scores), and grad.<name> for x and every weight, for the loss
sum(y * grad_out) + aux_weight * aux.

usage: moe_reference.py IN.safetensors OUT.safetensors
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def main():
    inp, out = sys.argv[1], sys.argv[2]
    with safe_open(inp, "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        o = json.loads(f.metadata()["options"])
    leaves = {k: v.clone().requires_grad_(True) for k, v in t.items() if k not in ("grad_out", "expert_bias")}
    x, gate = leaves["x"], leaves["gate"]
    T, E, K = x.shape[0], gate.shape[0], o["top_k"]
    logits = (x @ gate.T).float()
    scores = torch.sigmoid(logits) if o["score_func"] == "sigmoid" else torch.softmax(logits, -1)
    ids, weights = [], []
    for i in range(T):
        choice = scores[i].detach().clone()
        if "expert_bias" in t:
            choice = choice + t["expert_bias"]
        G = o.get("n_groups", 0)
        if G > 1:
            per = E // G
            group_score = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(G)]
            group_score = torch.tensor([sum(s) for s in group_score])
            keep = set(torch.topk(group_score, o["topk_groups"]).indices.tolist())
            for g in range(G):
                if g not in keep:
                    choice[g * per:(g + 1) * per] = float("-inf")
        chosen = torch.topk(choice, K).indices
        if o.get("force_load_balance"):  # debug routing: copy k of token i to expert (i K + k) mod E
            chosen = torch.tensor([(i * K + k) % E for k in range(K)])
        w = scores[i][chosen]
        if o["route_norm"]:
            w = w / (w.sum() + 1e-20)
        w = w * o["route_scale"]
        ids.append(chosen)
        weights.append(w)
    ys = []
    for i in range(T):
        y = torch.zeros(x.shape[1])
        for k in range(K):
            e = ids[i][k]
            y = y + weights[i][k] * swiglu(x[i], leaves["w1"][e], leaves["w2"][e], leaves["w3"][e])
        if "shared_w1" in leaves:
            y = y + swiglu(x[i], leaves["shared_w1"], leaves["shared_w2"], leaves["shared_w3"])
        ys.append(y)
    y = torch.stack(ys)
    ids = torch.stack(ids)
    counts = torch.zeros(E)
    for i in range(T):
        for k in range(K):
            counts[ids[i][k]] += 1
    probs = scores if o["score_func"] == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = E * sum(counts[e] / T * probs[:, e].mean() for e in range(E))
    ((y * t["grad_out"]).sum() + o.get("aux_weight", 0.0) * aux).backward()
    result = {"y": y.detach(), "ids": ids, "weights": torch.stack(weights).detach(),
              "counts": torch.bincount(ids.flatten(), minlength=E), "aux": aux.detach().reshape(())}
    for k, v in leaves.items():
        result["grad." + k] = v.grad
    save_file({k: v.contiguous() for k, v in result.items()}, out)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
