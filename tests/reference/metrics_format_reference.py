"""Python's formatting of torchtitan's training log line (used by tests/unit/metrics/format_test.cpp).

torchtitan prints its line with Python format specs (torchtitan v0.2.2, components/metrics.py):
  step {:2}, loss {:8.5f}, grad_norm {:7.4f}, memory {:5.2f}GiB({:.2f}%), tps round(x) with {:,},
  tflops {:,.2f}, mfu {:.2f}% ; fields joined by two spaces, each preceded by its ANSI color when
  coloring, the line ending with the default-foreground code.
This script applies those specs with Python itself, so the C++ formatting is checked against the
language torchtitan runs in.

usage: metrics_format_reference.py IN.json OUT.json
  IN:  {"ints": [...], "fixed": [[value, decimals, width, thousands], ...], "rounds": [...],
        "lines": [{"step", "loss", "grad_norm", "memory_gib", "memory_pct", "tps", "tflops",
                   "mfu_pct" (null: no peak known), "color"}, ...]}
  OUT: {"ints": [str], "fixed": [str], "rounds": [int], "lines": [str]}
"""

import json
import sys

COLORS = {
    "red": "\033[31m",
    "green": "\033[32m",
    "orange": "\033[38;2;180;60;0m",
    "turquoise": "\033[38;2;54;234;195m",
    "blue": "\033[34m",
    "cyan": "\033[36m",
    "magenta": "\033[35m",
    "reset": "\033[39m",
}


def log_line(f):
    c = COLORS if f["color"] else {k: "" for k in COLORS}
    mfu = "N/A" if f["mfu_pct"] is None else format(f["mfu_pct"], ".2f") + "%"
    fields = [
        c["red"] + "step: " + format(f["step"], "2"),
        c["green"] + "loss: " + format(f["loss"], "8.5f"),
        c["orange"] + "grad_norm: " + format(f["grad_norm"], "7.4f"),
        c["turquoise"] + "memory: " + format(f["memory_gib"], "5.2f") + "GiB(" + format(f["memory_pct"], ".2f") + "%)",
        c["blue"] + "tps: " + format(round(f["tps"]), ","),
        c["cyan"] + "tflops: " + format(f["tflops"], ",.2f"),
        c["magenta"] + "mfu: " + mfu + c["reset"],
    ]
    return "  ".join(fields)


def main():
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    out = {
        "ints": [format(n, ",") for n in cases["ints"]],
        "fixed": [format(v, (str(w) if w else "") + ("," if th else "") + f".{d}f") for v, d, w, th in cases["fixed"]],
        "rounds": [round(v) for v in cases["rounds"]],
        "lines": [log_line(f) for f in cases["lines"]],
    }
    with open(sys.argv[2], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
