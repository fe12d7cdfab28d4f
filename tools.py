"""The toolset K of AgentFlow (paper section 1): what a tool is, the short cards the planner
reads to choose among tools, the three tools the offline default uses (Base_Generator,
Python_Coder, Local_Search), and the registry a config names tools from. The paper's web
tools (Wikipedia_Search, Google_Search, Web_Search) are in web_tools.py and register
here the same way (tools.modules); a tool of your own is a Tool subclass in a module of
yours, listed there too.

Every tool takes one string (the command the executor LLM wrote) and returns a
ToolResult: the text that goes into memory, already capped, or a short error. A tool
never raises, so one bad call costs one turn, not the whole batch of trajectories.

Two kinds of failure are kept apart. A tool error is the model's doing (a query with no
results, code that crashes, a made-up URL that answers 404): it goes into memory and
the reward judges it. An infrastructure failure is not (a 429 or a 5xx after every
retry, a timeout, a refused or missing API key): the result says so (`infra`), and
train.py leaves such a trajectory out of the update instead of scoring it 0, so the
planner never learns to avoid a tool because a quota ran out. Identical commands to a
search are answered from a per-tool cache, so the G rollouts of a query that search the
same thing send one request.

Where this departs from the official code:
- Its Python tool runs model code twice, in-process, unsandboxed, with a timeout that
  cannot interrupt it. Here the code runs once, in its own Linux user, network, mount,
  PID and IPC namespaces (no network, a read-only view of little more than the
  interpreter, its own processes only), under rlimits and a wall clock, for root and
  ordinary users alike (support/sandbox.py).
- It pastes tool output into prompts uncapped. Here every output is cut to
  `max_output_chars` with a visible "...[cut N chars]" marker.
- Its search tools call paid LLMs. Here Local_Search ranks a JSONL corpus (or an on-disk
  index of a whole Wikipedia dump) with BM25 (support/bm25.py), offline.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from support.bm25 import BM25, DiskBM25, tokenize
from support.config import TOOLSET_SETTINGS, ConfigError, check_tools, tool_defaults, tool_modules
from support.reply_cache import ReplyCache
from support.sandbox import ISOLATIONS, Limits, Sandbox, SandboxError
from support.text import cut
from support.web import WebError

@dataclass
class ToolResult:
    output: str      # text stored in memory, already capped
    error: str = ""  # non-empty = the call failed, with a short reason
    infra: bool = False  # the failure was the infrastructure's (network, quota, key), not the model's

    @property
    def ok(self) -> bool:
        return not self.error


class ToolError(Exception):
    """A failure with a message fit for the memory (raised inside tools, never out of run).
    infra=True: the call failed for reasons the model did not cause."""

    def __init__(self, message: str, infra: bool = False):
        super().__init__(message)
        self.infra = infra


@dataclass(frozen=True)
class Check:
    """The verifier's question after a tool ran, answered by the frozen LLM with one forced
    " Yes" or " No". A 135M model cannot weigh the question against the whole memory, but it
    tells apart questions that ask for a calculation from those that do not (docs/LOG.md), so
    a tool asks the one thing its result leaves open: after a search, whether a calculation
    is still needed."""
    question: str  # the verifier's instruction, above the examples
    label: str  # the reply is forced to start here, in the examples and in the prompt
    stop_if: str  # "Yes" or "No": the answer that ends the trajectory
    examples: tuple[tuple[str, str, str], ...]  # (question, the tool's output, answer)
    continue_says: str = ""  # what the planner's view of the memory says after it continued


class Tool:
    """One tool, with every fact the agent's prompts need about it (agentflow.py reads
    them): its card for the planner, how the executor writes its input, and the words a
    small planner uses for it when it misspells the name."""
    name = ""
    card = ""  # read by the planner in every prompt: keep it to a few short lines
    input_prefix = "Input:"  # the executor's reply is forced to start with this
    found_as = "a tool gave"  # how the planner's view of the memory names a turn of this tool
    input_stops: tuple[str, ...] = ("\n",)  # ... and ends at the first of these
    # The executor's worked examples: (question, earlier turns, sub-goal, input written
    # after the prefix); an earlier turn is (tool, sub-goal, command, result) as memory holds it.
    examples: tuple[tuple[str, tuple, str, str], ...] = ()
    # What the verifier asks after this tool ran (None: the general STOP/CONTINUE prompt).
    check: "Check | None" = None
    aliases: tuple[str, ...] = ()  # lower-case words that name this tool in a planner's reply
    # The reply depends on the command alone (searches; not code, which may draw random
    # numbers or read the clock), so a repeated command may be answered from the cache.
    cacheable = False
    network = False  # it asks a service over the network (web_tools.NetworkTool): --plan counts its calls
    writes_code = False  # its input is a program: agent.code_start applies to it
    # Its settings (tools.* in the config) with their defaults, and the values a setting
    # may take where they are few; a subclass lists only its own.
    settings = {
        "max_output_chars": 600,  # every tool output is cut to this many characters
        "search_top_k": 3,  # passages / pages / results returned by a search
        "cache_size": 4096,  # cacheable tools: replies kept per tool (infrastructure failures never;
                             #   least recently used dropped first), answered again for the same command; 0 = off
    }
    choices: dict[str, tuple] = {}
    # Settings with a range stricter than every number's >= 0: (operator, bound, why).
    bounds = {"max_output_chars": (">=", 1, ""),
              "search_top_k": (">=", 1, "a search that may return nothing fails every time, and the failure "
                                        "would be blamed on the model's query")}

    def __init__(self, cfg: dict | None = None):
        self.cfg = {**tool_settings(), **(cfg or {})}
        self.max_chars = int(self.cfg["max_output_chars"])
        size = int(self.cfg["cache_size"])
        self.cache = ReplyCache(size) if self.cacheable and size > 0 else None

    @classmethod
    def required_env(cls, cfg: dict) -> tuple[str, ...]:
        """Environment variables it cannot run without under these settings."""
        return ()

    @classmethod
    def preflight(cls, cfg: dict) -> str:
        """What it lacks outside the config file under these settings (a key, a file, an
        address), in one line that names the fix; "" when nothing (check_toolset)."""
        missing = [n for n in cls.required_env(cfg) if n and not os.environ.get(n)]
        if not missing:
            return ""
        return (f"agent.tools: {cls.name} needs {' and '.join(missing)} in the environment; "
                f"export {missing[0]}=..., or drop {cls.name} from agent.tools")

    def lane(self, command: str) -> str | None:
        """The name of a service that takes one request at a time, if this call goes to one:
        run_tool_calls runs the calls of one lane in series, on a thread of their own."""
        return None

    def run(self, command: str) -> ToolResult:
        if self.cache is None:
            return self._call(command)
        return self.cache.get((command or "").strip(), lambda: self._call(command))

    def _call(self, command: str) -> ToolResult:
        try:
            return ToolResult(output=cut(self._run(command or ""), self.max_chars))
        except (ToolError, WebError) as e:  # the model's error, or the network's (e.infra)
            return ToolResult(output="", error=str(e), infra=e.infra)
        except Exception as e:  # a bug or an odd input must not take the batch down
            return ToolResult(output="", error=f"{self.name} failed: {type(e).__name__}: {e}"[:300])

    def _run(self, command: str) -> str:
        raise NotImplementedError


# ----------------------------------------------------------------------------- Base_Generator

class BaseGenerator(Tool):
    name = "Base_Generator"
    card = ("Answers directly from the language model's own knowledge and reasoning.\n"
            "Input: the question. No tools: may be wrong on exact arithmetic and rare facts.")
    found_as = "the model answered"
    input_prefix, input_stops = "Answer:", ("\n\n",)
    examples = (("What is the capital of France?", (), "name the capital", " Paris"),)
    aliases = ("base", "generat", "answer", "llm")

    def _run(self, command):
        # The executor LLM already answered when it wrote the command; nothing else to do.
        if not command.strip():
            raise ToolError("empty answer")
        return command.strip()


# ----------------------------------------------------------------------------- Python_Coder

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """Python code from an LLM reply: the first ```python block, else the first fenced
    block of any kind (an unclosed fence runs to the end), else the whole text."""
    blocks = _FENCE.findall(text or "")
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        code = (python or [blocks[0][1]])[0]
    else:
        code = (text or "").strip()
        if len(code) > 1 and code[0] == code[-1] == "`":  # `print(1)` written inline
            code = code.strip("`")
    lines = code.splitlines()
    # Dedent in case the whole block was indented inside a list item of the reply.
    indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return "\n".join(l[indent:] for l in lines).strip() + "\n"


class PythonCoder(Tool):
    name = "Python_Coder"
    card = ("Runs a Python program and returns what it prints. Best for exact arithmetic,\n"
            "counting and step-by-step calculation. Input: the calculation to do.\n"
            "Limits: standard library only, no internet, a few seconds of run time.")
    found_as = "code printed"
    input_prefix, input_stops = "```python\n", ("```",)
    # The later examples copy a looked-up number into code: the second step of a question
    # that needs a fact and then a calculation. Their passages hold two numbers, as the
    # corpus's do, and their wordings are not the task suite's templates.
    examples = (
        ("What is 1234 * 56 + 7?", (), "compute the expression", "print(1234 * 56 + 7)\n```"),
        ("Take the population of Orvel and multiply it by 5.",
         (("Local_Search", "find the population of Orvel", "Orvel population",
           "Orvel: Orvel is a harbour town on the Sel coast. Orvel was founded in 1702 and has a "
           "population of 48213."),), "multiply the population by 5", "print(48213 * 5)\n```"),
        ("What is the crew of the Vask multiplied by 6?",
         (("Local_Search", "find the crew of the Vask", "Vask crew",
           "Vask: The Vask is a cargo ship. It was launched in 1931 and carries a crew of 312."),),
         "multiply the crew by 6", "print(312 * 6)\n```"),
        ("Multiply the number of people working at Brandt by 8.",
         (("Local_Search", "find the staff of Brandt", "Brandt staff",
           "Brandt: Brandt is a shoe maker based in Holm. Brandt was founded in 1911 and has 2604 "
           "employees."),), "multiply the staff by 8", "print(2604 * 8)\n```"),
    )
    aliases = ("python", "code", "coder", "calculat", "comput")
    writes_code = True
    settings = {
        "python_timeout_s": 5.0,  # wall-clock limit of one program
        "python_memory_mb": 512,  # address-space limit (RLIMIT_AS)
        "python_max_procs": 32,  # processes + threads (RLIMIT_NPROC)
        "python_max_file_mb": 16,  # largest file it may write (RLIMIT_FSIZE)
        "python_workdir_mb": 64,  # size of its working directory, the one place it may write
        "python_interpreter": "",  # its python; "" = ours, stdlib only; a venv's brings its packages
        "python_isolation": "namespaces",  # "namespaces" (else it refuses) or "rlimits" (no isolation; warns)
        "python_sandbox_uid": 61100,  # as root: its uid, used by nothing else (rlimits: the 16 after it)
    }
    choices = {"python_isolation": ISOLATIONS}
    bounds = {"python_timeout_s": (">", 0, "every program would time out")}

    @classmethod
    def preflight(cls, cfg):
        """Whether programs can run isolated here (probed once per process, and kept)."""
        try:
            cls._sandbox(cfg)
        except SandboxError as e:
            return str(e)
        return ""

    @staticmethod
    def _sandbox(c: dict) -> Sandbox:
        limits = Limits(timeout_s=float(c["python_timeout_s"]), memory_mb=int(c["python_memory_mb"]),
                        max_procs=int(c["python_max_procs"]), max_file_mb=int(c["python_max_file_mb"]),
                        workdir_mb=int(c["python_workdir_mb"]))
        return Sandbox(limits, interpreter=str(c["python_interpreter"]), isolation=str(c["python_isolation"]),
                       sandbox_uid=int(c["python_sandbox_uid"]))

    def __init__(self, cfg=None):
        super().__init__(cfg)
        # Decided here, once: a machine that cannot isolate programs stops the run at build time.
        self.sandbox = self._sandbox(self.cfg)

    def _run(self, command):
        code = extract_code(command)
        if not code.strip():
            raise ToolError("no code in command")
        try:
            done = self.sandbox.run(code, self.max_chars)
        except SandboxError as e:
            raise ToolError(str(e)[:300]) from None
        if done.timed_out:
            raise ToolError(f"timeout after {self.sandbox.limits.timeout_s:g}s (the program was killed)")
        if done.signal:
            raise ToolError(f"the program was killed by {done.signal}")
        if done.exit_code != 0:  # the traceback's last line, and where in the program it happened
            lines = [l for l in done.stderr.splitlines() if l.strip()]
            where = re.findall(r'main\.py", line (\d+)', done.stderr)
            reason = lines[-1].strip()[:300] if lines else f"exit code {done.exit_code}"
            raise ToolError(f"line {where[-1]}: {reason}" if where else reason)
        text = done.stdout.rstrip()
        if not text.strip():
            raise ToolError("the program printed nothing; print the result")
        return text


# ----------------------------------------------------------------------------- Local_Search

class LocalSearch(Tool):
    name = "Local_Search"
    card = ("Searches a local document collection (offline) for facts about the people,\n"
            "places and things it covers. Input: a short keyword query.\n"
            "Returns the best-matching passages; knows nothing outside the collection.")
    found_as = "a search found"
    input_prefix, input_stops = "Query:", ("\n",)
    examples = (("When was the town of Arvel founded?", (), "find when Arvel was founded", " Arvel founded"),)
    # The order of the examples moves a 135M model's Yes/No balance; this one was measured
    # best on stored training states and then checked on held-out ones (docs/LOG.md).
    check = Check("You check a question after a search. Does answering it still need a calculation?",
                  "Calculation:", "No", (
                      ("Add 250 to the crew of the Pelk.", "Pelk: The Pelk is a ferry with a crew of 61.", "Yes"),
                      ("In which year was Tarvo founded?", "Tarvo: Tarvo is a town founded in 1702.", "No"),
                      ("Who built the Orsk bridge?", "Orsk: The Orsk bridge was built by Tam Vell in 1890.", "No"),
                      ("Take the height of Kell in metres and multiply it by 4.",
                       "Kell: Kell is a peak. Kell is 2210 metres high.", "Yes"),
                      ("Work out 4521 * 33.", "no passage matches '4521 33'", "Yes"),
                      ("Tell me the length of the Vell river in km.", "Vell: The Vell is a river 340 km long.", "No"),
                      ("Divide the length of the Vell in km by 5.", "Vell: The Vell is a river 340 km long.", "Yes"),
                      ("Which river runs through Dorn, and how many bridges cross it?",
                       "Dorn: The Dorn is a river. It is crossed by 14 bridges.", "No")),
                  continue_says="a calculation is still needed")
    aliases = ("local", "search", "retriev", "corpus", "lookup", "look up")
    cacheable = True
    settings = {
        "corpus": "data/corpus.jsonl",  # JSONL rows {"title", "text", optional "id"}
        "corpus_index": "",  # a folder built by `python -m scripts.build_index` (a whole Wikipedia dump);
                             #   when set, it is searched instead of `corpus`
    }

    @classmethod
    def preflight(cls, cfg):
        if cfg["corpus_index"]:
            if not os.path.isfile(os.path.join(cfg["corpus_index"], "meta.json")):
                return (f"tools.corpus_index: {cfg['corpus_index']} is not a built index (no meta.json); build it "
                        f"with `python -m scripts.build_index CORPUS {cfg['corpus_index']}`")
        elif not os.path.isfile(cfg["corpus"]):
            return (f"tools.corpus: {cfg['corpus']} not found (Local_Search reads it); regenerate it with "
                    f"`python -m scripts.make_tasks` or set tools.corpus=PATH")
        return ""

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self._rows: list[dict] | None = None  # the corpus in memory (tools.corpus), or
        self._index: BM25 | DiskBM25 | None = None  # ... an index on disk (tools.corpus_index)
        self._lock = threading.Lock()  # concurrent first calls load the corpus once

    def _load(self) -> None:
        # A corpus that is missing or unreadable is the setup's fault, not the model's: infra.
        if self.cfg["corpus_index"]:
            try:
                self._index = DiskBM25(self.cfg["corpus_index"])
            except (OSError, ValueError) as e:
                raise ToolError(str(e)[:300], infra=True) from None
            return
        path = self.cfg["corpus"]
        if not os.path.exists(path):
            raise ToolError(f"corpus file not found: {path}", infra=True)
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if "title" not in row or "text" not in row:
                        raise ToolError(f"{path}:{line_no}: a row needs 'title' and 'text'")
                    rows.append(row)
        self._index = BM25([f"{r['title']} {r['text']}" for r in rows])
        self._rows = rows

    def _run(self, command):
        if not tokenize(command):
            raise ToolError("empty query")
        with self._lock:
            if self._index is None:
                self._load()
        k = int(self.cfg["search_top_k"])
        hits = self._index.top(command, k)
        if not hits:
            raise ToolError(f"no passage matches {command.strip()[:80]!r}")
        passage = self._rows.__getitem__ if self._rows is not None else self._index.passage
        per_hit = max(self.max_chars // len(hits) - 1, 40)  # every hit gets its share of the budget
        return "\n".join(cut(f"{p['title']}: {p['text']}", per_hit) for p in (passage(i) for i, _ in hits))


# ----------------------------------------------------------------------------- the toolset a config names

TOOL_CLASSES: dict[str, type[Tool]] = {}  # by name, in the order they registered


def register(cls: type[Tool]) -> type[Tool]:
    """Make a Tool class one a config can name in agent.tools (a class decorator)."""
    TOOL_CLASSES[cls.name] = cls
    return cls


for _cls in (BaseGenerator, PythonCoder, LocalSearch):
    register(_cls)


def load_tool_modules(modules) -> None:
    """Import the modules of tools.modules, whose tools register themselves."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"tools.modules: cannot import {name!r} ({e}); name a module on the path "
                              f"that defines tools, or drop it") from None


def network_tools(cfg: dict) -> list[str]:
    """The tools of agent.tools that call a service over the network (the memory plan counts
    their calls); a config error for a module of tools.modules that cannot be imported."""
    load_tool_modules(cfg["tools"].get("modules", TOOLSET_SETTINGS["modules"]))
    return [n for n in cfg["agent"]["tools"] if getattr(TOOL_CLASSES.get(n), "network", False)]


def tool_settings() -> dict:
    """Every setting a config may give (tools.*) with its default: the toolset's and those
    of every registered tool."""
    return tool_defaults(TOOL_CLASSES.values())


def check_toolset(cfg: dict) -> list[str]:
    """The config's toolset, before any model loads (support/config.check_tools: what it
    checks, what raises, what comes back), tools.modules imported first: their tools count."""
    load_tool_modules(tool_modules(cfg["tools"]))
    return check_tools(cfg, TOOL_CLASSES)


def build_tools(names: list[str], cfg: dict | None = None) -> dict[str, Tool]:
    """Tools by name, in the given order, sharing one settings dict (defaults filled in;
    tools.modules imported first)."""
    load_tool_modules((cfg or {}).get("modules", TOOLSET_SETTINGS["modules"]))
    unknown = [n for n in names if n not in TOOL_CLASSES]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; allowed: {sorted(TOOL_CLASSES)}")
    known = tool_settings()
    bad_keys = sorted(set(cfg or {}) - set(known))
    if bad_keys:
        raise ValueError(f"unknown tool setting(s) {bad_keys}; allowed: {sorted(known)}")
    return {name: TOOL_CLASSES[name](cfg) for name in names}


def run_tool_calls(calls: list[tuple[Tool, str]], max_workers: int = 8) -> list[ToolResult]:
    """Run (tool, command) pairs concurrently; results in input order. Threads are
    enough: the slow parts (sandbox subprocesses, HTTP) release the GIL. The calls of a
    lane (Tool.lane: Wikimedia asks for one request at a time) run in series on a thread of
    their own: waiting for their turn never holds one of the `max_workers` threads that
    every other call shares."""
    if not calls:
        return []

    def one(call: tuple[Tool, str]) -> ToolResult:
        tool, command = call
        try:
            return tool.run(command)
        except Exception as e:  # run() should never raise, but a foreign Tool might
            name = getattr(tool, "name", type(tool).__name__)
            return ToolResult(output="", error=f"{name} raised {type(e).__name__}: {e}"[:300])

    lanes: dict[str, list[int]] = {}  # lane -> its calls, in order
    shared = []
    for i, (tool, command) in enumerate(calls):
        lane = tool.lane(command)
        (lanes.setdefault(lane, []) if lane else shared).append(i)
    with (ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(shared)))) as pool,
          ThreadPoolExecutor(max_workers=max(1, len(lanes))) as lane_threads):
        done = {i: pool.submit(one, calls[i]) for i in shared}
        in_series = [(order, lane_threads.submit(lambda order: [one(calls[i]) for i in order], order))
                     for order in lanes.values()]
    results = {i: future.result() for i, future in done.items()}
    for order, future in in_series:
        results.update(zip(order, future.result()))
    return [results[i] for i in range(len(calls))]
