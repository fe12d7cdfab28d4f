"""BM25 retrieval for the search tools: in memory for a page's chunks and a small corpus
(BM25), and as an index on disk for a corpus too large to hold (DiskBM25), such as the
2018 Wikipedia dump cut into 21M passages of 100 words that Search-R1 retrieves from.

    python -m scripts.build_index CORPUS INDEX_DIR     # once; then tools.corpus_index: INDEX_DIR
    python -m scripts.build_index --search INDEX_DIR "who wrote hey jude" [-k 3]

CORPUS is JSONL (optionally .gz) with {"title", "text"} rows or Search-R1's {"contents"}
rows (the first line of contents is the title, in quotes), or a TSV with a header row
naming text and optionally id and title columns (DPR's psgs_w100.tsv).

Paper, section 1: this is a retrieval tool of the toolset K; the paper's search tools
call web APIs, and a local index is what makes a run reproducible without them. Both
classes score exactly the same numbers (Okapi BM25, Lucene's idf, the same tokenizer),
so Local_Search ranks a corpus the same way whether it is held in memory or on disk.

What the on-disk index simplifies against Lucene (pyserini): no stemming, no stop
words, no positions (so no phrase queries), term frequencies capped at 65535; one
build, never updated. What it keeps: bounded memory while building (the corpus is read
in blocks, each block's postings sorted and written to disk, then placed into one
file), and answers read from memory-mapped arrays, so opening an index costs nothing
and the operating system keeps the hot parts in its page cache. Exact top-k with
max-score pruning: the postings of common words are never read unless they could change
the answer (DiskBM25.top; tests/test_retriever.py checks it against scoring every
document).
"""
from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import mmap
import re
import shutil
import sys
import time
from array import array
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from support.datasets import iter_jsonl

K1, B = 1.5, 0.75  # BM25's usual constants (Lucene's defaults are 1.2 / 0.75; Pyserini's 0.9 / 0.4)
FORMAT = 1  # bumped when the files of an index change meaning
TF_MAX = np.iinfo(np.uint16).max


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of word characters: the one tokenizer of every BM25 here."""
    return re.findall(r"\w+", text.lower())


def _idf(n_docs: int, df: int) -> float:
    return math.log(1 + (n_docs - df + 0.5) / (df + 0.5))  # Lucene's form: never negative


class BM25:
    """Okapi BM25 over a fixed list of documents:
        score(q, d) = sum_{t in q} idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
        idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))   (Lucene's form: never negative)
    Repeated query words count once."""

    def __init__(self, docs: list[str], k1: float = K1, b: float = B):
        self.k1, self.b = k1, b
        self.lengths = []
        self.postings: dict[str, list[tuple[int, int]]] = {}  # word -> [(doc index, tf)]
        for i, doc in enumerate(docs):
            words = tokenize(doc)
            self.lengths.append(len(words))
            for word, tf in Counter(words).items():
                self.postings.setdefault(word, []).append((i, tf))
        n = len(docs)
        self.avgdl = sum(self.lengths) / n if n else 0.0
        self.idf = {w: _idf(n, len(p)) for w, p in self.postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        """Score of every document sharing a word with the query (the others score 0)."""
        scores: dict[int, float] = {}
        for word in dict.fromkeys(tokenize(query)):  # unique, in query order: the same float sums every run
            for i, tf in self.postings.get(word, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                scores[i] = scores.get(i, 0.0) + self.idf[word] * tf * (self.k1 + 1) / (tf + norm)
        return scores

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best (index, score) pairs with score > 0; ties go to the earlier document."""
        return sorted(self.scores(query).items(), key=lambda p: (-p[1], p[0]))[:k]


# ----------------------------------------------------------------------------------------
# Corpus files -> passages


def read_passages(path):
    """{"id", "title", "text"} for every passage of a corpus file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if path.name.endswith((".tsv", ".tsv.gz")):
        yield from _read_tsv(path)
        return
    for n, row in enumerate(iter_jsonl(path, strict=True)):
        if "contents" in row:  # Search-R1 / FlashRAG: '"Title"\nthe passage text'
            title, _, text = str(row["contents"]).partition("\n")
            title = title.strip()
            if len(title) > 1 and title[0] == title[-1] == '"':
                title = title[1:-1]
        elif "text" in row:
            title, text = str(row.get("title", "")), str(row["text"])
        else:
            raise ValueError(f"{path}: row {n + 1} has neither 'text' nor 'contents'")
        yield {"id": str(row.get("id", n)), "title": title, "text": text}


def _read_tsv(path: Path):
    csv.field_size_limit(1 << 30)  # a passage longer than csv's 128 kB default is still one field
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        header = [h.strip().lower() for h in next(rows, [])]
        if "text" not in header:
            raise ValueError(f"{path}: the first row must name the columns (text, and optionally id and title), "
                             f"got {header[:5]}")
        col = {name: header.index(name) for name in ("id", "text", "title") if name in header}
        for n, row in enumerate(rows):
            if not row:
                continue
            get = lambda name, default="": row[col[name]] if name in col and col[name] < len(row) else default
            yield {"id": get("id", str(n)), "title": get("title"), "text": get("text")}


# ----------------------------------------------------------------------------------------
# The index on disk
#
# INDEX_DIR/
#   meta.json               counts, avgdl, k1, b, format
#   vocab.bin, vocab.npy    the terms, sorted (UTF-8 bytes back to back) and where each starts [V+1]
#   postings.npy            where each term's postings start in docs.npy / tf.npy [V+1]
#   docs.npy, tf.npy        the postings: document numbers (int32, ascending per term) and counts (uint16)
#   lengths.npy             |d| in tokens per document [N]
#   passages.bin, passages.npy   each passage as a JSON object, and where each starts [N+1]


def build_index(corpus, out_dir, block_docs: int = 250_000, k1: float = K1, b: float = B,
                progress: bool = True) -> dict:
    """Build INDEX_DIR from a corpus file in bounded memory; returns meta.json's content.

    Pass 1 reads the corpus in blocks of `block_docs` passages: each block's tokens become
    (term, document, tf) triples, sorted by term then document (one np.unique) and written
    to disk as a run. Pass 2 lays the postings out term by term in the order of the sorted
    vocabulary and copies every run into place; runs come in document order, so each
    term's documents stay ascending. Memory holds the vocabulary and one block."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or name another folder")
    tmp = out / "runs"
    tmp.mkdir(parents=True)
    t0 = time.time()
    vocab = defaultdict(itertools.count().__next__)  # term -> id in order of first sight
    lengths, starts, runs, df = array("i"), array("q", [0]), [], np.zeros(0, np.int64)
    n_docs = 0
    with open(out / "passages.bin", "wb") as texts:
        rows = read_passages(corpus)
        while True:
            block = list(itertools.islice(rows, block_docs))
            if not block:
                break
            ids, block_lengths = array("q"), array("i")
            for row in block:
                words = tokenize(f"{row['title']} {row['text']}")
                ids.extend(map(vocab.__getitem__, words))
                block_lengths.append(len(words))
                data = json.dumps(row, ensure_ascii=False).encode("utf-8")
                texts.write(data)
                starts.append(starts[-1] + len(data))
            terms = np.frombuffer(ids, dtype=np.int64)
            docs = np.repeat(np.arange(n_docs, n_docs + len(block), dtype=np.int64),
                             np.frombuffer(block_lengths, dtype=np.int32))
            pairs, tf = np.unique((terms << 32) | docs, return_counts=True)  # sorted by term, then document
            run_terms = (pairs >> 32).astype(np.int32)
            run = tmp / f"run{len(runs)}"
            np.save(f"{run}_terms.npy", run_terms)
            np.save(f"{run}_docs.npy", (pairs & 0xFFFFFFFF).astype(np.int32))
            np.save(f"{run}_tf.npy", np.minimum(tf, TF_MAX).astype(np.uint16))
            runs.append(run)
            block_df = np.bincount(run_terms, minlength=len(vocab))
            df = np.concatenate([df, np.zeros(len(block_df) - len(df), np.int64)]) + block_df
            lengths.extend(block_lengths)
            n_docs += len(block)
            if progress:
                print(f"  read {n_docs:,} passages, {len(vocab):,} terms ({time.time() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
    if n_docs == 0:
        shutil.rmtree(out)
        raise ValueError(f"no passages in {corpus}")
    if n_docs >= 2 ** 31:
        raise ValueError("more than 2^31 passages: document numbers are int32")

    # Pass 2. Terms sorted as strings: code-point order is UTF-8 byte order, which is how
    # DiskBM25 compares them while it bisects vocab.bin.
    words = list(vocab)  # by id
    del vocab
    order = sorted(range(len(words)), key=words.__getitem__)
    rank = np.empty(len(words), np.int64)
    rank[order] = np.arange(len(words))
    encoded = [words[i].encode("utf-8") for i in order]
    del words
    with open(out / "vocab.bin", "wb") as f:
        f.write(b"".join(encoded))
    np.save(out / "vocab.npy", _starts([len(w) for w in encoded]))
    del encoded
    offsets = _starts(df[order])  # by sorted position
    np.save(out / "postings.npy", offsets)
    n_post = int(offsets[-1])
    docs_out = np.lib.format.open_memmap(out / "docs.npy", mode="w+", dtype=np.int32, shape=(n_post,))
    tf_out = np.lib.format.open_memmap(out / "tf.npy", mode="w+", dtype=np.uint16, shape=(n_post,))
    next_free = offsets[:-1][rank]  # by term id: where its next posting goes
    for run in runs:
        terms = np.load(f"{run}_terms.npy")
        if len(terms):  # (a block of passages without a word has none)
            first = np.flatnonzero(np.r_[True, terms[1:] != terms[:-1]])  # where each term's entries begin
            count = np.diff(np.r_[first, len(terms)])
            term = terms[first]
            # entry j of a term goes to next_free[term] + j
            dest = np.repeat(next_free[term] - first, count) + np.arange(len(terms))
            docs_out[dest] = np.load(f"{run}_docs.npy")
            tf_out[dest] = np.load(f"{run}_tf.npy")
            next_free[term] += count
        for part in ("terms", "docs", "tf"):
            Path(f"{run}_{part}.npy").unlink()
    docs_out.flush()
    tf_out.flush()
    del docs_out, tf_out
    tmp.rmdir()
    np.save(out / "lengths.npy", np.frombuffer(lengths, dtype=np.int32))
    np.save(out / "passages.npy", np.frombuffer(starts, dtype=np.int64))
    total = int(np.frombuffer(lengths, dtype=np.int32).sum(dtype=np.int64))
    meta = {"format": FORMAT, "docs": n_docs, "terms": len(rank), "postings": n_post,
            "avgdl": total / n_docs, "k1": k1, "b": b, "corpus": Path(corpus).name,
            "build_s": round(time.time() - t0, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _starts(sizes) -> np.ndarray:
    """[0, s0, s0+s1, ...]: where each of a run of back-to-back pieces starts, and the end."""
    at = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=at[1:])
    return at


class DiskBM25:
    """A built index, memory-mapped: the same scores as BM25 over the same passages.

    Thread-safe for reading (the tool threads share one)."""

    def __init__(self, folder):
        folder = Path(folder)
        meta_path = folder / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder} is not an index (no meta.json); build one with "
                                    f"`python -m scripts.build_index CORPUS {folder}`")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{folder} is an index of format {self.meta.get('format')}, this code reads "
                             f"format {FORMAT}; rebuild it")
        self.n, self.avgdl = int(self.meta["docs"]), float(self.meta["avgdl"])
        self.k1, self.b = float(self.meta["k1"]), float(self.meta["b"])
        load = lambda name: np.load(folder / name, mmap_mode="r")
        self.vocab_at, self.postings_at = load("vocab.npy"), load("postings.npy")
        self.docs, self.tf, self.lengths, self.passage_at = load("docs.npy"), load("tf.npy"), \
            load("lengths.npy"), load("passages.npy")
        self._files = [open(folder / name, "rb") for name in ("vocab.bin", "passages.bin")]
        # mmap refuses an empty file: a corpus whose passages hold no word has an empty vocabulary
        self.vocab, self.passages = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                                     if Path(f.name).stat().st_size else b"" for f in self._files)

    def close(self):
        for m in (self.vocab, self.passages):
            if isinstance(m, mmap.mmap):
                m.close()
        for f in self._files:
            f.close()

    def term(self, word: str) -> int | None:
        """The term's place in the sorted vocabulary (bisection over vocab.bin), or None."""
        key, at = word.encode("utf-8"), self.vocab_at
        lo, hi = 0, len(at) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.vocab[int(at[mid]):int(at[mid + 1])] < key:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(at) - 1 and self.vocab[int(at[lo]):int(at[lo + 1])] == key:
            return lo
        return None

    def passage(self, i: int) -> dict:
        return json.loads(self.passages[int(self.passage_at[i]):int(self.passage_at[i + 1])])

    def _terms(self, query: str) -> list[tuple[int, int, float]]:
        """(start, end, idf) of each known query word's postings, unique, in query order."""
        found = []
        for word in dict.fromkeys(tokenize(query)):
            t = self.term(word)
            if t is not None:
                lo, hi = int(self.postings_at[t]), int(self.postings_at[t + 1])
                found.append((lo, hi, _idf(self.n, hi - lo)))
        return found

    def _score(self, cand: np.ndarray, terms) -> np.ndarray:
        """BM25 of the documents `cand` (ascending): each term's part looked up by binary
        search in its postings, added in query order, with BM25's operations in BM25's order
        (so the floats equal BM25.scores')."""
        k1, b = self.k1, self.b
        scores = np.zeros(len(cand))
        for lo, hi, idf in terms:
            docs = self.docs[lo:hi]
            pos = np.minimum(np.searchsorted(docs, cand), hi - lo - 1)
            hit = docs[pos] == cand
            tf = self.tf[lo + pos[hit]].astype(np.float64)
            norm = k1 * (1 - b + b * self.lengths[cand[hit]] / self.avgdl)
            scores[hit] += idf * tf * (k1 + 1) / (tf + norm)
        return scores

    def top(self, query: str, k: int, sample: int = 50_000) -> list[tuple[int, float]]:
        """BM25.top's answer: the k best (document, score) pairs, ties to the earlier one.

        Max-score pruning, exact. A term adds less than idf * (k1 + 1) to any score (its
        tf part tf (k1+1) / (tf + norm) stays below k1 + 1). Score some documents of the
        rarest term in full; the k-th best of them, theta, is a lower bound of the true
        k-th best score. Then the most common terms whose bounds sum to less than theta
        cannot lift a document into the top k on their own: only documents holding one of
        the other terms are candidates, and the common terms' postings are read only for
        those (by binary search), never in full."""
        terms = self._terms(query)
        if not terms or k < 1:
            return []
        by_df = sorted(range(len(terms)), key=lambda j: terms[j][1] - terms[j][0])
        lo, hi, _ = terms[by_df[0]]
        seed = np.asarray(self.docs[lo:min(hi, lo + sample)], dtype=np.int64)
        seed_scores = self._score(seed, terms)
        theta = np.partition(seed_scores, -k)[-k] if len(seed) >= k else 0.0
        bound, essential = 0.0, set(range(len(terms)))
        for j in reversed(by_df):  # most common first
            bound += terms[j][2] * (self.k1 + 1)
            if bound * (1 + 1e-9) >= theta:  # a margin for float rounding in the sums
                break
            essential.discard(j)
        essential = essential or {by_df[0]}  # (cannot be empty: theta is a sum of terms' parts)
        cand = np.unique(np.concatenate([np.asarray(self.docs[terms[j][0]:terms[j][1]], dtype=np.int64)
                                         for j in sorted(essential)]))
        scores = self._score(cand, terms)
        best = np.lexsort((cand, -scores))[:k]  # by score descending, then document ascending
        return [(int(cand[i]), float(scores[i])) for i in best]
