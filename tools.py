"""
The toolset K of AgentFlow (paper section 1): the six tools, the short cards the
planner reads to choose among them, and how they reach the network.

Every tool takes one string (the command the executor LLM wrote) and returns a
ToolResult: the text that goes into memory, already capped, or a short error. A tool
never raises, so one bad call costs one turn, not the whole batch of trajectories.

Two kinds of failure are kept apart. A tool error is the model's doing (a query with no
results, code that crashes, a made-up URL that answers 404): it goes into memory and
the reward judges it. An infrastructure failure is not (a 429 or a 5xx after every
retry, a timeout, a refused or missing API key): the result says so (`infra`), and
train.py leaves such a trajectory out of the update instead of scoring it 0, so the
planner never learns to avoid a tool because a quota ran out. Network calls are
retried with backoff, honouring Retry-After (_request); identical commands are answered
from a per-tool cache (search tools only), so the G rollouts of a query that search
the same thing send one request.

Where this departs from the official code:
- Its Python tool runs model code twice, in-process, unsandboxed, with a timeout that
  cannot interrupt it. Here the code runs once, in its own process, under a supervisor
  that enforces a wall-clock limit and leaves no process behind (sandbox.py).
- It pastes tool output into prompts uncapped. Here every output is cut to
  `max_output_chars` with a visible "...[cut N chars]" marker.
- Its search tools call paid LLMs. Here Google_Search returns Google's results from a
  results API (Serper by default; Google's own Custom Search JSON API as an option),
  Web_Search ranks page chunks with BM25, and Local_Search (BM25 over a JSONL corpus,
  or over an on-disk index of a whole Wikipedia dump, support/bm25.py) runs offline.

The Python sandbox is sandbox.py: by default each program runs in its own Linux user,
network, mount, PID and IPC namespaces (no network, a read-only view of little more
than the interpreter, its own processes only), under rlimits and a wall clock, for
root and ordinary users alike. Web_Search, which fetches URLs a model wrote, refuses
internal addresses (support/web.py).
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from support.bm25 import BM25, DiskBM25, tokenize
from support.reply_cache import ReplyCache
from support.config import ConfigError, merge
from support.sandbox import ISOLATIONS, Limits, Sandbox, SandboxError
from support.text import cut
from support.web import WIKIMEDIA_LOCK, RetryPolicy, WebError, api_json, fetch_page_text, is_wikimedia, user_agent

DEFAULT_TOOL_CFG = {
    "max_output_chars": 600,      # every tool output is cut to this many characters
    "search_top_k": 3,            # passages / pages / results returned by the search tools
    "corpus": "data/corpus.jsonl",  # Local_Search: JSONL rows {"title", "text", optional "id"}
    "corpus_index": "",           # Local_Search: a folder built by `python -m scripts.build_index` (a whole
                                  #   Wikipedia dump); when set, it is searched instead of `corpus`
    "python_timeout_s": 5.0,      # Python_Coder: wall-clock limit of one program
    "python_memory_mb": 512,      # Python_Coder: address-space limit (RLIMIT_AS)
    "python_max_procs": 32,       # Python_Coder: processes + threads (RLIMIT_NPROC)
    "python_max_file_mb": 16,     # Python_Coder: largest file it may write (RLIMIT_FSIZE)
    "python_workdir_mb": 64,      # Python_Coder: size of its working directory, the one place it may write
    "python_interpreter": "",     # Python_Coder: its python; "" = ours, stdlib only; a venv's brings its packages
    "python_isolation": "namespaces",  # Python_Coder: "namespaces" (else it refuses) or "rlimits" (no isolation; warns)
    "python_sandbox_uid": 61100,  # Python_Coder as root: its uid, used by nothing else (rlimits: the 16 after it)
    "web_timeout_s": 10.0,        # network tools: per-request timeout
    "web_max_bytes": 2_000_000,   # Web_Search: bytes of a page read at most
    "url_allow": [],              # Web_Search: hosts or CIDRs it may fetch although internal, e.g. [10.0.0.0/8]
    # Retries of a network request on HTTP 429, 5xx, a timeout or a dropped connection. A
    # request that still fails is an infrastructure failure: the trajectory is left out
    # of the update (train.py), not scored 0.
    "retry_attempts": 4,          # tries in all (1 = never retry)
    "retry_backoff_s": 1.0,       # wait before the 2nd try, doubled for each later one (x 0.5..1, random),
                                  #   unless the server says how long in Retry-After
    "retry_max_wait_s": 30.0,     # longest single wait; a server asking for more ends the request at once
    "retry_total_s": 60.0,        # no new try once this much time has passed since the first
    "cache_size": 4096,           # search tools: replies kept per tool (infrastructure failures never;
                                  #   least recently used dropped first), answered again for the same
                                  #   command; 0 = off
    # Wikimedia's User-Agent policy asks automated clients for a way to reach their operator;
    # Wikipedia_Search refuses to start without it (config.preflight).
    "contact": "",                # an email address or URL of yours, e.g. "you@example.org"
    "wikipedia_url": "https://en.wikipedia.org/w/api.php",
    "wikipedia_maxlag": 5,        # MediaWiki's maxlag (s): it asks non-interactive clients to send it and to
                                  #   wait when the servers lag; 0 = not sent
    # Google_Search's provider. Google closed its Custom Search JSON API to new customers
    # and ends its whole-web search on 2027-01-01, so the default is Serper, a Google
    # results API anyone can sign up for (serper.dev); cse keeps Google's own API for
    # those who still have a key.
    "google_provider": "serper",  # serper | cse
    "serper_url": "https://google.serper.dev/search",
    "serper_key_env": "SERPER_API_KEY",  # NAME of the environment variable holding the Serper key
    "google_url": "https://www.googleapis.com/customsearch/v1",  # cse
    "cse_key_env": "GOOGLE_API_KEY",     # cse: NAME of the variable holding the API key
    "cse_id_env": "GOOGLE_CSE_ID",       # cse: NAME of the variable holding the search engine id (cx)
}


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

    def __init__(self, cfg: dict | None = None):
        self.cfg = {**DEFAULT_TOOL_CFG, **(cfg or {})}
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

    def __init__(self, cfg=None):
        super().__init__(cfg)
        c = self.cfg
        limits = Limits(timeout_s=float(c["python_timeout_s"]), memory_mb=int(c["python_memory_mb"]),
                        max_procs=int(c["python_max_procs"]), max_file_mb=int(c["python_max_file_mb"]),
                        workdir_mb=int(c["python_workdir_mb"]))
        # Decided here, once: a machine that cannot isolate programs stops the run at build time.
        self.sandbox = Sandbox(limits, interpreter=str(c["python_interpreter"]),
                               isolation=str(c["python_isolation"]), sandbox_uid=int(c["python_sandbox_uid"]))

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


# ----------------------------------------------------------------------------- network tools

class WikipediaSearch(Tool):
    name = "Wikipedia_Search"
    card = ("Searches Wikipedia and returns the opening paragraphs of the best-matching\n"
            "articles. Good for well-known people, places, events and terms.\n"
            "Input: a short query, ideally an article title.")
    found_as = "a Wikipedia search found"
    input_prefix, input_stops = "Query:", ("\n",)
    examples = (("Who wrote Hamlet?", (), "find the author of Hamlet", " Hamlet"),)
    aliases = ("wiki",)
    cacheable = True
    # MediaWiki error codes that mean "not now" rather than "not this": retried like a 503.
    TRANSIENT = ("maxlag", "ratelimited")

    @classmethod
    def preflight(cls, cfg):
        if is_wikimedia(urlparse(cfg["wikipedia_url"]).hostname) and not cfg["contact"].strip():
            return ("tools.contact is empty: Wikimedia's User-Agent policy asks automated clients for a way to reach "
                    "their operator; set tools.contact=you@example.org (an email address or a URL), or drop "
                    "Wikipedia_Search from agent.tools")  # (a local mirror has its own rules)
        return super().preflight(cfg)

    def _api(self, params: dict) -> dict:
        params = {**params, "format": "json", "formatversion": 2}
        if int(self.cfg["wikipedia_maxlag"]) > 0:  # training is a non-interactive client
            params["maxlag"] = int(self.cfg["wikipedia_maxlag"])
        with WIKIMEDIA_LOCK:
            return api_json(self.cfg["wikipedia_url"], RetryPolicy.from_cfg(self.cfg), float(self.cfg["web_timeout_s"]),
                             transient_codes=self.TRANSIENT, params=params, agent=user_agent(self.cfg["contact"]))

    def _run(self, command):
        query = command.strip()
        if not query:
            raise ToolError("empty query")
        found = self._api({"action": "query", "list": "search", "srsearch": query,
                           "srlimit": int(self.cfg["search_top_k"])})
        hits = found.get("query", {}).get("search", [])
        if not hits:
            raise ToolError(f"no Wikipedia article matches {query[:80]!r}")
        titles = [h["title"] for h in hits]
        pages = self._api({"action": "query", "prop": "extracts", "explaintext": 1, "exintro": 1,
                           "titles": "|".join(titles), "redirects": 1}).get("query", {}).get("pages", [])
        extracts = {p.get("title"): (p.get("extract") or "").strip() for p in pages}
        per_hit = max(self.max_chars // len(hits) - 1, 40)
        lines = []
        for h in hits:  # in search order; the search snippet stands in for a missing extract
            text = extracts.get(h["title"]) or re.sub("<[^>]+>", "", h.get("snippet", ""))
            lines.append(cut(f"{h['title']}: {text}", per_hit))
        return "\n".join(lines)


class GoogleSearch(Tool):
    """Google's results through one of two APIs (tools.google_provider):
    serper: POST {"q", "num"} with the key in X-API-KEY; results in "organic" (title,
            link, snippet), Google's direct answer, if any, in "answerBox".
    cse:    Google's Custom Search JSON API, GET key, cx, q, num; results in "items".
            Closed to new customers; its whole-web search ends on 2027-01-01."""
    name = "Google_Search"
    card = ("Searches the web with Google; returns titles, short snippets and links.\n"
            "Good for specific or recent facts. Input: a short search query.")
    found_as = "a web search found"
    input_prefix, input_stops = "Query:", ("\n",)
    examples = (("Who won the 2018 World Cup?", (), "find the 2018 winner", " 2018 World Cup winner"),)
    aliases = ("google",)
    cacheable = True
    PROVIDERS = ("serper", "cse")

    def __init__(self, cfg=None):
        super().__init__(cfg)
        if self.cfg["google_provider"] not in self.PROVIDERS:
            raise ValueError(f"tools.google_provider must be one of {', '.join(self.PROVIDERS)}, "
                             f"got {self.cfg['google_provider']!r}")

    @classmethod
    def required_env(cls, cfg):
        c = {**DEFAULT_TOOL_CFG, **(cfg or {})}
        return (c["cse_key_env"], c["cse_id_env"]) if c["google_provider"] == "cse" else (c["serper_key_env"],)

    @classmethod
    def preflight(cls, cfg):
        problem = super().preflight(cfg)
        return problem.replace("in the environment;", f"in the environment (tools.google_provider is "
                                                      f"{cfg['google_provider']});") if problem else ""

    def _run(self, command):
        query = command.strip()
        if not query:
            raise ToolError("empty query")
        names = self.required_env(self.cfg)
        values = [os.environ.get(n, "") for n in names]  # read now, not at import
        if not all(values):
            raise ToolError(f"Google_Search needs {' and '.join(names)} in the environment", infra=True)
        k = min(int(self.cfg["search_top_k"]), 10)  # 10 is one page: what both APIs charge one query for
        retry, timeout = RetryPolicy.from_cfg(self.cfg), float(self.cfg["web_timeout_s"])
        if self.cfg["google_provider"] == "serper":
            data = api_json(self.cfg["serper_url"], retry, timeout, method="POST", json={"q": query, "num": k},
                             headers={"X-API-KEY": values[0]})
            box = data.get("answerBox") if isinstance(data.get("answerBox"), dict) else {}
            answer = box.get("answer") or box.get("snippet")
            items = ([{"title": box.get("title") or "Answer", "snippet": answer, "link": box.get("link", "")}]
                     if answer else []) + list(data.get("organic") or [])
        else:
            items = api_json(self.cfg["google_url"], retry, timeout,
                              params={"key": values[0], "cx": values[1], "q": query, "num": k}).get("items") or []
        items = [it for it in items if isinstance(it, dict)][:k]
        if not items:
            raise ToolError(f"no Google results for {query[:80]!r}")
        per_hit = self.max_chars // len(items) - 1
        lines = []
        for it in items:  # cut the snippet, not the link: the link is what Web_Search needs next
            title, link = str(it.get("title", "")), str(it.get("link", ""))
            snippet = cut(" ".join(str(it.get("snippet", "")).split()), max(per_hit - len(title) - len(link) - 5, 20))
            lines.append(f"{title}: {snippet}" + (f" ({link})" if link else ""))
        return "\n".join(lines)


_URL = re.compile(r"https?://[^\s<>\"'`]+")


class WebSearch(Tool):
    name = "Web_Search"
    card = ("Reads one web page and returns the passages most relevant to a question.\n"
            "Input: a URL and a question. Use it on a link another search returned.")
    found_as = "a web page gave"
    input_prefix, input_stops = "Input:", ("\n",)
    examples = (("How tall is the tower on https://example.org/tower ?", (), "read the page about the tower",
                 " https://example.org/tower How tall is the tower?"),)
    aliases = ("web", "url", "browse")
    cacheable = True
    CHUNK_WORDS, CHUNK_STRIDE = 80, 60  # 80-word chunks overlapping by 20, so a fact is rarely split

    def _run(self, command):
        match = _URL.search(command)
        if not match:
            raise ToolError("no URL in command")
        url = match.group(0).rstrip(".,;:!?)]}")
        question = (command[:match.start()] + " " + command[match.start() + len(url):]).strip()
        url, text = fetch_page_text(url, RetryPolicy.from_cfg(self.cfg), float(self.cfg["web_timeout_s"]),
                                    int(self.cfg["web_max_bytes"]), self.cfg["url_allow"], self.cfg["contact"])
        words = text.split()
        if not words:
            raise ToolError(f"no text on page {url[:100]}")
        # A chunk starts every STRIDE words until one reaches the end of the page.
        stop = max(len(words) - (self.CHUNK_WORDS - self.CHUNK_STRIDE), 1)
        chunks = [" ".join(words[i:i + self.CHUNK_WORDS]) for i in range(0, stop, self.CHUNK_STRIDE)]
        k = int(self.cfg["search_top_k"])
        best = [i for i, _ in BM25(chunks).top(question, k)] or list(range(min(k, len(chunks))))
        per_hit = max(self.max_chars // len(best) - 1, 40)
        return "\n".join(cut(chunks[i], per_hit) for i in best)


# ----------------------------------------------------------------------------- registry and batch calls

TOOL_CLASSES: dict[str, type[Tool]] = {
    cls.name: cls for cls in (BaseGenerator, PythonCoder, LocalSearch, WikipediaSearch, GoogleSearch, WebSearch)}
SETTING_CHOICES = {"tools.python_isolation": ISOLATIONS, "tools.google_provider": GoogleSearch.PROVIDERS}


def check_toolset(cfg: dict) -> None:
    """The config's toolset, before any model loads: agent.tools names known tools, every
    tools.* key is a known setting of the right type (the rest take DEFAULT_TOOL_CFG's
    values, written into cfg), and each tool has what it needs outside the file (its API
    key, its corpus, a contact address: Tool.preflight). A ConfigError names the key and
    the fix, one line for each tool that lacks something."""
    for name in cfg["agent"]["tools"]:
        if name not in TOOL_CLASSES:
            near = difflib.get_close_matches(name, list(TOOL_CLASSES), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(f"agent.tools: unknown tool {name!r}; {hint}known tools: {', '.join(TOOL_CLASSES)}")
    settings = copy.deepcopy(DEFAULT_TOOL_CFG)
    merge(settings, cfg["tools"], DEFAULT_TOOL_CFG, "tools.", SETTING_CHOICES)
    cfg["tools"] = settings
    problems = [TOOL_CLASSES[name].preflight(settings) for name in cfg["agent"]["tools"]]
    if any(problems):
        raise ConfigError("\n".join(p for p in problems if p))


def build_tools(names: list[str], cfg: dict | None = None) -> dict[str, Tool]:
    """Tools by name, in the given order, sharing one settings dict (defaults filled in)."""
    unknown = [n for n in names if n not in TOOL_CLASSES]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; allowed: {sorted(TOOL_CLASSES)}")
    bad_keys = sorted(set(cfg or {}) - set(DEFAULT_TOOL_CFG))
    if bad_keys:
        raise ValueError(f"unknown tool setting(s) {bad_keys}; allowed: {sorted(DEFAULT_TOOL_CFG)}")
    return {name: TOOL_CLASSES[name](cfg) for name in names}


def run_tool_calls(calls: list[tuple[Tool, str]], max_workers: int = 8) -> list[ToolResult]:
    """Run (tool, command) pairs concurrently; results in input order. Threads are
    enough: the slow parts (sandbox subprocesses, HTTP) release the GIL."""
    if not calls:
        return []

    def one(call: tuple[Tool, str]) -> ToolResult:
        tool, command = call
        try:
            return tool.run(command)
        except Exception as e:  # run() should never raise, but a foreign Tool might
            name = getattr(tool, "name", type(tool).__name__)
            return ToolResult(output="", error=f"{name} raised {type(e).__name__}: {e}"[:300])

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(calls)))) as pool:
        return list(pool.map(one, calls))
