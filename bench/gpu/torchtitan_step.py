"""GPU training-step benchmark, torchtitan side: torchtitan's own Llama 3 model (its released wheel),
its single-GPU train step (bf16 autocast over fp32 weights, cross-entropy in fp32, clip_grad_norm_,
fused AdamW with torchtitan's defaults), eager or with torchtitan's per-block torch.compile.
Prints one JSON line: tokens/s (median step), MFU, peak memory and seconds from launch to the first step.
With --float8 RECIPE, the linear layers but `output` train in float8 through torchtitan's own
converter (torchao's Float8Linear; "tensorwise" is torchtitan's default path, "rowwise" its recipe).
usage: torchtitan_step.py --flavor 1B | --layers N (8B-shaped) [--seq 8192] [--batch 1] [--steps 15]
       [--warmup 5] [--compile] [--float8 tensorwise|rowwise] [--label NAME]
       env LAUNCH_TIME: the shell's clock when the process was started
"""
import argparse
import json
import os
import statistics
import time

LAUNCH = float(os.environ.get("LAUNCH_TIME", time.time()))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args  # noqa: E402
from torchtitan.models.llama3.infra.parallelize import apply_compile  # noqa: E402

H100_H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of the SXM H100 and H200, as torchtitan counts MFU


class CompileConfig:
    backend = "inductor"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--float8", default="", choices=["", "tensorwise", "rowwise"])
    ap.add_argument("--label", default="", help="the model's name in the output (default: from the shapes)")
    ap.add_argument("--profile", default="", help="write a Chrome trace of the first timed step here")
    a = ap.parse_args()
    if a.flavor == "1B":  # Llama 3.2 1B's shapes (torchtitan's llama3_args has no 1B), embeddings untied
        margs = TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                                     multiple_of=1024, rope_theta=500000)
        name = "1B-shaped"
    elif a.flavor:
        margs = llama3_args[a.flavor]
        name = a.flavor
    else:
        margs = llama3_args["8B"]
        margs.n_layers = a.layers
        name = f"8B-shaped x{a.layers}"
    margs.max_seq_len = a.seq
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if a.label:
        name = a.label
    with torch.device("meta"):
        model = Transformer(margs)
    if a.float8:  # as torchtitan's trainer does: converters on the meta model, before compile and init
        import types
        from torchtitan.config.job_config import JobConfig
        from torchtitan.components.quantization.float8 import Float8LinearConverter
        jc = JobConfig()
        jc.model.converters = ["quantize.linear.float8"]
        jc.quantize.linear.float8.filter_fqns = ["output"]
        jc.quantize.linear.float8.recipe_name = None if a.float8 == "tensorwise" else a.float8
        Float8LinearConverter(jc, types.SimpleNamespace(dp_shard_enabled=False)).convert(model)
    model.to_empty(device=dev)
    with torch.no_grad():
        model.init_weights(buffer_device=dev)
    model.train()
    if a.compile:
        apply_compile(model, CompileConfig())
    nparams, flops_per_token = margs.get_nparams_and_flops(model, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    tokens = torch.randint(margs.vocab_size, (a.batch, a.seq + 1), device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    first_step = None
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        prof = None
        if a.profile and i == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss.item()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.profile)
            continue
        if first_step is None:
            first_step = time.time() - LAUNCH
        if i >= a.warmup:
            times.append(t1 - t0)
    med = statistics.median(times)
    tps = a.batch * a.seq / med
    print(json.dumps({
        "impl": "torchtitan " + ("compile" if a.compile else "eager") + (" float8" if a.float8 else ""), "model": name, "seq": a.seq,
        "batch": a.batch, "params": nparams, "median_step_s": round(med, 4), "tps": round(tps, 1),
        "mfu_pct": round(100 * tps * flops_per_token / H100_H200_BF16_PEAK, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "launch_to_first_step_s": round(first_step, 1), "final_loss": round(loss.item(), 4)}), flush=True)


if __name__ == "__main__":
    main()
