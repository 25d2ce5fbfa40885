#!/usr/bin/env python3
"""Reads bench/pipeline's SHOAL_TIMELINE traces, and summarizes bench/pipeline.sh's raw lines.

  pipeline_trace.py trace TRACE --warmup N
      One line of key=value for a run: over its timed steps (the "step" slices after the first N
      on each worker), the median bubble 1 - busy / (p x step), where step runs from the earliest
      worker's step start to the latest one's end and busy sums every worker's compute slices
      (F, B, I, W) inside its step; the median cost in ms of F, B, I and W; the peak number of
      micro-batches stashed by one stage (forwarded, and not yet through B, or W when the backward
      is split) and by one worker (over its stages).
  pipeline_trace.py replay TRACE LISTS --warmup N
      The bubble the schedule's lists (LISTS: bench/pipeline --impl theory --describe) would have
      with each stage's own median F, B, I, W from the trace, transfers taking no time: the theory
      for stages whose costs differ, which simulate()'s one cost per kind cannot give.
  pipeline_trace.py summarize RAW
      The tables of bench/pipeline.sh from its raw lines (medians over rounds).
"""
import json
import re
import statistics
import sys
from collections import defaultdict

COMPUTE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


def load(path):
    with open(path) as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text += "]"  # the timeline leaves the array open (docs/runtime.md)
    return json.loads(text)


def analyse(path, warmup):
    events = load(path)
    rank_of = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_sort_index":
            rank_of[e["pid"]] = e["args"]["sort_index"]
    steps = defaultdict(list)    # rank -> [(start, end)]
    compute = defaultdict(list)  # rank -> [(start, end, kind, stage, micro_batch)]
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "pipeline":
            continue
        rank = rank_of[e["pid"]]
        start, end = e["ts"], e["ts"] + e["dur"]
        if e["name"] == "step":
            steps[rank].append((start, end))
        else:
            match = COMPUTE.match(e["name"])
            if match:
                compute[rank].append((start, end, match[1], int(match[2]), int(match[3])))
    ranks = sorted(steps)
    p = len(ranks)
    for r in ranks:
        steps[r].sort()
        compute[r].sort()
    timed = min(len(steps[r]) for r in ranks) - warmup
    if timed < 1:
        raise SystemExit(f"pipeline_trace.py: {path} has no step after the {warmup} warm-up ones")
    bubbles, step_ms = [], []
    costs = defaultdict(list)
    peak_stage, peak_worker = 0, [0] * p
    split = any(c[2] == "I" for r in ranks for c in compute[r])
    for k in range(warmup, warmup + timed):
        first = min(steps[r][k][0] for r in ranks)
        last = max(steps[r][k][1] for r in ranks)
        busy = 0.0
        for i, r in enumerate(ranks):
            s0, s1 = steps[r][k]
            inside = [c for c in compute[r] if s0 <= c[0] and c[1] <= s1]
            busy += sum(c[1] - c[0] for c in inside)
            for c in inside:
                costs[c[2]].append((c[1] - c[0]) / 1000)
            # Stashed micro-batches: +1 at a forward's start, -1 at the end of the action that
            # frees them (B, or W when the backward is split).
            frees = "W" if split else "B"
            changes = []
            for c in inside:
                if c[2] == "F":
                    changes.append((c[0], 1, c[3]))
                elif c[2] == frees:
                    changes.append((c[1], -1, c[3]))
            changes.sort(key=lambda x: (x[0], x[1]))  # a free before a start at the same instant
            per_stage, total = defaultdict(int), 0
            for _, delta, stage in changes:
                per_stage[stage] += delta
                total += delta
                peak_stage = max(peak_stage, per_stage[stage])
                peak_worker[i] = max(peak_worker[i], total)
        bubbles.append(1 - busy / (p * (last - first)))
        step_ms.append((last - first) / 1000)

    def cost(kind):
        return f"{statistics.median(costs[kind]):.3f}" if costs[kind] else "0"

    print(f"trace_steps={timed} trace_step_ms={statistics.median(step_ms):.2f} "
          f"bubble={statistics.median(bubbles):.4f} f_ms={cost('F')} b_ms={cost('B')} "
          f"i_ms={cost('I')} w_ms={cost('W')} peak_stage={peak_stage} "
          f"peak_worker={','.join(map(str, peak_worker))}")


def stage_costs(path, warmup):
    """Median ms of each compute kind on each stage, over the timed steps."""
    events = load(path)
    rank_of = {e["pid"]: e["args"]["sort_index"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_sort_index"}
    steps, costs = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "pipeline" and e["name"] == "step":
            steps[rank_of[e["pid"]]].append((e["ts"], e["ts"] + e["dur"]))
    timed = {r: sorted(s)[warmup:] for r, s in steps.items()}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "pipeline":
            continue
        match = COMPUTE.match(e["name"])
        if match and any(a <= e["ts"] <= b for a, b in timed[rank_of[e["pid"]]]):
            costs[match[1], int(match[2])].append(e["dur"] / 1000)
    return {k: statistics.median(v) for k, v in costs.items()}


def replay(lists, costs):
    """Runs the schedule's lists (bench/pipeline --impl theory --describe) as simulate() does, a
    send never blocking and a receive waiting for its send, transfers taking no time, but with
    each stage's own cost of each kind. Returns the bubble."""
    workers = [line.split(":", 1)[1].split() for line in lists if line.startswith("worker ")]
    clock, pos, sent = [0.0] * len(workers), [0] * len(workers), {}
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for w, actions in enumerate(workers):
            while pos[w] < len(actions):
                name = actions[pos[w]]
                kind, rest = re.match(r"([A-Z]+)(.*)", name).groups()
                stage, mb = map(int, rest.split("."))
                if kind in ("SA", "SG"):
                    sent[kind, stage, mb] = clock[w]
                elif kind in ("RA", "RG"):
                    key = ("SA", stage - 1, mb) if kind == "RA" else ("SG", stage + 1, mb)
                    if key not in sent:
                        break
                    clock[w] = max(clock[w], sent[key])
                else:
                    cost = costs.get((kind, stage), 0.0)
                    clock[w] += cost
                    busy += cost
                pos[w] += 1
                progress = True
    assert all(pos[w] == len(a) for w, a in enumerate(workers)), "the lists deadlock"
    return 1 - busy / (len(workers) * max(clock))


def fields(line):
    out = {}
    for key, value in (t.split("=", 1) for t in line.split() if "=" in t):
        out.setdefault(key, value)  # the script's round, contender, p, m come first
    return out


def closed_form(schedule, p, v, m):
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * m + p - 1)  # ZB-H1 at f = i = w


def summarize(path):
    runs = defaultdict(list)
    stash = {}
    with open(path) as f:
        for line in f:
            if line.startswith("stash "):
                s = fields(line)
                stash[(s["p"], s["v"], s["m"])] = s
            elif line.startswith("round="):
                runs[fields(line)["contender"], fields(line)["p"], fields(line)["m"]].append(
                    fields(line))

    def med(rows, key):
        return statistics.median(float(r[key]) for r in rows)

    local = [r for (c, _, _), rows in runs.items() if c == "local" for r in rows]
    local_rate = med(local, "samples_per_s") if local else float("nan")
    print(f"one process, whole stack, whole batch: {local_rate:.1f} samples/s "
          f"(median of {len(local)} runs)")
    local_mb = {m: rows for (c, _, m), rows in runs.items() if c == "local-mb"}
    for p in sorted({k[1] for k in runs if not k[0].startswith("local")}, key=int):
        print()
        print(f"### p = {p}" + (" (oversubscribed: 4 workers on 2 cores)" if int(p) > 2 else ""))
        print()
        print("| schedule | m | step ms | samples/s | x one process | x hand GPipe | bubble "
              "measured | closed form | simulate() unit | simulate() measured costs | simulate() "
              "per-stage costs | peak stash/stage | peak stash/worker | simulate() peak/worker | "
              "MiB/stage | runs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for schedule in ("local-mb", "hand", "gpipe", "1f1b", "interleaved", "zb"):
            for m in sorted({k[2] for k in runs if k[1] == p}, key=int):
                rows = local_mb.get(m) if schedule == "local-mb" else runs.get((schedule, p, m))
                if not rows:
                    continue
                hand = runs.get(("hand", p, m))
                rate = med(rows, "samples_per_s")
                x_hand = f"{rate / med(hand, 'samples_per_s'):.2f}" if hand else "-"
                if schedule in ("hand", "local-mb"):
                    name = "hand GPipe (c10d)" if schedule == "hand" else "one process, m in turn"
                    x_hand = "-" if schedule == "local-mb" else x_hand
                    print(f"| {name} | {m} | {med(rows, 'step_ms'):.1f} | {rate:.1f} | "
                          f"{rate / local_rate:.2f} | {x_hand} | - | - | - | - | - | - | - | - | - | "
                          f"{len(rows)} |")
                    continue
                v = int(rows[0]["v"])
                st = stash.get((p, str(v), m))
                peak = int(max(float(r["peak_stage"]) for r in rows))
                theory_peak = rows[0]["sim_peak_in_flight"]
                worker_peak = ",".join(
                    str(max(int(r["peak_worker"].split(",")[w]) for r in rows))
                    for w in range(int(p)))
                mib = f"{peak * float(st['bytes']) / 2**20:.2f}" if st else "-"
                name = f"interleaved v={v}" if schedule == "interleaved" else schedule
                # Raw lines from before the per-stage replay have none. Bubbles get four
                # decimals: a target 10% above 0.040 is 0.044, which three would blur.
                staged = (f"{med(rows, 'sim_stage_bubble'):.4f}"
                          if all("sim_stage_bubble" in r for r in rows) else "-")
                print(f"| {name} | {m} | {med(rows, 'step_ms'):.1f} | {rate:.1f} | "
                      f"{rate / local_rate:.2f} | {x_hand} | {med(rows, 'bubble'):.4f} | "
                      f"{closed_form(schedule, int(p), v, int(m)):.4f} | "
                      f"{float(rows[0]['sim_unit_bubble']):.4f} | "
                      f"{med(rows, 'sim_measured_bubble'):.4f} | {staged} | {peak} | "
                      f"{worker_peak} | {theory_peak} | "
                      f"{mib} | "
                      f"{len(rows)} |")
    if stash:
        print()
        print("stashed bytes per micro-batch and stage (heap growth over one stage's forward, "
              "output held; analytic (layers + 1) x rows x dim x 4):")
        for (p, v, m), s in sorted(stash.items(), key=lambda kv: tuple(map(int, kv[0]))):
            print(f"  p={p} v={v} m={m}: rows {s['rows']}, {s['layers_per_stage']} layers, "
                  f"{int(s['bytes'])} B measured, {int(float(s['analytic_bytes']))} B analytic")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "trace":
        warmup = int(sys.argv[sys.argv.index("--warmup") + 1]) if "--warmup" in sys.argv else 0
        analyse(sys.argv[2], warmup)
    elif len(sys.argv) >= 4 and sys.argv[1] == "replay":
        # replay TRACE LISTS [--warmup N]: the bubble of the lists at the trace's per-stage costs.
        warmup = int(sys.argv[sys.argv.index("--warmup") + 1]) if "--warmup" in sys.argv else 0
        costs = stage_costs(sys.argv[2], warmup)
        with open(sys.argv[3]) as f:
            bubble = replay(f.read().splitlines(), costs)
        print("stage_costs_ms=" + ",".join(f"{k}{s}:{v:.2f}" for (k, s), v in sorted(costs.items(),
              key=lambda kv: (kv[0][1], kv[0][0]))) + f" replay_bubble={bubble:.4f}")
    elif len(sys.argv) == 3 and sys.argv[1] == "summarize":
        summarize(sys.argv[2])
    else:
        raise SystemExit("usage: pipeline_trace.py trace TRACE [--warmup N] | replay TRACE LISTS [--warmup N] | summarize RAW")
