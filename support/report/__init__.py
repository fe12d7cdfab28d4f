"""report.html for a run, and a page comparing runs: `python -m scripts.report RUN [RUN ...]`."""
