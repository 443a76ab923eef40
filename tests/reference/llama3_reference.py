"""Independent PyTorch reference for titan's Llama 3 (used by tests/unit/models/llama3_parity_test.cpp).

Reads the model configuration (safetensors metadata "config"), the initial weights and the token
batches that the C++ test wrote, and writes what plain PyTorch computes from them:
  logits          (B, S, V)  forward of batch 0
  loss            ()         mean cross entropy of batch 0
  grad.<name>                gradient of every parameter for that loss
  adamw_losses    (N,)       loss at each of N AdamW steps, step k on batch k

The model is written from the Llama 3 description, not from titan's code: RoPE through complex
multiplication of interleaved pairs, attention as an explicit masked softmax (no SDPA), RMSNorm
written out, grouped-query attention by repeating key/value heads.

With --hf the weights are in Hugging Face's LlamaForCausalLM names and layout (model.embed_tokens,
self_attn.q_proj, mlp.gate_proj, ...; q/k rows in rotate-half order) and only the logits of batch 0
are computed, with rotate-half RoPE as transformers applies it: a check of titan's HF adapter.

usage: llama3_reference.py IN.safetensors OUT.safetensors [--device cpu|cuda] [--autocast-bf16] [--hf]
"""

import argparse
import contextlib
import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file, safe_open


def rope_freqs(cfg):
    head_dim = cfg["dim"] // cfg["n_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    s = cfg.get("rope_scaling")
    if s:
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        out = []
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / s["factor"])
            else:
                smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                    s["high_freq_factor"] - s["low_freq_factor"])
                out.append((1 - smooth) * f / s["factor"] + smooth * f)
        freqs = torch.tensor(out, dtype=torch.float32)
    return freqs


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def rotate(x, cis):
    # x (B, S, n, E): pairs (x[2i], x[2i+1]) are complex numbers rotated by cis (S, E/2).
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3).type_as(x)


def forward(p, cfg, tokens, cis):
    B, S = tokens.shape
    H, K = cfg["n_heads"], cfg["n_kv_heads"]
    E = cfg["dim"] // H
    h = p["tok_embeddings.weight"][tokens]
    mask = torch.full((S, S), float("-inf"), device=tokens.device).triu(1)
    for i in range(cfg["n_layers"]):
        w = lambda n: p[f"layers.{i}.{n}.weight"]
        x = rms_norm(h, w("attention_norm"), cfg["norm_eps"])
        q = rotate((x @ w("attention.wq").t()).view(B, S, H, E), cis)
        k = rotate((x @ w("attention.wk").t()).view(B, S, K, E), cis)
        v = (x @ w("attention.wv").t()).view(B, S, K, E)
        k = k.repeat_interleave(H // K, dim=2)
        v = v.repeat_interleave(H // K, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, E)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(E) + mask
        attn = torch.softmax(scores.float(), dim=-1).type_as(v) @ v
        h = h + attn.transpose(1, 2).reshape(B, S, H * E) @ w("attention.wo").t()
        x = rms_norm(h, w("ffn_norm"), cfg["norm_eps"])
        h = h + (F.silu(x @ w("feed_forward.w1").t()) * (x @ w("feed_forward.w3").t())) @ w("feed_forward.w2").t()
    h = rms_norm(h, p["norm.weight"], cfg["norm_eps"])
    out_w = p["tok_embeddings.weight"] if cfg["tie_embeddings"] else p["output.weight"]
    return h @ out_w.t()


def forward_hf(p, cfg, tokens, freqs):
    """Llama in transformers' conventions: rotate-half RoPE on HF-permuted q/k projections."""
    B, S = tokens.shape
    H, K = cfg["n_heads"], cfg["n_kv_heads"]
    E = cfg["dim"] // H
    angles = torch.outer(torch.arange(S).float(), freqs).to(tokens.device)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (S, E)

    def rotate_half(x):
        return torch.cat([-x[..., E // 2:], x[..., : E // 2]], dim=-1)

    def rope(x):  # x (B, n, S, E)
        return x * cos + rotate_half(x) * sin

    h = p["model.embed_tokens.weight"][tokens]
    mask = torch.full((S, S), float("-inf"), device=tokens.device).triu(1)
    for i in range(cfg["n_layers"]):
        w = lambda n: p[f"model.layers.{i}.{n}.weight"]
        x = rms_norm(h, w("input_layernorm"), cfg["norm_eps"])
        q = rope((x @ w("self_attn.q_proj").t()).view(B, S, H, E).transpose(1, 2))
        k = rope((x @ w("self_attn.k_proj").t()).view(B, S, K, E).transpose(1, 2))
        v = (x @ w("self_attn.v_proj").t()).view(B, S, K, E).transpose(1, 2)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        attn = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(E) + mask, dim=-1) @ v
        h = h + attn.transpose(1, 2).reshape(B, S, H * E) @ w("self_attn.o_proj").t()
        x = rms_norm(h, w("post_attention_layernorm"), cfg["norm_eps"])
        h = h + (F.silu(x @ w("mlp.gate_proj").t()) * (x @ w("mlp.up_proj").t())) @ w("mlp.down_proj").t()
    h = rms_norm(h, p["model.norm.weight"], cfg["norm_eps"])
    out_w = p["model.embed_tokens.weight"] if cfg["tie_embeddings"] else p["lm_head.weight"]
    return h @ out_w.t()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--autocast-bf16", action="store_true")
    ap.add_argument("--hf", action="store_true")
    args = ap.parse_args()

    with safe_open(args.inp, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    data = load_file(args.inp, device=args.device)
    tokens, labels = data.pop("batch.tokens"), data.pop("batch.labels")  # (N, B, S) each
    init = {k[len("param."):]: v for k, v in data.items() if k.startswith("param.")}
    torch.manual_seed(0)

    freqs = rope_freqs(cfg)
    if args.hf:
        with torch.no_grad():
            logits = forward_hf(init, cfg, tokens[0], freqs)
        save_file({"logits": logits.float().contiguous().cpu()}, args.out)
        return
    angles = torch.outer(torch.arange(tokens.shape[-1]).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles).to(args.device)

    def autocast():
        if args.autocast_bf16:
            return torch.autocast(device_type=args.device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    with autocast():
        logits = forward(params, cfg, tokens[0], cis)
        loss = loss_fn(logits, labels[0])
    loss.backward()
    result = {"logits": logits.detach().float(), "loss": loss.detach().float()}
    for k, v in params.items():
        result[f"grad.{k}"] = v.grad.float()

    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    names = sorted(params)
    opt = torch.optim.AdamW([params[n] for n in names], lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    losses = []
    for step in range(tokens.shape[0]):
        opt.zero_grad()
        with autocast():
            loss = loss_fn(forward(params, cfg, tokens[step], cis), labels[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    result["adamw_losses"] = torch.tensor(losses, dtype=torch.float64)
    save_file({k: v.contiguous().cpu() for k, v in result.items()}, args.out)


if __name__ == "__main__":
    main()
