"""A dress rehearsal of `python train.py configs/qwen2.5-7b-1gpu.yaml` on a CPU.

The config as shipped, with what a CPU test cannot have replaced: Qwen2.5-7B by a tiny
random Qwen2 of the same kind (untied embeddings, q/k/v biases, bfloat16, the project's
tokenizer), the NQ + DeepMath files by small ones written here, Wikipedia and Google by a
loopback HTTP server (their URLs are config keys, Google through Serper as configured; Web_Search may fetch from it through
tools.url_allow), and a memory budget small enough that the sampler must run in sub-batches.
One training step of 3 turns, then the held-out evaluation of a few items, with the LLM
judge on the frozen engine as configured. It exercises bf16 weights with fp32 masters,
the sub-batches, the chunked log-probs and the plan's limits together."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


class _Api(BaseHTTPRequestHandler):
    """Wikipedia's search + extracts API and Google's Custom Search, in the shapes the tools read."""

    def do_GET(self):
        url = urlparse(self.path)
        self.server.seen.append(url.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/w/api.php" and q.get("list") == "search":
            body = {"query": {"search": [{"ns": 0, "title": "Velmora", "snippet": "a river town"}]}}
        elif url.path == "/w/api.php":
            body = {"query": {"pages": [{"pageid": 1, "title": "Velmora", "extract": "Velmora was founded in 1742."}]}}
        elif url.path == "/customsearch/v1":
            body = {"items": [{"title": "Velmora", "link": "http://127.0.0.1/velmora", "snippet": "Founded 1742."}]}
        else:
            body = None
        data = json.dumps(body).encode() if body else b"<p>Velmora was founded in 1742.</p>"
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if body else "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # Serper: POST {"q", "num"}, results in "organic"
        self.server.seen.append(urlparse(self.path).path)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        data = json.dumps({"organic": [{"title": "Velmora", "link": "http://127.0.0.1/velmora",
                                        "snippet": "Founded 1742."}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def api(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("GOOGLE_API_KEY", "test-key")
    monkeypatch.setenv("GOOGLE_CSE_ID", "test-cx")
    monkeypatch.setenv("SERPER_API_KEY", "test-key")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    srv.daemon_threads, srv.seen = True, []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, default_model_path) -> str:
    """A 4-block random Qwen2 in bfloat16 with the project's tokenizer, saved in HF format."""
    from scripts.tiny_model import build
    # Qwen2.5-7B's 32,768 positions: the 7B config's prompts (a 4,000-character memory) need more than 4,096
    return build(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2", layers=4, dtype="bfloat16", positions=32768)


def write_data(d: Path) -> tuple[Path, Path]:
    """NQ-like search questions and DeepMath-like ones, in prepare_data.py's layout."""
    rows = [{"id": f"nq-{i}", "question": f"When was the town of Velmora {i} founded?", "answer": ["1742"],
             "task": "search"} for i in range(4)]
    rows += [{"id": f"dm-{i}", "question": f"What is {i + 2} squared?", "answer": str((i + 2) ** 2),
              "kind": "number", "task": "math"} for i in range(4)]
    train, heldout = d / "train.jsonl", d / "heldout.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows[1::3]))
    return train, heldout


def test_the_7b_config_end_to_end_on_a_tiny_qwen2(tiny_qwen2_dir, tmp_path, api, monkeypatch):
    import agentflow
    import engine
    import flow_grpo
    import train
    from support.config import load_config
    from support.device_memory import DECODE_BYTES_PER_LOGIT, GB, plan_for

    train_file, heldout_file = write_data(tmp_path)
    overrides = [
        f"model.name={tiny_qwen2_dir}", "model.device=cpu", f"out_dir={tmp_path / 'run'}",
        f"data.train={train_file}", f"data.heldout={heldout_file}",
        f"tools.wikipedia_url={api.url}/w/api.php", f"tools.serper_url={api.url}/search",
        "tools.contact=tests@example.org",
        "tools.url_allow=[127.0.0.1]", "tools.python_timeout_s=3.0",
        "train.steps=1", "train.queries_per_step=4", "train.group_size=2", "train.train_layers=2",
        "train.save_every=1", "agent.planner.max_new_tokens=6", "agent.executor.max_new_tokens=8",
        "agent.generator.max_new_tokens=6", "eval.limit=3", "eval.max_turns=2",
        # the plan's lengths and chunks at this model's scale
        "model.max_prompt_tokens=256", "model.prefill_tokens=256", "train.logits_chunk=4",
        "train.micro_batch=2",  # fixed (not the config's auto), so the budget below can be sized around it
    ]
    config_path = str(ROOT / "configs" / "qwen2.5-7b-1gpu.yaml")
    # A budget that leaves the sampler room for a few rows a sub-batch (at least two sub-batches for a
    # call of 8 rows) and the update room to run: budget = resident + prefill + 2.5 rows, where
    # the resident part grows with the budget by the plan's 3% slack.
    probe = plan_for(load_config(config_path, overrides + ["model.memory_gb=1"]))
    fixed = probe.resident - 0.03 * probe.budget  # weights, the reference's copies, masters, AdamW, grads
    prefill = next(b for what, b, _ in probe.items if "prefill forward" in what)
    per_row = (256 + 8) * probe.shape.kv_bytes_per_token(2) + probe.shape.vocab * DECODE_BYTES_PER_LOGIT
    budget = max(fixed + prefill + 2.5 * per_row, 1.01 * (fixed + probe.update)) / 0.97
    overrides.append(f"model.memory_gb={budget / GB:.6f}")
    plan = plan_for(load_config(config_path, overrides))
    assert plan.fits, plan.text()
    assert 1 <= plan.rows_per_sub_batch < 8, plan.text()
    cfg = load_config(config_path, overrides)
    assert cfg["model"]["dtype"] == "bfloat16" and not cfg["agent"]["constrain_tool"]
    assert cfg["judge"]["llm"] and not cfg["judge"]["base_url"]  # the frozen engine judges

    # Three turns: the frozen verifier never says STOP (no tool's Check is asked, and the
    # general verdict token is compared with one that cannot be drawn), so every trajectory
    # runs to max_turns.
    real_init = agentflow.AgentSystem.__init__

    def never_stop(self, *a, **k):
        real_init(self, *a, **k)
        self.stop_token, self.check_system = -1, {}

    monkeypatch.setattr(agentflow.AgentSystem, "__init__", never_stop)
    # A random planner never names a tool; where it names none, take the toolset in turn,
    # so that every tool of the config runs (the search tools against the loopback server).
    real_parse, turn = agentflow.parse_plan, iter(range(10 ** 6))

    def some_tool(text, tools):
        plan = real_parse(text, tools)
        return plan if plan.tool else agentflow.Plan(list(tools)[next(turn) % len(tools)], text, "")

    monkeypatch.setattr(agentflow, "parse_plan", some_tool)
    # A random model never answers right: the rules' verdict becomes "the answer's length is
    # odd", which it earns sometimes, so that the update has a signal (the LLM judge still
    # reviews what the rules reject).
    import judge
    monkeypatch.setattr(judge, "score_item", lambda answer, *item: {"correct": len(answer) % 2 == 1, "f1": 0.0,
                                                                     "extracted": answer})
    calls, chunked = [], []
    real_sample = engine.LLM.sample

    def counted(self, prompts, *a, **k):
        before = self.sub_batches_run
        out = real_sample(self, prompts, *a, **k)
        calls.append((len(prompts), self.sub_batches_run - before))
        return out

    monkeypatch.setattr(engine.LLM, "sample", counted)
    real_chunked = flow_grpo.ChunkedLogprobs.apply
    monkeypatch.setattr(flow_grpo.ChunkedLogprobs, "apply", lambda *a: chunked.append(a[0].shape) or real_chunked(*a))

    assert train.main([config_path, *overrides]) == 0
    out = tmp_path / "run"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["mean_turns"] == 3
    m = metrics[0]
    assert m["planner_tokens"] > 0 and m["ratio_dev_first_step"] == 0.0  # on-policy in bf16
    assert m["logprob_gap"] > 0  # ... although the bf16 sampler's arithmetic is not the trainer's
    assert any(w >= 2 for _, w in calls)  # calls with more rows than a sub-batch holds ran in sub-batches
    assert all(w >= 1 for n, w in calls if n) and m["sampler_sub_batches"] > 0
    assert m["grad_norm"] > 0 and m["zero_variance_groups"] < 1  # a real update ...
    assert set(m["tool_shares"]) == set(cfg["agent"]["tools"])  # ... after every tool ran
    assert "/w/api.php" in api.seen and "/search" in api.seen
    assert chunked  # the loss ran through the chunked log-probs
    # bf16 weights in the exported model; the checkpoint holds their fp32 masters, not them.
    from transformers import AutoModelForCausalLM

    ck = out / "checkpoints" / "step_1"
    assert next(AutoModelForCausalLM.from_pretrained(out / "model").parameters()).dtype == torch.bfloat16
    state = torch.load(ck / "trainer_state.pt", weights_only=False)
    assert state["masters"] and all(t.dtype == torch.float32 for t in state["masters"]) and state["trained"] == {}
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).state_dict()
    trained = [k for k in start if k.startswith(("model.layers.2.", "model.layers.3.", "model.norm"))]
    assert len(state["masters"]) == len(trained)
    assert any(not torch.equal(m.to(torch.bfloat16), start[k]) or not torch.equal(m, start[k].float())
               for m, k in zip(state["masters"], trained))  # the masters moved at lr 1e-6
    # The held-out evaluation before and after, with the frozen engine as judge.
    learning = json.loads((out / "learning.json").read_text())
    assert learning["before"]["n"] == learning["after"]["n"] == 3
    rows = [json.loads(line) for line in (out / "eval" / "step_1" / "results.jsonl").read_text().splitlines()]
    assert not any(e.startswith("crashed") for r in rows for e in r["errors"])
    assert {r["judge"] for r in rows} <= {"rule", "llm"}


def test_the_7b_config_on_a_box_without_user_namespaces_and_a_small_disk(tmp_path, default_model_path):
    """The first minute on a rented GPU box, rehearsed for real on a CPU: user namespaces
    disabled (inside a user namespace of the test's own whose max_user_namespaces is 0, so
    the machine is untouched) and a 64 GiB disk with 24 GiB (25.8 GB) free, less than the two
    checkpoints a save holds at once. train.py must report both, each with its fix, in
    one go, and stop before loading any weight."""
    from transformers import AutoTokenizer

    from test_memory_plan import QWEN_7B, empty_weights
    model_dir = tmp_path / "qwen7b"  # Qwen2.5-7B's config.json beside a chat tokenizer, no weights
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(QWEN_7B))
    empty_weights(model_dir)
    script = f"""
import collections, ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
    print("SKIP", ctypes.get_errno()); sys.exit()
open("/proc/sys/user/max_user_namespaces", "w").write("0")
sys.path.insert(0, {str(ROOT)!r})
from support import checkpoints
GiB = 2 ** 30
checkpoints.shutil.disk_usage = lambda p: collections.namedtuple("U", "total used free")(64 * GiB, 40 * GiB, 24 * GiB)
import train
train.load_model = lambda *a, **k: sys.exit("LOADED A MODEL")
os.environ["SERPER_API_KEY"] = "k"
print("RC", train.main([{str(ROOT / "configs" / "qwen2.5-7b-1gpu.yaml")!r}, "model.name={model_dir}", "model.device=cpu",
                        "model.memory_gb=80", "out_dir={tmp_path / 'run'}", "tools.contact=tests@example.org",
                        "data.train={ROOT / 'data' / 'train.jsonl'}", "data.heldout={ROOT / 'data' / 'heldout.jsonl'}",
                        "train.eval_before_after=false"]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if r.stdout.startswith("SKIP"):
        pytest.skip(f"this machine refuses a user namespace to the test itself (errno {r.stdout.split()[1]})")
    assert "RC 2" in r.stdout and "LOADED" not in r.stdout + r.stderr, r.stdout + r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("config error:")]
    assert len(errors) == 2, r.stderr
    assert "user namespaces are disabled" in errors[0] and "python_isolation: rlimits" in errors[0]
    assert "25.8 GB free" in errors[1] and "44.7 GB" in errors[1] and "--plan" in errors[1]
