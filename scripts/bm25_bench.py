"""The local retriever's cost, measured side by side: build and query time of our on-disk
BM25 index (support/bm25.py) and, where it is installed, of the bm25s library, on a
generated corpus shaped like a Wikipedia passage dump.

    python -m scripts.bm25_bench [--passages 1000000] [--queries 200] [--dir DIR]

Passages are 100 words drawn from a Zipf law over a large vocabulary (as word
frequencies in text are), titles 2-3 rarer words; queries are 4 words picked from one
passage, so a query mixes common and rare words as a question does. Each system builds
in its own process, so each line of peak memory is its own. Prints one `name: value`
line per figure; docs/LOG.md keeps dated figures with their machine.

bm25s is run as its documentation shows (its own tokenizer, given our token pattern and
no stop words, so both index the same tokens; method "lucene", k1 1.5, b 0.75), on one
thread; install it with `pip install bm25s` to see its lines. Its scores differ from
ours by a constant factor (Lucene drops BM25's k1 + 1), so the top documents agree.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the repository: where each worker process runs


def make_corpus(path: Path, n: int, seed: int = 0, vocab: int = 2_000_000, words: int = 100) -> None:
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1) ** 1.07)
    cdf /= cdf[-1]
    letters = "abcdefghijklmnopqrstuvwxyz"

    def name(r: int) -> str:  # frequent ranks get short words, as in text
        s = ""
        r += 1
        while r:
            r, c = divmod(r - 1, 26)
            s = letters[c] + s
        return s

    names = [name(r) for r in range(vocab)]
    with open(path, "w") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            ranks = np.searchsorted(cdf, rng.random((m, words)))
            titles = rng.integers(1000, vocab, (m, 3))
            for i in range(m):
                title = " ".join(names[t] for t in titles[i][:2 + (i % 2)])
                f.write(json.dumps({"id": str(start + i), "title": title,
                                    "text": " ".join(names[r] for r in ranks[i])}) + "\n")


def make_queries(corpus: Path, n_passages: int, q: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    want = set(rng.choice(n_passages, size=q, replace=False).tolist())
    out = []
    with open(corpus) as f:
        for i, line in enumerate(f):
            if i in want:
                row = json.loads(line)
                words = (row["title"] + " " + row["text"]).split()
                out.append(" ".join(rng.choice(words, size=4, replace=False)))
    return out


def _peak_mb() -> float:
    """This process's peak resident memory. VmHWM, not getrusage's ru_maxrss: that one
    carries over from the parent through fork and exec."""
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024


def _times(fn, queries) -> list[float]:
    out = []
    for query in queries:
        t = time.perf_counter()
        fn(query)
        out.append((time.perf_counter() - t) * 1000)
    return out


def _du_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2 ** 20


def worker_ours(corpus: Path, work: Path, queries: list[str]) -> dict:
    from support.bm25 import DiskBM25, build_index
    t = time.perf_counter()
    build_index(corpus, work / "ours", progress=False)
    build_s = time.perf_counter() - t
    build_peak = _peak_mb()
    t = time.perf_counter()
    index = DiskBM25(work / "ours")
    open_ms = (time.perf_counter() - t) * 1000
    index.top(queries[0], 3)  # first touch of the arrays
    pruned = _times(lambda q: index.top(q, 3), queries)

    def unpruned(q):  # the same arithmetic over every document holding a query word
        terms = index._terms(q)
        cand = np.unique(np.concatenate([np.asarray(index.docs[lo:hi], dtype=np.int64) for lo, hi, _ in terms]))
        scores = index._score(cand, terms)
        return cand[np.lexsort((cand, -scores))[:3]]

    full = _times(unpruned, queries)
    tops = [[d for d, _ in index.top(q, 3)] for q in queries]
    return {"build_s": build_s, "build_peak_mb": build_peak, "disk_mb": _du_mb(work / "ours"),
            "open_ms": open_ms, "query_ms": pruned, "query_full_ms": full, "tops": tops}


def worker_bm25s(corpus: Path, work: Path, queries: list[str]) -> dict:
    import bm25s
    t = time.perf_counter()
    texts = []
    with open(corpus) as f:
        for line in f:
            row = json.loads(line)
            texts.append(f"{row['title']} {row['text']}")
    tokens = bm25s.tokenize(texts, token_pattern=r"\w+", stopwords=None, show_progress=False)
    del texts
    model = bm25s.BM25(k1=1.5, b=0.75, method="lucene")
    model.index(tokens, show_progress=False)
    model.save(work / "bm25s")
    build_s = time.perf_counter() - t
    build_peak = _peak_mb()
    del model, tokens
    t = time.perf_counter()
    model = bm25s.BM25.load(work / "bm25s", mmap=True)
    open_ms = (time.perf_counter() - t) * 1000

    def one(q):
        toks = bm25s.tokenize([q], token_pattern=r"\w+", stopwords=None, show_progress=False, return_ids=False)
        return model.retrieve(toks, k=3, show_progress=False, n_threads=1)

    one(queries[0])
    q_ms = _times(one, queries)
    tops = [one(q)[0][0].tolist() for q in queries]
    return {"build_s": build_s, "build_peak_mb": build_peak, "disk_mb": _du_mb(work / "bm25s"),
            "open_ms": open_ms, "query_ms": q_ms, "tops": tops}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bm25_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    ap.add_argument("--worker", choices=("ours", "bm25s"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one system in its own process: its peak memory is its own
        work = Path(args.dir)
        queries = json.loads((work / "queries.json").read_text())
        fn = worker_ours if args.worker == "ours" else worker_bm25s
        print(json.dumps(fn(work / "corpus.jsonl", work, queries)))
        return 0

    from support.provenance import cpu_name
    tmp = None if args.dir else tempfile.TemporaryDirectory()
    work = Path(args.dir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    t = time.perf_counter()
    make_corpus(corpus, args.passages)
    queries = make_queries(corpus, args.passages, args.queries)
    (work / "queries.json").write_text(json.dumps(queries))
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores)")
    print(f"corpus: {args.passages:,} passages of 100 words, {corpus.stat().st_size / 2 ** 20:.0f} MB "
          f"(generated in {time.perf_counter() - t:.0f}s); {len(queries)} queries of 4 words, top 3")
    results = {}
    for name in ("ours", "bm25s"):
        if name == "bm25s":
            try:
                import bm25s  # noqa: F401
            except ImportError:
                print("bm25s: not installed (pip install bm25s to compare)")
                continue
        done = subprocess.run([sys.executable, "-m", "scripts.bm25_bench", "--worker", name, "--dir", str(work)],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            print(f"{name}: failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            continue
        r = results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name} build_s: {r['build_s']:.1f}")
        print(f"{name} build_peak_rss_mb: {r['build_peak_mb']:.0f}")
        print(f"{name} index_disk_mb: {r['disk_mb']:.0f}")
        print(f"{name} open_ms: {r['open_ms']:.1f}")
        for key, label in (("query_ms", "query"), ("query_full_ms", "query_unpruned")):
            if key in r:
                ms = r[key]
                print(f"{name} {label}_ms: median {statistics.median(ms):.2f}, mean {statistics.mean(ms):.2f}, "
                      f"max {max(ms):.1f}")
    if "ours" in results and "bm25s" in results:
        pairs = list(zip(results["ours"]["tops"], results["bm25s"]["tops"]))
        print(f"same best passage (ours vs bm25s): {sum(a[:1] == b[:1] for a, b in pairs)}/{len(pairs)}; "
              f"same top-3 set: {sum(set(a) == set(b) for a, b in pairs)}/{len(pairs)} (bm25s scores in float32)")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
