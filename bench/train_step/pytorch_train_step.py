"""CPU training-step benchmark, PyTorch eager side: the same debug-size Llama 3 (torchtitan's
layers: nn.RMSNorm, complex RoPE, SDPA with repeated kv heads, SwiGLU), the same batch shape,
forward + cross-entropy + backward + clip_grad_norm_ + fused AdamW, timed per step after warm-up.
Prints one JSON line like the titan side.
usage: pytorch_train_step.py [batch] [seq_len] [steps] [warmup]
"""
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, LAYERS, HEADS, VOCAB, HIDDEN, THETA = 256, 6, 16, 2048, 768, 500000.0


def freqs_cis(head_dim, seq_len):
    freqs = 1.0 / (THETA ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rope(x, cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)

    def forward(self, x, cis):
        B, S, _ = x.shape
        h = self.attention_norm(x)
        q = rope(self.wq(h).view(B, S, HEADS, -1), cis).transpose(1, 2)
        k = rope(self.wk(h).view(B, S, HEADS, -1), cis).transpose(1, 2)
        v = self.wv(h).view(B, S, HEADS, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, DIM)
        x = x + self.wo(a)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, cis):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cis)
        return self.output(self.norm(h))


def main():
    batch, seq_len, steps, warmup = (int(a) for a in (sys.argv[1:] + ["4", "256", "10", "3"][len(sys.argv) - 1:]))
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    tokens = torch.randint(VOCAB, (batch, seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cis = freqs_cis(DIM // HEADS, seq_len)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs, cis).flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss.item()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    print(json.dumps({"impl": "pytorch", "threads": torch.get_num_threads(),
                      "median_ms": round(statistics.median(times), 3), "steps": [round(t, 3) for t in times]}))


if __name__ == "__main__":
    main()
