"""Time to first step: launches `titan train` (1 process, or N through `titan launch`), timestamps its
log lines from the launch and stops the run as soon as the start-up is over, before the first step.

The marker is the trainer's "Start-up: ..." line; binaries that predate it are timed to their
"Training N steps" line (the last line of start-up then). Prints one row per binary and configuration:
the median over the repetitions of the wall time from launch to the marker and, when the binary logs
it, the median of its own start-up and model figures. Several binaries (--titan A B) take turns run by
run, so that a before/after comparison sees the same machine load. The CPU time (user + system, the
process and its descendants, read from /proc at the marker) depends less on that load than wall time."""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

STARTUP = re.compile(r"Start-up: ([0-9.]+) s \(model [^0-9]*([0-9.]+) s\)")
TRAINING = re.compile(r"Training [0-9]+ steps")


def cpu_seconds(root):
    """User + system CPU seconds of process `root` and its descendants so far (from /proc)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
            except (OSError, IndexError, ValueError):
                pass
    tree, total, grew = {root}, 0.0, True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(stats[pid][1] for pid in tree if pid in stats)


def one_run(titan, flavor, nproc, dump, marker_is_startup, extra):
    shutil.rmtree(dump, ignore_errors=True)
    train = ["train", "--model.flavor", flavor, "--training.steps", "1", "--training.seq_len", "128",
             "--training.local_batch_size", "1", "--job.dump_folder", dump,
             "--model.hf_assets_path", "assets/tokenizer", "--training.dataset_path", "assets/corpus"] + extra
    if nproc == 1:
        cmd = [titan] + train
    else:
        cmd = [titan, "launch", "--nproc-per-node", str(nproc), "--standalone", "--local-ranks-filter", "0",
               "--"] + train + ["--parallelism.data_parallel_shard_degree", str(nproc)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wall = inner = model = cpu = None
    tail = []
    for line in p.stdout:
        tail = (tail + [line])[-20:]
        m = STARTUP.search(line)
        if marker_is_startup and m:
            wall, inner, model = time.monotonic() - t0, float(m.group(1)), float(m.group(2))
            cpu = cpu_seconds(p.pid)
            break
        if not marker_is_startup and TRAINING.search(line):
            wall, cpu = time.monotonic() - t0, cpu_seconds(p.pid)
            break
    # Stop the run before its step (the launcher stops its workers on SIGTERM).
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    shutil.rmtree(dump, ignore_errors=True)
    if wall is None:
        sys.exit("no start-up line; the run's last lines:\n" + "".join(tail))
    return wall, inner, model, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", nargs="+", default=["build/titan"])
    ap.add_argument("--flavors", nargs="+", default=["1B"])
    ap.add_argument("--nprocs", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dump", default="/tmp/titan_startup_bench")
    ap.add_argument("extra", nargs="*", help="more `titan train` options, after --")
    a = ap.parse_args()
    marker = {}
    for t in a.titan:
        with open(t, "rb") as f:
            marker[t] = b"Start-up: " in f.read()
        print(f"# {t}: timed to the {'Start-up' if marker[t] else 'Training N steps'} line")
    print(f"# median of {a.reps} runs; extra options: {' '.join(a.extra) or '-'}")
    print("| binary | flavor | processes | launch to start-up line (s) | logged start-up (s) | logged model (s) "
          "| CPU time, all processes (s) | runs (s) |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda xs: f"{statistics.median(xs):.2f}" if all(x is not None for x in xs) else "-"
    for flavor in a.flavors:
        for nproc in a.nprocs:
            runs = {t: [] for t in a.titan}
            for _ in range(a.reps):
                for t in a.titan:
                    runs[t].append(one_run(t, flavor, nproc, a.dump, marker[t], a.extra))
            for t in a.titan:
                walls = [r[0] for r in runs[t]]
                print(f"| {os.path.basename(t)} | {flavor} | {nproc} | {fmt(walls)} | {fmt([r[1] for r in runs[t]])} | "
                      f"{fmt([r[2] for r in runs[t]])} | {fmt([r[3] for r in runs[t]])} | "
                      f"{' '.join(f'{w:.2f}' for w in walls)} |", flush=True)


if __name__ == "__main__":
    main()
