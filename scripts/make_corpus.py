#!/usr/bin/env python3
"""Builds assets/corpus/: a small English prose corpus as JSON Lines (one {"text": ...} per line),
compressed with zstd. Only Debian packages are used as sources, fetched with `apt-get download`
(no installation); the pinned versions below are the ones recorded in assets/corpus/README.md.

Sources (English prose only: paragraphs, no code blocks, tables, navigation or indexes):
  - debian-handbook  The Debian Administrator's Handbook, en-US HTML (GPL-2.0+ or CC-BY-SA-3.0)
  - python3.11-doc   The Python 3.11 documentation HTML (PSF License Agreement)

A document is one section of a page (the text between two headings of level 1-3), its paragraphs
joined by blank lines; sections shorter than MIN_CHARS are merged into the next one of the same page.
Documents are shuffled with a fixed seed so that any prefix mixes both sources.

Usage: scripts/make_corpus.py [--out assets/corpus] [--work /tmp/titan_corpus]
Needs: apt-get (after `apt-get update`), dpkg-deb, zstd.
"""
import argparse
import glob
import hashlib
import html.parser
import json
import os
import random
import re
import subprocess

PACKAGES = {
    "debian-handbook": "11.20220922",
    "python3.11-doc": "3.11.2-6+deb12u9",
}
MIN_CHARS = 400
SEED = 1234
# Python documentation folders holding prose (the C API and the generated indexes are left out).
PY_DIRS = ["tutorial", "howto", "faq", "reference", "library", "using", "extending", "whatsnew", "installing"]


class ProseExtractor(html.parser.HTMLParser):
    """Collects (heading | paragraph) events from one HTML page.

    Paragraphs are <p> elements (Sphinx) and <div class="para"> elements (Publican/DocBook). Text
    inside <pre>, tables, scripts, navigation and sidebars is dropped."""

    SKIP_TAGS = {"pre", "table", "script", "style", "nav", "head"}
    SKIP_CLASSES = {"sphinxsidebar", "related", "footer", "highlight", "navfooter", "navheader", "toc",
                    "sidebar", "informalexample", "programlisting", "screen", "docs", "footnotes"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []  # (tag, skip, kind) for each open element
        self.events = []  # ("h", text) | ("p", text)
        self.buf = None
        self.buf_kind = None
        self.buf_depth = 0

    def _skipping(self):
        return any(s for _, s, _ in self.stack)

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "meta", "link", "input", "wbr"):
            return
        classes = set((dict(attrs).get("class") or "").split())
        skip = tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)
        kind = None
        if not self._skipping() and not skip and self.buf is None:
            if tag == "p" or (tag == "div" and "para" in classes):
                kind = "p"
            elif tag in ("h1", "h2", "h3"):
                kind = "h"
        self.stack.append((tag, skip, kind))
        if kind:
            self.buf, self.buf_kind, self.buf_depth = [], kind, len(self.stack)

    def handle_endtag(self, tag):
        # Pop to the matching element (HTML in the wild is not always well nested).
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                if self.buf is not None and i + 1 <= self.buf_depth:
                    text = " ".join("".join(self.buf).split())
                    text = text.replace("¶", "").strip()
                    if text:
                        self.events.append((self.buf_kind, text))
                    self.buf = None
                del self.stack[i:]
                return

    def handle_data(self, data):
        if self.buf is not None and not self._skipping():
            self.buf.append(data)


def page_documents(path):
    parser = ProseExtractor()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    docs, current = [], []
    for kind, text in parser.events:
        if kind == "h":
            if sum(len(p) for p in current) >= MIN_CHARS:
                docs.append("\n\n".join(current))
                current = []
            continue
        if len(text) >= 40 and re.search(r"[a-z]{3,} [a-z]{2,}", text):  # prose, not a label
            current.append(text)
    if sum(len(p) for p in current) >= MIN_CHARS:
        docs.append("\n\n".join(current))
    return docs


def fetch(work):
    os.makedirs(work, exist_ok=True)
    roots = {}
    for name, version in PACKAGES.items():
        debs = glob.glob(os.path.join(work, f"{name}_*.deb"))
        if not debs:
            subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=work, check=True)
            debs = glob.glob(os.path.join(work, f"{name}_*.deb"))
        root = os.path.join(work, name)
        if not os.path.isdir(root):
            subprocess.run(["dpkg-deb", "-x", debs[0], root], check=True)
        with open(debs[0], "rb") as f:
            roots[name] = (root, os.path.basename(debs[0]), hashlib.sha256(f.read()).hexdigest())
    return roots


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "assets", "corpus"))
    ap.add_argument("--work", default="/tmp/titan_corpus")
    args = ap.parse_args()
    roots = fetch(args.work)

    docs = []
    hb = os.path.join(roots["debian-handbook"][0], "usr/share/doc/debian-handbook/html/en-US")
    for path in sorted(glob.glob(os.path.join(hb, "*.html"))):
        docs += [("debian-handbook", d) for d in page_documents(path)]
    n_hb = len(docs)
    py = os.path.join(roots["python3.11-doc"][0], "usr/share/doc/python3.11/html")
    for sub in PY_DIRS:
        for path in sorted(glob.glob(os.path.join(py, sub, "**", "*.html"), recursive=True)):
            docs += [("python3.11-doc", d) for d in page_documents(path)]
    random.Random(SEED).shuffle(docs)

    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for source, text in docs:
            f.write(json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n")
    raw_bytes = os.path.getsize(jsonl)
    subprocess.run(["zstd", "-q", "-f", "-19", "--rm", jsonl, "-o", jsonl + ".zst"], check=True)
    print(f"documents: {len(docs)} (debian-handbook {n_hb}, python3.11-doc {len(docs) - n_hb})")
    print(f"characters: {sum(len(t) for _, t in docs)}; jsonl bytes: {raw_bytes}; "
          f"zst bytes: {os.path.getsize(jsonl + '.zst')}")
    for name, (_, deb, sha) in roots.items():
        print(f"{deb} sha256 {sha}")


if __name__ == "__main__":
    main()
