#!/usr/bin/env python3
"""Prepares the training data and the tokenizer of the model that ships with afd (models/afd-tiny-gpt-oss).

Data: Jane Austen's six completed novels as shipped by the Debian package `r-cran-janeaustenr` (the CRAN package
janeaustenr 1.0.0 by Julia Silge, MIT licensed; the novels themselves are public domain, taken from Project
Gutenberg). The package keeps the texts in R's lazy-load database (data/Rdata.rdb + Rdata.rdx); this script reads it
with a small R-serialization reader of its own, so neither R nor any R-reading library is needed.

Run by hand, never by CI (pinned versions: scripts/requirements-train.txt):

    /work/venv-hf/bin/python scripts/prepare_bundled_data.py --data-dir /work/data-bundled

It runs `apt-get download r-cran-janeaustenr` inside --data-dir when no `r-cran-janeaustenr_*.deb` is there yet
(or takes one given with --deb), then writes into --data-dir/prepared:
  corpus.txt                       the cleaned text, chapters separated by <|endoftext|>
  tokenizer/                       tokenizer.json, tokenizer_config.json, chat_template.jinja (transformers 5 layout)
  train.bin, val.bin               uint16 token ids (little-endian), what train_bundled_model.py reads
  meta.json                        source package, its sha256, counts, special token ids
Deterministic: a rerun gives the same bytes.
"""

import argparse
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import random
import re
import struct
import subprocess
import sys
import tarfile
import zlib

import numpy as np

DEB_PACKAGE = "r-cran-janeaustenr"
RDATA_DIR = "usr/lib/R/site-library/janeaustenr/data/"
NOVELS = {  # object name in the R package -> title
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
# GPT-OSS harmony specials (same order as the fixtures' gpt-oss tokenizer); they get the ids after the learned vocab.
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant<|message|>' -}}{%- endif -%}"
)
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a storyteller.", "Answer in the style of Jane Austen."]


# ------------------------------------------------------------------------------------------------ the package

def fetch_deb(data_dir, deb):
    """The .deb to read: --deb, else one already in data_dir, else `apt-get download` into data_dir."""
    if deb:
        return deb
    found = sorted(glob.glob(os.path.join(data_dir, f"{DEB_PACKAGE}_*.deb")))
    if not found:
        print(f"downloading {DEB_PACKAGE} with apt-get into {data_dir}", file=sys.stderr)
        subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=data_dir, check=True)
        found = sorted(glob.glob(os.path.join(data_dir, f"{DEB_PACKAGE}_*.deb")))
    if not found:
        sys.exit(f"no {DEB_PACKAGE}_*.deb in {data_dir}: run `apt-get update` first, or pass --deb FILE")
    return found[-1]


def read_deb_members(deb_path, wanted):
    """Files under `wanted` (a path prefix) from a .deb: an `ar` archive holding data.tar.{xz,gz}."""
    blob = open(deb_path, "rb").read()
    if not blob.startswith(b"!<arch>\n"):
        sys.exit(f"{deb_path} is not a Debian package (no ar header)")
    pos, out = 8, {}
    while pos < len(blob):
        name = blob[pos:pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48:pos + 58].decode().strip())
        body = blob[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            if name.endswith(".xz"):
                body = lzma.decompress(body)
            elif name.endswith(".gz"):
                body = gzip.decompress(body)
            elif name != "data.tar":
                sys.exit(f"{deb_path}: {name} is compressed in a way this script does not read (xz, gz)")
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                for member in tar.getmembers():
                    path = member.name.lstrip("./")
                    if member.isfile() and path.startswith(wanted):
                        out[path[len(wanted):]] = tar.extractfile(member).read()
    return out


class RReader:
    """Reads R's XDR serialization (format 2 or 3): the few types a lazy-load database of character vectors uses."""

    def __init__(self, data):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int()
        self.int()
        if version == 3:
            n = self.int()
            self.pos += n

    def int(self):
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP
            index = flags >> 8
            return self.refs[(index or self.int()) - 1]
        if kind == 1:  # SYMSXP
            symbol = ("symbol", self.item())
            self.refs.append(symbol)
            return symbol
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8")
            self.pos += n
            return text
        if kind == 2:  # LISTSXP (pairlist): a list of (tag, value)
            items = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item()[1] if has_tag else None
                items.append((tag, self.item()))
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return items
                if kind != 2:
                    raise ValueError(f"pairlist continued by type {kind}")
        if kind in (16, 19):  # STRSXP, VECSXP
            value = [self.item() for _ in range(self.int())]
        elif kind in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"R type {kind} is not supported by this reader")
        if has_attr:
            attrs = dict(self.item())
            if "names" in attrs:
                value = dict(zip(attrs["names"], value))
        return value


def read_novels(files):
    """{object name: list of lines} from the package's data/Rdata.rdx + Rdata.rdb."""
    index = RReader(gzip.decompress(files["Rdata.rdx"])).item()
    rdb = files["Rdata.rdb"]
    novels = {}
    for name, (offset, length) in index["variables"].items():
        entry = rdb[offset:offset + length]
        # each entry: 4-byte big-endian uncompressed length, then a zlib stream (compression type 1)
        novels[name] = RReader(zlib.decompress(entry[4:])).item()
    return novels


# ------------------------------------------------------------------------------------------------ cleaning

HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME|Volume)\s+[IVXLC0-9]+\.?$|^(THE )?END\.?$|^FINIS\.?$")


def chapters_of(lines):
    """Chapters of one novel, each a list of paragraphs (hard-wrapped lines joined, emphasis underscores dropped);
    the title block before the first chapter heading is left out."""
    paragraphs, current = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    chapters, chapter, started = [], [], False
    for paragraph in paragraphs:
        if HEADING.match(paragraph):
            if chapter:
                chapters.append(chapter)
            chapter, started = [], True
            continue
        if not started:
            continue
        paragraph = re.sub(r"_([^_]+)_", r"\1", paragraph).replace("_", "")
        paragraph = re.sub(r"\s+", " ", paragraph).strip()
        if paragraph:
            chapter.append(paragraph)
    if chapter:
        chapters.append(chapter)
    return chapters


def chat_samples(chapters, rng, share):
    """Harmony chat conversations made of consecutive paragraphs: the user says one, the assistant answers with the
    next. Teaches the chat format and to end an answer with <|return|>."""
    samples = []
    for chapter in chapters:
        i = 0
        while i + 1 < len(chapter):
            turns = 1 if rng.random() < 0.7 else 2
            pairs = chapter[i:i + 2 * turns]
            i += 2 * turns
            if len(pairs) < 2 * turns or rng.random() > share:
                continue
            if any(len(p) < 20 or len(p) > 900 for p in pairs):
                continue
            text = ""
            if rng.random() < 0.3:
                text += f"<|start|>system<|message|>{rng.choice(SYSTEM_PROMPTS)}<|end|>"
            for t in range(turns):
                text += f"<|start|>user<|message|>{pairs[2 * t]}<|end|>"
                end = "<|return|>" if t == turns - 1 else "<|end|>"
                text += f"<|start|>assistant<|message|>{pairs[2 * t + 1]}{end}"
            samples.append(text)
    return samples


# ------------------------------------------------------------------------------------------------ tokenizer

def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (GPT-2 regex, like the gpt-oss fixtures) with vocab_size - 9 learned tokens, then the harmony
    specials, so the vocabulary is exactly vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(HARMONY_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(HARMONY_SPECIALS)
    if tok.get_vocab_size() != vocab_size:
        sys.exit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}: too little text?")
    return tok


def save_tokenizer(tok, folder):
    """What transformers 5 save_pretrained writes: tokenizer.json, a minimal tokenizer_config.json and
    chat_template.jinja (like fixtures/gpt-oss-bf16)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, bos_token="<|startoftext|>",
                                   eos_token="<|return|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)


def encode(tok, texts):
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


# ------------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="/work/data-bundled", help="where the .deb is (or is downloaded to)")
    ap.add_argument("--deb", help="a r-cran-janeaustenr .deb to read instead of looking in --data-dir")
    ap.add_argument("--out", help="output folder (default: DATA_DIR/prepared)")
    ap.add_argument("--vocab-size", type=int, default=4096, help="tokenizer size including the 9 harmony specials")
    ap.add_argument("--val-every", type=int, default=40, help="every Nth chapter is held out for validation")
    ap.add_argument("--chat-share", type=float, default=0.3, help="share of paragraph pairs turned into chats")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.data_dir, exist_ok=True)
    out = args.out or os.path.join(args.data_dir, "prepared")
    os.makedirs(out, exist_ok=True)
    deb = fetch_deb(args.data_dir, args.deb)
    deb_sha = hashlib.sha256(open(deb, "rb").read()).hexdigest()
    files = read_deb_members(deb, RDATA_DIR)
    novels = read_novels(files)
    missing = set(NOVELS) - set(novels)
    if missing:
        sys.exit(f"{deb} lacks {sorted(missing)}")

    chapters, sources = [], []
    for name, title in NOVELS.items():
        for chapter in chapters_of(novels[name]):
            chapters.append(chapter)
            sources.append(title)
    val_idx = set(range(args.val_every // 2, len(chapters), args.val_every))
    train_ch = [c for i, c in enumerate(chapters) if i not in val_idx]
    val_ch = [c for i, c in enumerate(chapters) if i in val_idx]

    docs = ["\n\n".join(c) for c in chapters]
    with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write("<|endoftext|>".join(docs))

    tok = train_tokenizer(docs, args.vocab_size)
    save_tokenizer(tok, os.path.join(out, "tokenizer"))
    specials = {t: tok.token_to_id(t) for t in HARMONY_SPECIALS}

    rng = random.Random(args.seed)
    train_texts = ["\n\n".join(c) + "<|endoftext|>" for c in train_ch]
    chats = chat_samples(train_ch, rng, args.chat_share)
    train_texts += chats
    rng.shuffle(train_texts)
    val_texts = ["\n\n".join(c) + "<|endoftext|>" for c in val_ch]
    train_ids, val_ids = encode(tok, train_texts), encode(tok, val_texts)
    train_ids.astype("<u2").tofile(os.path.join(out, "train.bin"))
    val_ids.astype("<u2").tofile(os.path.join(out, "val.bin"))
    chat_tokens = int(sum(len(e.ids) for e in tok.encode_batch(chats, add_special_tokens=False)))

    meta = {
        "source": {
            "registry": "Debian (apt)", "package": DEB_PACKAGE, "deb": os.path.basename(deb), "sha256": deb_sha,
            "files": [RDATA_DIR + "Rdata.rdb", RDATA_DIR + "Rdata.rdx"],
            "upstream": "CRAN janeaustenr 1.0.0 (Julia Silge)",
            "license": "MIT (package, per debian/copyright and DESCRIPTION); the novels are public domain "
                       "(Jane Austen, 1811-1817; texts from Project Gutenberg)",
            "novels": list(NOVELS.values()),
        },
        "chapters": len(chapters), "train_chapters": len(train_ch), "val_chapters": len(val_ch),
        "val_chapter_titles": sorted({sources[i] for i in val_idx}),
        "characters": sum(len(d) for d in docs), "words": sum(len(d.split()) for d in docs),
        "chat_samples": len(chats), "chat_tokens": chat_tokens,
        "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
        "vocab_size": tok.get_vocab_size(), "specials": specials,
        "command": "python scripts/prepare_bundled_data.py " + " ".join(sys.argv[1:]),
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(json.dumps({k: meta[k] for k in meta if k != "source"}, indent=2))


if __name__ == "__main__":
    main()
