"""Tests for bm25.py: the on-disk index gives BM25's exact answers (the in-memory
class is the yardstick, itself checked against the formula in test_tools.py), its
pruning skips what it may and nothing else, the corpus formats it reads, and its command."""

import gzip
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support import bm25  # noqa: E402
from support.bm25 import BM25, DiskBM25, build_index, read_passages  # noqa: E402


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def zipf_corpus(seed, n, vocab=200):
    """Texts whose word frequencies fall off as in prose: some words in most passages,
    most words in few."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    weights = [1 / (i + 1) for i in range(vocab)]
    return [{"id": f"p{i}", "title": rng.choice(words[50:]),
             "text": " ".join(rng.choices(words, weights, k=rng.randint(0, 40)))} for i in range(n)]


@pytest.mark.parametrize("seed, block", [(0, 10_000), (1, 97), (2, 7)])  # one block, several, many
def test_the_index_answers_exactly_as_bm25_in_memory(tmp_path, seed, block):
    rows = zipf_corpus(seed, 1500)
    build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "idx", block_docs=block, progress=False)
    disk = DiskBM25(tmp_path / "idx")
    memory = BM25([f"{r['title']} {r['text']}" for r in rows])
    rng = random.Random(seed + 100)
    for _ in range(300):
        query = " ".join(rng.choices([f"w{i}" for i in range(200)] + ["unseen"], k=rng.randint(1, 7)))
        k = rng.choice([1, 3, 10, 2000])
        assert disk.top(query, k) == memory.top(query, k), (query, k)  # same documents, same floats, same ties
    assert unpruned(disk, "w0 w7 w0") == memory.scores("w0 w7 w0")
    assert disk.top("unseen", 3) == [] and disk.top("", 3) == [] and disk.top("w1", 0) == []
    assert disk.passage(5) == rows[5] and disk.meta["docs"] == 1500
    disk.close()


def test_pruning_never_reads_a_common_word_in_full(tmp_path, monkeypatch):
    """"the" is in every passage, "zebra" in three: the candidates are those three,
    and the answer is still the unpruned one."""
    rows = [{"title": "", "text": "the the cat sat on the mat"} for _ in range(400)]
    for i in (17, 230, 301):
        rows[i] = {"title": "", "text": f"the zebra {'ran ' * (i % 5)}on the plain"}
    build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "idx", progress=False)
    disk = DiskBM25(tmp_path / "idx")
    scored = []
    real = disk._score
    monkeypatch.setattr(disk, "_score", lambda cand, terms: scored.append(len(cand)) or real(cand, terms))
    top = disk.top("the zebra", 2)
    assert scored[-1] == 3  # the final scoring ran over the zebra passages only
    everything = everything_of(disk, "the zebra")
    assert top == everything[:2] and {d for d, _ in top} <= {17, 230, 301}
    scored.clear()
    assert disk.top("the", 3) == everything_of(disk, "the")[:3]  # nothing rarer to lean on: all of "the"
    assert scored[-1] == 400


def unpruned(disk, query):
    """Every document sharing a word with the query, scored without pruning: what top()
    must agree with."""
    terms = disk._terms(query)
    if not terms:
        return {}
    cand = np.unique(np.concatenate([np.asarray(disk.docs[lo:hi], dtype=np.int64) for lo, hi, _ in terms]))
    return dict(zip(cand.tolist(), disk._score(cand, terms).tolist()))


def everything_of(disk, query):
    return sorted(unpruned(disk, query).items(), key=lambda p: (-p[1], p[0]))


def test_concurrent_queries_share_one_index(tmp_path):
    rows = zipf_corpus(3, 600)
    build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "idx", progress=False)
    disk = DiskBM25(tmp_path / "idx")
    queries = [f"w{i} w{i * 7 % 200} w1" for i in range(64)]
    alone = [disk.top(q, 3) for q in queries]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda q: disk.top(q, 3), queries)) == alone


# ----------------------------------------------------------------------------- corpus formats

def test_corpus_formats(tmp_path):
    # Search-R1 / FlashRAG's wiki-18: the title is the first line of contents, in quotes
    search_r1 = write_jsonl(tmp_path / "wiki-18.jsonl", [
        {"id": "0", "contents": '"Aaron"\nAaron is a prophet, high priest, and the brother of Moses.'},
        {"id": "1", "contents": "Untitled\nno quotes here"}])
    assert list(read_passages(search_r1)) == [
        {"id": "0", "title": "Aaron", "text": "Aaron is a prophet, high priest, and the brother of Moses."},
        {"id": "1", "title": "Untitled", "text": "no quotes here"}]
    # DPR's psgs_w100.tsv: a header row, tab-separated, quoted where needed
    tsv = tmp_path / "psgs_w100.tsv"
    tsv.write_text('id\ttext\ttitle\n1\t"Aaron is a ""prophet"", high priest"\tAaron\n2\tsecond passage\tB\n')
    assert list(read_passages(tsv)) == [{"id": "1", "title": "Aaron", "text": 'Aaron is a "prophet", high priest'},
                                        {"id": "2", "title": "B", "text": "second passage"}]
    # gzip, ids by position when the rows have none, a raw U+2028 inside a string
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"title": "T", "text": "one\u2028line"}, ensure_ascii=False) + "\n\n")
        f.write(json.dumps({"title": "U", "text": "two"}) + "\n")
    assert list(read_passages(gz)) == [{"id": "0", "title": "T", "text": "one\u2028line"},
                                       {"id": "1", "title": "U", "text": "two"}]
    build_index(tsv, tmp_path / "from_tsv", progress=False)
    assert DiskBM25(tmp_path / "from_tsv").passage(0)["title"] == "Aaron"


def test_bad_corpora_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        list(read_passages(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="row 2 has neither 'text' nor 'contents'"):
        list(read_passages(write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"body": "y"}])))
    (tmp_path / "b.tsv").write_text("id\tpassage\n1\tx\n")
    with pytest.raises(ValueError, match="name the columns"):
        list(read_passages(tmp_path / "b.tsv"))
    with pytest.raises(ValueError, match="no passages"):
        build_index(write_jsonl(tmp_path / "empty.jsonl", []), tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


def test_a_corpus_without_words(tmp_path):
    build_index(write_jsonl(tmp_path / "c.jsonl", [{"title": "", "text": "  ...  "}]), tmp_path / "i", progress=False)
    disk = DiskBM25(tmp_path / "i")
    assert disk.meta["terms"] == 0 and disk.top("anything", 3) == [] and disk.passage(0)["text"] == "  ...  "


def test_an_index_is_checked_when_opened(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts.build_index"):
        DiskBM25(tmp_path)
    build_index(write_jsonl(tmp_path / "c.jsonl", [{"title": "a", "text": "b"}]), tmp_path / "i", progress=False)
    meta = json.loads((tmp_path / "i" / "meta.json").read_text())
    (tmp_path / "i" / "meta.json").write_text(json.dumps({**meta, "format": bm25.FORMAT + 1}))
    with pytest.raises(ValueError, match="rebuild it"):
        DiskBM25(tmp_path / "i")


def test_postings_are_laid_out_term_by_term(tmp_path):
    """The files themselves: sorted vocabulary, each term's documents ascending, df = the
    postings' count, tf capped, lengths in tokens."""
    rows = [{"title": "b", "text": "a a c"}, {"title": "", "text": "c b"}, {"title": "", "text": "a"}]
    build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "i", block_docs=2, progress=False)
    d = tmp_path / "i"
    at = np.load(d / "vocab.npy")
    blob = (d / "vocab.bin").read_bytes()
    assert [blob[at[i]:at[i + 1]] for i in range(len(at) - 1)] == [b"a", b"b", b"c"]
    assert np.load(d / "postings.npy").tolist() == [0, 2, 4, 6]
    assert np.load(d / "docs.npy").tolist() == [0, 2, 0, 1, 0, 1]
    assert np.load(d / "tf.npy").tolist() == [2, 1, 1, 1, 1, 1]
    assert np.load(d / "lengths.npy").tolist() == [4, 2, 1]
    assert not (d / "runs").exists()


# ----------------------------------------------------------------------------- the command

def test_build_and_search_commands(tmp_path, capsys):
    from scripts import build_index

    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "v1", "title": "Velmora", "text": "Velmora is a river town founded in 1742."},
        {"id": "o1", "title": "Ostrand", "text": "Ostrand is a mountain village."}])
    assert build_index.main([str(corpus), str(tmp_path / "idx")]) == 0
    assert "indexed 2 passages" in capsys.readouterr().out
    assert build_index.main(["--search", str(tmp_path / "idx"), "when was velmora founded", "-k", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "[v1] Velmora: Velmora is a river town founded in 1742." in out[0]
    assert build_index.main([str(corpus), str(tmp_path / "idx")]) == 2  # never over an index
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not empty" in err
    assert build_index.main([str(tmp_path / "none.jsonl"), str(tmp_path / "x")]) == 2
    assert "corpus file not found" in capsys.readouterr().err
