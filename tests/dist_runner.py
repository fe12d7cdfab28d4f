"""What tests/test_dist.py starts under torchrun: a list of jobs, one after another, in
every rank.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_runner.py JOBS.json

JOBS.json: {"dumps": DIR, "jobs": [{"train": [overrides]} | {"train_main": [argv]} | {"eval_main": [argv]}]}.
"train" is train.run on config.yaml with the overrides; "train_main" and "eval_main" are the
command lines' main(). The process group stays up from the first job to the last: the mains'
own leaving (ranks.shutdown) waits for the end, since a group left and started again in one
process can deadlock its next collective. A job with
"flaky": true runs with test_dist.flaky's Local_Search.

The reward is test_dist.alternating_verdicts: a random model never answers right, and
this one gives every group a signal. After every training step each rank saves its trainable weights
to DIR/<out_dir name>_rank<r>_step<n>.pt, so the test can compare the ranks' weights.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import judge  # noqa: E402
from support import ranks  # noqa: E402
import train  # noqa: E402
import tools  # noqa: E402
from test_dist import alternating_verdicts, flaky  # noqa: E402


def main(jobfile: str) -> int:
    spec = json.loads(Path(jobfile).read_text())
    dumps, rank = Path(spec["dumps"]), int(os.environ["RANK"])
    judge.Judge.score_batch = alternating_verdicts
    leave, ranks.shutdown = ranks.shutdown, lambda: None  # once, after the last job (below)
    real_step = train.train_step

    def step_and_dump(cfg, step, agent, model, *a, **kw):
        metrics = real_step(cfg, step, agent, model, *a, **kw)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(trained, dumps / f"{Path(cfg['out_dir']).name}_rank{rank}_step{step + 1}.pt")
        return metrics
    train.train_step = step_and_dump

    from support.config import load_config
    reliable = tools.LocalSearch._run
    for job in spec["jobs"]:
        tools.LocalSearch._run = flaky(reliable) if job.pop("flaky", False) else reliable
        (kind, args), = job.items()
        if kind == "train":
            train.run(load_config(str(ROOT / "config.yaml"), args))
        elif kind == "train_main":
            if train.main(args):
                return 1
        elif kind == "eval_main":
            import eval as evaluation
            if evaluation.main(args):
                return 1
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
