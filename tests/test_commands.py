"""Every command the README shows starts from its documented path, run as a user runs it
(a new process, from the repository root): its usage names that path. The commands that
do real work are exercised by their own tests (train and eval in test_train.py, torchrun
in test_dist.py, the report in test_report.py, gpu_check, prepare_data, make_tasks,
build_index, probe_tools in theirs); the BM25 benchmark runs here, on a tiny corpus."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem != "__init__")


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_starts_under_its_documented_path(name):
    r = run("-m", f"scripts.{name}", "--help")
    usage = r.stdout + r.stderr
    assert f"python -m scripts.{name}" in usage, usage[-500:]
    assert r.returncode in (0, 2) and "Traceback" not in usage, usage[-500:]
    assert f"python -m scripts.{name}" in (ROOT / "README.md").read_text()  # and the README shows it


def test_the_method_commands_start():
    r = run("train.py")
    assert r.returncode == 2 and "python train.py config.yaml" in r.stdout
    r = run("eval.py", "--help")
    assert r.returncode == 0 and "--benchmark" in r.stdout and "--sweep" in r.stdout


def test_bm25_bench_on_a_tiny_corpus(tmp_path):
    r = run("-m", "scripts.bm25_bench", "--passages", "2000", "--queries", "5", "--dir", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ours = set(re.findall(r"^ours (\w+): \S", r.stdout, flags=re.M))  # our index's figures
    assert {"build_s", "index_disk_mb", "query_ms"} <= ours, r.stdout


def test_the_smoke_config_runs_the_whole_pipeline(tmp_path):
    """configs/smoke.yaml, the check of a fork, as a user runs it: the default model and
    tools, two steps, a checkpoint and a report, in a fresh process."""
    import json
    r = run("train.py", "configs/smoke.yaml", f"out_dir={tmp_path}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2] and all(m["optimizer_steps"] == 1 for m in rows)
    assert (tmp_path / "checkpoints" / "step_2" / "trainer_state.pt").exists() and (tmp_path / "report.html").exists()
    assert (tmp_path / "model" / "model.safetensors").exists()  # the trained planner, exported at the end
