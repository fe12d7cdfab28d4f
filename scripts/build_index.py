"""Build an on-disk BM25 index of a corpus too large to hold (a Wikipedia dump), or query one.

    python -m scripts.build_index CORPUS INDEX_DIR [--block 250000]   # then tools.corpus_index: INDEX_DIR
    python -m scripts.build_index --search INDEX_DIR "who wrote hey jude" [-k 3]

CORPUS is JSONL (optionally .gz) with {"title", "text"} rows or Search-R1's {"contents"}
rows, or a TSV with a header row (DPR's psgs_w100.tsv): support/bm25.py says how it is
read and scored. Local_Search then ranks its passages as it ranks the shipped corpus.
"""

import argparse
import sys

from support.bm25 import DiskBM25, build_index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.build_index",
                                 description="Build or query an on-disk BM25 index for Local_Search.")
    ap.add_argument("source", help="the corpus to index (or, with --search, the index folder)")
    ap.add_argument("target", help="the new index folder (or, with --search, the query)")
    ap.add_argument("--search", action="store_true", help="print the best passages of an index for a query")
    ap.add_argument("--block", type=int, default=250_000, help="passages per block held in memory while building")
    ap.add_argument("-k", type=int, default=3, help="passages to print with --search")
    args = ap.parse_args(argv)
    try:
        if args.search:
            index = DiskBM25(args.source)
            for doc, score in index.top(args.target, args.k):
                p = index.passage(doc)
                print(f"{score:7.3f}  [{p['id']}] {p['title']}: {p['text'][:200]}")
        else:
            meta = build_index(args.source, args.target, block_docs=args.block)
            print(f"indexed {meta['docs']:,} passages, {meta['terms']:,} terms, {meta['postings']:,} postings "
                  f"in {meta['build_s']}s -> {args.target} (set tools.corpus_index: {args.target})")
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
