"""The checks before any model loads (support/config.py's load_config and check_run, with
the method files' checks of what a config names: train.check_train_names and
eval.check_eval_names, tools.check_toolset, judge.Reward; support/models.check_models): a
bad path, model name, tool or missing API key is one line that names the key and the fix,
and every problem is reported at once."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentflow import longest_prompts  # noqa: E402
from eval import check_eval_names  # noqa: E402
from support.config import ConfigError, check_run, load_config  # noqa: E402
from support.models import model_name_problem  # noqa: E402
from train import check_train_names  # noqa: E402

DATA = [f"data.train={ROOT / 'data' / 'train.jsonl'}", f"data.heldout={ROOT / 'data' / 'heldout.jsonl'}",
        f"data.paraphrase={ROOT / 'data' / 'paraphrase.jsonl'}", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}"]


def cfg(*overrides, path=ROOT / "config.yaml"):
    return load_config(str(path), [*DATA, *overrides])


def check(c, data=True, model_path=None):
    """What train.py (data=True) and eval.py check once the file is read."""
    check_run(c, check_train_names if data else check_eval_names, training=data, model_path=model_path,
              longest_prompts=longest_prompts)


def fails(c, *words, **kw):
    with pytest.raises(ConfigError) as e:
        check(c, **kw)
    msg = str(e.value)
    assert any(all(w in line for w in words) for line in msg.splitlines()), (words, msg)  # one line says it all
    return msg


def test_the_default_config_passes():
    check(cfg())


def test_missing_data_file_names_the_key_and_the_fix(tmp_path):
    fails(cfg(f"data.train={tmp_path / 'nope.jsonl'}"), "data.train", "nope.jsonl", "scripts.prepare_data")
    fails(cfg(f"data.heldout={tmp_path / 'gone.jsonl'}"), "data.heldout", "gone.jsonl")
    fails(cfg(f"data.paraphrase={tmp_path / 'p.jsonl'}"), "data.paraphrase", "p.jsonl")
    check(cfg(f"data.paraphrase={tmp_path / 'p.jsonl'}", "train.eval_before_after=false"))  # never read then
    check(cfg("data.paraphrase=''"))  # none
    fails(cfg(f"tools.corpus={tmp_path / 'c.jsonl'}"), "tools.corpus", "scripts.make_tasks")
    # eval.py reads --benchmark, not data.*
    check(cfg(f"data.train={tmp_path / 'nope.jsonl'}"), data=False)
    # every problem at once, one line each
    msg = fails(cfg(f"data.train={tmp_path / 'nope.jsonl'}", f"tools.corpus={tmp_path / 'c.jsonl'}",
                    "model.name=/nonexistent"), "data.train")
    assert len(msg.splitlines()) == 3 and "tools.corpus" in msg and "model.name" in msg


def test_data_train_takes_one_file_or_a_list(tmp_path):
    """One path is a list of one; a list is read as one pool; each missing file is named and
    an empty list is refused before a model loads."""
    one, other = str(ROOT / "data" / "train.jsonl"), str(ROOT / "data" / "heldout.jsonl")
    assert cfg()["data"]["train"] == [one]
    check(c := cfg(f"data.train=[{one}, {other}]"))
    assert c["data"]["train"] == [one, other]
    fails(cfg(f"data.train=[{one}, {tmp_path / 'gone.jsonl'}]"), "data.train", "gone.jsonl")
    fails(cfg("data.train="), "data.train is empty", "data.train=[PATH, PATH]")


def test_task_shares_must_name_the_data_kinds(tmp_path):
    """train.task_shares is checked against data.train's task kinds before a model loads;
    an override replaces the file's mapping (so {} goes back to the data's own shares)."""
    shipped = cfg()["train"]
    assert set(shipped["task_shares"]) == {"lookup", "arithmetic", "two_step"} and shipped["task_shares_from"] > 1
    check(cfg())  # config.yaml's curriculum names every kind of the shipped data
    text = (ROOT / "config.yaml").read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("task_shares:"))
    leaning = tmp_path / "leaning.yaml"
    leaning.write_text(text.replace(line, "  task_shares: {lookup: 2, arithmetic: 1, two_step: 1}"))
    assert cfg(path=leaning)["train"]["task_shares"] == {"lookup": 2, "arithmetic": 1, "two_step": 1}
    assert cfg("train.task_shares={}", "train.task_shares_from=1", path=leaning)["train"]["task_shares"] == {}
    assert cfg("train.task_shares={lookup: 1}", path=leaning)["train"]["task_shares"] == {"lookup": 1}  # not merged
    fails(cfg("train.task_shares={lookup: 2, arithmetic: 1}"), "train.task_shares", "two_step", "train.jsonl")
    fails(cfg("train.task_shares={lookup: 1, arithmetic: 1, two_step: 1, trivia: 1}"), "train.task_shares", "trivia")
    check(cfg("train.task_shares={lookup: 1, arithmetic: 1, two_step: 1}"))
    untagged = tmp_path / "untagged.jsonl"
    untagged.write_text('{"question": "q", "answer": "1", "kind": "number"}\n')
    fails(cfg(f"data.train={untagged}", path=leaning), "train.task_shares", "no row has a task")
    check(cfg(f"data.train={untagged}", "train.task_shares={}", "train.task_shares_from=1"))  # the data's own shares


@pytest.mark.parametrize("name, words", [
    ("/nonexistent", ["model.name", "/nonexistent", "no such directory"]),
    ("./runs/none/checkpoints/step_3", ["no such directory"]),
    ("runs/a/b", ["no such directory"]),
    ("not a model!", ["neither a local folder nor a hub id", "Qwen/Qwen2.5-7B-Instruct"]),
    ("owner/na--me", ["neither"]),
    ("-bad/name", ["neither"]),
])
def test_bad_model_names(name, words):
    fails(cfg(f"model.name={name}"), *words)


def test_model_folder_and_hub_ids(tmp_path, monkeypatch, default_model_path):
    fails(cfg(f"model.name={tmp_path}"), "without config.json")
    assert model_name_problem("model.name", str(tmp_path)) != ""
    (tmp_path / "config.json").write_text("{}")
    assert model_name_problem("model.name", str(tmp_path)) == ""
    check(cfg(f"model.name={default_model_path}"))  # a model folder
    for ok in ("Qwen/Qwen2.5-7B-Instruct", "gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"):
        assert model_name_problem("model.name", ok) == ""  # names a hub id could be (whether cached: check_model)
    # a one-slash name whose first part is a local folder is a path, not a hub id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    fails(cfg("model.name=runs/nothing-here"), "no such directory")
    fails(cfg(f"model.name={default_model_path}"), "--model", model_path="/no/such/checkpoint")


def test_unknown_tool_fails_before_a_model_loads_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown tool 'Google'; did you mean Google_Search\?"):
        check(cfg("agent.tools=[Base_Generator, Google]"))
    with pytest.raises(ConfigError, match="known tools: .*Python_Coder"):
        check(cfg("agent.tools=[Calculator]"))


def test_tool_api_keys_from_the_environment(monkeypatch):
    for var in ("SERPER_API_KEY", "GOOGLE_API_KEY", "GOOGLE_CSE_ID", "MY_SERPER"):
        monkeypatch.delenv(var, raising=False)
    c = cfg("agent.tools=[Base_Generator, Google_Search]")  # the default provider: Serper
    fails(c, "Google_Search", "SERPER_API_KEY", "google_provider is serper", "export SERPER_API_KEY")
    monkeypatch.setenv("SERPER_API_KEY", "k")
    check(c)
    fails(cfg("agent.tools=[Google_Search]", "tools.serper_key_env=MY_SERPER"), "MY_SERPER")
    c = cfg("agent.tools=[Base_Generator, Google_Search]", "tools.google_provider=cse")
    fails(c, "Google_Search", "GOOGLE_API_KEY and GOOGLE_CSE_ID", "export GOOGLE_API_KEY")
    monkeypatch.setenv("GOOGLE_API_KEY", "k")
    fails(c, "GOOGLE_CSE_ID")
    monkeypatch.setenv("GOOGLE_CSE_ID", "cx")
    check(c)
    with pytest.raises(ConfigError, match="serper, cse"):
        check(cfg("tools.google_provider=bing"))
    with pytest.raises(ConfigError, match="unknown config key 'tools.serper_kye'"):
        check(cfg("tools.serper_kye=X"))


def test_wikipedia_needs_a_contact_address():
    c = cfg("agent.tools=[Base_Generator, Wikipedia_Search]")
    fails(c, "tools.contact", "User-Agent", "tools.contact=you@example.org")
    check(cfg("agent.tools=[Wikipedia_Search]", "tools.contact=me@example.org"))
    # a local mirror is not Wikimedia's: its own rules, not checked here
    check(cfg("agent.tools=[Wikipedia_Search]", "tools.wikipedia_url=http://127.0.0.1:8080/w/api.php"))


def test_a_corpus_index_must_be_built(tmp_path):
    fails(cfg(f"tools.corpus_index={tmp_path / 'idx'}"), "tools.corpus_index", "scripts.build_index")
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "meta.json").write_text("{}")
    check(cfg(f"tools.corpus_index={tmp_path / 'idx'}", f"tools.corpus={tmp_path / 'unused.jsonl'}"))


def test_judge_endpoint_settings(monkeypatch):
    monkeypatch.delenv("MY_JUDGE_KEY", raising=False)
    on = ("judge.llm=true", "judge.base_url=http://127.0.0.1:8000/v1", "judge.model=qwen")
    fails(cfg(*on, "judge.api_key_env=MY_JUDGE_KEY"), "judge.api_key_env", "MY_JUDGE_KEY", "judge.api_key_env=''")
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-x")
    check(cfg(*on, "judge.api_key_env=MY_JUDGE_KEY"))
    check(cfg(*on, "judge.api_key_env=''"))  # a local server with no key
    fails(cfg("judge.llm=true", "judge.base_url=http://h/v1", "judge.api_key_env=''"), "judge.model")
    fails(cfg("judge.llm=true", "judge.base_url=localhost:8000", "judge.model=m", "judge.api_key_env=''"),
          "http://")
    check(cfg("judge.llm=true"))  # empty base_url: the frozen policy judges, nothing to check
    check(cfg(*on, "judge.llm=false", "judge.api_key_env=UNSET_ANYWAY"))  # off: not checked


def test_paper_config_points_at_the_prepared_mix():
    c = load_config(str(ROOT / "configs" / "qwen2.5-7b-1gpu.yaml"))
    (train_file,) = c["data"]["train"]
    assert train_file.endswith("nq_deepmath/train.jsonl")
    if not Path(train_file).exists():
        fails(c, "data.train", "scripts.prepare_data train")


def test_cli_fails_in_one_line_before_loading_a_model(capsys, tmp_path):
    import eval as evaluation
    import train
    assert train.main([str(ROOT / "config.yaml"), *DATA, "model.name=/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.name" in err and "Traceback" not in err
    bench = ROOT / "data" / "heldout.jsonl"
    assert evaluation.main(["--benchmark", str(bench), "--config", str(ROOT / "config.yaml"),
                            "--model", str(tmp_path / "none"), *DATA]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model" in err


def test_paper_config_uses_search_a_new_user_can_sign_up_for(monkeypatch, default_model_path):
    """The one-GPU config's web tools: Google through Serper (the key named), Wikipedia
    with a contact address; each missing piece stops it in one line, before any model.
    (The 7B model is not on this machine: the last check puts the default model in its place.)"""
    paper = ROOT / "configs" / "qwen2.5-7b-1gpu.yaml"
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    c = cfg(path=paper)
    assert {"Google_Search", "Wikipedia_Search", "Web_Search"} <= set(c["agent"]["tools"])
    assert c["tools"]["google_provider"] == "serper" and c["tools"]["serper_key_env"] == "SERPER_API_KEY"
    fails(c, "SERPER_API_KEY", "export SERPER_API_KEY")
    monkeypatch.setenv("SERPER_API_KEY", "k")
    fails(c, "tools.contact")
    check(cfg("tools.contact=me@example.org", f"model.name={default_model_path}", path=paper))


def test_a_tool_of_ones_own_is_named_through_tools_modules(tmp_path, monkeypatch):
    """A module of the user's that defines and registers a tool: listed in tools.modules, its
    tool can be named in agent.tools and its settings set; a module that cannot be
    imported is a one-line error."""
    (tmp_path / "my_tools_for_test.py").write_text(
        "from tools import Tool, register\n\n"
        "@register\nclass Echo(Tool):\n    name = 'Echo_Tool'\n    card = 'Says it back.\\nInput: text.'\n"
        "    settings = {'echo_times': 2}\n\n    def _run(self, command):\n"
        "        return command * self.cfg['echo_times']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import tools
    monkeypatch.setattr(tools, "TOOL_CLASSES", dict(tools.TOOL_CLASSES))  # the registration ends with the test
    c = cfg("agent.tools=[Python_Coder, Echo_Tool]", "tools.modules=[web_tools, my_tools_for_test]",
            "tools.echo_times=3")
    check(c)
    assert c["tools"]["echo_times"] == 3 and c["tools"]["python_timeout_s"] == 5.0
    from tools import build_tools
    assert build_tools(["Echo_Tool"], c["tools"])["Echo_Tool"].run("ab").output == "ababab"
    fails(cfg("tools.modules=[no_such_tools_module]"), "tools.modules", "no_such_tools_module")


def test_a_model_or_toolset_that_cannot_serve_stops_before_any_rollout(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """One line each, and no rollout: a model without a chat template, train_layers above
    the model's depth, a hub id that is neither cached nor reachable, two tools that the
    planner's first token cannot tell apart."""
    import json
    import shutil

    import train
    from agentflow import AgentSystem
    monkeypatch.setattr(AgentSystem, "rollout", lambda *a, **k: pytest.fail("a rollout ran"))
    base = [str(ROOT / "config.yaml"), *DATA, "model.device=cpu", f"out_dir={tmp_path / 'run'}"]

    def refused(*overrides, words):
        assert train.main(base + list(overrides)) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not progress bars
        assert len(said) == 1 and said[0].startswith("config error") and all(w in said[0] for w in words), said

    bare = tmp_path / "bare"  # the tiny model with its chat template taken away
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    refused(f"model.name={bare}", "train.train_layers=2", words=["model.name", "no chat template"])
    refused(f"model.name={tiny_model_dir}", "train.train_layers=5", words=["train.train_layers is 5", "2 blocks"])
    with monkeypatch.context() as offline:
        offline.setenv("HF_HUB_OFFLINE", "1")
        refused("model.name=SomeOrg/not-cached-model", words=["not in the Hugging Face cache", "hf download"])
    (tmp_path / "clash_tools_for_test.py").write_text(
        "import tools\n\n@tools.register\nclass PythonHelper(tools.BaseGenerator):\n    name = 'Python_Helper'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import tools
    monkeypatch.setattr(tools, "TOOL_CLASSES", dict(tools.TOOL_CLASSES))
    refused(f"model.name={tiny_model_dir}", "train.train_layers=2", "tools.modules=[web_tools, clash_tools_for_test]",
            "agent.tools=[Python_Coder, Python_Helper]", words=["Python_Coder and Python_Helper", "same token"])


@pytest.mark.parametrize("override, rng", [
    ("train.max_grad_norm=-1", "> 0"),  # the clip coefficient would flip the gradient
    ("train.beta=-0.1", ">= 0"),
    ("train.lr=-1", "> 0"),
    ("train.lr=0", "> 0"),
    ("train.eps_low=1.5", "< 1"),
    ("train.eps_high=-0.1", ">= 0"),
    ("train.group_size=1", ">= 2"),
    ("train.weight_decay=-0.01", ">= 0"),
    ("agent.planner.temperature=0", "> 0"),
    ("agent.executor.temperature=-1", ">= 0"),
    ("agent.generator.max_new_tokens=0", ">= 1"),
    ("agent.memory_budget_chars=0", ">= 1"),
    ("eval.batch_size=0", ">= 1"),
    ("judge.timeout_s=0", "> 0"),
    ("model.memory_gb=-5", ">= 0"),
    ("tools.search_top_k=0", ">= 1"),
    ("tools.python_timeout_s=-2", "> 0"),
    ("tools.web_timeout_s=0", "> 0"),
])
def test_every_bad_number_stops_train_py_before_a_weight_loads(override, rng, monkeypatch, capsys):
    """Each value that would corrupt a run (train against the reward, make every search
    fail, ...) exits with a config error naming the key, the value, the range and the fix,
    before any model loads."""
    import train
    from support import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    assert train.main([str(ROOT / "config.yaml"), *DATA, override]) == 2
    err = capsys.readouterr().err
    key, value = override.split("=")
    assert f"config key '{key}' is " in err and f"must be {rng}" in err and f"Fix: set {key}=" in err, err


def test_an_empty_override_empties_text_and_lists():
    """`key=` on the command line: no paraphrase set, no stop strings; a number needs a value."""
    c = cfg("data.paraphrase=", "agent.generator.stop=")
    assert c["data"]["paraphrase"] == "" and c["agent"]["generator"]["stop"] == []
    with pytest.raises(ConfigError, match="train.steps"):
        cfg("train.steps=")


def test_a_model_too_short_for_a_prompt_and_an_action_is_refused(tiny_model_dir, tmp_path):
    """A model with 128 positions under the default's 2,048-token prompts: refused before a
    weight loads, with both numbers."""
    import shutil
    short = tmp_path / "short"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    msg = fails(cfg(f"model.name={short}"), "model.name", "128 positions", "need 2096")
    assert "model.max_prompt_tokens" in msg


def test_a_model_too_short_for_the_prompts_the_modules_build_is_refused(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """512 positions and model.max_prompt_tokens=400: the cap and the longest reply fit (448),
    but the executor's prompt alone (its system prompt holds a worked example per tool) is
    longer than 512 tokens. Refused before any weights load, naming the module and each
    figure, whose sum is the total, by train.py's command too; the shipped configs' modules
    fit the default model."""
    import re
    import shutil
    import train
    from support import models
    short = tmp_path / "short"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    msg = fails(cfg(f"model.name={short}", "model.max_prompt_tokens=400", "train.train_layers=2"), "agent.executor:",
                f"more than the 512 positions of model.name {short}", "up to 800 of memory (agent.memory_budget_chars)",
                "up to 16 of the planner's sub-goal (agent.planner.max_new_tokens)",
                "up to 48 of reply (agent.executor.max_new_tokens)")
    line = next(ln for ln in msg.splitlines() if ln.startswith("agent.executor:"))
    text, total = (int(x) for x in re.search(r"its prompt's own text (\d+) .* = (\d+) > 512", line).groups())
    assert text > 512 and total == text + 800 + 16 + 48
    assert "model.max_prompt_tokens" not in msg  # the cap itself fits: the prompts do not
    assert train.main([str(ROOT / "config.yaml"), *DATA, f"model.name={short}", "model.max_prompt_tokens=400",
                       "train.train_layers=2", f"out_dir={tmp_path / 'run'}"]) == 2
    assert f"config error: {line}" in capsys.readouterr().err
    for path in (ROOT / "config.yaml", ROOT / "configs" / "smoke.yaml"):
        check(cfg(path=path))


def test_a_folder_without_a_tokenizer_says_what_a_model_folder_needs(tiny_model_dir, tmp_path):
    import shutil
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):  # a model, without its tokenizer's files
        shutil.copy(Path(tiny_model_dir) / name, bare / name)
    fails(cfg(f"model.name={bare}"), "model.name", "tokenizer.json or tokenizer.model")


@pytest.mark.parametrize("broken", ["{}", "{not json"])
def test_a_planner_folder_whose_tokenizer_cannot_be_built_is_refused_for_that(tiny_model_dir, tmp_path, broken):
    """Tokenizer files no tokenizer can be built from (JSON that is not a tokenizer's, or not
    JSON): as model.planner, refused for that, with the error, not as 'different tokenizers'
    and not with a traceback (the first raises a KeyError inside transformers)."""
    import shutil
    planner = tmp_path / "planner"
    shutil.copytree(tiny_model_dir, planner)
    (planner / "tokenizer.json").write_text(broken)
    msg = fails(cfg(f"model.planner={planner}", f"model.name={tiny_model_dir}", "train.train_layers=2"),
                "model.planner:", f"no tokenizer can be built from the files of {planner}", "tokenizer.json")
    assert "different tokenizers" not in msg


def test_a_replaced_prompt_must_name_a_prompt_and_keep_its_fields():
    fails(cfg("agent.prompts={planner_user: 'Question: {query}'}"), "agent.prompts.planner_user", "found")
    fails(cfg("agent.prompts={planer_system: 'x'}"), "agent.prompts", "planner_system")


def test_a_half_downloaded_model_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    """Its config and tokenizer are there, a weight file is not: in a folder (one file, or a
    shard its index names), and in the hub's cache on a machine that cannot reach the hub."""
    import shutil

    import huggingface_hub.constants

    folder = tmp_path / "half"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").unlink()
    fails(cfg(f"model.name={folder}"), "model.name", "lacks model.safetensors", "hf download")
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(Path(tiny_model_dir) / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    fails(cfg(f"model.name={folder}"), "lacks model-00002-of-00002.safetensors")
    # The same snapshot in a hub cache, the hub unreachable.
    snapshot = tmp_path / "hub" / "models--someone--half" / "snapshots" / "abc"
    shutil.copytree(folder, snapshot)
    (tmp_path / "hub" / "models--someone--half" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--half" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fails(cfg("model.name=someone/half"), "model.name", "someone/half lacks model-00002-of-00002.safetensors")
    shutil.copy(Path(tiny_model_dir) / "model.safetensors", snapshot / "model-00002-of-00002.safetensors")
    from support.models import missing_weights
    assert missing_weights("someone/half") == [] and missing_weights(str(snapshot)) == []  # complete


def test_a_config_file_may_start_from_a_base(tmp_path):
    """`base: other.yaml` (relative to the file) merges that file first, then this one's keys;
    a base's base first of all. A missing base and a cycle are refused, naming the file."""
    (tmp_path / "a.yaml").write_text("seed: 5\ntrain: {lr: 0.5, steps: 3}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrain: {lr: 0.25}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text("base: ../b.yaml\nseed: 7\n")
    cfg = load_config(str(tmp_path / "sub" / "c.yaml"), ["train.steps=4"])
    assert (cfg["seed"], cfg["train"]["lr"], cfg["train"]["steps"]) == (7, 0.25, 4)
    assert "base" not in cfg
    (tmp_path / "d.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml not found.*the base of"):
        load_config(str(tmp_path / "d.yaml"))
    (tmp_path / "e.yaml").write_text("base: f.yaml\n")
    (tmp_path / "f.yaml").write_text("base: e.yaml\n")
    with pytest.raises(ConfigError, match="without a cycle"):
        load_config(str(tmp_path / "e.yaml"))
