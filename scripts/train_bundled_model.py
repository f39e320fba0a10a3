#!/usr/bin/env python3
"""Trains the small GPT-OSS-architecture model that ships with afd (models/afd-tiny-gpt-oss), which `afd serve`
serves when no --model is given.

Input: the folder written by scripts/prepare_bundled_data.py (train.bin, val.bin: uint16 token ids; meta.json;
tokenizer/). The training itself needs only torch + transformers (+ safetensors), not the raw corpus.

    # on this CPU (2 cores), about 45 minutes:
    nice -n 10 /work/venv-hf/bin/python scripts/train_bundled_model.py --data /work/data-bundled/prepared \
        --out models/afd-tiny-gpt-oss --device cpu --max-minutes 45
    # a GPU machine without internet or transformers: make the carry folder here (wheels for Python 3.12, the
    # prepared data, run_on_gpu.sh), take it along, and run `bash .gpu-carry/run_on_gpu.sh` there:
    /work/venv-hf/bin/python scripts/train_bundled_model.py --make-gpu-carry .gpu-carry

The model is transformers' GptOssForCausalLM: alternating sliding/full attention with sinks, YaRN RoPE, an MoE of
8 experts (top 2) with GPT-OSS's clamped SwiGLU, untied LM head. The loop is plain PyTorch: AdamW, linear warm-up
then cosine decay (over --steps or --max-minutes, whichever ends first), gradient clipping, a seeded data order, the
router load-balancing loss, and the checkpoint with the best validation loss is the one saved, in bf16, as
transformers 5 `save_pretrained` writes it, with the tokenizer and a README.md model card (data, license, command,
loss curve, sample outputs made by reloading the saved folder).
"""

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys
import time

import numpy as np
import torch

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
PROMPTS = ["Once upon a time", "The old man said", "It is a truth universally acknowledged", "Elizabeth"]
CHAT = [{"role": "user", "content": "What do you think of Mr. Darcy?"}]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/work/data-bundled/prepared", help="folder from prepare_bundled_data.py")
    ap.add_argument("--out", default="models/afd-tiny-gpt-oss", help="checkpoint folder to write")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-minutes", type=float, default=45.0, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", type=int, default=100000, help="optimizer steps at most (the schedule's length)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    ap.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    ap.add_argument("--aux-coef", type=float, default=0.01, help="weight of the router load-balancing loss")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between validation passes")
    ap.add_argument("--eval-seqs", type=int, default=48, help="validation sequences of --seq-len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                    help="bf16 autocast for the forward pass (auto: on for cuda, off for cpu)")
    ap.add_argument("--experts-impl", default="auto", choices=["auto", "grouped_mm", "batched_mm", "eager"],
                    help="transformers experts implementation for training (auto: first that works)")
    # model shape
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=224, help="per-expert intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--sliding-window", type=int, default=64)
    ap.add_argument("--max-mb", type=float, default=25.0, help="refuse shapes whose bf16 weights exceed this")
    ap.add_argument("--init-from", metavar="DIR",
                    help="start from this saved checkpoint (its shape; the shape flags are ignored) and continue its "
                         "training log, with a fresh optimizer and schedule")
    ap.add_argument("--card-only", action="store_true",
                    help="no training: remake the samples and README.md of the checkpoint in --out from its "
                         "training_log.json")
    ap.add_argument("--make-gpu-carry", metavar="DIR",
                    help="instead of training: write DIR with wheels (Python 3.12), the --data files, run_on_gpu.sh")
    return ap.parse_args()


def make_config(args, meta):
    from transformers import GptOssConfig

    sp = meta["specials"]
    for name, value in [("hidden", args.hidden), ("intermediate", args.intermediate)]:
        if value % 32:
            sys.exit(f"--{name} {value} is not a multiple of 32 (MXFP4 blocks are 32 wide)")
    return GptOssConfig(
        vocab_size=meta["vocab_size"], hidden_size=args.hidden, intermediate_size=args.intermediate,
        head_dim=args.head_dim, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        sliding_window=args.sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
        # as the real model: YaRN factor 32 over 4096 (131072 positions avoids transformers' YaRN warning); this
        # model was trained on --seq-len tokens only, see the model card
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        tie_word_embeddings=False, router_aux_loss_coef=args.aux_coef, output_router_logits=False,
        bos_token_id=sp["<|startoftext|>"], eos_token_id=sp["<|return|>"], pad_token_id=sp["<|endoftext|>"],
    )


def batches(data, batch, seq_len, gen):
    """Random windows of seq_len + 1 tokens (inputs and shifted targets), drawn with a seeded generator."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    rows = np.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def lm_loss(model, x, y, autocast, aux_coef):
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=x, output_router_logits=aux_coef > 0, use_cache=False)
    ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    aux = out.aux_loss if aux_coef > 0 and out.aux_loss is not None else torch.zeros((), device=x.device)
    return ce, aux


@torch.no_grad()
def evaluate(model, val, seq_len, n, device, autocast):
    model.eval()
    total, count = 0.0, 0
    for i in range(0, min(n, (len(val) - 1) // seq_len), 8):
        rows = [val[j * seq_len:j * seq_len + seq_len + 1] for j in range(i, min(i + 8, n, (len(val) - 1) // seq_len))]
        t = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        ce, _ = lm_loss(model, t[:, :-1], t[:, 1:], autocast, 0.0)
        total += ce.item() * len(rows)
        count += len(rows)
    model.train()
    return total / max(count, 1)


def pick_experts_impl(model, args, train, device, autocast):
    """The first experts implementation whose forward+backward runs on this device (on CUDA grouped_mm is the
    fastest where supported; eager always works)."""
    if args.experts_impl != "auto":
        choices = [args.experts_impl]
    elif device.type == "cuda":
        choices = ["grouped_mm", "batched_mm", "eager"]
    else:  # on the CPU, eager measured 1.6x faster than grouped_mm for training (torch 2.15)
        choices = ["eager"]
    gen = torch.Generator().manual_seed(12345)
    for impl in choices:
        try:
            model.set_experts_implementation(impl)
            x, y = batches(train, 2, 32, gen)
            ce, aux = lm_loss(model, x.to(device), y.to(device), autocast, args.aux_coef)
            (ce + args.aux_coef * aux).backward()
            model.zero_grad(set_to_none=True)
            return impl
        except Exception as e:  # noqa: BLE001 - any failure means: try the next implementation
            print(f"experts implementation {impl} failed here ({type(e).__name__}: {str(e)[:200]})", flush=True)
            model.zero_grad(set_to_none=True)
    sys.exit("no experts implementation works on this device")


def lr_at(args, step, elapsed):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = max((step - args.warmup) / max(args.steps - args.warmup, 1), elapsed / (args.max_minutes * 60))
    progress = min(progress, 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def train(args, meta, config, device):
    from transformers import GptOssForCausalLM

    torch.manual_seed(args.seed)
    train_ids = np.fromfile(os.path.join(args.data, "train.bin"), dtype="<u2")
    val_ids = np.fromfile(os.path.join(args.data, "val.bin"), dtype="<u2")
    autocast = args.bf16 == "on" or (args.bf16 == "auto" and device.type == "cuda")
    previous = []
    if args.init_from:
        model = GptOssForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        config = model.config
        config.router_aux_loss_coef = args.aux_coef
        with open(os.path.join(args.init_from, "training_log.json")) as f:
            previous = json.load(f)["runs"]
    else:
        model = GptOssForCausalLM(config)
    model.set_attn_implementation("eager")  # sinks need the eager (or a sink-aware) attention
    n_params = sum(p.numel() for p in model.parameters())
    mb = n_params * 2 / 1e6
    if mb > args.max_mb:
        sys.exit(f"{n_params} parameters = {mb:.1f} MB in bf16, over --max-mb {args.max_mb}: shrink the model")
    model.to(device).train()
    impl = pick_experts_impl(model, args, train_ids, device, autocast)
    print(f"{n_params:,} parameters ({mb:.1f} MB bf16), experts={impl}, bf16 autocast={autocast}, "
          f"{len(train_ids):,} train / {len(val_ids):,} val tokens", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    log, best = [], {"val": float("inf"), "step": 0, "state": None}
    window_ce, window_aux, window_n = 0.0, 0.0, 0
    start = time.time()
    step = 0
    val = evaluate(model, val_ids, args.seq_len, args.eval_seqs, device, autocast)
    log.append({"step": 0, "tokens": 0, "train": None, "val": round(val, 4), "minutes": 0.0})
    print(f"step 0 val {val:.3f}", flush=True)
    while step < args.steps:
        elapsed = time.time() - start
        if elapsed > args.max_minutes * 60:
            break
        lr = lr_at(args, step, elapsed)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batches(train_ids, args.batch_size, args.seq_len, gen)
        ce, aux = lm_loss(model, x.to(device, non_blocking=True), y.to(device, non_blocking=True), autocast,
                          args.aux_coef)
        (ce + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        window_ce += ce.item()
        window_aux += aux.item()
        window_n += 1
        last = step >= args.steps or time.time() - start > args.max_minutes * 60
        if step % args.eval_every == 0 or last:
            val = evaluate(model, val_ids, args.seq_len, args.eval_seqs, device, autocast)
            minutes = (time.time() - start) / 60
            entry = {"step": step, "tokens": step * args.batch_size * args.seq_len,
                     "train": round(window_ce / window_n, 4), "val": round(val, 4), "minutes": round(minutes, 2),
                     "lr": float(f"{lr:.3g}"), "aux": round(window_aux / window_n, 4)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            window_ce, window_aux, window_n = 0.0, 0.0, 0
            if val < best["val"]:
                best = {"val": val, "step": step, "state": {k: v.detach().to("cpu", copy=True)
                                                            for k, v in model.state_dict().items()}}
    minutes = (time.time() - start) / 60
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    summary = {"steps": step, "tokens": step * args.batch_size * args.seq_len, "minutes": round(minutes, 2),
               "best_step": best["step"], "best_val": round(best["val"], 4), "experts_impl": impl,
               "parameters": n_params, "bf16_autocast": autocast, "epochs": round(
                   step * args.batch_size * args.seq_len / len(train_ids), 2)}
    summary["device"] = device_name(device)
    summary["torch"] = torch.__version__
    summary["args"] = {k: v for k, v in vars(args).items() if k not in ("make_gpu_carry",)}
    summary["command"] = " ".join(["python scripts/train_bundled_model.py"] + sys.argv[1:])
    runs = previous + [{"summary": summary, "log": log}]
    return model.to("cpu").float(), config, runs


def stop_ids(meta):
    """<|return|> ends an answer, <|endoftext|> a document; <|end|> too, because in training the earlier answers of
    two-turn chats end with it (harmony's history form) and the model sometimes closes its answer that way."""
    return [meta["specials"][t] for t in ("<|return|>", "<|endoftext|>", "<|end|>")]


def save(model, args, meta, out, runs):
    from transformers import GenerationConfig

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # a fresh folder, but keep nothing stale from an older run
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.config.output_router_logits = False
    bf16.generation_config = GenerationConfig(
        bos_token_id=meta["specials"]["<|startoftext|>"], pad_token_id=meta["specials"]["<|endoftext|>"],
        eos_token_id=stop_ids(meta))
    bf16.save_pretrained(out)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    with open(os.path.join(out, "training_log.json"), "w") as f:
        json.dump({"runs": runs}, f, indent=1)
        f.write("\n")
    for name in TOKENIZER_FILES:
        src = os.path.join(args.data, "tokenizer", name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out, name))


@torch.no_grad()
def samples(out):
    """Generations from the saved folder as reloaded by transformers (f32): greedy and seeded sampling."""
    from transformers import AutoTokenizer, GptOssForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    model = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    results = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        greedy = model.generate(ids, max_new_tokens=60, do_sample=False)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=60, do_sample=True, temperature=0.8, top_p=0.95)
        results.append({"prompt": prompt, "greedy": tok.decode(greedy[0, ids.shape[1]:]),
                        "sampled": tok.decode(sampled[0, ids.shape[1]:]),
                        "greedy_ids": greedy[0, ids.shape[1]:].tolist()})
    try:
        rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    except ImportError as e:  # jinja2 missing: the checkpoint is saved already, only this sample is lost
        print(f"no chat sample: {e}", flush=True)
        return results
    ids = tok(rendered, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(0)
    chat = model.generate(ids, max_new_tokens=120, do_sample=True, temperature=0.7, top_p=0.95)
    results.append({"prompt": rendered, "chat": tok.decode(chat[0, ids.shape[1]:], skip_special_tokens=False)})
    return results


def model_card(out, meta, config, runs, sample_list):
    src = meta["source"]
    summary = runs[-1]["summary"]
    seq_len = max(run["summary"]["args"]["seq_len"] for run in runs)
    lines = [
        "# afd-tiny-gpt-oss",
        "",
        "The small model that ships with afd: `afd serve` with no `--model` serves this folder. It has GPT-OSS's",
        "architecture (`GptOssForCausalLM`, model_type `gpt_oss`) at a tiny size, trained from scratch on Jane",
        "Austen's novels, so it answers in readable (if rambling, Regency-flavoured) English. It knows nothing and",
        "follows no instructions: it continues text, and in chat it answers with a paragraph in the same style.",
        "",
        "## Data",
        "",
        f"- Package: Debian `{src['package']}` (`{src['deb']}`, sha256 `{src['sha256'][:16]}...`), from",
        f"  {src['upstream']}; files `{src['files'][0]}` and `Rdata.rdx` (R's lazy-load database).",
        f"- License: {src['license']}.",
        f"- Novels: {', '.join(src['novels'])}: {meta['chapters']} chapters, {meta['words']:,} words,",
        f"  {meta['characters']:,} characters after cleaning (hard wraps joined, `_emphasis_` marks dropped,",
        "  chapter headings dropped). Each chapter is one document, followed by `<|endoftext|>`.",
        f"- {meta['chat_samples']} harmony chat samples ({meta['chat_tokens']:,} tokens) made of consecutive paragraphs",
        "  (user: one paragraph, assistant: the next, ending in `<|return|>`; some with a system message, some",
        "  with two turns) teach the chat format and when to stop.",
        f"- Tokens: {meta['train_tokens']:,} train, {meta['val_tokens']:,} validation ({meta['val_chapters']} held-out"
        " chapters, every 40th).",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (GPT-2 split regex), {meta['vocab_size']} tokens trained on this text with the `tokenizers`",
        "library, the last 9 being GPT-OSS's harmony specials: " +
        ", ".join(f"`{k}` {v}" for k, v in meta["specials"].items()) + ".",
        "Chat template (`chat_template.jinja`): `<|start|>{role}<|message|>{content}<|end|>` per message, then",
        "`<|start|>assistant<|message|>` for the generation prompt. Stop ids (generation_config.json):",
        f"`<|return|>` {meta['specials']['<|return|>']}, `<|endoftext|>` {meta['specials']['<|endoftext|>']} and"
        f" `<|end|>` {meta['specials']['<|end|>']} (the model sometimes closes an answer with `<|end|>`, the form",
        "earlier answers take in its two-turn training chats).",
        "",
        "## Model",
        "",
        f"- {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} query heads x"
        f" head_dim {config.head_dim}, {config.num_key_value_heads} KV heads, sinks, attention biases.",
        f"- Layers alternate sliding (window {config.sliding_window}, even layers) and full attention.",
        "- RoPE YaRN as GPT-OSS (theta 150000, factor 32, original 4096, beta 32/1, not truncated);"
        " `max_position_embeddings` 131072 as the real model, but trained on sequences of "
        f"{seq_len} tokens: quality drops past that.",
        f"- MoE: {config.num_local_experts} experts, top {config.num_experts_per_tok}, expert intermediate"
        f" {config.intermediate_size}, router with bias, clamped SwiGLU (alpha 1.702, limit 7).",
        f"- Untied LM head, vocab {config.vocab_size}. {summary['parameters']:,} parameters, stored in bf16"
        f" ({os.path.getsize(os.path.join(out, 'model.safetensors')) / 1e6:.1f} MB). Hidden and intermediate sizes"
        " are multiples of 32, so `afd compile --format mxfp4` applies.",
        "",
        "## Training",
        "",
        "Data and tokenizer: `python scripts/prepare_bundled_data.py --data-dir /work/data-bundled` (runs `apt-get",
        "download r-cran-janeaustenr` there when the .deb is missing). The weights saved are those with the best",
        "validation loss of the last run. Plain PyTorch loop: AdamW (betas 0.9/0.95), linear warm-up then cosine",
        "decay over --steps or --max-minutes (whichever ends first), gradient-norm clipping, the router",
        "load-balancing loss, seeded init and data order.",
    ]
    if any(run["summary"]["device"].startswith("CPU") for run in runs):
        lines[-1] += (" Minutes are wall-clock: the CPU runs shared the machine's 2 cores with other work (at"
                      " `nice -n 10`), hence the uneven pace.")
    for n, run in enumerate(runs, 1):
        summary, log, a = run["summary"], run["log"], run["summary"]["args"]
        lines += [
            "",
            f"### Run {n}" + (" (continues run %d)" % (n - 1) if n > 1 else ""),
            "",
            "```",
            summary["command"],
            "```",
            "",
            f"Device: {summary['device']}; torch {summary['torch']}. Peak lr {a['lr']}, {a['warmup']} warm-up steps,"
            f" cosine to {a['min_lr_ratio']}x, weight decay {a['weight_decay']}, clip {a['clip']}, batch"
            f" {a['batch_size']} x {a['seq_len']} tokens, load-balancing loss x {a['aux_coef']}, seed {a['seed']},"
            f" bf16 autocast {'on' if summary['bf16_autocast'] else 'off'}, experts implementation"
            f" `{summary['experts_impl']}`. Ran {summary['steps']} steps ({summary['tokens']:,} tokens,"
            f" {summary['epochs']} epochs) in {summary['minutes']} minutes; best validation loss"
            f" {summary['best_val']} nats/token at step {summary['best_step']}.",
            "",
            "| step | tokens | minutes | lr | train loss | val loss |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        stride = max(1, (len(log) - 1) // 16)
        shown = [e for i, e in enumerate(log) if i % stride == 0 or i == len(log) - 1]
        for e in shown:
            lines.append(f"| {e['step']} | {e['tokens']:,} | {e['minutes']} | {e.get('lr', '')} |"
                         f" {e['train'] if e['train'] is not None else ''} | {e['val']} |")
    lines += ["", "## Sample outputs", "",
              "Made by reloading this folder with `GptOssForCausalLM.from_pretrained(dtype=torch.float32)`;",
              "60 new tokens; sampled with temperature 0.8, top-p 0.95, `torch.manual_seed(0)`. Greedy decoding of a",
              "model this small falls into loops; sampled text reads better.", ""]
    for s in sample_list:
        if "chat" in s:
            lines += ["Chat (temperature 0.7, top-p 0.95), prompt rendered by the chat template:", "",
                      "```", s["prompt"], "```", "", "Answer:", "", "```", s["chat"], "```", ""]
        else:
            lines += [f"**{s['prompt']}** (greedy):", "", "```", s["prompt"] + s["greedy"], "```", "",
                      f"**{s['prompt']}** (sampled):", "", "```", s["prompt"] + s["sampled"], "```", ""]
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


RUN_ON_GPU = r"""#!/usr/bin/env bash
# Trains models/afd-tiny-gpt-oss on a machine with an NVIDIA GPU, torch installed, no internet, no transformers and
# no package index. Made by `python scripts/train_bundled_model.py --make-gpu-carry .gpu-carry`.
# Run from the repository root: bash .gpu-carry/run_on_gpu.sh   -> $OUT/afd-tiny-gpt-oss (then copy it to models/)
# Environment: PYTHON (python3), OUT (/tmp/afd-out), DEVICE (cuda), MAX_MINUTES (6), SKIP_INSTALL=1 to use the
# packages the interpreter already has. Extra arguments go to train_bundled_model.py (later ones win).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/afd-out}"
DEVICE="${DEVICE:-cuda}"
MAX_MINUTES="${MAX_MINUTES:-6}"
SCRIPT="$ROOT/scripts/train_bundled_model.py"
[ -f "$SCRIPT" ] || SCRIPT="$HERE/train_bundled_model.py"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  DEPS=/tmp/pydeps
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --find-links "$HERE/wheels" --target "$DEPS" \
      transformers==@TRANSFORMERS@ tokenizers==@TOKENIZERS@ safetensors==@SAFETENSORS@ jinja2
  else  # no pip: a wheel is a zip of what gets installed
    mkdir -p "$DEPS"
    "$PY" -c 'import sys, zipfile, glob; [zipfile.ZipFile(w).extractall(sys.argv[2]) for w in glob.glob(sys.argv[1] + "/*.whl")]' "$HERE/wheels" "$DEPS"
  fi
  export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi
time "$PY" "$SCRIPT" --data "$HERE/data" --out "$OUT/afd-tiny-gpt-oss" --device "$DEVICE" \
  --max-minutes "$MAX_MINUTES" --steps 2000 --batch-size 32 --seq-len 512 --eval-every 50 --eval-seqs 48 "$@"
ls -la "$OUT/afd-tiny-gpt-oss"
"""


def make_gpu_carry(args):
    """The folder a GPU machine without internet needs: wheels for Python 3.12 (no torch), the prepared data,
    a copy of this script, run_on_gpu.sh."""
    import subprocess

    import safetensors
    import tokenizers
    import transformers

    carry = args.make_gpu_carry
    os.makedirs(os.path.join(carry, "wheels"), exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--python-version", "3.12",
                    "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "--platform", "any",
                    "-d", os.path.join(carry, "wheels"), f"transformers=={transformers.__version__}",
                    f"tokenizers=={tokenizers.__version__}", f"safetensors=={safetensors.__version__}",
                    "jinja2"], check=True)  # jinja2: chat templates (torch usually brings it, but not always)
    data = os.path.join(carry, "data")
    if os.path.exists(data):
        shutil.rmtree(data)
    os.makedirs(data)
    for name in ["train.bin", "val.bin", "meta.json"]:
        shutil.copy(os.path.join(args.data, name), data)
    shutil.copytree(os.path.join(args.data, "tokenizer"), os.path.join(data, "tokenizer"))
    shutil.copy(os.path.abspath(__file__), os.path.join(carry, "train_bundled_model.py"))
    script = (RUN_ON_GPU.replace("@TRANSFORMERS@", transformers.__version__)
              .replace("@TOKENIZERS@", tokenizers.__version__).replace("@SAFETENSORS@", safetensors.__version__))
    path = os.path.join(carry, "run_on_gpu.sh")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(carry) for n in names)
    print(f"{carry}: {size / 1e6:.1f} MB")


def main():
    args = parse_args()
    if args.make_gpu_carry:
        make_gpu_carry(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    if args.card_only:
        from transformers import GptOssConfig

        config = GptOssConfig.from_pretrained(args.out)
        with open(os.path.join(args.out, "training_log.json")) as f:
            runs = json.load(f)["runs"]
    else:
        config = make_config(args, meta)
        model, config, runs = train(args, meta, config, device)
        save(model, args, meta, args.out, runs)
    sample_list = samples(args.out)
    model_card(args.out, meta, config, runs, sample_list)
    print(json.dumps({"summary": runs[-1]["summary"], "samples": sample_list}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
