"""The paper's web tools (section 1): Wikipedia_Search, Google_Search and Web_Search, which
configs/qwen2.5-7b-1gpu.yaml uses; the offline default never calls them.

They are tools like those of tools.py, registered with it when this module is loaded
(tools.modules lists it by default). What they need to be used for real by many
trajectories at once, and that no tool decision depends on, is support/web.py: retries
with backoff that honour Retry-After, Wikimedia's etiquette, and no fetch of an internal
address. A request that still fails after its retries raises WebError(infra=True): the
trajectory is left out of the update instead of being scored 0 (tools.py says why).

Where this departs from the official code: its search tools call paid LLMs. Here
Google_Search returns Google's results from a results API (Serper by default; Google's
own Custom Search JSON API as an option), Wikipedia_Search returns the opening
paragraphs of the best-matching articles, and Web_Search ranks a page's chunks with BM25.
"""

from contextlib import nullcontext
import os
import re
from urllib.parse import urlparse

from support.bm25 import BM25
from support.text import cut
from support.web import WIKIMEDIA_LOCK, RetryPolicy, api_json, fetch_page_text, is_wikimedia, user_agent
from tools import Tool, ToolError, register, tool_settings


class NetworkTool(Tool):
    """A tool that asks a service over the network: its replies depend on the command
    alone, so repeats are answered from the reply cache, and its requests are retried."""
    cacheable = True
    network = True
    settings = {
        "web_timeout_s": 10.0,  # per request
        # Retries of a request on HTTP 429, 5xx, a timeout or a dropped connection. A request
        # that still fails is an infrastructure failure: the trajectory is left out of the
        # update, not scored 0.
        "retry_attempts": 4,  # tries in all (1 = never retry)
        "retry_backoff_s": 1.0,  # wait before the 2nd try, doubled for each later one (x 0.5..1, random),
                                 #   unless the server says how long in Retry-After
        "retry_max_wait_s": 30.0,  # longest single wait; a server asking for more ends the request at once
        "retry_total_s": 60.0,  # no new try once this much time has passed since the first
        # Wikimedia's User-Agent policy asks automated clients for a way to reach their operator;
        # Wikipedia_Search refuses to start without it (WikipediaSearch.preflight).
        "contact": "",  # an email address or URL of yours, e.g. "you@example.org"
    }
    bounds = {"web_timeout_s": (">", 0, "every request would time out"), "retry_attempts": (">=", 1, "")}


@register
class WikipediaSearch(NetworkTool):
    name = "Wikipedia_Search"
    card = ("Searches Wikipedia and returns the opening paragraphs of the best-matching\n"
            "articles. Good for well-known people, places, events and terms.\n"
            "Input: a short query, ideally an article title.")
    found_as = "a Wikipedia search found"
    input_prefix, input_stops = "Query:", ("\n",)
    examples = (("Who wrote Hamlet?", (), "find the author of Hamlet", " Hamlet"),)
    aliases = ("wiki",)
    settings = {
        "wikipedia_url": "https://en.wikipedia.org/w/api.php",
        "wikipedia_maxlag": 5,  # MediaWiki's maxlag (s): it asks non-interactive clients to send it and to
                                #   wait when the servers lag; 0 = not sent
    }
    # MediaWiki error codes that mean "not now" rather than "not this": retried like a 503.
    TRANSIENT = ("maxlag", "ratelimited")

    @classmethod
    def preflight(cls, cfg):
        if is_wikimedia(urlparse(cfg["wikipedia_url"]).hostname) and not cfg["contact"].strip():
            return ("tools.contact is empty: Wikimedia's User-Agent policy asks automated clients for a way to reach "
                    "their operator; set tools.contact=you@example.org (an email address or a URL), or drop "
                    "Wikipedia_Search from agent.tools")  # (a local mirror has its own rules)
        return super().preflight(cfg)

    def lane(self, command):  # Wikimedia's etiquette: one request at a time; a mirror of one's own takes many
        return "wikimedia" if is_wikimedia(urlparse(self.cfg["wikipedia_url"]).hostname) else None

    def _api(self, params: dict) -> dict:
        params = {**params, "format": "json", "formatversion": 2}
        if int(self.cfg["wikipedia_maxlag"]) > 0:  # training is a non-interactive client
            params["maxlag"] = int(self.cfg["wikipedia_maxlag"])
        # The lane keeps run_tool_calls' calls in series; the lock, any other caller's too.
        with WIKIMEDIA_LOCK if self.lane("") else nullcontext():
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


@register
class GoogleSearch(NetworkTool):
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
    PROVIDERS = ("serper", "cse")
    # Google closed its Custom Search JSON API to new customers and ends its whole-web
    # search on 2027-01-01, so the default is Serper, a Google results API anyone can sign
    # up for (serper.dev); cse keeps Google's own API for those who still have a key.
    settings = {
        "google_provider": "serper",  # serper | cse
        "serper_url": "https://google.serper.dev/search",
        "serper_key_env": "SERPER_API_KEY",  # NAME of the environment variable holding the Serper key
        "google_url": "https://www.googleapis.com/customsearch/v1",  # cse
        "cse_key_env": "GOOGLE_API_KEY",     # cse: NAME of the variable holding the API key
        "cse_id_env": "GOOGLE_CSE_ID",       # cse: NAME of the variable holding the search engine id (cx)
    }
    choices = {"google_provider": PROVIDERS}

    def __init__(self, cfg=None):
        super().__init__(cfg)
        if self.cfg["google_provider"] not in self.PROVIDERS:
            raise ValueError(f"tools.google_provider must be one of {', '.join(self.PROVIDERS)}, "
                             f"got {self.cfg['google_provider']!r}")

    @classmethod
    def required_env(cls, cfg):
        c = {**tool_settings(), **(cfg or {})}
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


@register
class WebSearch(NetworkTool):
    name = "Web_Search"
    card = ("Reads one web page and returns the passages most relevant to a question.\n"
            "Input: a URL and a question. Use it on a link another search returned.")
    found_as = "a web page gave"
    input_prefix, input_stops = "Input:", ("\n",)
    examples = (("How tall is the tower on https://example.org/tower ?", (), "read the page about the tower",
                 " https://example.org/tower How tall is the tower?"),)
    aliases = ("web", "url", "browse")
    settings = {
        "web_max_bytes": 2_000_000,  # bytes of a page read at most
        "url_allow": [],  # hosts or CIDRs it may fetch although internal, e.g. [10.0.0.0/8]
    }
    CHUNK_WORDS, CHUNK_STRIDE = 80, 60  # 80-word chunks overlapping by 20, so a fact is rarely split

    def lane(self, command):  # a Wikimedia page joins the Wikipedia API's calls in series
        match = _URL.search(command or "")
        return "wikimedia" if match and is_wikimedia(urlparse(match.group(0)).hostname) else None

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
