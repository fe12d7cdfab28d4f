"""Tests for support/sandbox.py (and the Python_Coder tool on top of it): hostile programs, run
as root and as an ordinary user.

When the tests run as root (as in CI) the "user" runs go through a helper process that
runs as `nobody` (tests/sandbox_runner.py, the same code the "root" runs use in this
process); when they run as an ordinary user, "user" runs in-process and "root" is
skipped. Every attack is one the host would lose without the sandbox: the files are
readable and the directories writable by the program's outside uid, the holder process
belongs to that uid, and test_the_checks_see_breaches_without_namespaces runs the same
checks under python_isolation: rlimits to show that they do fail.
"""

import contextlib
import ctypes
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import sandbox  # noqa: E402
import sandbox_runner  # noqa: E402
import tools  # noqa: E402
from tools import ToolResult, run_tool_calls  # noqa: E402

AS_ROOT = os.geteuid() == 0
SANDBOX_UID = tools.PythonCoder.settings["python_sandbox_uid"]


# ----------------------------------------------------------------------------- running as root / as a user

def _nobody():
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


@pytest.fixture(scope="session")
def user_helper():
    """(python, lib dir) for running the sandbox as `nobody`: copies of support/sandbox.py (with
    the module it imports) and the runner in a world-readable directory, and a python that
    nobody can run."""
    nobody = _nobody()
    if nobody is None:
        pytest.skip("no user 'nobody' to run the non-root half as")
    lib = tempfile.mkdtemp(prefix="agentflow-sandbox-lib-")
    os.chmod(lib, 0o755)
    os.mkdir(os.path.join(lib, "support"), 0o755)
    for path, to in ((ROOT / "support" / "__init__.py", "support"), (ROOT / "support" / "sandbox.py", "support"),
                     (ROOT / "support" / "text.py", "support"), (Path(sandbox_runner.__file__), "")):
        shutil.copy(path, os.path.join(lib, to))
        os.chmod(os.path.join(lib, to, path.name), 0o644)
    try:
        for python in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]):
            try:
                works = python and subprocess.run([python, "-I", "-c", "import ctypes, json"], user=nobody.pw_uid,
                                                  group=nobody.pw_gid, extra_groups=[], cwd="/",
                                                  capture_output=True).returncode == 0
            except OSError:  # e.g. ours, under a mode-700 /root
                works = False
            if works:
                yield python, lib
                return
        pytest.skip("no python here that the user 'nobody' can run (ours may live under a mode-700 home)")
    finally:
        shutil.rmtree(lib, ignore_errors=True)


@pytest.fixture(params=["root", "user"])
def who(request):
    if request.param == "root" and not AS_ROOT:
        pytest.skip("the tests do not run as root")
    return request.param


def run_as(who: str, code: str, request=None, env: dict | None = None, **req) -> dict:
    """Run `code` in the sandbox as `who`; the runner's report (stdout, stderr, exit_code,
    signal, timed_out, error, elapsed, holder_alive)."""
    req = {"code": code, "limits": {"timeout_s": 2.0, **req.pop("limits", {})}, **req}
    if who == "root" or not AS_ROOT:
        if req.get("holder") and AS_ROOT:
            req["holder_uid"] = SANDBOX_UID  # the uid the program has outside: it could signal this one
        old = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            return sandbox_runner.run(req)
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    python, lib = request.getfixturevalue("user_helper")
    nobody = _nobody()
    helper = subprocess.run([python, "-I", os.path.join(lib, "sandbox_runner.py")],
                            input=json.dumps({**req, "lib": lib}), capture_output=True, text=True,
                            user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd=lib,
                            env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=60)
    assert helper.returncode == 0, helper.stderr
    return json.loads(helper.stdout)


@pytest.fixture
def open_dir():
    """A directory anyone may read and write, holding a world-readable secret: without
    the sandbox, the program's outside uid (ours, or nobody, or the sandbox uid) could."""
    path = tempfile.mkdtemp(prefix="agentflow-test-")
    os.chmod(path, 0o777)
    secret = os.path.join(path, "secret.txt")
    with open(secret, "w") as f:
        f.write("s3cr3t-in-a-file")
    os.chmod(secret, 0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def survivors(marker: str) -> set[str]:
    """Host processes (zombies included) showing `marker` in their command line or name."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        if marker in cmdline or marker[:15] in status.split("\n")[0]:
            found.add(f"pid {pid}: {status.splitlines()[0]}")
    return found


class _Quiet(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"reached-the-host")

    def log_message(self, *args):
        pass


@pytest.fixture
def loopback_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    srv.hits = []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def abstract_socket():
    """A unix socket in the abstract namespace (no file: only network namespaces separate them)."""
    name = f"\0agentflow-test-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(4)
    yield name
    srv.close()


@pytest.fixture
def sysv_segment():
    """A System V shared-memory segment anyone may attach: only IPC namespaces separate them."""
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(20):  # a fresh key: never touch a segment of someone else's
        key = int.from_bytes(os.urandom(3), "big") + 1
        shmid = libc.shmget(key, 4096, 0o1000 | 0o2000 | 0o666)  # IPC_CREAT | IPC_EXCL
        if shmid >= 0:
            break
    else:
        pytest.skip(f"shmget failed: {os.strerror(ctypes.get_errno())}")
    yield key
    libc.shmctl(shmid, 0, None)  # IPC_RMID


# The probes each attack prints: "<name> <OK|errno name>". Kept as functions of the host
# resources so that the namespaces runs and the rlimits control run print the same lines.
PROBE = r"""
import ctypes, errno, os, socket, sys
def probe(name, fn):
    try:
        result = fn()
        print(name, "OK", result if result is not None else "")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
libc = ctypes.CDLL(None, use_errno=True)
def check(ret):
    if ret == -1:
        raise OSError(ctypes.get_errno(), "")
    return ret
"""


def lines(report: dict) -> dict[str, str]:
    assert not report.get("error"), report
    return {l.split(" ", 1)[0]: (l.split(" ", 2) + [""])[1] for l in report["stdout"].splitlines() if l.strip()}


def network_probes(port: int, abstract: str, key: int) -> str:
    return PROBE + f"""
def http():
    s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
    s.sendall(b"GET /from-the-sandbox HTTP/1.0\\r\\n\\r\\n")
    return s.recv(1000)[-16:].decode()
probe("http_loopback", http)
probe("tcp_outside", lambda: socket.create_connection(("1.1.1.1", 53), timeout=1).close())
def unix():
    s = socket.socket(socket.AF_UNIX)
    s.connect({abstract!r})
probe("abstract_unix", unix)
probe("sysv_shm", lambda: check(libc.shmget({key}, 0, 0)))
probe("interfaces", lambda: ",".join(name for _, name in socket.if_nameindex()))
"""


def file_probes(open_dir: str) -> str:
    return PROBE + f"""
probe("secret", lambda: open({os.path.join(open_dir, 'secret.txt')!r}).read())
probe("test_file", lambda: open({__file__!r}).read()[:20])
probe("project", lambda: open({str(ROOT / 'tools.py')!r}).read()[:20])
probe("passwd", lambda: open("/etc/passwd").read()[:60].replace(chr(10), " "))
probe("environ", lambda: open("/proc/1/environ").read()[:60])
probe("home", lambda: os.listdir(os.path.expanduser("~")))
probe("root_home", lambda: os.listdir("/root"))
"""


def write_probes(open_dir: str, tag: str) -> str:
    targets = {"open_dir": os.path.join(open_dir, tag), "tmp": f"/tmp/{tag}", "dev_shm": f"/dev/shm/{tag}",
               "var_tmp": f"/var/tmp/{tag}", "slash": f"/{tag}", "usr": f"/usr/{tag}",
               "home": os.path.join(os.path.expanduser("~"), tag)}
    return PROBE + "".join(f"probe('write_{name}', lambda: open({path!r}, 'w').write('x'))\n"
                           for name, path in targets.items())


def host_writes(open_dir: str, tag: str) -> list[str]:
    paths = [os.path.join(open_dir, tag), f"/tmp/{tag}", f"/dev/shm/{tag}", f"/var/tmp/{tag}", f"/{tag}",
             f"/usr/{tag}", os.path.join(os.path.expanduser("~"), tag)]
    return [p for p in paths if os.path.exists(p)]


# ----------------------------------------------------------------------------- attacks (root and user)

def test_no_network_at_all(who, request, loopback_server, abstract_socket, sysv_segment):
    port = loopback_server.server_address[1]
    got = lines(run_as(who, network_probes(port, abstract_socket, sysv_segment), request))
    assert got["http_loopback"] in ("ENETUNREACH", "ECONNREFUSED") and loopback_server.hits == []
    assert got["tcp_outside"] == "ENETUNREACH"
    assert got["abstract_unix"] == "ECONNREFUSED"  # another network namespace: not our socket
    assert got["sysv_shm"] == "ENOENT"             # another IPC namespace: not our segment
    assert run_as(who, PROBE + "probe('lo', lambda: socket.if_nameindex())", request)["stdout"].strip() \
        == "lo OK [(1, 'lo')]"


def test_host_files_are_invisible(who, request, open_dir):
    report = run_as(who, file_probes(open_dir), request)
    got = lines(report)
    for name in ("secret", "test_file", "project", "environ"):
        assert got[name] == "ENOENT", (name, got[name])
    assert got["passwd"] == "OK" and "root:" not in report["stdout"]  # ours, naming the program only
    assert got["home"] == "OK" and got["root_home"] in ("ENOENT", "OK")
    listing = run_as(who, "import json, os\nprint(json.dumps([os.listdir(p) for p in ('/', '/tmp', '/dev')]))",
                     request)["stdout"]
    top, tmp, dev = json.loads(listing)
    # The interpreter's prefixes are bound at their own paths: a virtual environment under
    # /tmp may show its first folder there (read-only), one elsewhere its top folder at /.
    prefixes = [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)]
    own_top = {p.parts[1] for p in prefixes}
    own_tmp = {p.relative_to("/tmp").parts[0] for p in prefixes if p.is_relative_to("/tmp") and p != Path("/tmp")}
    assert set(top) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "etc", "tmp", "root", "home",
                        "opt"} | own_top
    assert "proc" not in top and "sys" not in top and "main.py" in tmp
    assert set(tmp) <= {"main.py"} | own_tmp
    assert sorted(dev) == ["null", "random", "shm", "urandom", "zero"]


def test_no_writes_outside_its_directory(who, request, open_dir):
    tag = f"agentflow-pwned-{uuid.uuid4().hex[:8]}"
    got = lines(run_as(who, write_probes(open_dir, tag), request))
    assert host_writes(open_dir, tag) == []
    assert got["write_tmp"] == got["write_dev_shm"] == "OK"  # its own directory...
    for name in ("write_open_dir", "write_var_tmp", "write_slash", "write_usr", "write_home"):
        assert got[name] in ("ENOENT", "EROFS", "EACCES"), (name, got[name])
    # ...a fresh one each call.
    assert run_as(who, f"import os\nprint(os.path.exists('/tmp/{tag}'))", request)["stdout"] == "False\n"


def test_other_processes_are_invisible_and_unsignalable(who, request):
    code = PROBE + """
probe("proc", lambda: os.listdir("/proc"))
for name, pid in (("holder", HOLDER_PID), ("caller", CALLER_PID), ("supervisor", SUPERVISOR_PID)):
    probe("kill0_" + name, lambda: os.kill(pid, 0))
    probe("kill9_" + name, lambda: os.kill(pid, 9))
    probe("ptrace_" + name, lambda: check(libc.ptrace(16, pid, 0, 0)))  # PTRACE_ATTACH
for sig in (2, 15, 9):  # SIGINT, SIGTERM, SIGKILL to our PID 1 inside: ignored
    probe(f"kill{sig}_init", lambda: os.kill(1, sig))
probe("pid", lambda: os.getpid())
probe("ppid", lambda: os.getppid())
"""
    report = run_as(who, code, request, holder=True)
    got = lines(report)
    assert report["holder_alive"]
    for name in ("holder", "caller", "supervisor"):
        for attack in ("kill0_", "kill9_", "ptrace_"):
            assert got[attack + name] == "ESRCH", (attack + name, got[attack + name])  # no pid names them
    assert all(got[f"kill{sig}_init"] == "OK" for sig in (2, 15, 9)) and report["exit_code"] == 0  # it lived on
    assert got["proc"] == "ENOENT"
    assert "pid OK 2" in report["stdout"] and "ppid OK 1" in report["stdout"]  # its parent is our PID 1 inside


def test_it_cannot_climb_out(who, request):
    """Gain capabilities in a nested user namespace, then try to undo the mounts."""
    code = PROBE + """
MS_REMOUNT, MS_BIND, MS_RDONLY = 32, 4096, 1
mount = lambda *a: check(libc.mount(*a))
probe("root_before", lambda: sorted(os.listdir("/")))
probe("setuid0", lambda: os.setuid(0))
probe("remount_root_rw", lambda: mount(None, b"/", None, MS_REMOUNT | MS_BIND, None))
probe("mount_proc", lambda: mount(b"proc", b"/tmp", b"proc", 0, None))
probe("nested_userns", lambda: check(libc.unshare(0x10000000 | 0x20000)))  # NEWUSER | NEWNS
probe("nested_remount_usr_rw", lambda: mount(None, b"/usr", None, MS_REMOUNT | MS_BIND, None))
probe("nested_umount_usr", lambda: check(libc.umount2(b"/usr", 2)))
probe("nested_mount_proc", lambda: mount(b"proc", b"/tmp", b"proc", 0, None))
probe("write_usr", lambda: open("/usr/pwned", "w"))
def chroot_escape():  # the classic one: the working directory left outside a new root
    os.chdir("/")
    os.chroot("/tmp")
    for _ in range(10):
        os.chdir("..")
    os.chroot(".")
    return sorted(os.listdir("/"))
probe("chroot_escape", chroot_escape)
probe("no_new_privs", lambda: libc.prctl(39, 0, 0, 0, 0))
probe("nosuid_usr", lambda: bool(os.statvfs("/usr").f_flag & os.ST_NOSUID))
"""
    report = run_as(who, code, request)
    got, out = lines(report), report["stdout"]
    assert got["setuid0"] in ("EINVAL", "EPERM") and got["remount_root_rw"] == "EPERM" and got["mount_proc"] == "EPERM"
    if got["nested_userns"] == "OK":  # allowed by the kernel: the mounts it copies are locked
        assert got["nested_remount_usr_rw"] == "EPERM" and got["nested_umount_usr"] in ("EINVAL", "EPERM")
        assert got["nested_mount_proc"] == "EPERM"
        listed = {l.split(" OK ")[0]: l.split(" OK ")[1] for l in out.splitlines() if " OK " in l}
        assert listed["chroot_escape"] == listed["root_before"]  # nothing above our root to climb to
    assert got["write_usr"] in ("EROFS", "EACCES")
    assert "no_new_privs OK 1" in out and "nosuid_usr OK True" in out


def test_it_inherits_nothing_of_ours(who, request):
    """No variable of our environment, no open file of ours, not our host name."""
    code = ("import os, socket\nprint(dict(os.environ))\nopen_fds = []\nfor fd in range(3, 1024):\n"
            "    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n    except OSError:\n        pass\n"
            "print('fds', open_fds, 'host', socket.gethostname())\n")
    report = run_as(who, code, request, env={"AGENTFLOW_TEST_SECRET": "s3cr3t"})
    assert "HOME" in report["stdout"] and "s3cr3t" not in report["stdout"] and "AGENTFLOW" not in report["stdout"]
    assert "fds [] host sandbox" in report["stdout"] and socket.gethostname() != "sandbox"


def test_infinite_loop_is_killed_at_the_timeout(who, request):
    report = run_as(who, "while True:\n    pass", request, limits={"timeout_s": 1.0})
    assert report["timed_out"] and 1.0 <= report["elapsed"] < 1.0 + 1.5


def test_memory_and_disk_bombs_fail(who, request):
    report = run_as(who, "x = bytearray(4 * 1024**3)\nprint(len(x))", request)
    assert report["stderr"].strip().endswith("MemoryError")
    # Touching 512 MB of fresh pages has stalled past 2 s on loaded virtual machines (a timeout,
    # not the MemoryError this checks), so this bomb gets a wall limit it cannot reach in time.
    report = run_as(who, "x = []\nwhile True:\n    x.append(' ' * 10**6)", request, limits={"timeout_s": 20.0})
    assert report["stderr"].strip().endswith("MemoryError"), report
    fill = PROBE + ("def fill():\n    for i in range(1000):\n        with open(f'f{i}', 'wb') as f:\n"
                    "            f.write(b'x' * (8 << 20))\nprobe('fill', fill)\n")
    got = lines(run_as(who, fill, request, limits={"workdir_mb": 16}))
    assert got["fill"] == "ENOSPC"  # the working directory is size-capped
    big = run_as(who, "open('big', 'wb').write(b'x' * (2 << 20))", request, limits={"max_file_mb": 1})
    assert "File too large" in big["stderr"] or big["signal"] == "SIGXFSZ"


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "import subprocess, sys\nwhile True:\n    try:\n        subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(60)', 'MARKER'])\n    except OSError:\n        pass\n",
])
def test_fork_bomb_is_contained_and_nothing_survives(who, request, bomb):
    marker = f"af{uuid.uuid4().hex[:13]}"  # 15 chars: fits a process name, which forks inherit
    name_it = f"import ctypes\nctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n"  # PR_SET_NAME
    report = run_as(who, name_it + bomb.replace("MARKER", marker), request, limits={"timeout_s": 0.5})
    assert report["timed_out"] and report["elapsed"] < 0.5 + 2.0
    assert survivors(marker) == set()
    assert run_as(who, "print(6 * 7)", request)["stdout"] == "42\n"


def test_children_die_with_the_program(who, request):
    marker = f"escapee-{uuid.uuid4().hex}"
    code = (f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
            f"import time\ntime.sleep(0.2)\nprint('parent done')\n")
    report = run_as(who, code, request)
    assert report["stdout"] == "parent done\n" and report["elapsed"] < 2.0  # not kept waiting for the child
    assert survivors(marker) == set()


def test_nested_namespaces_die_with_it_too(who, request):
    """A child hides in a PID namespace of its own (inside a user namespace of its own)."""
    marker = f"nested-{uuid.uuid4().hex}"
    code = PROBE + f"""
import sys, time
r, w = os.pipe()
if os.fork() == 0:
    check(libc.unshare(0x10000000 | 0x20000000))  # NEWUSER | NEWPID: its next child is PID 1 there
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    os.write(w, str(pid).encode())
    os._exit(0)
hidden = int(os.read(r, 20))
time.sleep(0.2)
probe("hidden_alive", lambda: os.kill(hidden, 0))
"""
    report = run_as(who, code, request)
    assert report["stdout"] == "hidden_alive OK \n"  # it did start, and outlived its parent...
    assert survivors(marker) == set()  # ...but not the program


def test_output_bombs_are_capped(who, request):
    report = run_as(who, "print('START' + 'a' * 5_000_000 + 'THE_END')", request, chars=300)
    assert len(report["stdout"]) <= 300 and "...[cut " in report["stdout"]
    assert report["stdout"].startswith("START") and report["stdout"].rstrip().endswith("THE_END")
    report = run_as(who, "while True:\n    print('y' * 1000)", request, limits={"timeout_s": 0.5}, chars=300)
    assert report["timed_out"] and report["elapsed"] < 0.5 + 1.5 and len(report["stdout"]) <= 300


def test_the_checks_see_breaches_without_namespaces(who, request, open_dir, loopback_server, abstract_socket,
                                                    sysv_segment):
    """The same probes under python_isolation: rlimits (no namespaces) do get through: the
    checks above can fail."""
    port = loopback_server.server_address[1]
    net = lines(run_as(who, network_probes(port, abstract_socket, sysv_segment), request, isolation="rlimits"))
    assert net["http_loopback"] == "OK" and loopback_server.hits == ["/from-the-sandbox"]
    assert net["abstract_unix"] == "OK" and net["sysv_shm"] == "OK"
    files = lines(run_as(who, file_probes(open_dir), request, isolation="rlimits"))
    assert files["secret"] == "OK" and files["passwd"] == "OK"
    tag = f"agentflow-pwned-{uuid.uuid4().hex[:8]}"
    lines(run_as(who, write_probes(open_dir, tag), request, isolation="rlimits"))
    written = host_writes(open_dir, tag)
    for path in written:  # the weaker isolation's writes are real: leave none behind
        with contextlib.suppress(OSError):
            os.remove(path)
    assert os.path.join(open_dir, tag) in written
    seen = run_as(who, PROBE + "probe('holder', lambda: os.kill(HOLDER_PID, 0))", request, holder=True,
                  isolation="rlimits")
    assert lines(seen)["holder"] in ("OK", "EPERM")  # it exists for the program (not ESRCH)


# ----------------------------------------------------------------------------- settings, once per process

def test_the_decision_is_made_once(monkeypatch):
    limits = sandbox.Limits(timeout_s=2.5)  # settings no other test uses: a fresh decision
    calls = []
    real = sandbox.Sandbox._prepare
    monkeypatch.setattr(sandbox.Sandbox, "_prepare", lambda self, i: calls.append(i) or real(self, i))
    first, second = sandbox.Sandbox(limits), sandbox.Sandbox(limits)
    assert calls == [""] and first.argv == second.argv
    assert first.run("print(1)", 100).stdout == "1\n" and calls == [""]  # no probe per call


def test_without_namespaces_it_refuses_with_cause_and_fix(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(sandbox.SandboxError) as e:
        sandbox.Sandbox(sandbox.Limits(timeout_s=2.25))
    message = str(e.value)
    assert "\n" not in message and "darwin" in message and "python_isolation: rlimits" in message
    with pytest.raises(sandbox.SandboxError, match="python_isolation: rlimits"):
        tools.build_tools(["Python_Coder"], {"python_timeout_s": 2.25})


def test_where_user_namespaces_are_disabled_it_refuses_and_rlimits_still_runs():
    """For real: inside a user namespace of the test's own whose max_user_namespaces is 0
    (the sysctl is per namespace), so the machine is untouched."""
    script = f"""
import ctypes, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
    print("SKIP", ctypes.get_errno()); sys.exit()
open("/proc/sys/user/max_user_namespaces", "w").write("0")
sys.path.insert(0, {str(ROOT)!r})
from support import sandbox
try:
    sandbox.Sandbox()
except sandbox.SandboxError as e:
    print("REFUSED", e)
print("RLIMITS", sandbox.Sandbox(isolation="rlimits").run("print(6 * 7)", 100).stdout.strip())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    if out.startswith("SKIP"):
        pytest.skip(f"cannot make a user namespace to test in ({out.strip()})")
    refused, rlimits = out.splitlines()
    assert refused.startswith("REFUSED Python_Coder cannot isolate programs here: user namespaces are disabled")
    assert "Fix: sysctl -w user.max_user_namespaces" in refused and "python_isolation: rlimits" in refused
    assert rlimits == "RLIMITS 42"


UNSHARE = "unshare(user, mount, net, ipc, pid, uts namespaces)"


@pytest.mark.parametrize("sysctls, step, errno_name, says", [
    ({"user.max_user_namespaces": "0"}, UNSHARE, "EPERM", "user.max_user_namespaces=10000"),
    ({}, UNSHARE, "ENOSPC", "user.max_user_namespaces=10000"),
    ({"kernel.unprivileged_userns_clone": "0"}, UNSHARE, "EPERM", "kernel.unprivileged_userns_clone=1"),
    # AppArmor's restriction lets unshare succeed and refuses the mounts after it.
    ({"kernel.apparmor_restrict_unprivileged_userns": "1"}, "mount --make-rprivate /", "EPERM",
     "apparmor_restrict_unprivileged_userns=0"),
    ({}, UNSHARE, "EPERM", "seccomp"),
    ({}, UNSHARE, "EINVAL", "CONFIG_USER_NS"),
    ({}, "pivot_root", "ENOSYS", "failed to set up at 'pivot_root': ENOSYS"),
])
def test_each_cause_gets_its_fix(monkeypatch, sysctls, step, errno_name, says):
    monkeypatch.setattr(sandbox, "_sysctl", sysctls.get)
    message = sandbox._explain({"error": step, "errno": errno_name})
    assert says in message and "python_isolation: rlimits" in message and "\n" not in message


def test_rlimits_mode_warns_once(capsys, monkeypatch):
    """The weaker isolation is announced once per process, however often the tool is built
    or checked (the preflight builds its sandbox too)."""
    monkeypatch.setattr(sandbox, "_warned", set())
    tools.build_tools(["Python_Coder"], {"python_isolation": "rlimits"})
    tools.build_tools(["Python_Coder"], {"python_isolation": "rlimits"})
    assert capsys.readouterr().err.count("warning: Python_Coder runs model-written code with python_isolation: "
                                         "rlimits") == 1
    with pytest.raises(ValueError, match="python_isolation"):
        tools.build_tools(["Python_Coder"], {"python_isolation": "none"})


def test_config_knows_the_new_keys():
    from support.config import ConfigError, load_config
    cfg = load_config(None, ["tools.python_isolation=rlimits", "tools.python_interpreter=/usr/bin/python3"])
    tools.check_toolset(cfg)
    assert cfg["tools"]["python_isolation"] == "rlimits" and cfg["tools"]["python_interpreter"] == "/usr/bin/python3"
    with pytest.raises(ConfigError, match="python_isolation"):
        tools.check_toolset(load_config(None, ["tools.python_isolation=off"]))


def test_a_configured_interpreter_brings_its_packages(tmp_path):
    """A venv (here under a mode-700 directory, as a python under /root would be) with a
    package of its own: the default interpreter runs the standard library only."""
    os.chmod(tmp_path, 0o700)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "agentflow_probe_pkg.py").write_text("ANSWER = 42\n")
    code = "import agentflow_probe_pkg\nprint(agentflow_probe_pkg.ANSWER)"
    venv = tools.PythonCoder({"python_interpreter": str(tmp_path / "venv" / "bin" / "python")})
    assert venv.run(code) == ToolResult(output="42")
    assert "No module named 'agentflow_probe_pkg'" in tools.PythonCoder().run(code).error
    assert "No module named 'requests'" in tools.PythonCoder().run("import requests").error
    with pytest.raises(sandbox.SandboxError, match="not an executable file"):
        tools.PythonCoder({"python_interpreter": str(tmp_path / "no-such-python")})


# ----------------------------------------------------------------------------- the Python_Coder tool

def coder(**cfg) -> tools.PythonCoder:
    return tools.PythonCoder({"python_timeout_s": 2, **cfg})


def test_sandbox_runs_a_correct_program():
    r = coder().run("Here you go:\n```python\nimport math\nprint(math.factorial(25))\n```")
    assert r == ToolResult(output="15511210043330985984000000")


def test_sandbox_errors_are_short_and_useful():
    assert coder().run("def f(:\n    pass").error.startswith("line 1: SyntaxError")
    assert coder().run("x = 1\nprint(x / 0)").error == "line 2: ZeroDivisionError: division by zero"
    assert coder().run("x = 41 + 1").error == "the program printed nothing; print the result"
    assert coder().run("```python\n```").error == "no code in command"
    assert coder(python_timeout_s=1).run("while True:\n    pass").error == "timeout after 1s (the program was killed)"
    assert coder().run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)").error == \
        "the program was killed by SIGKILL"


def test_huge_output_is_capped_keeping_both_ends():
    r = coder(max_output_chars=300).run("print('START' + 'a' * 5_000_000 + 'THE_END')")
    assert r.ok and len(r.output) <= 300
    assert r.output.startswith("START") and r.output.endswith("THE_END") and "...[cut " in r.output


def test_output_is_capped_while_reading():
    buf = sandbox._HeadTail(keep=100)
    for _ in range(1000):
        buf.add(b"0123456789" * 100)
    assert buf.total == 1_000_000 and len(buf.head) == len(buf.tail) == 100
    text = buf.text(150)
    assert len(text) <= 150 and text.startswith("0123") and text.endswith("789")
    assert "...[cut 999" in text  # the count covers what was dropped while reading


def test_run_tool_calls_is_concurrent_and_keeps_order():
    calls = [(coder(), f"import time\ntime.sleep(1)\nprint({i})") for i in range(4)]

    class Broken(tools.Tool):
        name = "Broken"

        def run(self, command):
            raise RuntimeError("boom")

    calls.append((Broken(), "x"))
    start = time.monotonic()
    results = run_tool_calls(calls)
    assert time.monotonic() - start < 3.0  # one after another would take 4 s
    assert [r.output for r in results[:4]] == ["0", "1", "2", "3"]
    assert not results[4].ok and "boom" in results[4].error
