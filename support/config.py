"""Configuration: every knob, its default, and validation on load.

`load_config(path, overrides)` reads a YAML file, applies dotted `key=value` overrides
(`train.lr=1e-5`, `out_dir=runs/x`), and checks the result against DEFAULTS: an unknown
key, a value of the wrong type or an impossible combination fails at once with the key's
name and what is allowed. Every key the code reads is listed here, once, except the
tools' own settings, which each tool class lists (tools.py) and check_tools below checks
with the names in agent.tools. `check_run` then checks what lies outside the file - the
data, the judge's endpoint and key, the models' files, the disk - beside what the method
files check of the names a config gives, so that train.py and eval.py fail in one line per
problem before any model is loaded (minutes at 7B), not with a traceback after.
"""

import copy
import difflib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml


DEFAULTS = {
    "seed": 0,  # one seed drives data order, sampling and initialisation
    "out_dir": "runs/default",  # metrics.jsonl, checkpoints/, eval/, report.html land here
    # continue out_dir's run from its latest checkpoint (with its config, but for RESUMABLE);
    # false: out_dir must hold no run (support/checkpoints.check_out_dir)
    "resume": True,
    "model": {
        "name": "smollm2-135m",  # HF name or path; "smollm2-135m" = the offline default (support/models.py)
        # The planner's own model, trained from these weights (pi_ref is their frozen copy);
        # "" = model.name. The executor, verifier and generator always run model.name, frozen.
        # Both must share one tokenizer: the planner's actions are read by the frozen modules.
        "planner": "",
        "device": "auto",  # auto | cpu | cuda
        "dtype": "float32",  # weights' dtype: float32 | bfloat16 | float16
        "threads": 0,  # torch CPU threads; 0 = leave torch's default
        # The memory plan (support/device_memory.py, printed at start; `python train.py CONFIG --plan`).
        "memory_gb": 0.0,  # memory the run may use, GB of 1e9 bytes; 0 = the device's total on CUDA, no limit on CPU
        "max_prompt_tokens": 2048,  # the longest prompt the plan provisions for (longer ones: smaller sub-batches)
        "prefill_tokens": 8192,  # under a memory limit: tokens one prefill forward may hold (rows x cached + new)
    },
    "agent": {
        "tools": ["Base_Generator", "Python_Coder", "Local_Search"],  # the toolset K
        "max_turns": 3,  # T_max while training (paper: 3; up to 10 at test)
        "constrain_tool": True,  # the planner's first token must begin a tool name (agentflow.py)
        "force_tool": "",  # measurement: "A" or "A,B": turn t's action picks the t-th tool (eval.py --force-tool)
        "code_start": "",  # text the input of a tool that writes code (Python_Coder) must begin with ("print(")
        # What the planner reads of the memory (memory.PLANNER_VIEWS): found (what each step found,
        # and what the verifier found still open) | records (the whole block the other modules read)
        "planner_view": "found",
        # Module prompts replaced by name (agentflow.PROMPTS: planner_system, generator_user, ...);
        # each keeps the {fields} of the one it replaces. {} = the shipped prompts.
        "prompts": {},
        "memory_budget_chars": 1200,  # cap on the rendered memory block
        "result_chars": 400,  # cap on one tool result in memory
        # Sampling per module: temperature (0 = greedy), the token limit, and stop strings
        # (generation ends once the text holds one). The planner is the policy: it samples
        # at temperature > 0 from the full softmax, which the loss recomputes exactly.
        # first_temperature: the temperature of the planner's first token, which with
        # constrain_tool is the tool choice (0 = temperature). Above 1 it explores tools
        # the initial model rarely picks; the loss scores that token at the same
        # temperature, so training stays on-policy, and greedy evaluation ignores it.
        "planner": {"temperature": 1.0, "max_new_tokens": 40, "stop": ["\n\n"], "first_temperature": 0.0},
        # The executor's stop strings come from the chosen tool (tools.py, input_stops).
        "executor": {"temperature": 0.0, "max_new_tokens": 96, "stop": []},
        "verifier": {"temperature": 0.0, "max_new_tokens": 1, "stop": []},  # a forced STOP / CONTINUE token
        "generator": {"temperature": 0.0, "max_new_tokens": 32, "stop": ["\n"]},
    },
    # The tools' own settings: each tool class lists and comments its own (tools.py,
    # web_tools.py), and check_tools (below) checks them, as it does agent.tools.
    "tools": {},
    "data": {
        # JSONL rows: question, answer, kind (judge), task (optional). One file, or a list of
        # files read as one pool in order (`data.train=[a.jsonl, b.jsonl]`).
        "train": ["data/train.jsonl"],
        "heldout": "data/heldout.jsonl",
        # Evaluated beside heldout before and after training (train.eval_before_after, eval.limit
        # and eval.* alike), never trained on: the held-out entities in wordings no other file
        # uses (scripts/make_tasks.py). "" = none.
        "paraphrase": "data/paraphrase.jsonl",
    },
    "train": {
        "steps": 20,  # optimizer rounds (rollout batches)
        "queries_per_step": 8,  # Q queries drawn per step
        "group_size": 4,  # G rollouts per query
        # kind -> weight: each task kind (a data row's "task") takes that share of every step;
        # {} = its share of the data. Name every kind of data.train (datasets.draw_queries).
        "task_shares": {},
        # the first step task_shares applies to (1 = every step); the steps before it draw the
        # data's shares: a curriculum that meets the composite kind more once the parts are learned
        "task_shares_from": 1,
        "lr": 2e-5,  # AdamW learning rate (paper: 1e-6 for a 7B model)
        "weight_decay": 0.0,
        "warmup_steps": 0,  # linear warmup, then constant
        "max_grad_norm": 1.0,
        "eps_low": 0.2,  # clip range 1 - eps_low (paper 0.2)
        "eps_high": 0.3,  # clip range 1 + eps_high (paper 0.3)
        "beta": 0.001,  # KL coefficient (paper 0.001)
        "kl_estimator": "k3",  # per-token KL: k3 (paper; its gradient is the forward KL's) | k2 (flow_grpo.token_kl)
        # How credit reaches a turn (flow_grpo.kept_rows): trajectory (the paper: A_i broadcast to
        # every turn) | turn_rows (the official code: the same, normalised over turn rows) |
        # per_turn (each turn its own advantage, from the score train.turn_score names).
        "advantage_mode": "trajectory",
        # How a group's rewards become advantages (flow_grpo.ADVANTAGE_ESTIMATORS): grpo (the paper:
        # (R - mean) / std) | dr_grpo (R - mean) | rloo (R - the mean of the others) |
        # reinforce_pp_baseline (R - the group's mean, over the batch's std) | one's own.
        "advantage": "grpo",
        "turn_score": "outcome",  # per_turn: a score per planner turn (judge.TURN_SCORES, or one's own)
        "row_weight": "trajectory",  # trajectory (J's 1/T_i average over a rollout's turns) | turn (rows alike)
        "epochs": 1,  # PPO epochs over one rollout batch
        "minibatches": 1,  # optimizer steps per epoch
        # rows per forward/backward (memory only; the result does not change); "auto": the
        # most the memory plan fits beside everything else, up to 16 (16 without a budget)
        "micro_batch": 16,
        "logits_chunk": 1024,  # action positions whose [chunk, V] float32 logits exist at once in the loss
        "train_layers": 0,  # 0 = train every weight; N = only the top N blocks and the final norm
        # LoRA (lora.py): 0 = off, every weight of the train_layers blocks trains (the paper's
        # full fine-tune); r > 0 = only rank-r adapters on those blocks' projections train, the
        # base frozen and shared by the reference and the frozen modules (one copy in memory).
        "lora_rank": 0,
        "lora_alpha": 32.0,  # the adapters' scale is lora_alpha / lora_rank
        # the projections of each trained block that get adapters (default: all of attention and MLP)
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        # activation checkpointing of the trained blocks (engine.checkpoint_blocks): each keeps its
        # input only and runs its forward again in the backward pass; the update then holds one
        # block's activations instead of every trained block's (the same result, more compute)
        "grad_checkpoint": False,
        "save_every": 10,  # checkpoint every N steps (and at the end)
        "eval_every": 0,  # held-out evaluation every N steps (0 = only before and after)
        "eval_before_after": True,  # held-out evaluation before the first and after the last step
        # Steps in a row in which infrastructure failures (network, keys, quotas) left no group
        # to train on, before the run stops and says so; 0 = go on regardless
        "max_infra_steps": 3,
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
    # The reward a trajectory trains on (judge.Reward): a weighted sum of named terms.
    "reward": {
        "terms": {"correct": 1.0},  # name -> weight; correct is the paper's 0/1 R (judge.py lists the others)
        "modules": [],  # modules that define terms of your own (@judge.reward_term), imported first
    },
    "judge": {
        "llm": False,  # also ask an LLM judge when the rules say wrong (off: rules only)
        "base_url": "",  # OpenAI-compatible endpoint (vLLM, llama.cpp, a paid API); empty = the frozen policy
        "model": "",  # the model name the endpoint serves
        "api_key_env": "OPENAI_API_KEY",  # NAME of the variable holding the key; "" = send none (local server)
        "timeout_s": 30.0,  # per request; a timeout is no verdict, i.e. the rule's (wrong)
        "max_workers": 4,  # requests in flight at once
    },
}

CHOICES = {
    "model.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "train.advantage_mode": ("trajectory", "turn_rows", "per_turn"),
    "train.row_weight": ("trajectory", "turn"),
    "train.kl_estimator": ("k3", "k2"),
}


# The range of each number: every numeric knob must be >= 0 (seeds aside), and these
# more: (operator, bound, what a value outside does). Checked before any model loads.
BOUNDS = {
    "model.max_prompt_tokens": (">=", 1, ""), "model.prefill_tokens": (">=", 1, ""),
    "agent.max_turns": (">=", 1, "T_max: a trajectory needs a turn"),
    "agent.memory_budget_chars": (">=", 1, ""), "agent.result_chars": (">=", 1, ""),
    "agent.planner.temperature": (">", 0, "the planner is the policy: the loss scores its actions under "
                                         "softmax(logits / temperature)"),
    **{f"agent.{m}.max_new_tokens": (">=", 1, "") for m in ("planner", "executor", "verifier", "generator")},
    "train.steps": (">=", 1, ""), "train.queries_per_step": (">=", 1, ""),
    "train.group_size": (">=", 2, "a group of one rollout always has advantage 0"),
    "train.task_shares_from": (">=", 1, ""),
    "train.lr": (">", 0, "a step of 0 learns nothing, and a negative one trains against the reward"),
    "train.max_grad_norm": (">", 0, "the clip scales the gradient by max_grad_norm / norm: a negative one "
                                    "flips it, so the run trains against the reward"),
    "train.eps_low": ("<", 1, "the clip range 1 - eps_low must stay above 0"),
    "train.epochs": (">=", 1, ""), "train.minibatches": (">=", 1, ""), "train.micro_batch": (">=", 1, ""),
    "train.logits_chunk": (">=", 1, ""), "train.save_every": (">=", 1, ""),
    "train.lora_alpha": (">", 0, "the adapters' scale lora_alpha / lora_rank: 0 would leave the base untrained"),
    "eval.batch_size": (">=", 1, ""), "eval.max_turns": (">=", 1, ""),
    "judge.timeout_s": (">", 0, ""), "judge.max_workers": (">=", 1, ""),
}
UNBOUNDED = {"seed", "eval.seed"}  # any integer
# What "beta < 0" and the like would do, for the message (the default >= 0 rule).
WHY_NOT_NEGATIVE = {"train.beta": "a negative KL coefficient rewards moving away from pi_ref",
                    "train.weight_decay": "a negative decay grows every weight"}


# Keys that existed once, and why they went: an old config fails with the reason.
REMOVED = {
    "train.equal_task_shares": "set train.task_shares to equal weights instead, e.g. "
                               "{lookup: 1, arithmetic: 1, two_step: 1}",
    "train.bf16_autocast": "it ran the update in bfloat16 over float32 weights that sample in float32, so the "
                           "loss could never score exactly what the sampler drew; set model.dtype=bfloat16 "
                           "instead (the sampler and the trainer then share the weights, with fp32 masters)",
}


class ConfigError(ValueError):
    pass


def load_config(path: str | None = None, overrides: list[str] = ()) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    for layer in _config_files(path) if path else []:  # a `base:` file first, then the file itself
        merge(cfg, layer, DEFAULTS)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=2")
        key, value = item.split("=", 1)
        node = yaml.safe_load(value) if value.strip() else EMPTY  # key= : the key's empty value
        for part in reversed(key.split(".")):  # train.lr=1e-5 -> {"train": {"lr": 1e-5}}
            node = {part: node}
        merge(cfg, node, DEFAULTS)
    problems = out_of_bounds(cfg, DEFAULTS)
    if problems:
        raise ConfigError("\n".join(problems))
    _check_combinations(cfg)
    return cfg


def _config_files(path: str, seen: tuple = ()) -> list[dict]:
    """The YAML mappings a config file stands for, in merge order: a file may start from
    another (`base: qwen2.5-7b-1gpu.yaml`, relative to its own folder) and set only what
    differs; that file's own base comes before it, and so on."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} not found" + (f" (the base of {seen[-1]})" if seen else ""))
    loaded = yaml.safe_load(p.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    base = loaded.pop("base", None)
    if base is None:
        return [loaded]
    if not isinstance(base, str) or p.resolve() in seen:
        raise ConfigError(f"{path}: base must name one other YAML file (relative to {p.parent}), without a "
                          f"cycle; got {base!r}")
    return _config_files(str(p.parent / base), seen + (p.resolve(),)) + [loaded]


EMPTY = object()  # `key=` on the command line: "" for text, [] for a list, {} for a mapping


def out_of_bounds(cfg: dict, ref: dict, prefix: str = "", bounds: dict = BOUNDS) -> list[str]:
    """One line per number outside its range (BOUNDS; >= 0 for the rest), with the key, the
    value, the range, what the value would do, and the default to go back to."""
    out = []
    for key, want in ref.items():
        name, value = prefix + key, cfg.get(key)
        if isinstance(want, dict):
            if isinstance(value, dict) and want:
                out += out_of_bounds(value, want, name + ".", bounds)
            continue
        if name in UNBOUNDED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        op, bound, why = bounds.get(name, (">=", 0, WHY_NOT_NEGATIVE.get(name, "")))
        if not {">": value > bound, ">=": value >= bound, "<": value < bound}[op]:
            out.append(f"config key '{name}' is {value!r}; it must be {op} {bound}"
                       + (" or auto" if name in AUTO_KEYS else "") + (f": {why}" if why else "")
                       + f". Fix: set {name}={want!r} (the default) or another value {op} {bound}")
        if name in bounds and op == "<" and value < 0:  # an upper bound, and the >= 0 of every number
            out.append(f"config key '{name}' is {value!r}; it must be >= 0. Fix: set {name}={want!r} (the default)")
    return out


# Sections whose keys another file owns and checks: their values are taken as given here.
OPEN_SECTIONS = {"tools": "check_tools", "reward.terms": "judge.Reward",
                 "agent.prompts": "agentflow.prompts_with",
                 "train.task_shares": "preflight (against the data's task kinds)"}
# Open mappings taken whole: an override replaces the file's (train.task_shares={} is the data's shares).
WHOLE_MAPPINGS = {"train.task_shares"}


def merge(cfg: dict, new: dict, ref: dict, prefix: str = "", choices: dict = CHOICES) -> None:
    """Write `new` into `cfg`, key by key, each checked against its default in `ref` (its
    type) and `choices` (its allowed values): an unknown key or a wrong value is a
    ConfigError that names the key and what is allowed."""
    for key, value in new.items():
        name = prefix + str(key)
        if name in REMOVED:
            raise ConfigError(f"config key '{name}' was removed: {REMOVED[name]}")
        if key not in ref:
            raise ConfigError(f"unknown config key '{name}'; allowed here: {', '.join(sorted(ref))}")
        want = ref[key]
        if isinstance(want, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{name}' must be a mapping" + (f" with keys {', '.join(sorted(want))}"
                                                                            if want else ""))
            if name in WHOLE_MAPPINGS:
                cfg[key] = dict(value)
            elif name in OPEN_SECTIONS:
                cfg[key].update(value)
            else:
                merge(cfg[key], value, want, name + ".", choices)
            continue
        cfg[key] = _coerce(name, value, want, choices)


# Keys that take "auto" beside a value of their type (decided at start, by the memory plan).
AUTO_KEYS = {"train.micro_batch"}
# List keys where one text stands for a list of one (a single data file).
ONE_OR_MANY = {"data.train"}


def _coerce(name: str, value, want, choices: dict):
    if name in AUTO_KEYS and value == "auto":
        return value
    if value is EMPTY:
        if not isinstance(want, (str, list)):
            raise ConfigError(f"config key '{name}' needs a value (default {want!r}); `{name}=` empties only "
                              f"text and lists")
        value = type(want)()
    kind = type(want)
    if name in ONE_OR_MANY and isinstance(value, str):
        value = [value]
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
        raise ConfigError(f"config key '{name}' must be a {kind.__name__}" + (" or auto" if name in AUTO_KEYS else "")
                          + f" (default {want!r}), got {type(value).__name__} {value!r}")
    if name in choices and value not in choices[name]:
        raise ConfigError(f"config key '{name}' must be one of {', '.join(choices[name])}, got {value!r}")
    return value


def _check_combinations(cfg: dict) -> None:
    t, a = cfg["train"], cfg["agent"]
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0 for w in t["task_shares"].values()):
        raise ConfigError(f"train.task_shares must map each task kind to a weight > 0, got {t['task_shares']!r}; "
                          "e.g. {lookup: 2, arithmetic: 1, two_step: 1}, or {} for the data's own shares")
    if t["task_shares_from"] > 1 and not t["task_shares"]:
        raise ConfigError(f"train.task_shares_from above 1 works only with train.task_shares set "
                          f"(the steps from it on draw those shares), got {t['task_shares_from']} with "
                          f"task_shares {t['task_shares']!r}")
    if not a["tools"]:
        raise ConfigError("agent.tools must name at least one tool")
    if t["lora_rank"] and not t["lora_targets"]:
        raise ConfigError("train.lora_targets is empty with train.lora_rank > 0: name the projections that get "
                          "adapters (e.g. [q_proj, v_proj]), or set train.lora_rank=0 for no adapters")
    if t["advantage_mode"] == "turn_rows" and t["advantage"] != "grpo":
        raise ConfigError(f"train.advantage_mode turn_rows is the official code's normalisation of grpo over turn "
                          f"rows; train.advantage {t['advantage']!r} needs advantage_mode trajectory or per_turn")
    if any(n.strip() not in a["tools"] for n in a["force_tool"].split(",") if a["force_tool"]):
        raise ConfigError(f"agent.force_tool is {a['force_tool']!r}, naming a tool that is not in agent.tools "
                          f"({', '.join(a['tools'])}); name one of those or leave it empty")


# What may differ between a run's config.json and the config that resumes it
# (support/checkpoints.check_out_dir): the folder's name, how far the run goes, when it saves,
# evaluates or gives up on broken infrastructure, and where and in what pieces it computes
# (memory only: the plan's knobs). None changes what a step computes, but for another device's
# rounding (run.json records each process's). Any other difference (train.lr included; and
# eval.batch_size, which seeds a sampled evaluation's batches) would go on with one experiment's
# checkpoint, metrics and evaluations under another's settings, in a config.json that would
# then claim settings its earlier steps never ran with.
RESUMABLE = {"out_dir", "resume", "train.steps", "train.save_every", "train.eval_every", "train.eval_before_after",
             "train.max_infra_steps", "model.device", "model.threads", "model.memory_gb", "model.max_prompt_tokens",
             "model.prefill_tokens", "train.micro_batch", "train.logits_chunk", "train.grad_checkpoint",
             "judge.max_workers"}


def resume_conflicts(saved: dict, cfg: dict) -> list[str]:
    """'key: saved -> new' for each key outside RESUMABLE whose value in `cfg` is not the one
    in `saved` (a run's config.json). A key `saved` lacks (added to the code since that run
    began) counts as its default, which is what the code did before the key existed."""
    old, new = {**dotted(DEFAULTS), **dotted(saved)}, dotted(json.loads(json.dumps(cfg)))  # as config.json holds it
    show = lambda values, key: repr(values[key]) if key in values else "(not set)"
    return [f"{key}: {show(old, key)} -> {show(new, key)}" for key in sorted(old.keys() | new.keys())
            if key not in RESUMABLE and old.get(key, EMPTY) != new.get(key, EMPTY)]


def dotted(cfg: dict, prefix: str = "") -> dict:
    """{"train.lr": 2e-05, ...}: every value of a nested config by its dotted key."""
    flat = {}
    for key, value in cfg.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


# ----------------------------------------------------------------------------------------
# The tools' settings (tools.*): the toolset's own here, each tool's in its class (tools.Tool:
# settings, choices, bounds). tools.py hands its registry in, so this file imports no tool.

# The settings of the toolset itself; each tool class adds its own.
TOOLSET_SETTINGS = {
    # Modules that define tools (e.g. a module of your own), imported before the config's
    # toolset is checked: each registers its tools (@register) under their names.
    "modules": ["web_tools"],
}


def tool_modules(tools: dict) -> list[str]:
    """tools.modules of the config's tools section (its default when unset), a list of names."""
    modules = tools.get("modules", TOOLSET_SETTINGS["modules"])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"tools.modules must be a list of module names, got {modules!r}")
    return modules


def own_entries(cls: type, attr: str) -> dict:
    """`attr` (settings, choices, bounds) of a tool class and of its bases: each class's own."""
    return {k: v for c in reversed(cls.__mro__) for k, v in vars(c).get(attr, {}).items()}


def tool_defaults(classes) -> dict:
    """Every setting a config may give (tools.*) with its default: the toolset's and those of
    each tool class in `classes`."""
    out = copy.deepcopy(TOOLSET_SETTINGS)
    for cls in classes:
        out.update(copy.deepcopy(own_entries(cls, "settings")))
    return out


def check_tools(cfg: dict, classes: dict[str, type]) -> list[str]:
    """The config's toolset against `classes` (the registered tools by name, tools.modules
    imported: tools.check_toolset): agent.tools names known tools, every tools.* key is a
    known setting of the right type and range (the rest take their defaults, written into
    cfg), and each tool has what it needs outside the file (its API key, its corpus, a
    contact address, a sandbox: Tool.preflight). A name or setting that does not exist
    raises ConfigError; what a tool lacks comes back as one line with the fix per tool."""
    for name in cfg["agent"]["tools"]:
        if name not in classes:
            near = difflib.get_close_matches(name, list(classes), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(f"agent.tools: unknown tool {name!r}; {hint}known tools: "
                              f"{', '.join(classes)}; a tool of your own: @register it in a module "
                              f"and name the module in tools.modules")
    each = lambda attr: {f"tools.{k}": v for cls in classes.values()  # noqa: E731
                         for k, v in own_entries(cls, attr).items()}
    settings = tool_defaults(classes.values())
    merge(settings, cfg["tools"], tool_defaults(classes.values()), "tools.", each("choices"))
    problems = out_of_bounds(settings, tool_defaults(classes.values()), "tools.", each("bounds"))
    if problems:
        raise ConfigError("\n".join(problems))
    cfg["tools"] = settings
    return [p for p in (classes[name].preflight(settings) for name in cfg["agent"]["tools"]) if p]


# ----------------------------------------------------------------------------------------
# Preflight: what the config points at, checked before anything heavy happens.

def check_run(cfg: dict, check_names: Callable[[dict], list[str]], training: bool = True,
              model_path: str | None = None, longest_prompts: Callable | None = None) -> None:
    """What a run needs before any model loads, every problem at once (one ConfigError, a
    line each): the data (for training) and the judge's endpoint (preflight), what the
    config names (check_names(cfg): the method files' check, train.check_train_names or
    eval.check_eval_names, whose lines join these), the models' own files (chat template,
    depth, cache, one tokenizer: support/models.check_models) and, with longest_prompts
    (agentflow.longest_prompts: the method files pass it, as support imports nothing above
    it), each module's longest call against its model's positions, a trained planner to
    evaluate (model_path: eval.py --model), and for training the disk its checkpoints need."""
    # Imported here: reading a config needs neither torch nor transformers.
    from support.device_memory import plan_for
    from support.models import check_model, check_models
    problems = preflight(cfg, data=training) + check_names(cfg)
    models = check_models(cfg, training, longest_prompts) + (check_model("--model", model_path) if model_path else [])
    problems += models
    if training and not models:  # the plan reads the config.json check_models just read
        problems += [p for p in [disk_problem(cfg["out_dir"], plan_for(cfg).disk_bytes)] if p]
    if problems:
        raise ConfigError("\n".join(problems))


def preflight(cfg: dict, data: bool = True) -> list[str]:
    """What the config points at outside the file, one line with the fix for each problem,
    all of them at once: a missing data file, a judge endpoint without its model or key.
    data=False skips data.* (eval.py reads --benchmark instead)."""
    problems = []
    if data:
        # the paraphrase set is read only where the before/after evaluation runs
        paraphrase = ("paraphrase",) if cfg["data"]["paraphrase"] and cfg["train"]["eval_before_after"] else ()
        files = [("data.train", path) for path in cfg["data"]["train"]]
        files += [(f"data.{split}", cfg["data"][split]) for split in ("heldout",) + paraphrase]
        if not cfg["data"]["train"]:
            problems.append("data.train is empty; name the training file(s): data.train=PATH or "
                            "data.train=[PATH, PATH]")
        for key, path in files:
            if not Path(path).is_file():
                problems.append(f"{key}: {path} not found; build the paper's mix with "
                                f"`python -m scripts.prepare_data train`, the offline suite with "
                                f"`python -m scripts.make_tasks`, or set {key}=PATH to a JSONL file")
        shares = cfg["train"]["task_shares"]
        if shares and all(Path(path).is_file() for path in cfg["data"]["train"]):
            kinds = set().union(*(_task_kinds(path) for path in cfg["data"]["train"]))
            if set(shares) != kinds:
                problems.append(f"train.task_shares names {', '.join(sorted(shares))} but data.train "
                                f"({', '.join(cfg['data']['train'])}) holds the task kinds "
                                f"{', '.join(sorted(kinds)) or '(none: no row has a task)'}; "
                                f"give each of those a weight, or set train.task_shares={{}}")
    j = cfg["judge"]
    if j["llm"] and j["base_url"]:
        if not re.match(r"^https?://", j["base_url"]):
            problems.append(f"judge.base_url must start with http:// or https://, got {j['base_url']!r}")
        if not j["model"]:
            problems.append("judge.model is empty; name the model the endpoint at judge.base_url serves")
        if j["api_key_env"] and not os.environ.get(j["api_key_env"]):
            problems.append(f"judge.api_key_env: {j['api_key_env']} is not set in the environment; export it, "
                            f"or set judge.api_key_env='' for a server that needs no key")
    return problems


def _task_kinds(path: str) -> set[str]:
    """The task kinds of a data file's rows, as datasets.draw_queries reads them ("" for none)."""
    from support.datasets import load_benchmark
    return {it.meta.get("task", "") for it in load_benchmark(path)}


def disk_problem(out_dir, need: float) -> str:
    """Why out_dir's disk cannot hold `need` bytes ("" if it can): where it would be written."""
    where = Path(out_dir).resolve()
    while not where.exists():  # the folder is made at start: its disk is its nearest parent's
        where = where.parent
    free = shutil.disk_usage(where).free
    if free >= need:
        return ""
    return (f"out_dir: {free / 1e9:.1f} GB free on the disk of {where}, and the run's checkpoints "
            f"and final export need up to {need / 1e9:.1f} GB (`python train.py CONFIG --plan` "
            f"details them); free space or point out_dir at a larger disk")
