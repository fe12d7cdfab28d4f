"""Write a run's report page, or a page comparing runs, from the shell:

    python -m scripts.report OUT_DIR         writes OUT_DIR/report.html and prints its path
    python -m scripts.report RUN_A RUN_B [...] [--out FILE]
                                             compares runs; writes FILE, by default
                                             compare_<A>_<B>...html in the folder that holds
                                             the runs (a comparison belongs to no one run, so
                                             it is not written into any of them)

Exit status 0 when the page was written, 2 on a usage error or a missing run directory.
The pages themselves are support/report/page.py (one run) and support/report/compare.py
(several).
"""

import sys

from support.report.compare import write_comparison
from support.report.page import write_report


def main(argv: list[str] | None = None) -> int:
    args, out = list(sys.argv[1:] if argv is None else argv), None
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1] if i + 1 < len(args) else None
        del args[i:i + 2]
        if out is None:
            args = []
    if not args or any(a.startswith("-") for a in args):
        print(__doc__.split("\n\n")[1])  # the usage lines above
        return 2
    try:
        path = write_report(args[0]) if len(args) == 1 else write_comparison(args, out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
