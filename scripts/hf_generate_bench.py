#!/usr/bin/env python3
"""Hugging Face transformers `generate` on a checkpoint: the peer that afd is compared with.

Offline batched greedy decoding with fixed lengths: for each batch size B, B random prompts of
exactly --input-len token ids, exactly --output-len new tokens each (EOS suppressed with
min_new_tokens). Reports, per batch size, the median over --repeats runs of:

- TTFT: a generate call with max_new_tokens=1 (the prefill of the whole batch plus one step);
- TPOT: (full generate - TTFT) / (output_len - 1), the per-token latency every sequence sees;
- output throughput: B * output_len / full generate time.

Writes one JSON per batch size into --out with afd-loadtest's (vLLM's) field names
(`max_concurrency` = the batch size, `median_tpot_ms`, `median_ttft_ms`, `output_throughput`),
so `afd-loadtest compare hf=OUT` reads them beside served runs, plus `hf_generate.json` with
everything, which is also printed. Not part of CI: it needs torch and transformers
(scripts/requirements-fixtures.txt has suitable versions).

Offline batching is not served load: there is no HTTP, no streaming and no scheduler, and the
whole batch starts together. Compare it with a served run at the same concurrency as a peer's
raw decoding speed on the same CPU, not as a like-for-like server.

    python3 scripts/hf_generate_bench.py --model /path/to/synth --out bench/hf \
        --batch-sizes 1,4,16 --input-len 64 --output-len 32
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (Hugging Face layout)")
    p.add_argument("--out", required=True, help="folder for the JSON files")
    p.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per sequence (>= 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weights and activations dtype (bf16 is what DESIGN.md quotes)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="prompt ids are drawn from [0, vocab-size), as afd-loadtest does")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
    p.add_argument("--label", default="hf-transformers", help="label written to each result")
    p.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active", "as-is"],
                   help="OMP_WAIT_POLICY for torch's OpenMP threads (see below; as-is: the "
                        "environment's)")
    args = p.parse_args()
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (TPOT needs two tokens)")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes takes whole numbers like 1,4,16, not {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes needs at least one batch size >= 1")
    return args


def main():
    args = parse_args()
    # OpenMP's default spin-waiting collapses when other processes share the cores: on a busy
    # 2-core machine transformers dropped from 91 to 4 tok/s at batch 1; passive waiting kept
    # about half of the idle figure. Must be set before torch loads its OpenMP runtime.
    if args.omp_wait_policy != "as-is":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        sys.exit(f"hf_generate_bench: {e}. Install torch and transformers "
                 "(pip install -r scripts/requirements-fixtures.txt) or use a venv that has them")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - started
    vocab = min(args.vocab_size, model.config.vocab_size)
    generator = torch.Generator().manual_seed(args.seed)

    def generate(ids, new_tokens):
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - t0
        produced = out.shape[1] - ids.shape[1]
        if produced != new_tokens:
            sys.exit(f"hf_generate_bench: asked for {new_tokens} new tokens, got {produced}")
        return elapsed

    os.makedirs(args.out, exist_ok=True)
    results = []
    for batch in args.batch_sizes:
        ids = torch.randint(0, vocab, (batch, args.input_len), generator=generator)
        generate(ids, 2)  # warm-up: allocations, kernel selection
        ttfts, fulls = [], []
        for _ in range(args.repeats):
            ttfts.append(generate(ids, 1))
            fulls.append(generate(ids, args.output_len))
        tpots = [(f - t) / (args.output_len - 1) for f, t in zip(fulls, ttfts)]
        throughputs = [batch * args.output_len / f for f in fulls]
        result = {
            "label": args.label,
            "backend": "hf-generate",
            "endpoint_type": "offline",
            "model_id": args.model,
            "max_concurrency": batch,
            "num_prompts": batch,
            "completed": batch,
            "failed": 0,
            "total_input_tokens": batch * args.input_len,
            "total_output_tokens": batch * args.output_len,
            "duration": statistics.median(fulls),
            "output_throughput": statistics.median(throughputs),
            "median_tpot_ms": statistics.median(tpots) * 1000,
            "mean_tpot_ms": statistics.mean(tpots) * 1000,
            "median_ttft_ms": statistics.median(ttfts) * 1000,
            "mean_ttft_ms": statistics.mean(ttfts) * 1000,
            "decode_tokens_per_s": batch / statistics.median(tpots),
            "runs": {"ttft_s": ttfts, "generate_s": fulls},
            "workload": {
                "input_len": args.input_len,
                "output_len": args.output_len,
                "batch_size": batch,
                "greedy": True,
                "repeats": args.repeats,
            },
        }
        path = os.path.join(args.out, f"{args.label}-concurrency{batch}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"hf_generate_bench: batch {batch}: {result['output_throughput']:.1f} output tok/s, "
              f"TPOT {result['median_tpot_ms']:.1f} ms, TTFT {result['median_ttft_ms']:.1f} ms",
              file=sys.stderr)
        results.append(result)

    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_seconds": load_s,
        "results": [
            {k: r[k] for k in ("max_concurrency", "output_throughput", "median_tpot_ms",
                               "median_ttft_ms", "decode_tokens_per_s")}
            for r in results
        ],
    }
    with open(os.path.join(args.out, "hf_generate.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
