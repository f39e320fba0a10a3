#!/usr/bin/env python3
"""Summarise an `afd generate --trace` Chrome trace: where a decode step's time goes.

Per layer and step, from the node's spans and the cards' messages (one clock):
  - the step's time (median, from one step's first attention span to the next);
  - the node's attention, dispatch and wait+combine (medians over layers);
  - the cards' compute time added up, and the span from the first card message landing to the
    last one's reply: their ratio is how many cards computed at a time on average;
  - how long messages waited for a CPU turn, and how much of a message's compute span its worker
    spent on a CPU (traces from afd versions that record it);
  - the LM head's node span and the cards' compute for it;
  - the hops: from the start of the node's dispatch (which includes routing and the sends) to
    the first card message landing, and from the last reply to the end of the node's
    wait+combine (which includes the combine): what the data plane and the threads' wake-ups
    add to each layer (paired by time: with two micro-batches a reply may be paired with the
    other micro-batch's wait+combine). The dispatch's start, not its end: a node that sends
    its packets itself may see a card's message land before its last send returns.

With --prefill, the first step instead (a prompt's prefill): each node span kind added up over
the layers' first spans, and the time from the first span to the end of the first LM head.

Usage: scripts/trace_summary.py TRACE.json [--skip-steps N | --prefill]   (standard library only)
"""
import argparse
import bisect
import collections
import json
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--skip-steps", type=int, default=2, help="first steps left out (prefill, warm-up); default 2")
    ap.add_argument("--prefill", action="store_true", help="sum up the first step (the prefill) instead")
    args = ap.parse_args()
    with open(args.trace) as f:
        doc = json.load(f)
    events = [e for e in doc.get("traceEvents", doc) if e.get("ph") == "X"]
    if args.prefill:
        prefill(events)
        return
    node = collections.defaultdict(list)
    for e in events:
        if e["pid"] == 1:
            node[e["cat"]].append(e["dur"] / 1000)
    cards = [e for e in events if e["pid"] == 2]
    if not cards:
        raise SystemExit("no card spans in this trace: it needs `afd generate --cards N --trace FILE` from this version on")
    first_step = min(e["args"]["step"] for e in cards) + args.skip_steps
    groups = collections.defaultdict(list)
    for e in cards:
        a = e["args"]
        if a["step"] >= first_step:
            groups[(a["step"], e["name"].split(" ", 1)[1], a["micro_batch"])].append(e)
    busy, span, waits, lm_busy, per_msg, per_cpu, preempted, blocked = [], [], [], [], [], [], [], []
    # The node's spans by name, in time order (their starts and their ends), to find each
    # group's hops.
    node_starts, node_ends = collections.defaultdict(list), collections.defaultdict(list)
    for e in events:
        if e["pid"] == 1:
            node_starts[e["name"]].append(e["ts"])
            node_ends[e["name"]].append(e["ts"] + e["dur"])
    for times in list(node_starts.values()) + list(node_ends.values()):
        times.sort()
    hop_out, hop_back = [], []
    for (step, what, mb), evs in groups.items():
        compute = [e for e in evs if e["cat"] == "compute"]
        wait = [e for e in evs if e["cat"] == "wait"]
        start = min(e["ts"] for e in wait)
        end = max(e["ts"] + e["dur"] for e in compute)
        total = sum(e["dur"] for e in compute) / 1000
        if what == "lm-head":
            lm_busy.append(total)
            continue
        busy.append(total)
        span.append((end - start) / 1000)
        dispatched = node_starts.get(f"dispatch {what}", [])
        i = bisect.bisect_right(dispatched, start)
        if i > 0:
            hop_out.append((start - dispatched[i - 1]) / 1000)
        combined = node_ends.get(f"wait+combine {what}", [])
        j = bisect.bisect_left(combined, end)
        if j < len(combined):
            hop_back.append((combined[j] - end) / 1000)
        waits += [e["dur"] / 1000 for e in wait]
        per_msg += [e["dur"] / 1000 for e in compute]
        per_cpu += [e["args"]["cpu_ms"] for e in compute if "cpu_ms" in e["args"]]
        preempted += [e["args"]["preempted"] for e in compute if "preempted" in e["args"]]
        blocked += [e["args"]["blocked"] for e in compute if "blocked" in e["args"]]
    med = statistics.median
    # A step runs from its first layer's attention to the next step's; with two micro-batches
    # a step has two such spans, and only the first after an LM head starts a step.
    starts, head_seen = [], True
    for e in sorted((e for e in events if e["pid"] == 1), key=lambda e: e["ts"]):
        if e["name"] == "attention L0" and head_seen:
            starts.append(e["ts"])
            head_seen = False
        elif e["name"].startswith("lm-head merge"):
            head_seen = True
    steps = [(b - a) / 1000 for a, b in zip(starts, starts[1:])][args.skip_steps:]
    if steps:
        print(f"step: {med(steps):.1f} ms (median of {len(steps)}, from one step's first attention span to the next)")
    print(f"node (medians over layers): " + ", ".join(f"{k} {med(v):.2f} ms" for k, v in sorted(node.items())))
    if busy:
        print(f"cards, {len(busy)} layer messages groups from step {first_step} on (medians):")
        print(f"  compute added up {med(busy):.2f} ms, first landing to last reply {med(span):.2f} ms: "
              f"{med(busy) / med(span):.2f} cards at a time")
        print(f"  a message computes {med(per_msg):.2f} ms and waits {med(waits):.2f} ms for its turn "
              f"(mean {statistics.mean(waits):.2f})")
        if per_cpu:
            print(f"  on its worker's CPU a message computes {med(per_cpu):.2f} ms (median; "
                  f"{statistics.mean(per_cpu):.2f} mean against {statistics.mean(per_msg):.2f} ms of wall time), "
                  f"preempted {statistics.mean(preempted):.2f} and blocked {statistics.mean(blocked):.2f} times on average")
    if lm_busy:
        print(f"  LM head: cards' compute added up {med(lm_busy):.1f} ms a step")
    if hop_out and hop_back:
        print(f"hops (medians): dispatch's start to the first landing {med(hop_out) * 1000:.0f} us, "
              f"last reply to the end of wait+combine {med(hop_back) * 1000:.0f} us")


def prefill(events):
    """The first step's node spans: node spans carry no step, so each layer's first span of a
    kind is the first step's."""
    first = {}
    for e in sorted((e for e in events if e["pid"] == 1), key=lambda e: e["ts"]):
        first.setdefault(e["name"], e)
    if not first:
        raise SystemExit("no node spans in this trace")
    totals = collections.defaultdict(float)
    for name, e in first.items():
        totals[name.split(" L", 1)[0]] += e["dur"] / 1000
    start = min(e["ts"] for e in first.values())
    heads = [e for name, e in first.items() if name.startswith("lm-head merge")]
    print("first step (node spans added up over layers): "
          + ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(totals.items())))
    if heads:
        end = heads[0]["ts"] + heads[0]["dur"]
        print(f"first span to the end of the first LM head: {(end - start) / 1000:.0f} ms")


if __name__ == "__main__":
    main()
