"""Medians of bench/moe/run.sh's JSON lines (one per variant and round) and their ratios."""

import json
import statistics
import sys

by = {}
for line in sys.stdin:
    r = json.loads(line)
    by.setdefault(r["impl"], []).append(r["median_ms"])
m = {k: statistics.median(v) for k, v in by.items()}
for k, v in by.items():
    print(f"{k:14s} median step {m[k]:8.2f} ms  (rounds {len(v)}: {', '.join(f'{x:.1f}' for x in v)})")
grouped, loop, torch_ms = m["titan_grouped"], m["titan_loop"], m["pytorch"]
print(f"grouped / loop: {grouped / loop:.3f}; titan grouped / pytorch: {grouped / torch_ms:.3f}  (<1: faster)")
