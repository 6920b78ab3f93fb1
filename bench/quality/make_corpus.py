"""Builds the language-model study's English corpus, tokenised with GPT-2's BPE, from Debian
packages and a PyPI sdist fetched here (bench/quality/README.md says which and why).

    python3 bench/quality/make_corpus.py            # about 2 minutes on 2 cores; 106 MB of downloads

Writes, under --out (default bench/quality/corpus/gpt2, git-ignored; the device call carries it):
  train.bin.xz, val.bin.xz  the token streams, uint16 little-endian, xz-compressed (the device
                            call's tree travels under 64 MiB, .gpubin included: raw they would not fit)
  meta.json                 token counts, sources (package, version, characters, tokens), digests
  gpt2.tiktoken             GPT-2's BPE ranks (r50k_base), to decode samples
Downloads stay in --cache (default bench/quality/corpus/cache, not carried).

Sources (Debian bookworm, the registry this machine reaches; no Wikipedia, Gutenberg or web-text
dump is packaged there or on PyPI): the literature and reference works (Spurgeon's Treasury of
David, Matthew Henry's Concise Commentary and the World English Bible as SWORD modules, Jane
Austen's six novels from r-cran-janeaustenr, the GCIDE dictionary: Webster 1913 with its
literary quotations), and the largest prose documentation (the Linux kernel's, Python's, Perl's).
GPT-2's BPE ranks come from openai-whisper's sdist (whisper/assets/gpt2.tiktoken, byte-identical
to tiktoken's r50k_base, checked by its SHA-256); tiktoken (PyPI) applies them.

Every source is cut into documents (a file, a book, a chapter), long documents into chunks of about
CHUNK characters at paragraph boundaries; a chunk goes to validation when a hash of its source,
document and index falls under --val-per-mille, so validation is drawn from every source in its
proportion. The training chunks are shuffled (fixed seed) and joined with <|endoftext|>.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import html
import json
import lzma
import os
import random
import re
import struct
import subprocess
import sys
import tarfile
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EOT = 50256
CHUNK = 8000  # characters: long documents are cut at paragraph boundaries into chunks of about this
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # r50k_base.tiktoken
WHISPER = "openai-whisper==20250625"
TIKTOKEN = "tiktoken==0.14.0"
DEBS = ["sword-comm-tdavid", "sword-comm-mhcc", "sword-text-web", "r-cran-janeaustenr", "dict-gcide",
        "linux-doc-6.1", "python3.11-doc", "perl-doc"]


def run(cmd: list[str], cwd: str) -> None:
    print("  $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def fetch(cache: str) -> dict[str, str]:
    """The Debian packages (apt-get download) unpacked under cache/x/<package>, and the BPE file;
    returns the package versions."""
    debs = os.path.join(cache, "debs")
    os.makedirs(debs, exist_ok=True)
    missing = [p for p in DEBS if not glob.glob(os.path.join(debs, p + "_*.deb"))]
    if missing:
        try:
            run(["apt-get", "download", *missing], debs)
        except subprocess.CalledProcessError:
            sys.exit("make_corpus.py: apt-get download failed; run `apt-get update` once and retry")
    versions = {}
    for p in DEBS:
        deb = max(glob.glob(os.path.join(debs, p + "_*.deb")))
        versions[p] = os.path.basename(deb).split("_")[1]
        dest = os.path.join(cache, "x", p)
        if not os.path.isdir(dest):
            os.makedirs(dest + ".tmp", exist_ok=True)
            run(["dpkg-deb", "-x", deb, dest + ".tmp"], cache)
            os.replace(dest + ".tmp", dest)
    pip = os.path.join(cache, "pip")
    if not glob.glob(os.path.join(pip, "openai_whisper-*.tar.gz")):
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", pip, WHISPER], cache)
    bpe = os.path.join(cache, "gpt2.tiktoken")
    if not os.path.exists(bpe):
        with tarfile.open(glob.glob(os.path.join(pip, "openai_whisper-*.tar.gz"))[0]) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            data = tar.extractfile(member).read()
        with open(bpe, "wb") as f:
            f.write(data)
    versions["openai-whisper (gpt2.tiktoken)"] = WHISPER.split("==")[1]
    return versions


def encoder(cache: str):
    """GPT-2's tokenizer from the local ranks (tiktoken installed into the cache if missing)."""
    try:
        import tiktoken
    except ImportError:
        site = os.path.join(cache, "site")
        run([sys.executable, "-m", "pip", "install", "-q", "--target", site, TIKTOKEN], cache)
        sys.path.insert(0, site)
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = load_tiktoken_bpe(os.path.join(cache, "gpt2.tiktoken"), expected_hash=GPT2_SHA256)
    enc = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)
    assert enc.encode("Hello world") == [15496, 995]  # GPT-2's ids
    return enc


# ---- the sources: (document id, text) ---------------------------------------------------------

def sword(root: str):
    """A SWORD zText / zCom module: blocks (book or chapter) of zlib-compressed OSIS, tags dropped."""
    for zs in sorted(glob.glob(os.path.join(root, "usr/share/sword/modules/*/*/*/*.?zs"))):
        with open(zs, "rb") as f, open(zs[:-1] + "z", "rb") as g:
            idx, data = f.read(), g.read()
        for i in range(0, len(idx), 12):
            off, size, _ = struct.unpack("<III", idx[i:i + 12])
            if size:
                osis = zlib.decompress(data[off:off + size]).decode("utf-8", "replace")
                # Verse and note markup goes; a paragraph or line break becomes a line break.
                osis = re.sub(r"<(?:/?p|lb|/?l|/?lg|div[^>]*|/div|title[^>]*)\s*/?>", "\n", osis)
                osis = re.sub(r"<note\b.*?</note>", "", osis, flags=re.DOTALL)
                text = html.unescape(re.sub(r"<[^>]+>", "", osis))
                yield f"{os.path.basename(zs)}:{i // 12}", text


def austen(root: str):
    """janeaustenr's six novels: R's lazy-load database, one serialized character vector (the
    lines of a novel) per zlib stream, read without R."""
    with open(glob.glob(os.path.join(root, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"))[0], "rb") as f:
        rdb = f.read()
    pos, n = 0, 0
    while pos < len(rdb):
        d = zlib.decompressobj()
        raw = d.decompress(rdb[pos + 4:])
        pos = len(rdb) - len(d.unused_data)
        assert raw[:2] == b"X\n", "not an XDR-serialized R object"
        p = 2 + 12
        if int.from_bytes(raw[2:6], "big") == 3:  # format 3 names the native encoding
            p += 4 + int.from_bytes(raw[p:p + 4], "big")
        assert int.from_bytes(raw[p:p + 4], "big") & 0xFF == 16, "not a character vector"
        count = int.from_bytes(raw[p + 4:p + 8], "big")
        p += 8
        lines = []
        for _ in range(count):
            length = int.from_bytes(raw[p + 4:p + 8], "big", signed=True)
            p += 8
            if length > 0:
                lines.append(raw[p:p + length].decode("utf-8", "replace"))
                p += length
            else:
                lines.append("")
        n += 1
        yield f"novel{n}", "\n".join(lines)


def gcide(root: str):
    """The dictionary in dictd's format; source tags ([1913 Webster], [WordNet 1.5], ...) and the
    layout's indentation go. One document per initial letter of the headwords (an entry starts
    with its headword and the pronunciation between backslashes: `Affect \\Af*fect"\\, v. t.`)."""
    with gzip.open(glob.glob(os.path.join(root, "usr/share/dictd/gcide.dict.dz"))[0], "rt", errors="replace") as f:
        text = f.read()
    text = re.sub(r"(?m)^[ \t]*\[[^\]\n]*\][ \t]*\n", "", text)  # a line holding only a source tag
    text = normalise(re.sub(r"(?m)^[ \t]+", "", text))
    letters: dict[str, list[str]] = {}
    letter = "front matter"
    for para in text.split("\n\n"):
        if para[:1].isalpha() and re.match(r"[^\n\\]+ \\[^\\\n]+\\", para):
            letter = para[0].upper()
        letters.setdefault(letter, []).append(para)
    for letter, paras in letters.items():
        yield letter, "\n\n".join(paras)


def files(root: str, patterns: list[str], exclude: str | None = None):
    seen = set()
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            if exclude and re.search(exclude, path):
                continue
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", errors="replace") as f:
                text = f.read()
            digest = hashlib.sha1(text.encode()).digest()
            if digest not in seen:  # the same page under two paths
                seen.add(digest)
                yield os.path.relpath(path, root), text


SOURCES = [
    # (name, package, what, reader)
    ("tdavid", "sword-comm-tdavid", "C. H. Spurgeon, The Treasury of David (1869-1885)", sword),
    ("mhcc", "sword-comm-mhcc", "Matthew Henry's Concise Commentary on the Bible (1706-1721)", sword),
    ("web", "sword-text-web", "World English Bible with Deuterocanon (2015)", sword),
    ("austen", "r-cran-janeaustenr", "Jane Austen's six novels", austen),
    ("gcide", "dict-gcide", "GNU Collaborative International Dictionary of English (Webster 1913, WordNet)", gcide),
    ("kernel", "linux-doc-6.1", "Linux kernel documentation (reStructuredText, translations left out)",
     lambda r: files(r, ["usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz",
                         "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt.gz"], exclude=r"/translations/")),
    ("python", "python3.11-doc", "Python 3.11 documentation (reStructuredText sources)",
     lambda r: files(r, ["usr/share/doc/python3.11/html/_sources/**/*.txt"])),
    ("perl", "perl-doc", "Perl 5.36 documentation (POD)", lambda r: files(r, ["usr/share/perl/*/pod/*.pod"])),
]


def normalise(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def chunks(text: str, size: int = CHUNK):
    """Paragraphs packed into pieces of about `size` characters (a longer paragraph stays whole)."""
    piece, n = [], 0
    for para in text.split("\n\n"):
        piece.append(para)
        n += len(para) + 2
        if n >= size:
            yield "\n\n".join(piece)
            piece, n = [], 0
    if piece:
        yield "\n\n".join(piece)


def english(text: str) -> bool:
    """Leaves out a document in another script (a few stray pages): < 95 % ASCII characters."""
    return sum(c < "\x80" for c in text) >= 0.95 * len(text)


def write_xz(path: str, tokens: np.ndarray) -> None:
    tmp = path + ".tmp"
    with lzma.open(tmp, "wb", preset=6) as f:
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(HERE, "corpus", "cache"))
    ap.add_argument("--out", default=os.path.join(HERE, "corpus", "gpt2"))
    ap.add_argument("--val-per-mille", type=int, default=15, help="share of chunks held out for validation")
    ap.add_argument("--seed", type=int, default=1234, help="order of the training chunks")
    args = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(args.cache, exist_ok=True)
    print(f"fetching into {args.cache}", flush=True)
    versions = fetch(args.cache)
    enc = encoder(args.cache)
    train_docs, val_docs, sources = [], [], []
    for name, package, what, reader in SOURCES:
        kept = dropped = chars = 0
        s_train, s_val = [], []
        for doc_id, text in reader(os.path.join(args.cache, "x", package)):
            text = normalise(text)
            if not text:
                continue
            if not english(text):
                dropped += 1
                continue
            kept += 1
            for i, piece in enumerate(chunks(text)):
                chars += len(piece)
                h = int.from_bytes(hashlib.sha1(f"{name}/{doc_id}/{i}".encode()).digest()[:4], "little")
                (s_val if h % 1000 < args.val_per_mille else s_train).append(piece)
        tok_train = enc.encode_ordinary_batch(s_train, num_threads=os.cpu_count() or 2)
        tok_val = enc.encode_ordinary_batch(s_val, num_threads=os.cpu_count() or 2)
        n_train, n_val = sum(map(len, tok_train)), sum(map(len, tok_val))
        train_docs += tok_train
        val_docs += tok_val
        sources.append(dict(name=name, package=package, version=versions[package], what=what, documents=kept,
                            dropped_non_english=dropped, chars=chars, train_tokens=n_train, val_tokens=n_val,
                            chars_per_token=round(chars / max(1, n_train + n_val), 3)))
        print(f"  {name:7s} {package:20s} {kept:6d} documents  {chars / 1e6:7.2f} M characters  "
              f"{n_train / 1e6:6.2f} M train + {n_val / 1e6:5.3f} M val tokens", flush=True)
    random.Random(args.seed).shuffle(train_docs)  # the sources interleave along the stream

    def stream(docs):
        out = np.empty(sum(len(d) + 1 for d in docs), dtype=np.uint16)
        p = 0
        for d in docs:
            out[p:p + len(d)] = d
            out[p + len(d)] = EOT
            p += len(d) + 1
        return out

    train, val = stream(train_docs), stream(val_docs)
    os.makedirs(args.out, exist_ok=True)
    write_xz(os.path.join(args.out, "train.bin.xz"), train)
    write_xz(os.path.join(args.out, "val.bin.xz"), val)
    with open(os.path.join(args.cache, "gpt2.tiktoken"), "rb") as src, open(os.path.join(args.out, "gpt2.tiktoken"), "wb") as dst:
        dst.write(src.read())
    meta = dict(
        tokenizer="GPT-2 BPE (r50k_base ranks from openai-whisper's gpt2.tiktoken, applied by tiktoken)",
        vocab=50257, eot=EOT, dtype="uint16", train_tokens=len(train), val_tokens=len(val),
        train_sha256=hashlib.sha256(train.astype("<u2").tobytes()).hexdigest(),
        val_sha256=hashlib.sha256(val.astype("<u2").tobytes()).hexdigest(),
        chunk_chars=CHUNK, val_per_mille=args.val_per_mille, shuffle_seed=args.seed, sources=sources,
        command="python3 bench/quality/make_corpus.py" + ("" if argv is None else " " + " ".join(argv)))
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    size = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"train {len(train):,} tokens, val {len(val):,} tokens "
          f"({sum(s['chars'] for s in sources) / 1e6:.1f} M characters); {args.out}: {size / 2**20:.1f} MiB; "
          f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
