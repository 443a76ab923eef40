"""Medians of bench/moe/run.sh's JSON lines (one per variant and round) and their ratios.
usage: summarize.py [FLOPS per step: the experts' matmuls, for TFLOP/s]"""

import json
import statistics
import sys

by = {}
for line in sys.stdin:
    r = json.loads(line)
    by.setdefault(r["impl"], []).append(r["median_ms"])
m = {k: statistics.median(v) for k, v in by.items()}
flops = float(sys.argv[1]) if len(sys.argv) > 1 else 0
for k, v in by.items():
    rate = f"  experts' matmuls {flops / (m[k] * 1e-3) / 1e12:8.3f} TFLOP/s" if flops else ""
    print(f"{k:14s} median step {m[k]:8.2f} ms  (rounds {len(v)}: {', '.join(f'{x:.1f}' for x in v)}){rate}")
grouped, loop, torch_ms = m["titan_grouped"], m["titan_loop"], m["pytorch"]
print(f"grouped / loop: {grouped / loop:.3f}; titan grouped / pytorch: {grouped / torch_ms:.3f}  (<1: faster)")
