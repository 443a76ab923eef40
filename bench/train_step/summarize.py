"""Reads the JSON lines of bench/train_step/run.sh and prints medians and the titan/pytorch ratio."""
import json
import statistics
import sys

rows = [json.loads(line) for line in sys.stdin if line.startswith("{")]
med = {impl: statistics.median(r["median_ms"] for r in rows if r["impl"] == impl) for impl in ("titan", "pytorch")}
threads = rows[0]["threads"]
for impl, ms in med.items():
    print(f"{impl:8s} median step {ms:8.2f} ms  (threads {threads}, rounds {len(rows) // 2})")
print(f"ratio titan/pytorch step time: {med['titan'] / med['pytorch']:.3f}  (<1: titan faster)")
