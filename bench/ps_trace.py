#!/usr/bin/python3
"""Where a parameter-server step's time goes, read from a SHOAL_TIMELINE trace of bench/ps.

    SHOAL_PS_MODE=sync SHOAL_TIMELINE=trace.json build/bin/shoal run --servers 1 -n 2 \\
        build/bench/ps --steps 20
    /usr/bin/python3 bench/ps_trace.py trace.json [--skip 3]

Per worker, the medians over the steps after the first --skip (bench/ps's warm-up) of: the
whole step ("step N"), its forward, backward and optimizer.step() (bench/ps's slices), and
within the step the pushes and pulls ("push to server S", "pull from server S", each from the
call to its answer: a sync pull waits for the step's sum). The worker's compute is forward +
backward; the rest of the step is the parameter server's. Per server: each step's sum ("sum
step N", inside the push that completed the step) and the pushes and pulls it answered.
"""
import argparse
import collections
import json
import re
import statistics


def load(path):
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out (default 3)")
    args = parser.parse_args()
    events = load(args.trace)
    names = {}
    slices = collections.defaultdict(list)  # pid -> [(name, ts, dur)]
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            slices[e["pid"]].append((e["name"], e["ts"], e["dur"]))

    def median_ms(values):
        return statistics.median(values) / 1000 if values else float("nan")

    for pid in sorted(names, key=lambda p: names[p]):
        name = names[pid]
        own = slices[pid]
        if name.startswith("worker"):
            steps = sorted((ts, dur, n) for n, ts, dur in own if re.fullmatch(r"step \d+", n))
            steps = [s for s in steps if int(s[2].split()[1]) >= args.skip]
            parts = collections.defaultdict(list)
            for ts, dur, _ in steps:
                within = collections.defaultdict(float)
                for n, t, d in own:
                    if t >= ts and t + d <= ts + dur:
                        key = re.sub(r" \d+$", " S", n) if n.startswith(("push to", "pull from")) else n
                        within[key] += d
                for key in ("forward", "backward", "optimizer.step()", "push to server S",
                            "pull from server S"):
                    parts[key].append(within.get(key, 0.0))
                parts["step"].append(dur)
            step = median_ms(parts["step"])
            compute = median_ms(parts["forward"]) + median_ms(parts["backward"])
            print(f"{name}: {len(steps)} steps, step {step:.2f} ms: forward "
                  f"{median_ms(parts['forward']):.2f}, backward {median_ms(parts['backward']):.2f}, "
                  f"optimizer.step() {median_ms(parts['optimizer.step()']):.2f} (pushes "
                  f"{median_ms(parts['push to server S']):.2f}, pulls "
                  f"{median_ms(parts['pull from server S']):.2f}, summed over servers); compute "
                  f"{compute / step:.2f} of the step")
        else:
            sums = [d for n, _, d in own if n.startswith("sum step")]
            sums = sums[args.skip:]
            pushes = [d for n, _, d in own if n == "push"]
            pulls = [d for n, _, d in own if n == "pull"]
            print(f"{name}: {len(sums)} sums, median {median_ms(sums):.2f} ms; pushes answered "
                  f"{len(pushes)}, median {median_ms(pushes):.2f} ms (the last of a step includes its "
                  f"sum); pulls {len(pulls)}, median {median_ms(pulls):.2f} ms (with the wait for "
                  f"the step)")


if __name__ == "__main__":
    main()
