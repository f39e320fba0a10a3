#!/usr/bin/env python3
"""Soak client for `afd serve` (run by scripts/soak.sh; Python standard library only).

Sends a long mix of requests from many threads, each on a fresh connection or a kept-alive
one: plain completions, streamed completions read to the end, streams the client drops after
the first chunk or a few (disconnects), n > 1, several prompts at once, chat (streamed or not),
and a few malformed requests. Every interval it prints the server's resident memory (VmRSS),
its open file descriptors, the KV-cache use and requests running or waiting (from /metrics),
and the answers so far by outcome. At the end it waits for the server to go idle and prints
the same figures once more, then a summary line per figure.

A request fails the soak when its answer is not what its kind expects: 200 with the right
shape (a stream ending in `data: [DONE]`), or 4xx with the OpenAI error envelope for the
malformed ones. 429 (queue full) is counted apart.
"""

import argparse
import http.client
import json
import os
import random
import socket
import threading
import time
from collections import Counter

PROMPTS = [
    "It is a truth universally acknowledged, that",
    "Mr. Darcy",
    "She was",
    "The weather",
    "Elizabeth could not",
    "My dear",
    "In the morning",
    "Lady Catherine",
]


def proc_figures(pid):
    """Resident memory (MiB) and open file descriptors of process `pid`."""
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def metrics(host, port):
    """KV-cache use (fraction), running and waiting requests, from /metrics."""
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    found = {}
    for line in text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                     "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return (found.get("vllm:kv_cache_usage_perc", 0.0),
            int(found.get("vllm:num_requests_running", 0)),
            int(found.get("vllm:num_requests_waiting", 0)))


def raw_request(host, port, path, body, content_type="application/json"):
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    s = socket.create_connection((host, port), timeout=120)
    s.sendall(head + payload)
    return s


def read_all(s):
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    return out


def status_of(raw):
    try:
        return int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def is_envelope(raw, status):
    body = raw.split(b"\r\n\r\n", 1)[-1]
    start = body.find(b"{")
    try:
        e = json.loads(body[start:body.rfind(b"}") + 1])["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return e.get("code") == status and isinstance(e.get("message"), str) and "type" in e


def one_request(host, port, rng, keep):
    """Sends one request of a random kind; returns (kind, outcome)."""
    roll = rng.random()
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(1, 16)
    if roll < 0.30:
        kind = "completion"
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        return kind, json_call(keep, host, port, "/v1/completions", body, choices=1)
    if roll < 0.45:
        kind = "stream"
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        raw = read_all(raw_request(host, port, "/v1/completions", body))
        return kind, stream_outcome(raw)
    if roll < 0.60:
        kind = "disconnect"
        body = {"prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
        s = raw_request(host, port, "/v1/completions", body)
        wanted = rng.randint(1, 4)
        got = b""
        while got.count(b"data: ") < wanted:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        s.close()
        status = status_of(got)
        return kind, "ok" if status == 200 else str(status)
    if roll < 0.70:
        kind = "n>1"
        n = rng.randint(2, 4)
        body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": 1.0}
        return kind, json_call(keep, host, port, "/v1/completions", body, choices=n)
    if roll < 0.75:
        kind = "prompts"
        k = rng.randint(2, 6)
        body = {"prompt": rng.sample(PROMPTS, k), "max_tokens": max_tokens}
        return kind, json_call(keep, host, port, "/v1/completions", body, choices=k)
    if roll < 0.95:
        kind = "chat"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        if rng.random() < 0.5:
            body["stream"] = True
            raw = read_all(raw_request(host, port, "/v1/chat/completions", body))
            return kind, stream_outcome(raw)
        return kind, json_call(keep, host, port, "/v1/chat/completions", body, choices=1)
    kind = "malformed"
    bad = rng.choice([
        (b'{"prompt": "a", "max_tokens": "many"}', "application/json"),
        (b'{"prompt": "a", "temperature": -1}', "application/json"),
        (b'{"prompt": ', "application/json"),
        (b'{"prompt": "a"}', "text/plain"),
        (b'\xff\xfe', "application/json"),
    ])
    raw = read_all(raw_request(host, port, "/v1/completions", bad[0], bad[1]))
    status = status_of(raw)
    ok = 400 <= status < 500 and is_envelope(raw, status)
    return kind, "ok" if ok else f"bad {status}"


def stream_outcome(raw):
    status = status_of(raw)
    if status != 200:
        return str(status)
    return "ok" if b"data: [DONE]" in raw and b'"error"' not in raw else "broken stream"


def json_call(keep, host, port, path, body, choices):
    """A non-streamed call on this thread's kept-alive connection (reopened when closed)."""
    for attempt in range(2):
        if keep.get("c") is None:
            keep["c"] = http.client.HTTPConnection(host, port, timeout=120)
        c = keep["c"]
        try:
            c.request("POST", path, body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
        except (http.client.HTTPException, OSError):
            # The server closed a kept-alive connection (idle timeout): once more, fresh.
            c.close()
            keep["c"] = None
            if attempt == 1:
                return "connection error"
            continue
        if r.status != 200:
            return str(r.status)
        v = json.loads(data)
        return "ok" if len(v.get("choices", [])) == choices else "wrong choices"
    return "connection error"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pid", type=int, required=True, help="the server's process id")
    p.add_argument("--requests", type=int, default=30000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    lock = threading.Lock()
    outcomes = Counter()
    sent = [0]
    done = [0]

    def worker(index):
        rng = random.Random(args.seed * 1000 + index)
        keep = {}
        while True:
            with lock:
                if sent[0] >= args.requests:
                    return
                sent[0] += 1
            try:
                kind, outcome = one_request(args.host, args.port, rng, keep)
            except OSError as e:
                kind, outcome = "any", f"socket error {type(e).__name__}"
            with lock:
                outcomes[(kind, outcome)] += 1
                done[0] += 1

    started = time.time()
    samples = []

    def sample(label):
        rss, fds = proc_figures(args.pid)
        kv, running, waiting = metrics(args.host, args.port)
        elapsed = time.time() - started
        with lock:
            n = done[0]
            failed = sum(v for (k, o), v in outcomes.items() if o != "ok" and o != "429")
            busy = sum(v for (k, o), v in outcomes.items() if o == "429")
        samples.append((rss, fds))
        print(f"{label:>7} {elapsed:8.0f} {n:9d} {n / max(elapsed, 1e-9):7.1f} {failed:6d} "
              f"{busy:5d} {rss:8.1f} {fds:6d} {kv * 100:6.2f} {running:4d} {waiting:4d}",
              flush=True)

    print(f"{'':>7} {'s':>8} {'requests':>9} {'req/s':>7} {'failed':>6} {'429':>5} "
          f"{'RSS MiB':>8} {'fds':>6} {'KV %':>6} {'run':>4} {'wait':>4}", flush=True)
    sample("start")
    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(args.concurrency)]
    for t in threads:
        t.start()
    next_sample = time.time() + args.interval
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.time() >= next_sample:
            sample("running")
            next_sample += args.interval
    sample("done")
    # Disconnected streams are aborted at the next step; kept-alive connections close after
    # the server's idle timeout (10 s).
    time.sleep(15)
    sample("idle")

    print("\noutcomes (kind, outcome): count")
    for (kind, outcome), count in sorted(outcomes.items()):
        print(f"  {kind:>10} {outcome:>16}: {count}")
    rss = [s[0] for s in samples]
    fds = [s[1] for s in samples]
    failed = sum(v for (k, o), v in outcomes.items() if o != "ok" and o != "429")
    print(f"\nrequests {done[0]} in {time.time() - started:.0f} s, failed {failed}")
    print(f"RSS MiB: start {rss[0]:.1f}, max {max(rss):.1f}, end of load {rss[-2]:.1f}, "
          f"idle {rss[-1]:.1f}")
    print(f"open fds: start {fds[0]}, max {max(fds)}, end of load {fds[-2]}, idle {fds[-1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
