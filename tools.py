"""
The toolset K of AgentFlow (paper section 1): the six tools, the short cards the
planner reads to choose among them, and the sandbox the Python Coder runs code in.

Every tool takes one string (the command the executor LLM wrote) and returns a
ToolResult: the text that goes into memory, already capped, or a short error. A tool
never raises, so one bad call costs one turn, not the whole batch of trajectories.

Where this departs from the official code:
- Its Python tool runs model code twice, in-process, unsandboxed, with a timeout that
  cannot interrupt it. Here the code runs once, in its own process, under a supervisor
  that enforces a wall-clock limit and leaves no process behind (below).
- It pastes tool output into prompts uncapped. Here every output is cut to
  `max_output_chars` with a visible "...[cut N chars]" marker.
- Its search tools call paid LLMs. Here Google is the plain Custom Search API,
  Web_Search ranks page chunks with BM25, and Local_Search (BM25 over a JSONL corpus)
  is added so the default task runs offline.

The Python sandbox is sandbox.py: by default each program runs in its own Linux user,
network, mount, PID and IPC namespaces (no network, a read-only view of little more
than the interpreter, its own processes only), under rlimits and a wall clock, for
root and ordinary users alike. Web_Search, which fetches URLs a model wrote, refuses
internal addresses (_guarded_get).
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urljoin, urlparse

import requests
import urllib3

from memory import cut
from sandbox import Limits, Sandbox, SandboxError

DEFAULT_TOOL_CFG = {
    "max_output_chars": 600,      # every tool output is cut to this many characters
    "search_top_k": 3,            # passages / pages / results returned by the search tools
    "corpus": "data/corpus.jsonl",  # Local_Search: JSONL rows {"title", "text", optional "id"}
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
    "wikipedia_url": "https://en.wikipedia.org/w/api.php",
    "google_url": "https://www.googleapis.com/customsearch/v1",
}
USER_AGENT = "AgentFlow-from-scratch/0.1 (research agent; python-requests)"


@dataclass
class ToolResult:
    output: str      # text stored in memory, already capped
    error: str = ""  # non-empty = the call failed, with a short reason

    @property
    def ok(self) -> bool:
        return not self.error


class ToolError(Exception):
    """A failure with a message fit for the memory (raised inside tools, never out of run)."""


class Tool:
    """One tool, with every fact the agent's prompts need about it (agentflow.py reads
    them): its card for the planner, how the executor writes its input, and the words a
    small planner uses for it when it misspells the name."""
    name = ""
    card = ""  # read by the planner in every prompt: keep it to a few short lines
    input_prefix = "Input:"  # the executor's reply is forced to start with this
    input_stops: tuple[str, ...] = ("\n",)  # ... and ends at the first of these
    # The executor's worked example: (question, sub-goal, input written after the prefix).
    example: tuple[str, str, str] | None = None
    aliases: tuple[str, ...] = ()  # lower-case words that name this tool in a planner's reply
    required_env: tuple[str, ...] = ()  # environment variables it cannot run without (config.preflight)

    def __init__(self, cfg: dict | None = None):
        self.cfg = {**DEFAULT_TOOL_CFG, **(cfg or {})}
        self.max_chars = int(self.cfg["max_output_chars"])

    def run(self, command: str) -> ToolResult:
        try:
            return ToolResult(output=cut(self._run(command or ""), self.max_chars))
        except ToolError as e:
            return ToolResult(output="", error=str(e))
        except Exception as e:  # a bug or an odd input must not take the batch down
            return ToolResult(output="", error=f"{self.name} failed: {type(e).__name__}: {e}"[:300])

    def _run(self, command: str) -> str:
        raise NotImplementedError


# ----------------------------------------------------------------------------- Base_Generator

class BaseGenerator(Tool):
    name = "Base_Generator"
    card = ("Answers directly from the language model's own knowledge and reasoning.\n"
            "Input: the question. No tools: may be wrong on exact arithmetic and rare facts.")
    input_prefix, input_stops = "Answer:", ("\n\n",)
    example = ("What is the capital of France?", "name the capital", " Paris")
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
    input_prefix, input_stops = "```python\n", ("```",)
    example = ("What is 1234 * 56 + 7?", "compute the expression", "print(1234 * 56 + 7)\n```")
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


# ----------------------------------------------------------------------------- BM25, Local_Search

def tokenize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class BM25:
    """Okapi BM25 over a fixed list of documents:
        score(q, d) = sum_{t in q} idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
        idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))   (Lucene's form: never negative)
    Repeated query words count once."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.lengths = []
        self.postings: dict[str, list[tuple[int, int]]] = {}  # word -> [(doc index, tf)]
        for i, doc in enumerate(docs):
            words = tokenize(doc)
            self.lengths.append(len(words))
            for word, tf in Counter(words).items():
                self.postings.setdefault(word, []).append((i, tf))
        n = len(docs)
        self.avgdl = sum(self.lengths) / n if n else 0.0
        self.idf = {w: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for w, p in self.postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        """Score of every document sharing a word with the query (the others score 0)."""
        scores: dict[int, float] = {}
        for word in dict.fromkeys(tokenize(query)):  # unique, in query order: the same float sums every run
            for i, tf in self.postings.get(word, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                scores[i] = scores.get(i, 0.0) + self.idf[word] * tf * (self.k1 + 1) / (tf + norm)
        return scores

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best (index, score) pairs with score > 0; ties go to the earlier document."""
        return sorted(self.scores(query).items(), key=lambda p: (-p[1], p[0]))[:k]


class LocalSearch(Tool):
    name = "Local_Search"
    card = ("Searches a local document collection (offline) for facts about the people,\n"
            "places and things it covers. Input: a short keyword query.\n"
            "Returns the best-matching passages; knows nothing outside the collection.")
    input_prefix, input_stops = "Query:", ("\n",)
    example = ("When was the town of Arvel founded?", "find when Arvel was founded", " Arvel founded")
    aliases = ("local", "search", "retriev", "corpus", "lookup", "look up")

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self._rows: list[dict] | None = None
        self._index: BM25 | None = None
        self._lock = threading.Lock()  # concurrent first calls load the corpus once

    def _load(self) -> None:
        path = self.cfg["corpus"]
        if not os.path.exists(path):
            raise ToolError(f"corpus file not found: {path}")
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
        per_hit = max(self.max_chars // len(hits) - 1, 40)  # every hit gets its share of the budget
        return "\n".join(cut(f"{self._rows[i]['title']}: {self._rows[i]['text']}", per_hit)
                         for i, _ in hits)


# ----------------------------------------------------------------------------- network tools

def _get(url: str, params: dict | None, timeout: float, session=None, **kw) -> requests.Response:
    """GET with our User-Agent; failures become ToolError. The messages never quote the
    request URL: it can hold an API key, and errors end up in prompts and logs."""
    host = urlparse(url).netloc or url[:60]
    try:
        resp = (session or requests).get(url, params=params, timeout=timeout, headers={"User-Agent": USER_AGENT},
                                         **kw)
    except requests.Timeout:
        raise ToolError(f"timeout after {timeout:g}s from {host}") from None
    except requests.RequestException as e:
        raise ToolError(f"request to {host} failed ({type(e).__name__})") from None
    if resp.status_code >= 400:
        try:  # APIs explain themselves in a JSON error body
            message = _api_error(resp.json())
        except ValueError:
            message = ""
        resp.close()
        raise ToolError(f"HTTP {resp.status_code} from {host}" + (f": {message}" if message else ""))
    return resp


# A URL that a model wrote must not turn the agent inward: onto this machine's services
# (a judge, a model server, a database on 127.0.0.1), the local network or a cloud
# metadata endpoint (169.254.169.254). Every address a fetch would go to is checked:
# what the name resolves to before the request (so an internal one is never contacted)
# and the peer the socket actually connected to (so a name that resolves to a public
# address for our check and to an internal one for the connection, DNS rebinding, is
# caught too), on the first request and on every redirect, which we follow ourselves.
# Behind an HTTP proxy the proxy resolves the name and only the first check applies.
# Not guarded: the API endpoints of the config (wikipedia_url, google_url), which the
# user chose (a local mirror is legitimate) and of which a model writes only the query.

_MAX_REDIRECTS = 5
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _allow_list(entries) -> tuple[set[str], list]:
    """tools.url_allow as (host names, networks): an entry that parses as an address or
    CIDR allows those addresses under any name; any other entry allows that host name."""
    names, nets = set(), []
    for entry in entries or ():
        try:
            nets.append(ipaddress.ip_network(str(entry), strict=False))
        except ValueError:
            names.add(str(entry).lower().rstrip("."))
    return names, nets


def _refusal(ip: str, nets) -> str:
    """Why a fetch may not go to `ip` ("" = it may)."""
    addr = ipaddress.ip_address(ip.split("%")[0])  # a scope id (fe80::1%eth0) is no part of the address
    if addr.version == 6:  # an IPv4 address inside IPv6 is judged as itself (::ffff:127.0.0.1 is loopback)
        if addr in _NAT64:
            addr = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        else:
            addr = addr.ipv4_mapped or addr.sixtofour or addr
    if any(addr in net for net in nets if net.version == addr.version):
        return ""
    for kind in ("loopback", "unspecified", "link_local", "private", "multicast", "reserved"):
        if getattr(addr, "is_" + kind):
            return f"{addr} is a {kind.replace('_', '-')} address"
    return "" if addr.is_global else f"{addr} is not a public address"


def _refuse(host: str, why: str) -> ToolError:
    return ToolError(f"refused to fetch from {host}: {why} (tools.url_allow lets a host in)")


def _check_host(host: str, port: int, allow: tuple[set[str], list]) -> None:
    names, nets = allow
    if host.lower().rstrip(".") in names:
        return
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ToolError(f"cannot resolve {host}") from None
    for *_, sockaddr in found:  # every address it resolves to: the client may pick any of them
        why = _refusal(sockaddr[0], nets)
        if why:
            raise _refuse(host, why)


def _guarded_session(allow: tuple[set[str], list]) -> requests.Session:
    """A session whose direct connections refuse a peer outside the allow list."""

    def guarded(base):
        class Guarded(base):
            def _new_conn(self):
                sock = super()._new_conn()
                if self.host.lower().rstrip(".") not in allow[0]:
                    why = _refusal(sock.getpeername()[0], allow[1])
                    if why:  # nothing was sent yet
                        sock.close()
                        raise _refuse(self.host, why)
                return sock
        return Guarded

    pools = {"http": type("GuardedPool", (urllib3.HTTPConnectionPool,),
                          {"ConnectionCls": guarded(urllib3.connection.HTTPConnection)}),
             "https": type("GuardedPool", (urllib3.HTTPSConnectionPool,),
                           {"ConnectionCls": guarded(urllib3.connection.HTTPSConnection)})}

    class Adapter(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = pools

    session = requests.Session()
    for scheme in ("http://", "https://"):
        session.mount(scheme, Adapter())
    return session


def _guarded_get(url: str, timeout: float, allow_entries) -> tuple[str, requests.Response]:
    """(final URL, streamed response) of a GET to a model-written URL, redirects followed
    by hand so that every hop is checked."""
    allow = _allow_list(allow_entries)
    with _guarded_session(allow) as session:
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urlparse(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ToolError(f"not an http(s) URL: {url[:100]}")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise ToolError(f"bad port in {url[:100]}") from None
            _check_host(parts.hostname, port, allow)
            resp = _get(url, None, timeout, session=session, stream=True, allow_redirects=False)
            if not resp.is_redirect:
                return url, resp
            url = urljoin(url, resp.headers["Location"])
            resp.close()
    raise ToolError(f"more than {_MAX_REDIRECTS} redirects")


def _api_error(data) -> str:
    """The message of an API error body: Google {"error": {"message"}}, MediaWiki {"error": {"info"}}."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message") or error.get("info") or error.get("code") or "unknown error"
    return str(error)[:200] if error else ""


def _get_json(url: str, params: dict, timeout: float) -> dict:
    resp = _get(url, params, timeout)
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ToolError(f"non-JSON reply from {urlparse(url).netloc}")
    if _api_error(data):  # MediaWiki answers errors with HTTP 200
        raise ToolError(f"API error: {_api_error(data)}")
    return data


class WikipediaSearch(Tool):
    name = "Wikipedia_Search"
    card = ("Searches Wikipedia and returns the opening paragraphs of the best-matching\n"
            "articles. Good for well-known people, places, events and terms.\n"
            "Input: a short query, ideally an article title.")
    input_prefix, input_stops = "Query:", ("\n",)
    example = ("Who wrote Hamlet?", "find the author of Hamlet", " Hamlet")
    aliases = ("wiki",)

    def _run(self, command):
        query = command.strip()
        if not query:
            raise ToolError("empty query")
        url, timeout = self.cfg["wikipedia_url"], float(self.cfg["web_timeout_s"])
        found = _get_json(url, {"action": "query", "list": "search", "srsearch": query, "format": "json",
                                "srlimit": int(self.cfg["search_top_k"]), "formatversion": 2}, timeout)
        hits = found.get("query", {}).get("search", [])
        if not hits:
            raise ToolError(f"no Wikipedia article matches {query[:80]!r}")
        titles = [h["title"] for h in hits]
        pages = _get_json(url, {"action": "query", "prop": "extracts", "explaintext": 1, "exintro": 1,
                                "titles": "|".join(titles), "format": "json", "formatversion": 2,
                                "redirects": 1}, timeout).get("query", {}).get("pages", [])
        extracts = {p.get("title"): (p.get("extract") or "").strip() for p in pages}
        per_hit = max(self.max_chars // len(hits) - 1, 40)
        lines = []
        for h in hits:  # in search order; the search snippet stands in for a missing extract
            text = extracts.get(h["title"]) or re.sub("<[^>]+>", "", h.get("snippet", ""))
            lines.append(cut(f"{h['title']}: {text}", per_hit))
        return "\n".join(lines)


class GoogleSearch(Tool):
    name = "Google_Search"
    card = ("Searches the web with Google; returns titles, short snippets and links.\n"
            "Good for specific or recent facts. Input: a short search query.")
    input_prefix, input_stops = "Query:", ("\n",)
    example = ("Who won the 2018 World Cup?", "find the 2018 winner", " 2018 World Cup winner")
    aliases = ("google",)
    required_env = ("GOOGLE_API_KEY", "GOOGLE_CSE_ID")

    def _run(self, command):
        query = command.strip()
        if not query:
            raise ToolError("empty query")
        key, cx = os.environ.get("GOOGLE_API_KEY"), os.environ.get("GOOGLE_CSE_ID")  # read now, not at import
        if not key or not cx:
            raise ToolError("Google_Search needs GOOGLE_API_KEY and GOOGLE_CSE_ID in the environment")
        k = min(int(self.cfg["search_top_k"]), 10)  # the API returns at most 10
        data = _get_json(self.cfg["google_url"], {"key": key, "cx": cx, "q": query, "num": k},
                         float(self.cfg["web_timeout_s"]))
        items = data.get("items") or []
        if not items:
            raise ToolError(f"no Google results for {query[:80]!r}")
        per_hit = self.max_chars // len(items[:k]) - 1
        lines = []
        for it in items[:k]:  # cut the snippet, not the link: the link is what Web_Search needs next
            title, link, snippet = it.get("title", ""), it.get("link", ""), " ".join(it.get("snippet", "").split())
            lines.append(f"{title}: {cut(snippet, max(per_hit - len(title) - len(link) - 5, 20))} ({link})")
        return "\n".join(lines)


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page: skips script/style/noscript/template/svg; entities
    are decoded by convert_charrefs. Every tag becomes a space, so blocks never glue."""
    SKIP = {"script", "style", "noscript", "template", "svg"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        self.skipping += tag in self.SKIP
        self.parts.append(" ")

    def handle_endtag(self, tag):
        self.skipping = max(self.skipping - (tag in self.SKIP), 0)
        self.parts.append(" ")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    return " ".join("".join(parser.parts).split())


_URL = re.compile(r"https?://[^\s<>\"'`]+")


class WebSearch(Tool):
    name = "Web_Search"
    card = ("Reads one web page and returns the passages most relevant to a question.\n"
            "Input: a URL and a question. Use it on a link another search returned.")
    input_prefix, input_stops = "Input:", ("\n",)
    example = ("How tall is the tower on https://example.org/tower ?", "read the page about the tower",
               " https://example.org/tower How tall is the tower?")
    aliases = ("web", "url", "browse")
    CHUNK_WORDS, CHUNK_STRIDE = 80, 60  # 80-word chunks overlapping by 20, so a fact is rarely split

    def _run(self, command):
        match = _URL.search(command)
        if not match:
            raise ToolError("no URL in command")
        url = match.group(0).rstrip(".,;:!?)]}")
        question = (command[:match.start()] + " " + command[match.start() + len(url):]).strip()
        timeout, max_bytes = float(self.cfg["web_timeout_s"]), int(self.cfg["web_max_bytes"])
        url, resp = _guarded_get(url, timeout, self.cfg["url_allow"])
        with resp:
            ctype = resp.headers.get("Content-Type", "").lower()
            if not (ctype.startswith("text/") or "html" in ctype or "xml" in ctype):
                raise ToolError(f"unsupported content type {ctype.split(';')[0] or 'unknown'!r} at {url[:100]}")
            body, stop_at = b"", time.monotonic() + timeout  # a page that drips forever still ends
            for piece in resp.iter_content(65536):
                body += piece
                if len(body) >= max_bytes or time.monotonic() > stop_at:
                    break
        charset = re.search(r"charset=[\"']?([\w.-]+)", ctype)
        try:
            text = body[:max_bytes].decode(charset.group(1) if charset else "utf-8", "replace")
        except LookupError:  # an unknown charset name
            text = body[:max_bytes].decode("utf-8", "replace")
        if "html" in ctype or "xml" in ctype:
            text = html_to_text(text)
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
