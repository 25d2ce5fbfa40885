#!/usr/bin/env python3
"""Draws a pipeline step of a SHOAL_TIMELINE trace as text, one row per worker.

    SHOAL_TIMELINE=trace.json shoal run -n 2 build/examples/pipeline_mlp --schedule zb ...
    examples/pipeline_trace_picture.py trace.json

The step drawn is the fastest of the run (the k-th step of every worker, k chosen so that the
time from the first worker's start to the last one's end is the least), which a busy machine
disturbs least; --step K draws the K-th (from 0). Two characters per time unit (the median forward's duration, unless --unit gives one in
microseconds): the action's kind and its micro-batch, as docs/pipeline.md's pictures from
simulate() show them; stages of a worker's second chunk (interleaved) in lower case; '..' where
the worker computes nothing (waiting for a transfer, or idle). Prints the measured bubble,
1 - busy / (p x step time), busy being the time in F, B, I and W.
"""
import argparse
import json
import statistics


def load(path):
    text = open(path).read().strip()
    # The trace is a JSON array whose closing bracket may be missing (Chrome's trace format).
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    return events["traceEvents"] if isinstance(events, dict) else events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--unit", type=float, help="microseconds per two characters")
    parser.add_argument("--step", type=int, help="the step to draw (default: the fastest)")
    args = parser.parse_args()

    events = [e for e in load(args.trace) if e.get("cat") == "pipeline" and e.get("ph") == "X"]
    names = {e["pid"]: e["args"]["name"] for e in load(args.trace)
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    every = {}
    for e in events:
        if e["name"] == "step":
            every.setdefault(e["pid"], []).append(e)
    if not every:
        raise SystemExit(f"{args.trace}: no pipeline step recorded (was SHOAL_TIMELINE set?)")
    for pid in every:
        every[pid].sort(key=lambda s: s["ts"])
    count = min(len(s) for s in every.values())

    def span(k):
        return (max(s[k]["ts"] + s[k]["dur"] for s in every.values()) -
                min(s[k]["ts"] for s in every.values()))

    k = args.step if args.step is not None else min(range(count), key=span)
    steps = {pid: every[pid][k] for pid in every}
    workers = sorted(steps, key=lambda pid: names.get(pid, str(pid)))
    p = len(workers)
    compute = {}
    for pid in workers:
        step = steps[pid]
        compute[pid] = sorted(
            (e for e in events
             if e["pid"] == pid and e["name"][0] in "FBIW" and e["name"] != "step"
             and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]),
            key=lambda e: e["ts"])
    start = min(steps[pid]["ts"] for pid in workers)
    end = max(steps[pid]["ts"] + steps[pid]["dur"] for pid in workers)
    forwards = [e["dur"] for pid in workers for e in compute[pid] if e["name"][0] == "F"]
    unit = args.unit or statistics.median(forwards)
    busy = sum(e["dur"] for pid in workers for e in compute[pid])
    print(f"step {(end - start) / 1000:.2f} ms, unit {unit:.0f} us, measured bubble "
          f"{1 - busy / (p * (end - start)):.3f}")
    cells = int((end - start) / unit + 0.5)
    for pid in workers:
        row = [".."] * cells
        for e in compute[pid]:
            stage = e["args"]["stage"]
            label = e["name"][0] + str(e["args"]["micro_batch"] % 10)
            if stage >= p:
                label = label.lower()
            first = int((e["ts"] - start) / unit + 0.5)
            last = max(first + 1, int((e["ts"] + e["dur"] - start) / unit + 0.5))
            for c in range(first, min(last, cells)):
                row[c] = label
        print(f"{names.get(pid, str(pid)).split(' (')[0]:<9} {''.join(row)}")


if __name__ == "__main__":
    main()
