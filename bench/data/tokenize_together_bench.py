#!/usr/bin/env python3
"""Text data on the training path: each rank's data-loading throughput at dp 1, 2 and 4, with the
node's ranks tokenizing together (each encodes 1/dp of the documents) and, as the peer in the same run,
every rank tokenizing the whole stream (TITAN_DEBUG_TOKENIZE_ALONE=1).

  bench/data/tokenize_together_bench.py [--dp 1,2,4] [--steps 12] [--repeats 3]

Each run is `titan launch --nproc-per-node DP -- train` of a one-layer Llama (dim 64: the step is mostly
the data path) on the bundled corpus (titan_corpus, BPE tokenizer assets/tokenizer), FSDP over DP ranks,
seq_len 2048, local batch 8 (16,384 tokens per rank per step), log_freq 1. Rank 0's metrics.jsonl gives the data-loading seconds per step
(data_loading_s, TensorBoard's time_metrics/data_loading(s): reading, JSON, tokenization, the exchange);
the data tokens/s per rank is the rank's tokens over its data seconds, summed over steps 2.. (an
exchange serves several steps), and the training tokens/s per rank (tps) the median over those steps;
then the median over --repeats runs.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TITAN = os.path.join(ROOT, "build", "titan")
# A Llama of one small layer: its step is short, so that the step is mostly the data path and the ranks
# stay in step (a big model's compute skew between ranks would count as waiting in the exchange).
TINY = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_hidden_layers": 1, "vocab_size": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                   "tie_word_embeddings": False})


def run(dp, steps, alone):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [TITAN] + (["launch", "--nproc-per-node", str(dp), "--master-port", "0", "--"] if dp > 1 else [])
        cmd += ["train", "--job.config_file", os.path.join(ROOT, "configs/llama3_debugmodel.toml"),
                "--model.name", "llama3", "--model.flavor", TINY,
                "--job.dump_folder", dump, "--training.dataset", "titan_corpus", "--training.steps", str(steps),
                "--training.seq_len", "2048", "--training.local_batch_size", "8", "--metrics.log_freq", "1",
                "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if alone:
            env["TITAN_DEBUG_TOKENIZE_ALONE"] = "1"
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(p.stdout[-3000:] + p.stderr[-3000:])
        together = "tokenized together by" in p.stdout + p.stderr
        assert together == (dp > 1 and not alone), "the run did not tokenize as asked"
        seconds, tps = [], []
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            for line in f:
                j = json.loads(line)
                if j.get("kind") == "train" and j["step"] >= 2:
                    seconds.append(j["data_loading_s"])
                    tps.append(j["tps"])
        # Data: the mean over the steps (an exchange serves several steps, so medians would hide it).
        return 8 * 2048 * len(seconds) / sum(seconds), statistics.median(tps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"{'dp':>3} | {'data tok/s/rank: together':>26} {'alone':>10} {'ratio':>6} | "
          f"{'training tps/rank: together':>28} {'alone':>8} {'ratio':>6}")
    for dp in [int(x) for x in a.dp.split(",")]:
        tog, alo = [], []
        for _ in range(a.repeats):
            tog.append(run(dp, a.steps, alone=False))
            alo.append(run(dp, a.steps, alone=True))
        td, tt = statistics.median(x[0] for x in tog), statistics.median(x[1] for x in tog)
        ad, at = statistics.median(x[0] for x in alo), statistics.median(x[1] for x in alo)
        print(f"{dp:>3} | {td:>26,.0f} {ad:>10,.0f} {td / ad:>6.2f} | {tt:>28,.0f} {at:>8,.0f} {tt / at:>6.2f}",
              flush=True)


if __name__ == "__main__":
    main()
