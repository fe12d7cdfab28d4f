"""Configuration: every knob, its default, and validation on load.

`load_config(path, overrides)` reads a YAML file, applies dotted `key=value` overrides
(`train.lr=1e-5`, `out_dir=runs/x`), and checks the result against DEFAULTS: an unknown
key, a value of the wrong type, or an impossible combination fails at once with the
key's name and what is allowed. Every key the code reads is listed here, once.
"""

import copy
from pathlib import Path

import yaml

from tools import DEFAULT_TOOL_CFG

DEFAULTS = {
    "seed": 0,  # one seed drives data order, sampling and initialisation
    "out_dir": "runs/default",  # metrics.jsonl, checkpoints/, eval/, report.html land here
    "resume": True,  # continue from the latest checkpoint in out_dir if there is one
    "model": {
        "name": "smollm2-135m",  # HF name or path; "smollm2-135m" = the offline default (see agentflow.py)
        "device": "auto",  # auto | cpu | cuda
        "dtype": "float32",  # weights' dtype: float32 | bfloat16 | float16
        "threads": 0,  # torch CPU threads; 0 = leave torch's default
    },
    "agent": {
        "tools": ["Base_Generator", "Python_Coder", "Local_Search"],  # the toolset K
        "max_turns": 3,  # T_max while training (paper: 3; up to 10 at test)
        "constrain_tool": True,  # the planner's first token must begin a tool name (agentflow.py)
        "force_tool": "",  # measurement: every planner action picks this tool (eval.py --force-tool)
        "code_start": "",  # text every Python_Coder input must begin with ("print(" for a 135M model)
        "memory_budget_chars": 1200,  # cap on the rendered memory block
        "result_chars": 400,  # cap on one tool result in memory
        # Sampling per module. The planner is the policy: temperature > 0, no truncation,
        # so the sampler's log-probs are exactly what the loss recomputes.
        # first_temperature: the temperature of the planner's first token, which with
        # constrain_tool is the tool choice (0 = temperature). Above 1 it explores tools
        # the initial model rarely picks; the loss scores that token at the same
        # temperature, so training stays on-policy, and greedy evaluation ignores it.
        "planner": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 40, "first_temperature": 0.0},
        "executor": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 96},
        "verifier": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 1},  # a forced STOP / CONTINUE token
        "generator": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 32},
    },
    "tools": dict(DEFAULT_TOOL_CFG),  # passed to tools.build_tools; tools.py comments each key
    "data": {
        "train": "data/train.jsonl",  # JSONL rows: question, answer, kind (judge), task (optional)
        "heldout": "data/heldout.jsonl",
    },
    "train": {
        "steps": 20,  # optimizer rounds (rollout batches)
        "queries_per_step": 8,  # Q queries drawn per step
        "group_size": 4,  # G rollouts per query
        "lr": 2e-5,  # AdamW learning rate (paper: 1e-6 for a 7B model)
        "weight_decay": 0.0,
        "warmup_steps": 0,  # linear warmup, then constant
        "max_grad_norm": 1.0,
        "eps_low": 0.2,  # clip range 1 - eps_low (paper 0.2)
        "eps_high": 0.3,  # clip range 1 + eps_high (paper 0.3)
        "beta": 0.001,  # KL coefficient (paper 0.001, k3 estimator)
        "advantage_mode": "trajectory",  # trajectory (paper) | turn_rows (official code)
        "epochs": 1,  # PPO epochs over one rollout batch
        "minibatches": 1,  # optimizer steps per epoch
        "micro_batch": 16,  # rows per forward/backward (memory only; the result does not change)
        "train_layers": 0,  # 0 = train every weight; N = only the top N blocks and the final norm
        "bf16_autocast": False,  # CUDA only: run the update's forward in bfloat16
        "save_every": 10,  # checkpoint every N steps (and at the end)
        "eval_every": 0,  # held-out evaluation every N steps (0 = only before and after)
        "eval_before_after": True,  # held-out evaluation before the first and after the last step
    },
    "eval": {
        "limit": 0,  # held-out items to evaluate (0 = all)
        "batch_size": 32,  # trajectories run in lockstep
        "max_turns": 3,
        "seed": 1234,  # the same seed before and after training: a fair comparison
        # The planner's temperature in evaluation. 0 = greedy: the tool the policy finds
        # most likely, so before vs after measures what training changed, not sampling luck.
        "planner_temperature": 0.0,
    },
    "judge": {
        "llm": False,  # also ask an LLM judge when the rules say wrong (off: rules only)
        "base_url": "",  # OpenAI-compatible endpoint; empty = the local frozen model
        "model": "",
        "api_key_env": "OPENAI_API_KEY",
    },
}

CHOICES = {
    "model.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "train.advantage_mode": ("trajectory", "turn_rows"),
    "tools.python_isolation": ("namespaces", "rlimits"),
}


class ConfigError(ValueError):
    pass


def load_config(path: str | None = None, overrides: list[str] = ()) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {path} not found")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
        _merge(cfg, loaded, DEFAULTS, "")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=2")
        key, value = item.split("=", 1)
        node, parts = {}, key.split(".")
        leaf = node
        for part in parts[:-1]:
            leaf = leaf.setdefault(part, {})
        leaf[parts[-1]] = yaml.safe_load(value)
        _merge(cfg, node, DEFAULTS, "")
    _check_combinations(cfg)
    return cfg


def _merge(cfg: dict, new: dict, ref: dict, prefix: str) -> None:
    for key, value in new.items():
        name = prefix + str(key)
        if key not in ref:
            raise ConfigError(f"unknown config key '{name}'; allowed here: {', '.join(sorted(ref))}")
        want = ref[key]
        if isinstance(want, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{name}' must be a mapping with keys {', '.join(sorted(want))}")
            _merge(cfg[key], value, want, name + ".")
            continue
        cfg[key] = _coerce(name, value, want)


def _coerce(name: str, value, want):
    kind = type(want)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is float and isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if kind is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{name}' must be a {kind.__name__} (default {want!r}), "
                          f"got {type(value).__name__} {value!r}")
    if name in CHOICES and value not in CHOICES[name]:
        raise ConfigError(f"config key '{name}' must be one of {', '.join(CHOICES[name])}, got {value!r}")
    return value


def _check_combinations(cfg: dict) -> None:
    t, a = cfg["train"], cfg["agent"]
    planner = a["planner"]
    if planner["temperature"] <= 0 or planner["top_p"] != 1.0 or planner["top_k"] != 0:
        raise ConfigError("agent.planner must sample with temperature > 0, top_p = 1.0 and top_k = 0: "
                          "the loss scores actions under softmax(logits / temperature), which is the "
                          "sampling distribution only without truncation")
    if planner["first_temperature"] < 0:
        raise ConfigError("agent.planner.first_temperature must be >= 0 (0 = the same as temperature)")
    for key in ("steps", "queries_per_step", "group_size", "epochs", "minibatches", "micro_batch"):
        if t[key] < 1:
            raise ConfigError(f"config key 'train.{key}' must be >= 1, got {t[key]}")
    if t["group_size"] < 2:
        raise ConfigError("config key 'train.group_size' must be >= 2: a group of one rollout always "
                          "has advantage 0")
    if not 0 <= t["eps_low"] < 1 or t["eps_high"] < 0:
        raise ConfigError("train.eps_low must be in [0, 1) and train.eps_high >= 0")
    if t["bf16_autocast"] and cfg["model"]["device"] == "cpu":
        raise ConfigError("train.bf16_autocast needs model.device cuda (or auto on a GPU machine)")
    if a["max_turns"] < 1 or cfg["eval"]["max_turns"] < 1:
        raise ConfigError("agent.max_turns and eval.max_turns must be >= 1")
    if not a["tools"]:
        raise ConfigError("agent.tools must name at least one tool")
    if a["force_tool"] and a["force_tool"] not in a["tools"]:
        raise ConfigError(f"agent.force_tool is {a['force_tool']!r}, which is not in agent.tools "
                          f"({', '.join(a['tools'])}); name one of those or leave it empty")
