"""The same MoE layer step in PyTorch eager, written as torchtitan's layer (softmax router, top-k,
normalized weights, tokens sorted by expert, torch._grouped_mm experts, scatter_add combine).
usage: pytorch_moe.py TOKENS DIM HIDDEN EXPERTS TOP_K STEPS [cpu|cuda]; prints one JSON line.
On the CPU in fp32; on CUDA in bf16, timed with a device synchronization around each step.
env TRACE=FILE: the fourth step recorded by torch.profiler as a Chrome trace in FILE."""

import os

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def main():
    T, D, Fh, E, K, steps = (int(a) for a in sys.argv[1:7])
    cuda = len(sys.argv) > 7 and sys.argv[7] == "cuda"
    kw = {"device": "cuda", "dtype": torch.bfloat16} if cuda else {}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    gate = (torch.randn(E, D, **kw) * 0.02).requires_grad_()
    w1 = (torch.randn(E, Fh, D, **kw) * 0.02).requires_grad_()
    w2 = (torch.randn(E, D, Fh, **kw) * 0.02).requires_grad_()
    w3 = (torch.randn(E, Fh, D, **kw) * 0.02).requires_grad_()
    x = torch.randn(T, D, requires_grad=True, **kw)
    g = torch.randn(T, D, **kw)

    def step():
        scores = torch.softmax((x @ gate.T).float(), -1)
        ids = torch.topk(scores.detach(), K, dim=-1).indices
        w = scores.gather(-1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        counts = torch.bincount(ids.flatten(), minlength=E)
        perm = torch.argsort(ids.flatten(), stable=True)
        token = perm // K
        routed = x[token]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(routed, w1.transpose(-2, -1), offs=offs)) * \
            torch._grouped_mm(routed, w3.transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        out = out * w.flatten()[perm].unsqueeze(1).to(out.dtype)
        y = torch.zeros(T, D, **kw).scatter_add(0, token.unsqueeze(1).expand(-1, D), out)
        (y * g).sum().backward()
        for t in (gate, w1, w2, w3, x):
            t.grad = None

    ms = []
    trace = os.environ.get("TRACE")
    for s in range(steps + 3):
        sync()
        t0 = time.perf_counter()
        if trace and s == 3:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts) as prof:
                step()
                sync()
            prof.export_chrome_trace(trace)
        else:
            step()
        sync()
        if s >= 3:
            ms.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"impl": "pytorch", "threads": torch.get_num_threads(), "median_ms": statistics.median(ms)}))


if __name__ == "__main__":
    main()
