"""Export a run's trained planner, whole, in Hugging Face format, from its latest checkpoint.

    python -m scripts.export_model RUN_DIR [--out DIR]      default DIR: RUN_DIR/model

A checkpoint holds only what a resume needs (support/checkpoints.py); train.py exports the
whole model at the end of a run, and this does it for a run that is still going or was cut
short: the configured planner model (RUN_DIR/config.json) with the checkpoint's trained
weights (with LoRA: merged, and adapter.safetensors beside it), loadable with
`AutoModelForCausalLM.from_pretrained` and by eval.py --model.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from lora import export, trained_weights
from support.checkpoints import checkpoints, load_trained
from support.config import DEFAULTS
from support.models import load_model, planner_name
from support.optim import PlannerOptimizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.export_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's out_dir")
    ap.add_argument("--out", default=None, help="where to write the model (default: RUN_DIR/model)")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    found = sorted(checkpoints(run))
    if not (run / "config.json").is_file() or not found:
        print(f"error: {run} holds no run with a checkpoint (config.json and checkpoints/step_N)", file=sys.stderr)
        return 2
    cfg = json.loads((run / "config.json").read_text())
    step, path = found[-1]
    model, tok = load_model(planner_name(cfg["model"]), "cpu", cfg["model"]["dtype"])
    t = {**DEFAULTS["train"], **cfg["train"]}  # a run from before a key existed ran its default
    trained = trained_weights(model, t)  # with train.lora_rank: the adapters, their values loaded next
    state = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    load_trained(model, state["trained"], path)  # fp32 weights; bf16 ones come from their masters:
    PlannerOptimizer(trained, t["lr"]).load_state_dict(state)
    print(export(Path(args.out) if args.out else run / "model", model, tok), f"(step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
