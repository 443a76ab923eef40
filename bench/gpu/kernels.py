"""Sums the GPU kernel time of a Chrome trace (PyTorch's profiler, titan's or torchtitan's) by kernel,
and prints the total, the GPU's busy fraction of the traced span and the largest kernels.
usage: kernels.py TRACE.json [top N]"""
import collections
import json
import sys

trace = json.load(open(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
events = trace["traceEvents"] if isinstance(trace, dict) else trace
kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
if not kernels:
    sys.exit(f"{sys.argv[1]}: no GPU kernels in the trace")
by = collections.defaultdict(lambda: [0.0, 0])
for k in kernels:
    name = k["name"][:110]
    by[name][0] += k["dur"]
    by[name][1] += 1
busy = sum(k["dur"] for k in kernels)
span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
print(f"{sys.argv[1]}: {len(kernels)} kernels, {busy / 1e3:.1f} ms busy over a {span / 1e3:.1f} ms span "
      f"({100 * busy / span:.1f}% busy)")
for name, (dur, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"  {dur / 1e3:8.2f} ms {n:5d}x  {name}")
