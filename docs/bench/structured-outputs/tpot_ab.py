"""TPOT with and without a structured output format, one request at a time, interleaved.

Streams chat completions from a running afd server (greedy, max_tokens N) with and without
`response_format` and reports each side's median time per output token (from the stream's
chunk arrival times, first token excluded) and their ratio, measured side by side in one run.

Usage: python3 tpot_ab.py http://127.0.0.1:8000 [rounds] [max_tokens] > result.json
"""

import json
import statistics
import sys
import time
import urllib.request

base = sys.argv[1].rstrip("/")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "tags"],
}


def run(fmt):
    body = {
        "messages": [{"role": "user", "content": "Describe a city as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if fmt:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    stamps, tokens = [], 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    if tokens < 2 or len(stamps) < 2:
        return None, tokens
    return (stamps[-1] - stamps[0]) / (tokens - 1), tokens


sides = {"free": [], "json_schema": []}
counts = {"free": [], "json_schema": []}
for _ in range(rounds):
    for name, fmt in (("free", False), ("json_schema", True)):
        tpot, n = run(fmt)
        counts[name].append(n)
        if tpot is not None:
            sides[name].append(tpot * 1000)
result = {
    "rounds": rounds,
    "max_tokens": max_tokens,
    "tpot_ms_median": {k: statistics.median(v) for k, v in sides.items() if v},
    "tpot_ms_all": sides,
    "completion_tokens": counts,
}
if sides["free"] and sides["json_schema"]:
    result["ratio_json_to_free"] = statistics.median(sides["json_schema"]) / statistics.median(sides["free"])
print(json.dumps(result, indent=1))
