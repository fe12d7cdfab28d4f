"""Tests for tools.py: code extraction, BM25 against its formula, and the network tools
against a local HTTP server (127.0.0.1, random port) that serves recorded-style replies
to the real client code: retries and Retry-After, infrastructure failures kept apart
from tool errors, the reply cache, both Google providers, Wikimedia's client rules, and
Web_Search's refusal of internal addresses. Waits between retries are recorded, not
slept (the `waits` fixture). The Python sandbox has its own file, tests/test_sandbox.py;
the on-disk index has tests/test_retriever.py.
"""

import email.utils
import json
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tools  # noqa: E402
import web_tools  # noqa: E402
from support import web  # noqa: E402
from support.text import cut
from tools import BM25, build_tools, extract_code  # noqa: E402

# ----------------------------------------------------------------------------- extract_code, cut

@pytest.mark.parametrize("reply, code", [
    ("```python\nprint(1)\n```", "print(1)\n"),
    ("Sure!\n```py\nx = 2\nprint(x)\n```\nDone.", "x = 2\nprint(x)\n"),
    ("```\nprint(3)\n```", "print(3)\n"),
    ("Output:\n```text\n42\n```\nCode:\n```Python\nprint(42)\n```", "print(42)\n"),  # the python block wins
    ("```python\nprint(4)\n", "print(4)\n"),  # unclosed fence, e.g. cut by max tokens
    ("print(5)", "print(5)\n"),
    ("`print(6)`", "print(6)\n"),
    ("1. Run this:\n    ```python\n    for i in range(2):\n        print(i)\n    ```", "for i in range(2):\n    print(i)\n"),
    ("", "\n"),
])
def test_extract_code(reply, code):
    assert extract_code(reply) == code


def test_cut_for_tool_output():
    assert cut("short", 10) == "short"
    capped = cut("x" * 1000, 100)
    assert len(capped) <= 100 and capped.endswith("...[cut 919 chars]") and capped.startswith("x" * 50)
    both = cut("A" * 500 + "B" * 500, 100, keep_tail=True)
    assert len(both) <= 100 and both.startswith("A") and both.endswith("B") and "...[cut " in both


# ----------------------------------------------------------------------------- BM25 and Local_Search

def test_bm25_matches_the_formula_by_hand():
    docs = ["the cat sat", "the dog sat down", "cat cat cat"]
    k1, b, n, avgdl = 1.5, 0.75, 3, (3 + 4 + 3) / 3
    idf = {w: math.log(1 + (n - df + 0.5) / (df + 0.5)) for w, df in [("cat", 2), ("sat", 2), ("dog", 1)]}

    def term(word, tf, length):
        return idf[word] * tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / avgdl))

    scores = BM25(docs).scores("cat sat cat")  # a repeated query word counts once
    assert scores[0] == pytest.approx(term("cat", 1, 3) + term("sat", 1, 3), rel=1e-12)
    assert scores[1] == pytest.approx(term("sat", 1, 4), rel=1e-12)
    assert scores[2] == pytest.approx(term("cat", 3, 3), rel=1e-12)
    assert BM25(docs).scores("dog")[1] == pytest.approx(term("dog", 1, 4), rel=1e-12)


def test_bm25_ranking_and_deterministic_ties():
    docs = ["apples and pears", "the zebra of Kalmor", "zebra zebra", "apples and pears", "nothing here"]
    index = BM25(docs)
    assert [i for i, _ in index.top("Kalmor zebra", 5)] == [1, 2]  # rare word beats repetition; no zero scores
    assert index.top("pears", 5) == index.top("pears", 5) and [i for i, _ in index.top("pears", 5)] == [0, 3]
    assert index.top("unknownword", 3) == []
    # Equal scores, and the later document is met first (through the query's first word): index decides.
    assert [i for i, _ in BM25(["alpha", "beta"]).top("beta alpha", 2)] == [0, 1]


@pytest.fixture
def corpus(tmp_path):
    rows = [{"id": "1", "title": "Velmora", "text": "Velmora is a river town founded in 1742 by glassmakers."},
            {"id": "2", "title": "Ostrand", "text": "Ostrand is a mountain village known for its bells."},
            {"title": "Kess Dunmore", "text": "Kess Dunmore was the first mayor of Velmora."}]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_local_search(corpus):
    tool = tools.LocalSearch({"corpus": str(corpus), "search_top_k": 2})
    r = tool.run("When was Velmora founded?")
    assert r.ok and r.output.splitlines()[0] == "Velmora: Velmora is a river town founded in 1742 by glassmakers."
    assert len(r.output.splitlines()) == 2 and r.output == tool.run("When was Velmora founded?").output
    assert tool.run("   ").error == "empty query"
    assert "no passage matches" in tool.run("quantum chromodynamics").error


def test_local_search_missing_corpus(tmp_path):
    r = tools.LocalSearch({"corpus": str(tmp_path / "nope.jsonl")}).run("anything")
    assert not r.ok and str(tmp_path / "nope.jsonl") in r.error


# ----------------------------------------------------------------------------- registry

def test_build_tools_and_cards():
    built = build_tools(["Python_Coder", "Local_Search"], {"python_timeout_s": 3})
    assert {"Base_Generator", "Python_Coder", "Local_Search", "Wikipedia_Search", "Google_Search",
            "Web_Search"} <= set(tools.TOOL_CLASSES)  # the shipped six, web_tools by default
    assert list(built) == ["Python_Coder", "Local_Search"] and built["Python_Coder"].cfg["python_timeout_s"] == 3
    with pytest.raises(ValueError, match="Python_Coder"):
        build_tools(["Calculator"])
    with pytest.raises(ValueError, match="python_timeout"):
        build_tools(["Python_Coder"], {"pyton_timeout_s": 3})
    for cls in tools.TOOL_CLASSES.values():  # a 135M model reads every card in every prompt
        assert 2 <= len(cls.card.splitlines()) <= 4 and len(cls.card) <= 300
        assert cls.input_prefix and cls.input_stops and cls.examples and cls.aliases  # agentflow.py's prompts


def test_base_generator():
    tool = tools.BaseGenerator()
    assert tool.run("  Paris is the capital of France. ").output == "Paris is the capital of France."
    assert tool.run("").error == "empty answer"
    assert len(tools.BaseGenerator({"max_output_chars": 50}).run("word " * 100).output) <= 50


# ----------------------------------------------------------------------------- network tools (local server)

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        url = urlparse(self.path)
        self._answer(url.path, {k: v[0] for k, v in parse_qs(url.query).items()})

    def do_POST(self):  # a JSON body (Serper); the route sees it as its params
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(urlparse(self.path).path, json.loads(body or b"{}"))

    def _answer(self, path, params):
        srv = self.server
        with srv.lock:
            srv.seen.append((path, params, self.headers.get("User-Agent", "")))
            srv.headers.append(dict(self.headers))
            srv.active += 1
            srv.most_active = max(srv.most_active, srv.active)
        try:
            route = srv.routes.get(path)
            status, ctype, body, delay, *headers = route(params) if route else (404, "text/html", b"<h1>Not Found</h1>", 0)
            time.sleep(delay)
        finally:
            with srv.lock:
                srv.active -= 1
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for name, value in (headers[0] if headers else {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the client hung up (timeout test): expected


def _serve(host: str) -> _Server:
    srv = _Server((host, 0), _Handler)
    srv.routes, srv.seen, srv.headers = {}, [], []
    srv.lock, srv.active, srv.most_active = threading.Lock(), 0, 0  # requests in flight at once, and the most seen
    srv.url = f"http://{host}:{srv.server_address[1]}"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@pytest.fixture(autouse=True)
def waits(monkeypatch):
    """Retry waits are recorded on a clock of our own instead of slept: no test waits for
    a backoff, and the waits a test sees are exactly the ones asked for."""
    now, seen = [1000.0], []

    def sleep(s):
        seen.append(s)
        now[0] += s

    monkeypatch.setattr(web, "_sleep", sleep)
    monkeypatch.setattr(web, "_clock", lambda: now[0])
    return seen


@pytest.fixture
def server(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,127.0.0.2,localhost")
    srv = _serve("127.0.0.1")
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def other_server(server):
    """A second server on another loopback address (Linux routes all of 127/8 to lo)."""
    srv = _serve("127.0.0.2")
    yield srv
    srv.shutdown()
    srv.server_close()


def wiki(server, **cfg):
    return web_tools.WikipediaSearch({"wikipedia_url": server.url + "/w/api.php", "search_top_k": 2, **cfg})


def test_wikipedia_search_and_extracts(server):
    def api(p):
        if p.get("list") == "search":
            return 200, "application/json", {"batchcomplete": True, "query": {"search": [
                {"ns": 0, "title": "Eiffel Tower", "snippet": "The <span>Eiffel</span> Tower"},
                {"ns": 0, "title": "Gustave Eiffel", "snippet": "French engineer"}]}}, 0
        return 200, "application/json", {"batchcomplete": True, "query": {"pages": [  # not in search order
            {"pageid": 2, "title": "Gustave Eiffel", "extract": "Gustave Eiffel was a French civil engineer."},
            {"pageid": 1, "title": "Eiffel Tower", "extract": "The Eiffel Tower is a wrought-iron tower in Paris."}]}}, 0
    server.routes["/w/api.php"] = api
    r = wiki(server).run("Eiffel Tower")
    assert r.output.splitlines() == ["Eiffel Tower: The Eiffel Tower is a wrought-iron tower in Paris.",
                                     "Gustave Eiffel: Gustave Eiffel was a French civil engineer."]
    (_, search, agent), (_, extracts, _) = server.seen
    assert search["srsearch"] == "Eiffel Tower" and search["srlimit"] == "2" and search["list"] == "search"
    assert extracts["titles"] == "Eiffel Tower|Gustave Eiffel" and extracts["exintro"] == "1"
    assert extracts["explaintext"] == "1" and agent == web.USER_AGENT and "(research bot)" in agent
    assert search["maxlag"] == "5" and search["format"] == "json"  # MediaWiki's etiquette for bots


def test_wikipedia_failures(server):
    server.routes["/w/api.php"] = lambda p: (500, "text/html", b"<h1>oops</h1>", 0)
    r = wiki(server).run("x")
    assert r.error == f"HTTP 500 from {server.url[len('http://'):]} (gave up after 4 tries)" and r.infra
    server.routes["/w/api.php"] = lambda p: (200, "text/html", b"<html>maintenance</html>", 0)
    r = wiki(server).run("x")
    assert "non-JSON" in r.error and r.infra
    server.routes["/w/api.php"] = lambda p: (200, "application/json", {"query": {"search": []}}, 0)
    r = wiki(server).run("xyzzy")
    assert "no Wikipedia article" in r.error and not r.infra  # the model's query found nothing: its doing
    error = {"error": {"code": "badvalue", "info": "bad srlimit"}}  # MediaWiki errors come with HTTP 200
    server.routes["/w/api.php"] = lambda p: (200, "application/json", error, 0)
    r = wiki(server).run("x")
    assert r.error == "API error: bad srlimit" and not r.infra


def google(server, **cfg):
    return web_tools.GoogleSearch({"google_provider": "cse", "google_url": server.url + "/customsearch/v1", **cfg})


def test_google_search(server, monkeypatch):
    monkeypatch.setenv("GOOGLE_API_KEY", "key-s3cr3t")
    monkeypatch.setenv("GOOGLE_CSE_ID", "cx-1")
    server.routes["/customsearch/v1"] = lambda p: (200, "application/json; charset=UTF-8", {"items": [
        {"title": "Eiffel Tower - Wikipedia", "link": "https://en.wikipedia.org/wiki/Eiffel_Tower",
         "snippet": "The Eiffel Tower is a\nwrought-iron lattice tower."},
        {"title": "Tickets", "link": "https://example.org/t", "snippet": "Buy tickets."}]}, 0)
    r = google(server, search_top_k=2).run("eiffel tower height")
    assert r.output.splitlines() == [
        "Eiffel Tower - Wikipedia: The Eiffel Tower is a wrought-iron lattice tower. "
        "(https://en.wikipedia.org/wiki/Eiffel_Tower)", "Tickets: Buy tickets. (https://example.org/t)"]
    assert server.seen[0][1] == {"key": "key-s3cr3t", "cx": "cx-1", "q": "eiffel tower height", "num": "2"}


def test_google_failures(server, monkeypatch):
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    monkeypatch.setenv("GOOGLE_CSE_ID", "cx-1")
    need = "Google_Search needs GOOGLE_API_KEY and GOOGLE_CSE_ID in the environment"
    r = google(server).run("x")
    assert r.error == need and r.infra  # the setup's fault, not the model's
    assert server.seen == []
    monkeypatch.setenv("GOOGLE_API_KEY", "key-s3cr3t")
    server.routes["/customsearch/v1"] = lambda p: (
        403, "application/json", {"error": {"code": 403, "message": "Daily Limit Exceeded"}}, 0)
    r = google(server).run("x")  # a quota: not retried (it will not clear in seconds), and infra
    assert r.error == f"HTTP 403 from {server.url[7:]}: Daily Limit Exceeded" and r.infra
    assert len(server.seen) == 1
    server.routes["/customsearch/v1"] = lambda p: (200, "application/json", {"items": []}, 1.5)
    r = google(server, web_timeout_s=0.3, retry_attempts=1).run("x")
    assert r.error.startswith("timeout after 0.3s") and r.infra
    server.routes["/customsearch/v1"] = lambda p: (200, "application/json", {"items": []}, 0)
    r = google(server).run("x")
    assert r.error == "no Google results for 'x'" and not r.infra
    # Connection refused: retried, then infra; the message must not quote the URL, which holds the key.
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = web_tools.GoogleSearch({"google_provider": "cse", "google_url": f"http://127.0.0.1:{port}/customsearch/v1"}).run("x")
    assert r.error == f"request to 127.0.0.1:{port} failed (ConnectionError) (gave up after 4 tries)" and r.infra
    assert "s3cr3t" not in r.error


PAGE = ("<html><head><title>Towers</title><style>.zebra { color: red }</style>"
        "<script>var zebra_js = 'zebra zebra';</script></head><body>"
        + "".join(f"<p>Filler paragraph {i} about bridges, rivers &amp; roads in general.</p>" for i in range(40))
        + "<p>The Eiffel Tower was completed in 1889 for the World&#39;s Fair.</p>"
        + "".join(f"<p>More filler {i} on canals and harbours.</p>" for i in range(40))
        + "<noscript>zebra noscript</noscript></body></html>")


def test_web_search_ranks_the_relevant_chunk_first(server):
    server.routes["/page"] = lambda p: (200, "text/html; charset=utf-8", PAGE.encode(), 0)
    tool = web_tools.WebSearch({"search_top_k": 2, "url_allow": ["127.0.0.1"]})
    r = tool.run(f"Read {server.url}/page. When was the Eiffel Tower completed?")
    assert r.ok and "completed in 1889 for the World's Fair" in r.output.splitlines()[0]
    page_text = web.html_to_text(PAGE)
    assert "zebra" not in r.output and "zebra" not in page_text and "rivers & roads" in page_text
    assert server.seen[0][0] == "/page"


def test_web_search_failures(server):
    tool = web_tools.WebSearch({"url_allow": ["127.0.0.1"]})
    r = tool.run(f"{server.url}/missing what?")  # a URL the model made up: its doing, asked once
    assert r.error.startswith("HTTP 404 from") and not r.infra and len(server.seen) == 1
    server.routes["/private"] = lambda p: (403, "text/html", b"<h1>Forbidden</h1>", 0)
    r = tool.run(f"{server.url}/private what?")  # a page that refuses us: the model's choice of page
    assert r.error.startswith("HTTP 403 from") and not r.infra
    server.routes["/file.bin"] = lambda p: (200, "application/octet-stream", b"\x00\x01" * 100, 0)
    assert "unsupported content type 'application/octet-stream'" in tool.run(f"{server.url}/file.bin what?").error
    server.routes["/empty"] = lambda p: (200, "text/html", b"<html><script>x = 1</script></html>", 0)
    assert "no text on page" in tool.run(f"{server.url}/empty what?").error
    assert tool.run("When was the Eiffel Tower completed?").error == "no URL in command"


# ----------------------------------------------------------------------------- Web_Search stays outward

@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1%2", "link-local"), ("224.0.0.251", "multicast"),
    ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("240.0.0.1", "private"),
    ("100.64.0.1", "not a public"), ("64:ff9b::a9fe:a9fe", "link-local"), ("2002:7f00:1::", "loopback"),
    ("93.184.216.34", ""), ("2606:2800:220:1:248:1893:25c8:1946", ""),
])
def test_internal_addresses_are_refused(address, kind):
    why = web._refusal(address, [])
    assert (kind in why) if kind else why == ""


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/page", "http://localhost:{port}/page", "http://[::1]:{port}/page",
    "http://[::ffff:127.0.0.1]:{port}/page", "http://2130706433:{port}/page", "http://0x7f.1:{port}/page",
    "http://0.0.0.0:{port}/page", "http://10.0.0.1/page", "http://192.168.0.1/", "http://172.16.0.1/",
    "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/", "http://224.0.0.1/",
])
def test_web_search_refuses_internal_urls(server, url):
    server.routes["/page"] = lambda p: (200, "text/html", b"<p>internal secret</p>", 0)
    start = time.monotonic()
    r = web_tools.WebSearch().run(url.format(port=server.server_address[1]) + " what is the secret?")
    assert r.error.startswith("refused to fetch from ") and "url_allow" in r.error
    assert server.seen == [] and time.monotonic() - start < 1.0  # refused before connecting, not timed out


def test_the_allow_list_lets_hosts_and_networks_in(server):
    server.routes["/page"] = lambda p: (200, "text/html", b"<p>internal but allowed</p>", 0)
    port = server.server_address[1]
    for allow in (["127.0.0.1"], ["127.0.0.0/8"], ["localhost"]):
        host = "localhost" if allow == ["localhost"] else "127.0.0.1"
        r = web_tools.WebSearch({"url_allow": allow}).run(f"http://{host}:{port}/page what?")
        assert r.output == "internal but allowed", allow
    assert web_tools.WebSearch({"url_allow": ["localhost"]}).run(f"http://127.0.0.1:{port}/page what?").error


def test_redirects_are_checked_at_every_hop(server, other_server):
    """The allowed server (127.0.0.2) redirects; a hop to a refused address is never made."""
    allowed = web_tools.WebSearch({"url_allow": ["127.0.0.2/32"]})
    other_server.routes["/page"] = lambda p: (200, "text/html", b"<p>the page</p>", 0)
    other_server.routes["/here"] = lambda p: (302, "text/html", b"", 0, {"Location": "/page"})
    assert allowed.run(f"{other_server.url}/here what?").output == "the page"
    server.routes["/secret"] = lambda p: (200, "text/html", b"<p>internal secret</p>", 0)
    for target in (f"{server.url}/secret", "http://169.254.169.254/latest/meta-data/",
                   f"http://localhost:{server.server_address[1]}/secret"):
        other_server.routes["/away"] = lambda p: (301, "text/html", b"", 0, {"Location": target})
        r = allowed.run(f"{other_server.url}/away what?")
        assert r.error.startswith("refused to fetch from ") and server.seen == []
    other_server.routes["/loop"] = lambda p: (307, "text/html", b"", 0, {"Location": "/loop"})
    assert allowed.run(f"{other_server.url}/loop what?").error == "more than 5 redirects"
    other_server.routes["/ftp"] = lambda p: (302, "text/html", b"", 0, {"Location": "ftp://example.org/"})
    assert allowed.run(f"{other_server.url}/ftp what?").error.startswith("not an http(s) URL")


def test_dns_rebinding_is_caught_at_connect(server, monkeypatch):
    """A name that resolves to a public address for the check and to 127.0.0.1 for the
    connection: the socket's peer is what counts."""
    real, answers = socket.getaddrinfo, iter(["93.184.216.34"])

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.test":
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers, "127.0.0.1"), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    server.routes["/page"] = lambda p: (200, "text/html", b"<p>internal secret</p>", 0)
    r = web_tools.WebSearch().run(f"http://rebind.test:{server.server_address[1]}/page what?")
    assert r.error.startswith("refused to fetch from rebind.test: 127.0.0.1 is a loopback address")
    assert server.seen == []


def test_the_allow_list_is_a_config_key():
    from support.config import load_config
    cfg = load_config(None, ["tools.url_allow=[127.0.0.1, 10.0.0.0/8, intranet.example]"])
    assert cfg["tools"]["url_allow"] == ["127.0.0.1", "10.0.0.0/8", "intranet.example"]
    assert web._allow_list(cfg["tools"]["url_allow"])[0] == {"intranet.example"}


def test_configured_api_endpoints_are_not_guarded(server):
    """wikipedia_url and google_url come from the user's config, not from a model (the
    Wikipedia tests above run against 127.0.0.1 with no allow list)."""
    server.routes["/w/api.php"] = lambda p: (200, "application/json", {"query": {"search": []}}, 0)
    assert "no Wikipedia article" in wiki(server).run("xyzzy").error and server.seen


# ----------------------------------------------------------------------------- retries, infra failures

def serper(server, **cfg):
    return web_tools.GoogleSearch({"serper_url": server.url + "/search", **cfg})


ORGANIC = {"searchParameters": {"q": "x", "type": "search"}, "organic": [
    {"title": "Eiffel Tower - Wikipedia", "link": "https://en.wikipedia.org/wiki/Eiffel_Tower",
     "snippet": "The Eiffel Tower is a wrought-iron lattice tower.", "position": 1},
    {"title": "Tickets", "link": "https://example.org/t", "snippet": "Buy\ntickets.", "position": 2}], "credits": 1}


def flaky(status, times, headers=None, then=(200, "application/json", ORGANIC, 0)):
    """A route that answers `status` the first `times` calls, then `then`."""
    calls = []

    def route(p):
        calls.append(p)
        if len(calls) <= times:
            return (status, "application/json", {"message": "slow down"}, 0, headers or {})
        return then
    return route


def test_retry_after_is_honoured_then_the_reply_is_used(server, monkeypatch, waits):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = flaky(429, 2, {"Retry-After": "7"})
    r = serper(server, search_top_k=2).run("eiffel tower")
    assert r.ok and not r.infra and r.output.startswith("Eiffel Tower - Wikipedia:")
    assert len(server.seen) == 3 and waits == [7.0, 7.0]  # exactly what the server asked for


def test_backoff_doubles_without_retry_after_and_ends_in_an_infra_failure(server, monkeypatch, waits):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = flaky(503, 99)
    r = serper(server, retry_attempts=5, retry_backoff_s=2.0).run("x")
    assert r.infra and r.error == f"HTTP 503 from {server.url[7:]}: slow down (gave up after 5 tries)"
    assert len(server.seen) == 5 and len(waits) == 4
    for n, w in enumerate(waits):  # 2 * 2^n, times a random 0.5..1
        assert 2.0 * 2 ** n * 0.5 <= w <= 2.0 * 2 ** n


def test_retry_limits_in_time(server, monkeypatch, waits):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = flaky(503, 99, {"Retry-After": "120"})
    r = serper(server, retry_max_wait_s=30).run("x")  # asked to wait longer than we may: no wait at all
    assert r.infra and "retry_max_wait_s" in r.error and len(server.seen) == 1 and waits == []
    server.seen.clear()
    server.routes["/search"] = flaky(502, 99, {"Retry-After": "2"})
    r = serper(server, retry_attempts=10, retry_total_s=5).run("x")  # 2 + 2, and a third 2 would pass 5 s
    assert r.infra and "retry_total_s" in r.error and len(server.seen) == 3 and waits == [2.0, 2.0]


def test_retry_after_forms():
    assert web._retry_after("3") == 3.0 and web._retry_after(" 0 ") == 0.0 and web._retry_after(None) is None
    assert web._retry_after("soon") is None and web._retry_after("-5") == 0.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)  # an HTTP date
    assert 25 <= web._retry_after(later) <= 30
    assert web._retry_after(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


def test_client_errors_are_not_retried(server, monkeypatch, waits):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = lambda p: (400, "application/json", {"message": "Query not allowed", "statusCode": 400}, 0)
    r = serper(server).run("x")
    assert r.error == f"HTTP 400 from {server.url[7:]}: Query not allowed" and not r.infra
    assert len(server.seen) == 1 and waits == []


def test_mediawiki_lag_is_retried(server, waits):
    lagged = {"error": {"code": "maxlag", "info": "Waiting for db1: 6 seconds lagged", "lag": 6}}
    ok = {"query": {"search": [{"title": "Hamlet", "snippet": "a tragedy"}], "pages": [
        {"title": "Hamlet", "extract": "Hamlet is a tragedy by Shakespeare."}]}}
    calls = []

    def api(p):
        calls.append(p)
        if len(calls) == 1:
            return 200, "application/json", lagged, 0, {"Retry-After": "5"}
        return 200, "application/json", ok, 0
    server.routes["/w/api.php"] = api
    r = wiki(server).run("hamlet")
    assert r.output == "Hamlet: Hamlet is a tragedy by Shakespeare." and waits == [5.0] and len(calls) == 3
    server.routes["/w/api.php"] = lambda p: (200, "application/json", lagged, 0, {"Retry-After": "5"})
    r = wiki(server).run("macbeth")
    assert r.infra and r.error.startswith("API error: Waiting for db1") and "gave up after 4 tries" in r.error


# ----------------------------------------------------------------------------- Google through Serper

def test_serper_request_and_reply(server, monkeypatch):
    monkeypatch.setenv("MY_SERPER", "serper-s3cr3t")
    box = {"title": "Eiffel Tower height", "answer": "330 m", "link": "https://example.org/h"}
    server.routes["/search"] = lambda p: (200, "application/json", {**ORGANIC, "answerBox": box}, 0)
    r = serper(server, search_top_k=2, serper_key_env="MY_SERPER").run("  eiffel tower height ")
    assert r.output.splitlines() == ["Eiffel Tower height: 330 m (https://example.org/h)",
                                     "Eiffel Tower - Wikipedia: The Eiffel Tower is a wrought-iron lattice tower. "
                                     "(https://en.wikipedia.org/wiki/Eiffel_Tower)"]
    (path, body, agent), = server.seen
    assert path == "/search" and body == {"q": "eiffel tower height", "num": 2} and agent == web.USER_AGENT
    headers = {k.lower(): v for k, v in server.headers[0].items()}
    assert headers["x-api-key"] == "serper-s3cr3t" and headers["content-type"] == "application/json"
    server.routes["/search"] = lambda p: (200, "application/json", ORGANIC, 0)
    assert serper(server, search_top_k=5, serper_key_env="MY_SERPER").run("tickets").output.splitlines()[1] == \
        "Tickets: Buy tickets. (https://example.org/t)"


def test_serper_failures(server, monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    r = serper(server).run("x")
    assert r.error == "Google_Search needs SERPER_API_KEY in the environment" and r.infra and server.seen == []
    monkeypatch.setenv("SERPER_API_KEY", "bad-key")
    server.routes["/search"] = lambda p: (403, "application/json", {"message": "Unauthorized.", "statusCode": 403}, 0)
    r = serper(server).run("x")  # a key or quota problem: ours, not the model's; not retried
    assert r.error == f"HTTP 403 from {server.url[7:]}: Unauthorized." and r.infra and len(server.seen) == 1
    server.routes["/search"] = lambda p: (200, "application/json", {"organic": []}, 0)
    r = serper(server).run("qwzxv")
    assert r.error == "no Google results for 'qwzxv'" and not r.infra
    with pytest.raises(ValueError, match="google_provider"):
        web_tools.GoogleSearch({"google_provider": "bing"})


def test_google_provider_decides_the_keys():
    assert web_tools.GoogleSearch.required_env({}) == ("SERPER_API_KEY",)
    assert web_tools.GoogleSearch.required_env({"google_provider": "cse"}) == ("GOOGLE_API_KEY", "GOOGLE_CSE_ID")
    assert web_tools.GoogleSearch.required_env({"serper_key_env": "K2"}) == ("K2",)
    assert web_tools.WebSearch.required_env({}) == ()


# ----------------------------------------------------------------------------- the reply cache

def test_repeated_commands_are_answered_from_the_cache(server, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = lambda p: (200, "application/json", ORGANIC, 0)
    tool = serper(server)
    first, again = tool.run("eiffel tower"), tool.run("  eiffel tower\n")
    assert again == first and first.ok and len(server.seen) == 1
    assert (tool.cache.hits, tool.cache.misses) == (1, 1)
    tool.run("louvre")
    assert len(server.seen) == 2 and tool.cache.misses == 2
    # a failure the command caused (no results) is kept like a reply; one of the
    # infrastructure's (a server error, retried inside each call) is asked again
    server.routes["/search"] = lambda p: (200, "application/json", {"organic": []}, 0)
    nothing = tool.run("nothing")
    assert not nothing.ok and not nothing.infra and tool.run("nothing") == nothing and len(server.seen) == 3
    server.routes["/search"] = lambda p: (500, "application/json", {}, 0)
    assert tool.run("broken").infra and tool.run("broken").infra and len(server.seen) == 11


def test_cache_is_bounded_and_can_be_off(server, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = lambda p: (200, "application/json", ORGANIC, 0)
    tool = serper(server, cache_size=2)
    for q in ("a", "b", "a", "c", "b"):  # "a" was used after "b", so "b" is the one "c" pushes out
        tool.run(q)
    assert [body["q"] for _, body, _ in server.seen] == ["a", "b", "c", "b"]
    off = serper(server, cache_size=0)
    assert off.cache is None
    off.run("a"), off.run("a")
    assert len(server.seen) == 6
    assert tools.PythonCoder.cacheable is False and tools.BaseGenerator({}).cache is None


def test_identical_calls_in_flight_send_one_request(server, monkeypatch):
    """G rollouts searching the same thing at the same moment: one request, G answers."""
    monkeypatch.setenv("SERPER_API_KEY", "k")
    release = threading.Event()

    def slow(p):
        release.wait(10)  # held until every other call has come in and is waiting
        return 200, "application/json", ORGANIC, 0
    server.routes["/search"] = slow
    tool = serper(server)
    original, callers = tool.cache.get, []

    def arrive(key, call):  # the eighth caller lets the one request finish
        callers.append(key)
        if len(callers) == 8:
            release.set()
        return original(key, call)

    tool.cache.get = arrive
    results = tools.run_tool_calls([(tool, "eiffel tower")] * 8)
    assert len(server.seen) == 1 and all(r.ok and r == results[0] for r in results)
    assert (tool.cache.hits, tool.cache.misses) == (7, 1)


# ----------------------------------------------------------------------------- Wikimedia's client rules

WIKI_OK = {"query": {"search": [{"title": "T", "snippet": "s"}], "pages": [{"title": "T", "extract": "e"}]}}


def test_wikimedia_requests_are_serial_and_carry_the_contact(server, monkeypatch):
    server.routes["/w/api.php"] = lambda p: (200, "application/json", WIKI_OK, 0.05)
    monkeypatch.setattr(web_tools, "is_wikimedia", lambda host: True)  # the local server plays Wikimedia
    tool = wiki(server, contact="you@example.org")
    results = tools.run_tool_calls([(tool, f"query {i}") for i in range(8)])
    assert all(r.ok for r in results) and len(server.seen) == 16
    assert server.most_active == 1  # never two requests to Wikimedia at once
    assert {agent for _, _, agent in server.seen} == {web.user_agent("you@example.org")}
    assert "(research bot; you@example.org) python-requests/" in web.user_agent("you@example.org")


def test_queued_wikimedia_calls_never_hold_the_other_tools_workers(server, monkeypatch):
    """Eight Wikipedia calls first, then eight Serper calls, on two workers: the Wikipedia
    calls wait in their own lane, in series, while every Serper call finishes. The first
    Wikipedia request is held until the Serper calls are all done, so calls that took the
    shared workers to wait for their turn would never let them finish (the test would time
    out instead of passing)."""
    monkeypatch.setenv("SERPER_API_KEY", "k")
    monkeypatch.setattr(web_tools, "is_wikimedia", lambda host: True)  # the local server plays Wikimedia
    others_done = threading.Event()
    answered = []

    def held(p):
        assert others_done.wait(timeout=10), "the Serper calls never finished"
        return 200, "application/json", WIKI_OK, 0

    def organic(p):
        answered.append(p)
        if len(answered) == 8:
            others_done.set()
        return 200, "application/json", ORGANIC, 0
    server.routes["/w/api.php"], server.routes["/search"] = held, organic
    tool = wiki(server, contact="you@example.org", retry_attempts=1)
    assert tool.lane("q") == "wikimedia" and serper(server).lane("q") is None
    calls = [(tool, f"query {i}") for i in range(8)] + [(serper(server), f"q{i}") for i in range(8)]
    results = tools.run_tool_calls(calls, max_workers=2)
    assert all(r.ok for r in results) and [r.output for r in results[8:]] == [results[8].output] * 8
    assert server.most_active <= 1 + 2  # the lane's one request, the two workers' own


def test_a_web_page_on_wikimedia_joins_the_lane():
    page = web_tools.WebSearch({})
    assert page.lane("https://en.wikipedia.org/wiki/Eiffel_Tower How tall?") == "wikimedia"
    assert page.lane("https://example.org/tower How tall?") is None and page.lane("no url") is None


def test_a_wikipedia_mirror_of_ones_own_is_asked_in_parallel(server):
    """tools.wikipedia_url on a host that is not Wikimedia's (a local MediaWiki): no lock,
    the calls overlap (each waits at a barrier that only four requests in flight pass)."""
    barrier = threading.Barrier(4, timeout=10)

    def meet(p):
        if p.get("list") == "search":
            barrier.wait()
        return 200, "application/json", WIKI_OK, 0
    server.routes["/w/api.php"] = meet
    results = tools.run_tool_calls([(wiki(server), f"query {i}") for i in range(4)])
    assert all(r.ok for r in results) and server.most_active == 4


def test_other_apis_are_asked_in_parallel(server, monkeypatch):
    """The contrast that shows the test above can fail: without the lock, calls overlap
    (each request waits at a barrier that only four requests in flight together pass)."""
    monkeypatch.setenv("SERPER_API_KEY", "k")
    barrier = threading.Barrier(4, timeout=10)

    def meet(p):
        barrier.wait()
        return 200, "application/json", ORGANIC, 0
    server.routes["/search"] = meet
    results = tools.run_tool_calls([(serper(server), f"q{i}") for i in range(4)])
    assert all(r.ok for r in results) and server.most_active == 4


def test_the_contact_goes_to_wikimedia_pages_only(server, monkeypatch):
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):  # a Wikimedia name that leads to our loopback server
        if host == "en.wikipedia.org":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,en.wikipedia.org")
    server.routes["/wiki/Hamlet"] = lambda p: (200, "text/html", b"<p>Hamlet is a tragedy.</p>", 0)
    tool = web_tools.WebSearch({"url_allow": ["127.0.0.1", "en.wikipedia.org"], "contact": "you@example.org"})
    port = server.server_address[1]
    assert tool.run(f"http://en.wikipedia.org:{port}/wiki/Hamlet what is it?").output == "Hamlet is a tragedy."
    assert tool.run(f"http://127.0.0.1:{port}/wiki/Hamlet what is it?").ok
    (_, _, to_wikimedia), (_, _, elsewhere) = server.seen
    assert "you@example.org" in to_wikimedia and "you@example.org" not in elsewhere
    assert web.is_wikimedia("en.wikipedia.org") and web.is_wikimedia("commons.wikimedia.org.")
    assert not web.is_wikimedia("notwikipedia.org") and not web.is_wikimedia("example.org")


# ----------------------------------------------------------------------------- Local_Search on an index

def test_local_search_on_a_built_index_answers_as_the_corpus_does(corpus, tmp_path):
    from support.bm25 import build_index
    build_index(corpus, tmp_path / "index", progress=False)
    in_memory = tools.LocalSearch({"corpus": str(corpus), "search_top_k": 2})
    on_disk = tools.LocalSearch({"corpus": "/nonexistent", "corpus_index": str(tmp_path / "index"), "search_top_k": 2})
    for q in ("When was Velmora founded?", "bells", "mayor of Velmora", "quantum chromodynamics"):
        assert on_disk.run(q) == in_memory.run(q), q
    r = tools.LocalSearch({"corpus_index": str(tmp_path / "none")}).run("Velmora")
    assert r.infra and "scripts.build_index" in r.error


def test_backoff_is_capped_by_the_longest_wait(server, monkeypatch, waits):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    server.routes["/search"] = flaky(500, 99)
    r = serper(server, retry_attempts=6, retry_backoff_s=10, retry_max_wait_s=15, retry_total_s=1000).run("x")
    assert r.infra and len(server.seen) == 6 and max(waits) == 15 and len(waits) == 5
