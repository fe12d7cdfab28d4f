"""Tests for tools.py: code extraction, BM25 against its formula, and the network tools
against a local HTTP server (127.0.0.1, random port) that serves recorded-style replies
to the real client code; Web_Search's refusal of internal addresses. The Python sandbox
has its own file, tests/test_sandbox.py.
"""

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
from memory import cut
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
    assert set(tools.TOOL_CLASSES) == {"Base_Generator", "Python_Coder", "Local_Search",
                                       "Wikipedia_Search", "Google_Search", "Web_Search"}
    built = build_tools(["Python_Coder", "Local_Search"], {"python_timeout_s": 3})
    assert list(built) == ["Python_Coder", "Local_Search"] and built["Python_Coder"].cfg["python_timeout_s"] == 3
    with pytest.raises(ValueError, match="Python_Coder"):
        build_tools(["Calculator"])
    with pytest.raises(ValueError, match="python_timeout"):
        build_tools(["Python_Coder"], {"pyton_timeout_s": 3})
    for cls in tools.TOOL_CLASSES.values():  # a 135M model reads every card in every prompt
        assert 2 <= len(cls.card.splitlines()) <= 4 and len(cls.card) <= 300
        assert cls.input_prefix and cls.input_stops and cls.example and cls.aliases  # agentflow.py's prompts


def test_base_generator():
    tool = tools.BaseGenerator()
    assert tool.run("  Paris is the capital of France. ").output == "Paris is the capital of France."
    assert tool.run("").error == "empty answer"
    assert len(tools.BaseGenerator({"max_output_chars": 50}).run("word " * 100).output) <= 50


# ----------------------------------------------------------------------------- network tools (local server)

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        url = urlparse(self.path)
        params = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.seen.append((url.path, params, self.headers.get("User-Agent", "")))
        route = self.server.routes.get(url.path)
        status, ctype, body, delay, *headers = route(params) if route else (404, "text/html", b"<h1>Not Found</h1>", 0)
        time.sleep(delay)
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
    srv.routes, srv.seen = {}, []
    srv.url = f"http://{host}:{srv.server_address[1]}"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


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
    return tools.WikipediaSearch({"wikipedia_url": server.url + "/w/api.php", "search_top_k": 2, **cfg})


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
    assert extracts["explaintext"] == "1" and agent == tools.USER_AGENT


def test_wikipedia_failures(server):
    server.routes["/w/api.php"] = lambda p: (500, "text/html", b"<h1>oops</h1>", 0)
    assert wiki(server).run("x").error == "HTTP 500 from " + server.url[len("http://"):]
    server.routes["/w/api.php"] = lambda p: (200, "text/html", b"<html>maintenance</html>", 0)
    assert "non-JSON" in wiki(server).run("x").error
    server.routes["/w/api.php"] = lambda p: (200, "application/json", {"query": {"search": []}}, 0)
    assert "no Wikipedia article" in wiki(server).run("xyzzy").error
    error = {"error": {"code": "badvalue", "info": "bad srlimit"}}  # MediaWiki errors come with HTTP 200
    server.routes["/w/api.php"] = lambda p: (200, "application/json", error, 0)
    assert wiki(server).run("x").error == "API error: bad srlimit"


def google(server, **cfg):
    return tools.GoogleSearch({"google_url": server.url + "/customsearch/v1", **cfg})


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
    assert google(server).run("x").error == need
    assert server.seen == []
    monkeypatch.setenv("GOOGLE_API_KEY", "key-s3cr3t")
    server.routes["/customsearch/v1"] = lambda p: (
        403, "application/json", {"error": {"code": 403, "message": "Daily Limit Exceeded"}}, 0)
    assert google(server).run("x").error == f"HTTP 403 from {server.url[7:]}: Daily Limit Exceeded"
    server.routes["/customsearch/v1"] = lambda p: (200, "application/json", {"items": []}, 1.5)
    start = time.monotonic()
    r = google(server, web_timeout_s=0.3).run("x")
    assert r.error.startswith("timeout after 0.3s") and time.monotonic() - start < 1.2
    # Connection refused: the message must not quote the URL, which holds the key.
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = tools.GoogleSearch({"google_url": f"http://127.0.0.1:{port}/customsearch/v1"}).run("x")
    assert not r.ok and "s3cr3t" not in r.error


PAGE = ("<html><head><title>Towers</title><style>.zebra { color: red }</style>"
        "<script>var zebra_js = 'zebra zebra';</script></head><body>"
        + "".join(f"<p>Filler paragraph {i} about bridges, rivers &amp; roads in general.</p>" for i in range(40))
        + "<p>The Eiffel Tower was completed in 1889 for the World&#39;s Fair.</p>"
        + "".join(f"<p>More filler {i} on canals and harbours.</p>" for i in range(40))
        + "<noscript>zebra noscript</noscript></body></html>")


def test_web_search_ranks_the_relevant_chunk_first(server):
    server.routes["/page"] = lambda p: (200, "text/html; charset=utf-8", PAGE.encode(), 0)
    tool = tools.WebSearch({"search_top_k": 2, "url_allow": ["127.0.0.1"]})
    r = tool.run(f"Read {server.url}/page. When was the Eiffel Tower completed?")
    assert r.ok and "completed in 1889 for the World's Fair" in r.output.splitlines()[0]
    page_text = tools.html_to_text(PAGE)
    assert "zebra" not in r.output and "zebra" not in page_text and "rivers & roads" in page_text
    assert server.seen[0][0] == "/page"


def test_web_search_failures(server):
    tool = tools.WebSearch({"url_allow": ["127.0.0.1"]})
    assert tool.run(f"{server.url}/missing what?").error.startswith("HTTP 404 from")
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
    why = tools._refusal(address, [])
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
    r = tools.WebSearch().run(url.format(port=server.server_address[1]) + " what is the secret?")
    assert r.error.startswith("refused to fetch from ") and "url_allow" in r.error
    assert server.seen == [] and time.monotonic() - start < 1.0  # refused before connecting, not timed out


def test_the_allow_list_lets_hosts_and_networks_in(server):
    server.routes["/page"] = lambda p: (200, "text/html", b"<p>internal but allowed</p>", 0)
    port = server.server_address[1]
    for allow in (["127.0.0.1"], ["127.0.0.0/8"], ["localhost"]):
        host = "localhost" if allow == ["localhost"] else "127.0.0.1"
        r = tools.WebSearch({"url_allow": allow}).run(f"http://{host}:{port}/page what?")
        assert r.output == "internal but allowed", allow
    assert tools.WebSearch({"url_allow": ["localhost"]}).run(f"http://127.0.0.1:{port}/page what?").error


def test_redirects_are_checked_at_every_hop(server, other_server):
    """The allowed server (127.0.0.2) redirects; a hop to a refused address is never made."""
    allowed = tools.WebSearch({"url_allow": ["127.0.0.2/32"]})
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
    r = tools.WebSearch().run(f"http://rebind.test:{server.server_address[1]}/page what?")
    assert r.error.startswith("refused to fetch from rebind.test: 127.0.0.1 is a loopback address")
    assert server.seen == []


def test_the_allow_list_is_a_config_key():
    from config import load_config
    cfg = load_config(None, ["tools.url_allow=[127.0.0.1, 10.0.0.0/8, intranet.example]"])
    assert cfg["tools"]["url_allow"] == ["127.0.0.1", "10.0.0.0/8", "intranet.example"]
    assert tools._allow_list(cfg["tools"]["url_allow"])[0] == {"intranet.example"}


def test_configured_api_endpoints_are_not_guarded(server):
    """wikipedia_url and google_url come from the user's config, not from a model (the
    Wikipedia tests above run against 127.0.0.1 with no allow list)."""
    server.routes["/w/api.php"] = lambda p: (200, "application/json", {"query": {"search": []}}, 0)
    assert "no Wikipedia article" in wiki(server).run("xyzzy").error and server.seen
