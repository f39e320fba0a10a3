#!/usr/bin/env python3
"""Fails when a markdown document names, in backticks, a repository path that does not exist.

    python3 scripts/check_doc_paths.py [FILE.md ...]

Without arguments it reads README.md, DESIGN.md, BENCHMARKS.md and every docs/**/*.md.
Python 3 standard library only. Exit status 0 when every path exists, 1 otherwise, with one
line per broken path: `FILE:LINE: PATH`.

The rule, kept simple on purpose:

1. Only inline code spans outside fenced code blocks are read: `like this`.
2. A span is a path candidate when it has no whitespace, and either contains a `/` or ends in
   one of EXTENSIONS. A trailing `#anchor` or `:LINE` is dropped first.
3. Spans that are clearly something else are ignored: URLs (`://`, `www.`), absolute paths and
   URL paths (a leading `/`: `/v1/completions`, `/metrics`, `/tmp/x`), `~/...`, and anything
   with a placeholder or pattern character (`< > * ? { } [ ] $ | ...` and `=`, `,`, `(`).
4. A candidate is checked when its first component is `.` or `..` or an entry of the markdown
   file's own folder (resolved from that folder), or a top-level entry of the repository
   (resolved from the root), or when it is path-shaped: it contains a `/` and ends in `/` or
   one of EXTENSIONS (resolved from the root). Anything else (a bare `config.json`, a MIME type
   such as `application/json`, a gRPC method `Card/Health`) is ignored.
5. A checked path is broken when it does not exist or resolves outside the repository, so a
   shorthand such as `node/compute.rs` must be written out from the repository root.
6. Paths under SKIP (generated output folders, absent from a clean checkout) are not checked.

So a file of another project is named without backticks (or by its URL), and an example of a
path the reader chooses carries a placeholder: `<dir>/config.json`, `<out>/00-config.yaml`.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_FILES = ["README.md", "DESIGN.md", "BENCHMARKS.md"]
DEFAULT_TREES = ["docs"]

EXTENSIONS = (
    ".rs", ".md", ".toml", ".py", ".sh", ".json", ".yaml", ".yml", ".proto", ".cu",
    ".txt", ".svg", ".png", ".csv", ".safetensors",
)

# Generated output: written by builds, benchmarks and scripts, absent from a clean checkout.
SKIP = (
    "target/",          # cargo's build folder (also scripts/gpu_check.sh's default output)
    "bench-results/",   # scripts/bench_suite.sh and other benchmark runs
    ".gpu-carry/",      # release binaries carried to a GPU machine (scripts/gpu_carry.sh)
    ".venv",            # local Python environments
)

PLACEHOLDER = re.compile(r"[<>*?{}\[\]$|=,()]|\.\.\.")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files(args):
    if args:
        return args
    files = [f for f in DEFAULT_FILES if os.path.exists(os.path.join(ROOT, f))]
    for tree in DEFAULT_TREES:
        for folder, dirs, names in os.walk(os.path.join(ROOT, tree)):
            dirs.sort()
            for name in sorted(names):
                if name.endswith(".md"):
                    files.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return files


def candidate(span):
    """The path a code span names, or None when it is not a path candidate."""
    text = span.strip()
    if not text or any(c.isspace() for c in text):
        return None
    if "://" in text or text.startswith(("www.", "/", "~")):
        return None
    text = re.sub(r"#[^/]*$", "", text)
    text = re.sub(r":\d+(-\d+)?$", "", text)
    if not text or PLACEHOLDER.search(text):
        return None
    if "/" not in text and not text.endswith(EXTENSIONS):
        return None
    return text


def resolve(path, md_dir, top_level):
    """The absolute path to check, or None when the candidate is not a repository path."""
    first = path.split("/", 1)[0]
    if first in (".", "..") or os.path.exists(os.path.join(md_dir, first)):
        return os.path.normpath(os.path.join(md_dir, path))
    path_shaped = "/" in path and path.endswith(("/",) + EXTENSIONS)
    if first in top_level or path_shaped:
        return os.path.normpath(os.path.join(ROOT, path))
    return None


def skipped(full):
    rel = os.path.relpath(full, ROOT).replace(os.sep, "/") + "/"
    return rel.startswith(SKIP)


def check(md, top_level):
    broken = []
    md_path = os.path.join(ROOT, md)
    md_dir = os.path.dirname(os.path.abspath(md_path))
    in_fence = False
    with open(md_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            if in_fence:
                continue
            for span in SPAN.findall(line):
                path = candidate(span)
                if path is None:
                    continue
                full = resolve(path, md_dir, top_level)
                if full is None or skipped(full):
                    continue
                inside = full == ROOT or full.startswith(ROOT + os.sep)
                if not inside or not os.path.exists(full):
                    broken.append((md, number, span))
    return broken


def main(argv):
    top_level = {e for e in os.listdir(ROOT) if e != ".git"}
    broken = []
    for md in markdown_files(argv[1:]):
        broken.extend(check(md, top_level))
    for md, number, span in broken:
        print(f"{md}:{number}: {span}")
    if broken:
        print(f"check_doc_paths: {len(broken)} backticked path(s) that do not exist",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
