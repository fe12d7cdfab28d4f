"""The web layer under the network tools: retries, Wikimedia's rules, and no fetch inward.

Not part of the paper's method; what the search tools of tools.py need to be used for
real by many trajectories at once:

  * retries: a request is tried again on HTTP 429, a 5xx, a timeout or a dropped
    connection, with backoff or what the server's Retry-After asks (`request`); one that
    still fails raises WebError(infra=True), which the trainer keeps out of the update;
  * Wikimedia's etiquette: one request at a time to its sites (WIKIMEDIA_LOCK), `maxlag`,
    and a User-Agent that says how to reach the operator (`user_agent`);
  * a URL that a model wrote never reaches this machine, its network or a cloud metadata
    endpoint (`guarded_get`): every address is checked before and after connecting, on
    every redirect;
  * JSON APIs that report errors in their bodies (`api_json`), and the visible text of a
    page (`fetch_page_text`).
"""
from __future__ import annotations

import contextlib
import email.utils
import ipaddress
import json
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urljoin, urlparse

import requests
import urllib3


class WebError(Exception):
    """A request that failed, with a message fit for the memory (it never quotes the URL,
    which can hold an API key). infra=True: the network, a quota or a key failed, not the
    request the model wrote."""

    def __init__(self, message: str, infra: bool = False):
        super().__init__(message)
        self.infra = infra


VERSION = "0.1"


def user_agent(contact: str = "") -> str:
    """Our User-Agent, in the form Wikimedia's policy asks for: client/version
    (contact information) library/version; "bot" says it is automated. The contact goes
    only to Wikimedia (see is_wikimedia): a page a model picks need not learn it."""
    about = f"research bot; {contact}" if contact else "research bot"
    return f"AgentFlow-from-scratch/{VERSION} ({about}) python-requests/{requests.__version__}"


USER_AGENT = user_agent()


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed request is tried again (tools.retry_* in the config)."""
    attempts: int      # tries in all
    backoff_s: float   # first wait; doubled for each later one
    max_wait_s: float  # longest single wait
    total_s: float     # no new try after this long

    @classmethod
    def from_cfg(cls, c: dict) -> RetryPolicy:
        return cls(max(1, int(c["retry_attempts"])), float(c["retry_backoff_s"]), float(c["retry_max_wait_s"]),
                   float(c["retry_total_s"]))


# Indirections that tests replace, so that waits are recorded instead of slept through.
_clock, _sleep = time.monotonic, time.sleep
_jitter = random.Random()  # its own stream: the seeded global one drives a run's sampling and must not move


def _retry_after(value: str | None) -> float | None:
    """The seconds a Retry-After header asks for (a number of seconds, or an HTTP date)."""
    if not value:
        return None
    try:
        return max(float(value.strip()), 0.0)
    except ValueError:
        pass
    try:
        return max(email.utils.parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, IndexError):
        return None


def request(method: str, url: str, retry: RetryPolicy, timeout: float, *, session=None, agent: str = USER_AGENT,
             ours: bool = True, transient=None, headers: dict | None = None, **kw) -> requests.Response:
    """An HTTP request with retries: a response with status < 400, or a WebError.

    Tried again, after backoff_s * 2^n seconds (times 0.5..1 at random, so that threads
    that failed together do not retry together) or what the server's Retry-After asks:
    HTTP 429, any 5xx, a timeout, a dropped or refused connection, and a reply that
    `transient(resp)` names (MediaWiki says "lagged, retry" with HTTP 200). Still
    failing after retry.attempts tries or retry.total_s seconds, or asked to wait more
    than retry.max_wait_s: an infrastructure failure (infra=True).
    Never retried: other 4xx, which say the request itself is wrong. `ours` = the URL is
    an endpoint of the config, so 401 / 403 mean our key or quota (infra); on a URL a
    model wrote they are that page's answer to the model.
    Messages never quote the URL: it can hold an API key, and errors end up in prompts."""
    host = urlparse(url).netloc or url[:60]
    headers = {"User-Agent": agent, **(headers or {})}
    start, tries = _clock(), 0
    while True:
        tries += 1
        wait = None
        try:
            resp = (session or requests).request(method, url, timeout=timeout, headers=headers, **kw)
        except requests.Timeout:
            failure = f"timeout after {timeout:g}s from {host}"
        except requests.exceptions.SSLError:  # a certificate problem does not fix itself in seconds
            raise WebError(f"TLS error from {host}", infra=ours) from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            failure = f"request to {host} failed ({type(e).__name__})"
        except requests.RequestException as e:  # an invalid URL and the like: retrying cannot help
            raise WebError(f"request to {host} failed ({type(e).__name__})", infra=ours) from None
        else:
            failure = transient(resp) if transient and resp.status_code < 400 else ""
            if resp.status_code < 400 and not failure:
                return resp
            if resp.status_code >= 400:
                message = _error_message(resp)
                failure = f"HTTP {resp.status_code} from {host}" + (f": {message}" if message else "")
                if resp.status_code != 429 and resp.status_code < 500:
                    resp.close()
                    raise WebError(failure, infra=ours and resp.status_code in (401, 403))
            wait = _retry_after(resp.headers.get("Retry-After"))
            resp.close()
        asked = wait is not None
        if not asked:
            wait = min(retry.backoff_s * 2 ** (tries - 1) * (0.5 + _jitter.random() / 2), retry.max_wait_s)
        n = f"{tries} {'try' if tries == 1 else 'tries'}"
        if tries >= retry.attempts:
            why = n
        elif asked and wait > retry.max_wait_s:  # a server that says "in an hour" will not be ready in seconds
            why = f"{n}: asked to wait {wait:.0f}s, more than tools.retry_max_wait_s"
        elif _clock() - start + wait > retry.total_s:
            why = f"{n} in tools.retry_total_s"
        else:
            _sleep(wait)
            continue
        raise WebError(f"{failure} (gave up after {why})", infra=True)


def _error_message(resp: requests.Response) -> str:
    """What an error reply says about itself, if it is JSON (APIs explain their errors)."""
    if "json" not in resp.headers.get("Content-Type", "").lower():
        return ""
    try:
        return _api_error(resp.json(), loose=True)
    except ValueError:
        return ""


# Wikimedia's API etiquette asks for requests in series, not in parallel: every request
# to a Wikimedia site holds this lock (tool calls run in threads, run_tool_calls),
# Wikipedia_Search's and Web_Search's alike. Other hosts (a mirror of one's own) are
# asked in parallel.
WIKIMEDIA_LOCK = threading.Lock()
_WIKIMEDIA = ("wikipedia.org", "wikimedia.org", "wikidata.org", "wiktionary.org", "wikiquote.org", "wikibooks.org",
              "wikisource.org", "wikinews.org", "wikiversity.org", "wikivoyage.org", "mediawiki.org")


def is_wikimedia(host: str) -> bool:
    host = (host or "").lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in _WIKIMEDIA)


# A URL that a model wrote must not turn the agent inward: onto this machine's services
# (a judge, a model server, a database on 127.0.0.1), the local network or a cloud
# metadata endpoint (169.254.169.254). Every address a fetch would go to is checked:
# what the name resolves to before the request (so an internal one is never contacted)
# and the peer the socket actually connected to (so a name that resolves to a public
# address for our check and to an internal one for the connection, DNS rebinding, is
# caught too), on the first request and on every redirect, which we follow ourselves.
# Behind an HTTP proxy the proxy resolves the name and only the first check applies.
# Not guarded: the API endpoints of the config (wikipedia_url, serper_url, google_url), which the
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


def _refuse(host: str, why: str) -> WebError:
    return WebError(f"refused to fetch from {host}: {why} (tools.url_allow lets a host in)")


def _check_host(host: str, port: int, allow: tuple[set[str], list]) -> None:
    names, nets = allow
    if host.lower().rstrip(".") in names:
        return
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise WebError(f"cannot resolve {host}") from None
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


def guarded_get(url: str, timeout: float, allow_entries, retry: RetryPolicy,
                 contact: str = "") -> tuple[str, requests.Response]:
    """(final URL, streamed response) of a GET to a model-written URL, redirects followed
    by hand so that every hop is checked. Wikimedia's hosts get our contact address."""
    allow = _allow_list(allow_entries)
    with _guarded_session(allow) as session:
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urlparse(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise WebError(f"not an http(s) URL: {url[:100]}")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise WebError(f"bad port in {url[:100]}") from None
            _check_host(parts.hostname, port, allow)
            agent = user_agent(contact) if is_wikimedia(parts.hostname) else USER_AGENT
            resp = request("GET", url, retry, timeout, session=session, agent=agent, ours=False, stream=True,
                            allow_redirects=False)
            if not resp.is_redirect:
                return url, resp
            url = urljoin(url, resp.headers["Location"])
            resp.close()
    raise WebError(f"more than {_MAX_REDIRECTS} redirects")


def _api_error(data, loose: bool = False) -> str:
    """The message of an API error body: Google {"error": {"message"}}, MediaWiki {"error":
    {"info"}}; loose (a body that came with an error status) also Serper's {"message"}."""
    if not isinstance(data, dict):
        return ""
    error = data.get("error")
    if isinstance(error, dict):
        error = error.get("message") or error.get("info") or error.get("code") or "unknown error"
    if not error and loose:
        error = data.get("message")
    return str(error)[:200] if error else ""


def api_json(url: str, retry: RetryPolicy, timeout: float, method: str = "GET", transient_codes=(),
              **kw) -> dict:
    """The JSON object an API endpoint of the config answers (request's retries). An error
    in the body is a WebError (MediaWiki answers errors with HTTP 200); one whose code is
    in transient_codes is retried like a 503."""

    def transient(resp):
        try:
            error = resp.json().get("error")
        except (ValueError, AttributeError):
            return ""
        if isinstance(error, dict) and error.get("code") in transient_codes:
            return f"API error: {_api_error({'error': error})}"
        return ""

    resp = request(method, url, retry, timeout, transient=transient if transient_codes else None, **kw)
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise WebError(f"non-JSON reply from {urlparse(url).netloc}", infra=True)
    if _api_error(data):
        raise WebError(f"API error: {_api_error(data)}")
    return data


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


def fetch_page_text(url: str, retry: RetryPolicy, timeout: float, max_bytes: int, allow_entries,
                    contact: str = "") -> tuple[str, str]:
    """(final URL, visible text) of a page a model named: guarded_get's checks and
    retries, at most max_bytes of its body, read within `timeout` even from a server that
    drips, decoded by its charset, HTML and XML reduced to their visible text.

    Wikimedia's pages, like its API, are fetched one at a time (WIKIMEDIA_LOCK), the body
    included. (A redirect from elsewhere onto Wikimedia is not serialised.)"""
    with WIKIMEDIA_LOCK if is_wikimedia(urlparse(url).hostname) else contextlib.nullcontext():
        url, resp = guarded_get(url, timeout, allow_entries, retry, contact)
        with resp:
            ctype = resp.headers.get("Content-Type", "").lower()
            if not (ctype.startswith("text/") or "html" in ctype or "xml" in ctype):
                raise WebError(f"unsupported content type {ctype.split(';')[0] or 'unknown'!r} at {url[:100]}")
            body, stop_at = b"", time.monotonic() + timeout  # a page that drips forever still ends
            try:
                for piece in resp.iter_content(65536):
                    body += piece
                    if len(body) >= max_bytes or time.monotonic() > stop_at:
                        break
            except requests.RequestException as e:
                raise WebError(f"the connection to {urlparse(url).netloc} broke mid-page "
                               f"({type(e).__name__})", infra=True) from None
    charset = re.search(r"charset=[\"']?([\w.-]+)", ctype)
    try:
        text = body[:max_bytes].decode(charset.group(1) if charset else "utf-8", "replace")
    except LookupError:  # an unknown charset name
        text = body[:max_bytes].decode("utf-8", "replace")
    if "html" in ctype or "xml" in ctype:
        text = html_to_text(text)
    return url, text


def chat_reply(base_url: str, model: str, api_key_env: str, prompt: str, timeout: float) -> tuple[str | None, str]:
    """(the reply, "") of an OpenAI-compatible chat endpoint to one user message, greedy and a
    few tokens long (a judge's verdict), or (None, why) when the request, the status or the
    body failed: the endpoint's failure, never the judge's. The key is read from the
    environment variable api_key_env names (none sent when it is empty or unset)."""
    key = os.environ.get(api_key_env) if api_key_env else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 5}
    try:
        r = requests.post(f"{base_url}/chat/completions", headers=headers, data=json.dumps(body), timeout=timeout)
    except requests.RequestException as e:
        return None, f"request failed: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}: {r.text[:200]!r}"
    try:
        return r.json()["choices"][0]["message"]["content"], ""
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return None, f"malformed response ({type(e).__name__}): {r.text[:200]!r}"
