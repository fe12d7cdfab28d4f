"""The paper's data, downloaded from the Hugging Face hub and converted to ours.

    python -m scripts.prepare_data train [--out data/nq_deepmath] [--heldout 200] [--limit N]
    python -m scripts.prepare_data gaia  [--out data/benchmarks] [--with-files]
    python -m scripts.prepare_data gpqa  [--out data/benchmarks] [--subset diamond]
    python -m scripts.prepare_data all
    common: --dry-run  (download nothing, write nothing: show the plan, and the rows
                        for sources already on disk)
            --from DIR (read local copies instead of the hub, laid out as
                        DIR/<owner>/<name>/<path in the repo>)
            --token T  (else HF_TOKEN or a saved `hf auth login`)

Paper, section 3: the planner is trained on Search-R1's Natural Questions search
questions mixed with DeepMath-103K (the official mix: about 182k rows, shuffled with
seed 42), and evaluated on ten benchmarks, two of which are gated on the hub (GAIA,
GPQA) and so not shipped beside the project. Facts read off the official data
preparation and the datasets' cards:

  train  NQ: RUC-NLPIR/FlashRAG_datasets, nq/train.jsonl, fields question and
         golden_answers (a list of aliases), about 79k rows, about 10 MB.
         DeepMath: zwhe99/DeepMath-103K, data/train-*.parquet, fields question and
         final_answer (and difficulty, topic, three R1 solutions, which is why the
         download is about 2.1 GB; only the two fields are read), about 103k rows.
         NQ rows first, then DeepMath, permuted by numpy's default_rng(42) as the
         official code's datasets.shuffle(seed=42) does, so the rows come in the
         official order. NQ questions get a final "?" as there.
         -> train.jsonl / heldout.jsonl rows {"id", "question", "answer", "kind",
         "task"}: NQ answer = the alias list, kind "text", task "nq"; DeepMath answer
         = final_answer, kind "math", task "deepmath". The first --heldout rows of
         the shuffle (default 200) are held out for the evaluation during training.
  gaia   gaia-benchmark/GAIA, 2023/validation/metadata.parquet (older revisions:
         metadata.jsonl), fields task_id, Question, Level, Final answer, file_name.
         GATED: accept its terms on the dataset's page with your hub account, then
         log in or set HF_TOKEN. Its terms forbid resharing: keep the output out of
         public repositories (gaia.json and gpqa.json are git-ignored). The official
         evaluation keeps the 127 of 165 validation tasks without an attached file
         (the agent cannot open attachments); --with-files keeps all.
         -> gaia.json, a list of {"pid", "task_id", "query", "answer", "kind",
         "level"}; kind "number" where the final answer is a plain number (GAIA's
         own scorer compares those as numbers), else "text".
  gpqa   Idavidrein/gpqa, gpqa_diamond.csv (or gpqa_main / gpqa_extended), fields
         Question, Correct Answer, Incorrect Answer 1-3, Record ID, High-level
         domain. GATED like GAIA. The four options are shuffled per question with a
         fixed seed (the file lists the correct one first).
         -> gpqa.json, {"pid", "record_id", "query", "options" ["A. ...", ...],
         "answer" "C. <text>", "answer_idx", "kind": "choice", "domain"}. The official
         evaluation file has 300 questions whose subset we could not establish;
         diamond (198) is the standard one.

Every output loads with support.datasets.load_benchmark (the explicit kind wins over
inference). Simplified against the official scripts: no parquet output, no "chain"
or "extra_info" columns, aliases kept as a list (the official mix joins them into one
"a; b" string, which no answer can equal).
"""

import argparse
import csv
import fnmatch
import json
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from support.datasets import read_jsonl
from support.answers import parse_number
from support.text import cut
from scripts.make_tasks import dump_jsonl

MIX_SEED = 42  # the official shuffle
GPQA_SUBSETS = ("diamond", "main", "extended")


class DataError(Exception):
    """A one-line reason the data cannot be prepared, with the fix."""


@dataclass(frozen=True)
class Source:
    repo: str                     # hub dataset id
    patterns: tuple[str, ...]     # files inside the repo (globs)
    size: str                     # what a download costs, for the plan
    gated: bool = False

    @property
    def page(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo}"


NQ = Source("RUC-NLPIR/FlashRAG_datasets", ("nq/train.jsonl",), "about 10 MB")
DEEPMATH = Source("zwhe99/DeepMath-103K", ("data/train-*.parquet",),
                  "about 2.1 GB: R1 solutions included, only question and final_answer are read")
GAIA = Source("gaia-benchmark/GAIA", ("2023/validation/metadata.parquet", "2023/validation/metadata.jsonl"),
              "a few MB", gated=True)


def gpqa_source(subset: str) -> Source:
    return Source("Idavidrein/gpqa", (f"gpqa_{subset}.csv",), "a few MB", gated=True)


# ----------------------------------------------------------------------------------------
# Where the source files come from: the hub, or a folder of local copies.

class Hub:
    """Files from the Hugging Face hub, through its cache (a second run downloads nothing).
    local_only: look in the cache only (the dry run)."""

    def __init__(self, token: str | None = None, local_only: bool = False):
        self.token, self.local_only = token, local_only

    def files(self, src: Source) -> list[Path] | None:
        """The source's files on disk; None when local_only and they are not cached."""
        try:
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
        except ImportError:
            raise DataError("downloading needs huggingface_hub (it comes with transformers): "
                            "pip install -r requirements.txt") from None
        try:
            folder = snapshot_download(src.repo, repo_type="dataset", allow_patterns=list(src.patterns),
                                       token=self.token, local_files_only=self.local_only)
        except GatedRepoError:
            raise DataError(self._gated(src)) from None
        except RepositoryNotFoundError:
            # without a token a gated repo answers 401, which reads as "not found"
            raise DataError(self._gated(src) if src.gated else f"{src.repo} was not found on the hub") from None
        except HfHubHTTPError as e:
            raise DataError(f"the hub refused {src.repo}: {cut(str(e).splitlines()[0], 200)}") from None
        except OSError as e:  # offline or unreachable and nothing cached (LocalEntryNotFoundError), or a failed link
            if self.local_only:
                return None
            raise DataError(self._offline(src, e)) from None
        found = _match(Path(folder), src.patterns)
        if not found and not self.local_only:
            raise DataError(f"{src.repo} has no file matching {', '.join(src.patterns)}: its layout changed; "
                            f"see {src.page}")
        return found or None

    @staticmethod
    def _offline(src: Source, e: Exception) -> str:
        return (f"cannot reach the Hugging Face hub to download {src.repo} (offline? {type(e).__name__}); "
                f"connect and rerun, or fetch {', '.join(src.patterns)} elsewhere into "
                f"DIR/{src.repo}/ and pass --from DIR")

    @staticmethod
    def _gated(src: Source) -> str:
        return (f"{src.repo} is gated: accept its terms at {src.page} with your hub account, then log in "
                f"(`hf auth login`) or set HF_TOKEN (or pass --token)")


class LocalDir:
    """Local copies laid out as root/<owner>/<name>/<path in the repo>."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def files(self, src: Source) -> list[Path]:
        base = self.root / src.repo
        found = _match(base, src.patterns)
        if not found:
            raise DataError(f"no {' or '.join(src.patterns)} under {base}; download them from {src.page}")
        return found


def _match(folder: Path, patterns) -> list[Path]:
    """Files under folder matching the first pattern that matches any, sorted."""
    if not folder.is_dir():
        return []
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    for pat in patterns:
        hits = [p for p in every if fnmatch.fnmatch(p.relative_to(folder).as_posix(), pat)]
        if hits:
            return hits
    return []


# ----------------------------------------------------------------------------------------
# Readers: JSONL (support.datasets.read_jsonl), parquet (pyarrow, imported only here), CSV.

def read_parquet(path: Path, columns: list[str] | None = None) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path.name} needs pyarrow: pip install pyarrow") from None
    try:
        schema = pq.read_schema(path)
        cols = [c for c in columns if c in schema.names] if columns else None
        return pq.read_table(path, columns=cols).to_pylist()
    except Exception as e:  # a truncated download, not a parquet file at all
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {cut(str(e), 120)}); "
                        f"delete it and rerun") from None


def read_rows(path: Path, columns: list[str] | None = None) -> list[dict]:
    if path.suffix == ".parquet":
        return read_parquet(path, columns)
    if path.suffix == ".jsonl":
        return read_jsonl(path, strict=True)
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    raise DataError(f"{path}: unknown file type {path.suffix}")


# ----------------------------------------------------------------------------------------
# Converters: source rows -> our rows. Pure functions, so the tests run them on small files.

def _text(v) -> str:
    return "" if v is None else str(v).strip()


def nq_rows(records: list[dict]) -> list[dict | None]:
    """One row per record, None where the record has no question or no answer (kept as a
    placeholder so that the mix's permutation still lines up with the official one)."""
    out = []
    for idx, r in enumerate(records):
        q = _text(r.get("question"))
        if q and not q.endswith("?"):
            q += "?"
        answers = r.get("golden_answers")
        answers = [answers] if isinstance(answers, str) else list(answers or [])
        aliases = list(dict.fromkeys(a for a in (_text(x) for x in answers) if a))
        out.append({"id": f"nq-{idx}", "question": q, "answer": aliases, "kind": "text", "task": "nq"}
                   if q and aliases else None)
    return out


def deepmath_rows(records: list[dict]) -> list[dict | None]:
    out = []
    for idx, r in enumerate(records):
        q, a = _text(r.get("question")), _text(r.get("final_answer"))
        out.append({"id": f"deepmath-{idx}", "question": q, "answer": a, "kind": "math", "task": "deepmath"}
                   if q and a else None)
    return out


def shuffle_like_datasets(rows: list, seed: int = MIX_SEED) -> list:
    """The order datasets.Dataset.shuffle(seed) gives: row k of the result is row
    default_rng(seed).permutation(n)[k] of the input."""
    import numpy as np
    perm = np.random.default_rng(seed).permutation(len(rows))
    return [rows[int(i)] for i in perm]


def gaia_rows(records: list[dict], with_files: bool = False) -> list[dict]:
    out = []
    for r in records:
        if _text(r.get("file_name")) and not with_files:
            continue
        q, a = _text(r.get("Question")), _text(r.get("Final answer"))
        if not q or not a or a == "?":  # the test split hides its answers as "?"
            continue
        kind = "number" if parse_number(a, allow_units=False) is not None else "text"
        out.append({"pid": str(len(out)), "task_id": _text(r.get("task_id")), "query": q, "answer": a,
                    "kind": kind, "level": _text(r.get("Level"))})
    return out


def gpqa_rows(records: list[dict], seed: int = 0) -> list[dict]:
    letters = "ABCD"
    out = []
    for k, r in enumerate(records):
        q = _text(r.get("Question"))
        opts = [_text(r.get("Correct Answer"))] + [_text(r.get(f"Incorrect Answer {i}")) for i in (1, 2, 3)]
        if not q or not all(opts):
            continue
        rid = _text(r.get("Record ID")) or str(k)
        order = list(range(4))
        random.Random(f"gpqa:{seed}:{rid}").shuffle(order)  # a str seed hashes the same everywhere
        right = order.index(0)
        options = [f"{letters[j]}. {opts[i]}" for j, i in enumerate(order)]
        out.append({"pid": str(len(out)), "record_id": rid, "query": q, "options": options,
                    "answer": options[right], "answer_idx": str(right), "kind": "choice",
                    "domain": _text(r.get("High-level domain"))})
    return out


# ----------------------------------------------------------------------------------------
# The three jobs. Each returns {output path: rows} and prints what it read.

def _rows_of(fetch, src: Source, columns=None) -> list[dict] | None:
    files = fetch.files(src)
    if files is None:
        gate = f"; gated: accept its terms at {src.page} and log in first" if src.gated else ""
        print(f"  would download {src.repo}: {', '.join(src.patterns)} ({src.size}{gate})")
        return None
    rows = []
    for f in files:
        rows += read_rows(f, columns)
    print(f"  read {len(rows)} rows from {src.repo} ({len(files)} file{'s' * (len(files) > 1)})")
    return rows


def job_train(fetch, out: Path, heldout: int = 200, limit: int = 0, seed: int = MIX_SEED) -> dict:
    print(f"train: {NQ.repo} + {DEEPMATH.repo}, shuffled with seed {seed}")
    nq = _rows_of(fetch, NQ)
    dm = _rows_of(fetch, DEEPMATH, columns=["question", "final_answer"])
    if nq is None or dm is None:
        return {out / "train.jsonl": None, out / "heldout.jsonl": None}
    mixed = shuffle_like_datasets(nq_rows(nq) + deepmath_rows(dm), seed)
    kept = [r for r in mixed if r is not None]
    if len(kept) < len(mixed):
        print(f"  dropped {len(mixed) - len(kept)} row(s) without a question or an answer")
    held, train = kept[:heldout], kept[heldout:]
    if not train:
        raise DataError(f"the mix has {len(kept)} rows, no more than --heldout {heldout}: nothing left to train on")
    if limit:
        train = train[:limit]
    return {out / "train.jsonl": train, out / "heldout.jsonl": held}


def job_gaia(fetch, out: Path, with_files: bool = False) -> dict:
    print(f"gaia: {GAIA.repo}, validation split{'' if with_files else ', tasks without attached files'}")
    rows = _rows_of(fetch, GAIA)
    return {out / "gaia.json": None if rows is None else gaia_rows(rows, with_files)}


def job_gpqa(fetch, out: Path, subset: str = "diamond", seed: int = 0) -> dict:
    src = gpqa_source(subset)
    print(f"gpqa: {src.repo}, {subset}")
    rows = _rows_of(fetch, src)
    name = "gpqa.json" if subset == "diamond" else f"gpqa_{subset}.json"
    return {out / name: None if rows is None else gpqa_rows(rows, seed)}


def describe(rows: list[dict]) -> str:
    kinds = Counter(r.get("kind", "?") for r in rows)
    tasks = Counter(r.get("task") for r in rows if r.get("task"))
    text = f"{len(rows)} rows; kinds " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    if tasks:
        text += "; tasks " + ", ".join(f"{k} {n}" for k, n in sorted(tasks.items()))
    return text


def write(outputs: dict, dry_run: bool) -> None:
    for path, rows in outputs.items():
        if rows is None:
            print(f"  would write {path} once the sources are downloaded")
            continue
        verb = "would write" if dry_run else "wrote"
        if not dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            if path.suffix == ".jsonl":
                dump_jsonl(rows, tmp)
            else:
                tmp.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            os.replace(tmp, path)  # never a half-written file under the real name
        print(f"  {verb} {path}: {describe(rows)}")
        if dry_run and rows:
            print(f"    first row: {cut(json.dumps(rows[0], ensure_ascii=False), 300)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.prepare_data",
                                 description="Download the paper's training mix (NQ + DeepMath-103K) and the gated "
                                 "GAIA / GPQA evaluation sets, and convert them to this project's formats.",
                                 epilog="GAIA and GPQA are gated: accept their terms on the hub and log in "
                                 "(hf auth login) or set HF_TOKEN.")
    ap.add_argument("what", choices=("train", "gaia", "gpqa", "all"), help="which data set(s)")
    ap.add_argument("--out", default=None, help="output folder (train: data/nq_deepmath; gaia, gpqa: "
                    "data/benchmarks)")
    ap.add_argument("--from", dest="source_dir", default=None, metavar="DIR",
                    help="read local copies laid out as DIR/<owner>/<name>/<path> instead of the hub")
    ap.add_argument("--token", default=None, help="hub token (default: HF_TOKEN or a saved login)")
    ap.add_argument("--dry-run", action="store_true", help="download nothing and write nothing: show what "
                    "would be written (rows and kinds for sources already on disk)")
    ap.add_argument("--heldout", type=int, default=200, help="train: rows of the shuffled mix held out "
                    "(default 200)")
    ap.add_argument("--limit", type=int, default=0, help="train: keep only the first N training rows")
    ap.add_argument("--seed", type=int, default=MIX_SEED, help="train: shuffle seed (official: 42)")
    ap.add_argument("--with-files", action="store_true", help="gaia: keep the tasks that come with an "
                    "attached file too")
    ap.add_argument("--subset", choices=GPQA_SUBSETS, default="diamond", help="gpqa: which file (default "
                    "diamond, 198 questions)")
    args = ap.parse_args(argv)
    if args.heldout < 0 or args.limit < 0:
        ap.error("--heldout and --limit must be >= 0")
    fetch = LocalDir(args.source_dir) if args.source_dir else Hub(args.token, local_only=args.dry_run)
    todo = ("train", "gaia", "gpqa") if args.what == "all" else (args.what,)
    try:
        for what in todo:
            if what == "train":
                outputs = job_train(fetch, Path(args.out or "data/nq_deepmath"), args.heldout, args.limit,
                                    args.seed)
            elif what == "gaia":
                outputs = job_gaia(fetch, Path(args.out or "data/benchmarks"), args.with_files)
            else:
                outputs = job_gpqa(fetch, Path(args.out or "data/benchmarks"), args.subset)
            write(outputs, args.dry_run)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if "gaia" in todo and not args.dry_run:
        print("note: GAIA's terms forbid resharing it; keep gaia.json out of public repositories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
