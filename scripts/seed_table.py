"""The README's results table from finished runs, one column per run (one per seed):

    python -m scripts.seed_table runs/seed0 runs/seed1 runs/seed2 runs/seed3 runs/seed4

Reads each run's learning.json (the summaries before and after training, held-out and,
when the run had data.paraphrase, the paraphrase set) and its eval/step_N/results.jsonl
(which items went from right to wrong). Prints a Markdown table: accuracy overall and per
task kind, how the two-step questions were planned (the plan "Local_Search >
Python_Coder" is the one the built-in suite needs), mean turns, the flips, wall time.
The before column is the first run's: evaluation is greedy with a fixed seed, so it is the
same for every seed of one config (a run whose before differs is flagged with a *).

Exit status 0 when the table was printed, 2 when a folder has no learning.json.
"""

import argparse
import json
import sys
from pathlib import Path

TWO_STEP_PLAN = "Local_Search > Python_Coder"


def flips(run: Path, where: str = "") -> tuple[int, int]:
    """(wrong -> right, right -> wrong) items between the first and the last evaluation."""
    folder = run / "eval" / where
    steps = sorted(int(d.name.split("_")[1]) for d in folder.glob("step_*") if (d / "results.jsonl").exists())
    if len(steps) < 2:
        return 0, 0
    read = lambda s: {r["id"]: r["correct"] for r in map(json.loads, (folder / f"step_{s}" / "results.jsonl")  # noqa: E731
                                                         .read_text().splitlines())}
    before, after = read(steps[0]), read(steps[-1])
    return (sum(after[i] and not before[i] for i in after if i in before),
            sum(before[i] and not after[i] for i in after if i in before))


def rows(pairs: list[tuple[dict, dict]], flipped: list[tuple[int, int]], label: str) -> list[str]:
    """The table's lines for one set: pairs = (before, after) summaries, one per run."""
    first = pairs[0][0]
    kinds = sorted(first.get("by_kind", {}))
    cell = lambda b, a: f"{a:.3f} ({a - b:+.3f})"  # noqa: E731
    mark = lambda b: "" if b == first["accuracy"] else " *"  # noqa: E731
    out = [f"| {label}, all | {first['accuracy']:.3f} | "
           + " | ".join(f"**{cell(b['accuracy'], a['accuracy'])}**{mark(b['accuracy'])}" for b, a in pairs) + " |"]
    for k in kinds:
        out.append(f"| {k} | {first['by_kind'][k]['accuracy']:.3f} | "
                   + " | ".join(f"{a['by_kind'][k]['accuracy']:.3f}" for _, a in pairs) + " |")
    if "two_step" in kinds:
        n = first["by_kind"]["two_step"]["n"]
        plan = lambda s: round(s["by_kind"]["two_step"]["plans"].get(TWO_STEP_PLAN, 0.0) * n)  # noqa: E731
        out.append(f"| two_step planned search, then code | {plan(first)}/{n} | "
                   + " | ".join(f"{plan(a)}/{n}" for _, a in pairs) + " |")
    turns = lambda s: " / ".join(f"{s['by_kind'][k]['mean_turns']:.2f}" for k in kinds)  # noqa: E731
    out.append(f"| mean turns, {' / '.join(kinds)} | {turns(first)} | " + " | ".join(turns(a) for _, a in pairs) + " |")
    out.append("| items wrong -> right / right -> wrong | | " + " | ".join(f"{g} / {lo}" for g, lo in flipped) + " |")
    return out


def table(runs: list[Path]) -> str:
    learned = [json.loads((r / "learning.json").read_text()) for r in runs]
    head = ["| | before | " + " | ".join(r.name for r in runs) + " |", "|---" * (len(runs) + 2) + "|"]
    lines = head + rows([(x["before"], x["after"]) for x in learned], [flips(r) for r in runs], "held-out")
    if all("paraphrase" in x for x in learned):
        lines += rows([(x["paraphrase"]["before"], x["paraphrase"]["after"]) for x in learned],
                      [flips(r, "paraphrase") for r in runs], "paraphrase")
    wall = [x.get("run", {}).get("wall_s") for x in learned]
    lines.append("| wall time | | " + " | ".join(f"{int(w // 60)} min {int(w % 60)} s" if w else "-" for w in wall) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.seed_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, one per seed, in column order")
    runs = parser.parse_args(argv).runs
    missing = [str(r) for r in runs if not (r / "learning.json").is_file()]
    if missing:
        print(f"error: no learning.json in {', '.join(missing)} (a run writes it when it finishes)", file=sys.stderr)
        return 2
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
