"""The run report: runs.py reads a run directory, stats.py holds the intervals and tests,
charts.py draws the SVG, blocks.py and curves.py hold what both pages share, page.py
writes a run's report.html and compare.py the page comparing runs. The command line is
`python -m scripts.report RUN [RUN ...]`."""
