"""
The sandbox the Python Coder tool runs model-written code in (tools.PythonCoder calls
`Sandbox.run`). The paper's tool runs the code in the agent's own process; here it
runs in a throw-away Linux container built from scratch with namespaces, the way
bubblewrap and nsjail build theirs, much simplified:

  caller --Popen--> supervisor S (our Python, outside every namespace: the wall clock)
                     `--fork--> A: unshare(user, mount, net, ipc, pid, uts); builds the root
                                 `--fork--> B = PID 1 of the new PID namespace (reaps)
                                             `--fork--> the program: exec python main.py

What the program gets ("namespaces", the default):
- its own user namespace, mapped to one outside uid: ours when we are an ordinary
  user, `python_sandbox_uid` when we are root (root's uid would make it exempt from
  RLIMIT_NPROC and the owner of every root file it can see). Inside it is uid 1000,
  not root, so exec drops every capability the namespace gave A; NO_NEW_PRIVS and
  nosuid mounts keep setuid binaries from giving any back.
- a network namespace with nothing in it but a loopback that is down: no host, no
  127.0.0.1 of ours, no abstract unix sockets of ours;
- a mount namespace whose root is a fresh tmpfs, read-only, holding read-only binds
  of /usr, the /lib* and /bin links, the interpreter's own prefixes, and /dev/null,
  /dev/zero, /dev/random, /dev/urandom; an /etc with a passwd naming only the program;
  no /proc, /sys or home; /tmp (also /dev/shm and HOME) is the working directory, a
  size-capped tmpfs and the one writable place;
- its own PID namespace: it sees and can signal only its own processes. The
  supervisor is outside it, so no pid names it (no kill, no ptrace). When the
  program ends, our PID 1 ends with it, and when PID 1 ends (or the supervisor kills
  it at the timeout) the kernel kills every process left in the namespace;
- its own IPC namespace (System V IPC, POSIX message queues) and UTS namespace (the
  hostname reads "sandbox");
- rlimits on address space, CPU seconds, processes (counted per user namespace, so
  per program, since Linux 5.14; per outside uid before), file size and open files,
  which it cannot raise; an environment with nothing of ours in it.

"rlimits" (selected explicitly, with a warning every run) keeps only the last point
plus, as root, a pool of unprivileged uids; it isolates no network, files or
processes. It is for machines where namespaces are unavailable.

What is simplified: no seccomp filter (the kernel's namespace checks are the only
wall, as in a plain bubblewrap call), no cgroup (memory is bounded per process by
RLIMIT_AS, not per program), no /proc inside (a fresh proc mount is refused in some
containers and nothing in the standard library needs it), and a fixed list of what is
visible rather than a configurable one.
"""
from __future__ import annotations

import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from support.text import cut

ISOLATIONS = ("namespaces", "rlimits")
INSIDE_ID = 1000  # the program's uid and gid inside its user namespace: not 0, so it holds no capabilities


class SandboxError(Exception):
    """The sandbox cannot run programs here (setup failed), with a message fit for the user."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0   # wall clock of one program
    memory_mb: int = 512     # RLIMIT_AS of each process
    max_procs: int = 32      # RLIMIT_NPROC: processes + threads
    max_file_mb: int = 16    # RLIMIT_FSIZE: the largest file it may write
    workdir_mb: int = 64     # size of its working directory (namespaces only)
    open_files: int = 64     # RLIMIT_NOFILE


@dataclass
class Finished:
    stdout: str              # cut to the caller's limit, both ends kept
    stderr: str              # its last 4 KB or so, cut the same way
    exit_code: int | None    # None when it was killed (by a signal or at the timeout)
    signal: str = ""         # the signal that killed it, e.g. "SIGXCPU"
    timed_out: bool = False


# ----------------------------------------------------------------------------- the supervisor

# Runs as its own process: `python -I -S -c _SUPERVISOR <json settings>`, the program's
# code on stdin, and one JSON line of outcome written to the settings' report_fd at the end.
# It is a separate process, rather than a fork of ours, because ours holds threads and
# possibly gigabytes of model: fork would copy its page tables and can deadlock on locks
# other threads held. It is written against the standard library only and kept short;
# every step that can fail names itself in the report.
_SUPERVISOR = r"""
import ctypes, errno, json, os, resource, select, signal, sys, time
cfg = json.loads(sys.argv[1])
report = cfg["report_fd"]
os.set_inheritable(report, False)  # the program must never hold it (closed at exec)
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
step = "start"

def check(ret):  # a libc call's -1 as an OSError
    if ret == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret

def prctl(option, value):
    if hasattr(libc, "prctl"):  # Linux; the rlimits mode runs without it elsewhere
        check(libc.prctl(option, value, 0, 0, 0))

def mount(source, target, fstype, flags, data=None):
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                     data and data.encode()))

def limit():  # hard = soft: the program cannot raise them
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))

def tell(pipe, message):
    os.write(pipe, (json.dumps(message) + "\n").encode())

def failed(pipe, e):  # a setup step failed: say which, then stop
    tell(pipe, {"error": step, "errno": errno.errorcode.get(e.errno, "") if isinstance(e, OSError) else "",
                "message": str(e)[:300]})
    os._exit(125)

def write_ids(proc, uid, gid):
    # The one outside uid/gid we own becomes INSIDE inside. An unprivileged writer must
    # give up setgroups first (else a dropped group could be shed to pass a deny ACL).
    for name, text in (("setgroups", "deny"), ("uid_map", f"{cfg['inside']} {uid} 1"),
                       ("gid_map", f"{cfg['inside']} {gid} 1")):
        fd = os.open(name, os.O_WRONLY, dir_fd=proc)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

def enter_new_root(owner):
    # A tmpfs becomes the root: read-only binds of what the interpreter needs, the devices,
    # the working directory; then pivot_root into it and detach the old root.
    global step
    # Flags the kernel locks on mounts copied into a user namespace: a remount must repeat them.
    keep = [(os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21)]
    step = "mount --make-rprivate /"  # nothing mounted below may reach the host's mounts
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Opened before anything is mounted over them (a source may live under /tmp, which the
    # new root covers), then bound from /proc/self/fd/N, which names the opened file.
    step = "open what the interpreter needs"
    binds = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in cfg["binds"]]
    devices = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in cfg["devices"]]
    new = "/tmp"
    step = "mount the new root (tmpfs)"
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    # The working directory first: an interpreter under /tmp (a venv in a temporary
    # directory) is then bound inside it rather than hidden under it.
    step = "mount the working directory (tmpfs)"
    os.mkdir(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['workdir_mb']}m,nr_inodes=16384,mode=0700,{owner}")
    for path, fd in binds:
        step = f"bind {path} read-only"
        os.makedirs(new + path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", new + path, None, MS_BIND)
        have = os.statvfs(new + path).f_flag
        mount(None, new + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
              | sum(ms for st, ms in keep if have & st))
    for name, target in cfg["links"]:
        os.symlink(target, new + name)
    step = "bind the devices"
    os.mkdir(new + "/dev")
    for path, fd in devices:  # device nodes work through binds of the host's (a tmpfs of ours is nodev)
        os.close(os.open(new + path, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(f"/proc/self/fd/{fd}", new + path, None, MS_BIND)
    # POSIX semaphores (multiprocessing) live in /dev/shm: let it be the working directory.
    os.symlink("/tmp", new + "/dev/shm")
    step = "write /etc"  # a passwd naming only the program's uid, for code that looks itself up
    os.mkdir(new + "/etc")
    for name, line in (("passwd", "sandbox:x:{0}:{0}:sandbox:/tmp:/usr/sbin/nologin"), ("group", "sandbox:x:{0}:")):
        with open(f"{new}/etc/{name}", "w") as f:
            f.write(line.format(cfg["inside"]) + "\n")
    step = "pivot_root"  # then detach the old root: nothing of the host stays reachable
    os.chdir(new)
    check(libc.syscall(cfg["pivot_root_nr"], b".", b"."))
    check(libc.umount2(b".", 2))  # MNT_DETACH
    os.chdir("/")
    step = "remount / read-only"
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for fd in [fd for _, fd in binds + devices]:
        os.close(fd)

def exec_program(pipe):  # the program's process, PID 2 of the new PID namespace
    global step
    try:
        step = "write main.py"
        os.chdir("/tmp")
        with os.fdopen(os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(code)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        step = "set limits"
        limit()
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        step = f"exec {cfg['argv'][0]}"
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:
        failed(pipe, e)

def a_main(pipe):
    # A builds the container and waits for B, its child and PID 1 inside. PDEATHSIG chains
    # S -> A -> B, so killing A (or S dying) kills B, and with B the whole PID namespace.
    global step
    try:
        uid, gid = cfg["uid"], cfg["gid"]
        everything = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWUTS
        if os.geteuid() == 0:
            # As root: build the root first, with root's access to every path (an interpreter
            # under a mode-700 /root included), in a mount namespace of our own; then drop to
            # the sandbox uid for good and create the namespaces as that unprivileged user.
            # The mounts, copied into a namespace of a less privileged user, get locked by
            # the kernel: nothing inside can unmount or remount them.
            step = "unshare(mount namespace)"
            check(libc.unshare(CLONE_NEWNS))
            proc = os.open(f"/proc/{os.getpid()}", os.O_PATH | os.O_DIRECTORY)  # /proc is gone after the pivot
            enter_new_root(f"uid={uid},gid={gid}")
            step = "drop to the sandbox uid"
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            prctl(PR_SET_DUMPABLE, 1)  # the uid change made /proc/<us> root's; our id maps must be ours to write
            step = "unshare(user, mount, net, ipc, pid, uts namespaces)"
            check(libc.unshare(everything))
            step = "write the uid/gid maps"
            write_ids(proc, uid, gid)
            prctl(PR_SET_DUMPABLE, 0)  # and no longer: nothing else of this uid may ptrace us
        else:
            step = "unshare(user, mount, net, ipc, pid, uts namespaces)"
            check(libc.unshare(everything))
            step = "write the uid/gid maps"
            write_ids(os.open("/proc/self", os.O_PATH | os.O_DIRECTORY), uid, gid)
            enter_new_root(f"uid={cfg['inside']},gid={cfg['inside']}")
        step = "set the hostname"  # ours would tell the program where it runs
        check(libc.sethostname(b"sandbox", 7))
        step = "fork PID 1"
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        if os.fork() == 0:
            init(pipe)
        os.wait()  # B returns once every process of the namespace is gone
        os._exit(0)
    except BaseException as e:
        failed(pipe, e)

def init(pipe):
    # B, PID 1 of the namespace: the program runs as its child rather than as PID 1 itself,
    # which the kernel shields from its own signals and which would have to reap orphans.
    # B reaps them, and when the program ends, B ends, which kills all that is left.
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The kernel drops signals from inside to a PID 1 that has no handler for them; the
        # one Python installed (SIGINT) would let the program stop us.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        program = os.fork()
        if program == 0:
            exec_program(pipe)
        while True:
            pid, status = os.wait()
            if pid == program:
                tell(pipe, {"status": status})
                os._exit(0)
    except BaseException as e:
        failed(pipe, e)

def rlimits_main(pipe):  # the weaker mode: limits and (as root) a pool uid, in the host's namespaces
    global step
    try:
        os.setpgid(0, 0)
        step = "set limits"
        limit()
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        if cfg["uid"] >= 0:
            step = "drop to the sandbox uid"
            os.setgroups([]); os.setgid(cfg["gid"]); os.setuid(cfg["uid"])
        step = f"exec {cfg['argv'][0]}"
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:
        failed(pipe, e)

def wait(pid, deadline):  # its wait status, or None at the deadline
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3 or no Linux: poll
        pidfd = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if pidfd is not None:
            select.select([pidfd], [], [], left)
        else:
            time.sleep(min(left, 0.005))

namespaces = cfg["isolation"] == "namespaces"
# Orphans become our children, so we reap them: in the rlimits mode the program's, in the
# namespaces mode B once we killed A (we return only when the namespace is gone).
prctl(PR_SET_CHILD_SUBREAPER, 1)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    (a_main if namespaces else rlimits_main)(w)
os.close(w)
status = wait(pid, time.monotonic() + cfg["timeout"])
timed_out = status is None
if namespaces:
    if timed_out:
        os.kill(pid, signal.SIGKILL)  # A's death kills B (PDEATHSIG), B's the namespace
elif cfg["uid"] >= 0:  # kill(-1) from a helper with the sandbox uid hits every process of that uid
    if os.fork() == 0:
        try:
            os.setuid(cfg["uid"]); os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
else:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
give_up = time.monotonic() + 2.0  # everything got SIGKILL; reap until no child is left
while time.monotonic() < give_up:
    try:
        if os.waitpid(-1, os.WNOHANG)[0] == 0:
            time.sleep(0.002)
    except ChildProcessError:
        break
outcome = {"timed_out": timed_out, "status": None if timed_out or namespaces else status}
with os.fdopen(r, "rb") as pipe:  # read to the end: every writer is gone, A and B have exited or exec'd
    lines = pipe.read()
for line in lines.splitlines():
    outcome.update(json.loads(line))
os.write(report, json.dumps(outcome).encode())
"""

# pivot_root(2) has no libc wrapper; its number differs between architectures.
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41}


# ----------------------------------------------------------------------------- stream capture

class _HeadTail:
    """Keeps the first and last `keep` bytes of a stream and counts the rest, so a
    program printing forever costs bounded memory here."""

    def __init__(self, keep: int):
        self.keep, self.head, self.tail, self.total = keep, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        del self.tail[:-self.keep or None]

    def text(self, limit: int) -> str:
        dropped = self.total - len(self.head) - len(self.tail)
        text = (self.head + self.tail).decode("utf-8", "replace") if not dropped else \
            self.head.decode("utf-8", "replace") + self.tail.decode("utf-8", "replace")
        return cut(text, limit, keep_tail=True, already_cut=dropped)


def _read_until(proc: subprocess.Popen, deadline: float, out: _HeadTail, err: _HeadTail) -> None:
    """Drain stdout and stderr until both close or the deadline passes."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(deadline - time.monotonic(), 0)):
            data = os.read(key.fd, 65536)
            if data:
                key.data.add(data)
            else:
                sel.unregister(key.fileobj)
    sel.close()


# ----------------------------------------------------------------------------- the rlimits mode's uid pool

_UID_POOL_SIZE = 16
_LOCK_DIR = "/tmp/agentflow-sandbox-locks"  # a fixed path: every process on the machine must agree


def _take_uid(base: int) -> tuple[int, int]:
    """rlimits mode as root: a free uid of the pool and the fd that holds it. One uid per
    running program, so its RLIMIT_NPROC budget is its own and the kill(-1) cleanup cannot
    hit another program. The hold is an flock on a per-uid file: it works across threads
    and processes (train and eval on one machine), and the kernel drops it if we die.
    The pool is the 16 uids after the namespaces mode's one, which that kill(-1) must
    never hit. (The namespaces mode needs no pool: RLIMIT_NPROC counts per user
    namespace there, and the PID namespace, not the uid, is what cleanup kills.)"""
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    if os.stat(_LOCK_DIR).st_uid != os.geteuid():  # made by someone else (a sandbox?): don't trust it
        raise SandboxError(f"{_LOCK_DIR} is not owned by us")
    while True:
        for uid in range(base, base + _UID_POOL_SIZE):
            fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return uid, fd
            except BlockingIOError:
                os.close(fd)
        time.sleep(0.05)  # all busy: wait for one


def _sweep_world_writable(uid: int) -> None:
    """rlimits mode as root: delete what the pool uid left at the top of the
    world-writable directories (safe because the uid belongs to this one finished program)."""
    for top in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        for entry in (os.scandir(top) if os.path.isdir(top) else ()):
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
            except OSError:
                pass


# ----------------------------------------------------------------------------- diagnosis

_ISOLATION_HINT = ("or set tools.python_isolation: rlimits to run programs with rlimits only "
                   "(no network, file or process isolation)")


def _sysctl(name: str) -> str | None:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return None


def _explain(outcome: dict) -> str:
    """One line for a failed setup step: the cause, as far as we can tell, and the fix.
    The sysctls matter as root too: the namespaces are made after the drop to the
    sandbox uid. AppArmor's restriction lets unshare succeed and refuses what follows."""
    step, code = outcome.get("error", "?"), outcome.get("errno", "")
    cause = fix = ""
    if step.startswith("unshare") or code in ("EPERM", "EACCES"):
        if _sysctl("user.max_user_namespaces") == "0" or code == "ENOSPC":
            cause, fix = ("user namespaces are disabled or used up (sysctl user.max_user_namespaces)",
                          "sysctl -w user.max_user_namespaces=10000")
        elif _sysctl("kernel.unprivileged_userns_clone") == "0":
            cause, fix = ("unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0)",
                          "sysctl -w kernel.unprivileged_userns_clone=1")
        elif _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
            cause, fix = ("AppArmor restricts unprivileged user namespaces "
                          "(kernel.apparmor_restrict_unprivileged_userns = 1)",
                          "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor "
                          "profile that allows userns for this python")
    if not cause and step.startswith("unshare"):
        if code == "EINVAL":
            cause, fix = "this kernel lacks user, PID or network namespaces", "a kernel built with CONFIG_USER_NS"
        else:
            cause, fix = (f"unshare() was refused ({code}): a seccomp filter or security module blocks "
                          "namespaces (a container's default profile does)",
                          "allow unshare/clone of namespaces (e.g. docker --security-opt seccomp=unconfined)")
    if cause:
        return f"Python_Coder cannot isolate programs here: {cause}. Fix: {fix}; {_ISOLATION_HINT}."
    return (f"Python_Coder's sandbox failed to set up at '{step}': {code} {outcome.get('message', '')}"
            f"; {_ISOLATION_HINT}.")


# ----------------------------------------------------------------------------- the sandbox

_PREFIXES = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
_PROBE_CODE, _PROBE_OUT = "import encodings, json\nprint(6 * 7)\n", "42"
# The program's whole environment: nothing of ours (API keys) reaches it.
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_ready: dict[tuple, tuple | SandboxError] = {}  # settings -> what `_prepare` found, once per process
_ready_lock = threading.Lock()
_warned: set[tuple] = set()  # the settings whose weaker isolation has been announced


class Sandbox:
    """Runs one Python program per `run` call under `limits`. Construction decides, once
    per process and settings, whether this machine can: it raises SandboxError with the
    cause and the fix if not (so a run stops at start, not at its first tool call)."""

    def __init__(self, limits: Limits = Limits(), interpreter: str = "", isolation: str = "namespaces",
                 sandbox_uid: int = 61100):
        if isolation not in ISOLATIONS:
            raise ValueError(f"python_isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.limits, self.isolation, self.sandbox_uid = limits, isolation, sandbox_uid
        self.root = hasattr(os, "geteuid") and os.geteuid() == 0
        key = (limits, interpreter, isolation, sandbox_uid, self.root)
        with _ready_lock:
            if key not in _ready:
                try:
                    _ready[key] = self._prepare(interpreter)
                except SandboxError as e:
                    _ready[key] = e
        found = _ready[key]
        if isinstance(found, SandboxError):
            raise SandboxError(str(found))
        self.argv, self.binds, self.links, self.devices = found
        if isolation == "rlimits" and key not in _warned:  # once per process and settings
            _warned.add(key)
            print("warning: Python_Coder runs model-written code with python_isolation: rlimits: it can reach "
                  "the network, read what this user can and see other processes", file=sys.stderr)

    # -- deciding once

    def _prepare(self, interpreter: str) -> tuple:
        if self.isolation == "namespaces" and not sys.platform.startswith("linux"):
            raise SandboxError(f"Python_Coder cannot isolate programs here: Linux namespaces do not exist on "
                               f"{sys.platform}. Fix: run on Linux; {_ISOLATION_HINT}.")
        # Our own interpreter with -S: the standard library only, as the tool's card says. A
        # configured one runs with its site-packages (a venv with numpy and sympy). As root,
        # a python under a mode-700 /root still works (root binds its prefix before dropping
        # to the sandbox uid), but not one whose own files only root may read: then the
        # system python3 is tried. Each is probed by running it, the only sure test.
        candidates = [sys.executable, "/usr/bin/python3"] if not interpreter else [interpreter]
        flags = ["-I", "-S"] if not interpreter else ["-I"]
        problems = []
        for exe in dict.fromkeys(candidates):
            if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
                problems.append(f"{exe} is not an executable file")
                continue
            # Symlinks in its directory resolved (they may not exist inside), its name kept (a
            # venv's python is a symlink whose location is what makes it the venv's).
            exe = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(exe))), os.path.basename(exe))
            self.argv, (self.binds, self.links, self.devices) = [exe, *flags, "main.py"], self._visible(exe)
            if self.isolation == "rlimits" and self.root:
                exe = self._rlimits_interpreter(exe)
                if exe is None:
                    problems.append(f"{self.argv[0]} cannot be run by the unprivileged uid {self.sandbox_uid + 1}")
                    continue
                self.argv[0] = exe
            done = self.run(_PROBE_CODE, 200)
            if done.stdout.strip() == _PROBE_OUT:
                return self.argv, self.binds, self.links, self.devices
            last = [l for l in done.stderr.splitlines() if l.strip()][-1:] or [f"exit code {done.exit_code}"]
            problems.append(f"{exe} does not start in the sandbox ({last[0].strip()[:200]})")
        raise SandboxError("Python_Coder has no interpreter that runs in its sandbox: " + "; ".join(problems)
                           + ". Fix: point tools.python_interpreter at a python installed under its own prefix"
                           " or /usr")

    def _visible(self, exe: str) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        """What the new root shows: /usr, the /lib* and /bin of the host (as the symlinks
        they are on merged-/usr systems), the interpreter's prefixes, four devices."""
        if exe == os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable)):
            prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        else:  # ask it where it lives (run as we are, outside the sandbox: it is the user's configured python)
            try:
                probe = subprocess.run([exe, "-I", "-c", _PREFIXES], env=_ENV, cwd="/", stdin=subprocess.DEVNULL,
                                       capture_output=True, timeout=60, text=True)
                prefixes = json.loads(probe.stdout)
            except (OSError, ValueError, subprocess.SubprocessError):
                prefixes = []
        wanted, links = ["/usr"], []
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                links.append((top, os.readlink(top)))
            elif os.path.isdir(top):
                wanted.append(top)
        wanted += [os.path.realpath(p) for p in prefixes] + [os.path.dirname(exe)]
        binds = []
        for path in sorted(set(p for p in wanted if os.path.isdir(p))):  # parents sort before children
            if path != "/" and not any(path.startswith(b.rstrip("/") + "/") for b in binds):
                binds.append(path)
        devices = [d for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom") if os.path.exists(d)]
        return binds, links, devices

    def _rlimits_interpreter(self, exe: str) -> str | None:
        """rlimits mode as root: `exe` if a pool uid can run it, else a system python3 (our
        own may live under /root, mode 700), else None. Probed by running it."""
        for candidate in dict.fromkeys([exe, "/usr/bin/python3"]):
            try:
                probe = subprocess.run([candidate, "-I", "-S", "-c", _PROBE_CODE], user=self.sandbox_uid + 1,
                                       group=self.sandbox_uid + 1, extra_groups=[], cwd="/", env=_ENV,
                                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60, text=True)
            except (OSError, subprocess.SubprocessError):
                continue
            if probe.stdout.strip() == _PROBE_OUT:
                return candidate
        return None

    # -- one program

    def run(self, code: str, output_chars: int) -> Finished:
        """Run `code` as main.py; its stdout cut to `output_chars` (both ends kept)."""
        lim = self.limits
        rlimits = {"RLIMIT_AS": lim.memory_mb << 20, "RLIMIT_CPU": int(lim.timeout_s) + 2,
                   "RLIMIT_NPROC": lim.max_procs + (self.isolation == "namespaces"),  # + our PID 1
                   "RLIMIT_FSIZE": lim.max_file_mb << 20, "RLIMIT_NOFILE": lim.open_files}
        settings = {"isolation": self.isolation, "argv": self.argv, "timeout": lim.timeout_s, "rlimits": rlimits,
                    "inside": INSIDE_ID, "uid": os.getuid(), "gid": os.getgid()}
        uid_fd, workdir = -1, None
        try:
            if self.isolation == "namespaces":
                if self.root:
                    settings.update(uid=self.sandbox_uid, gid=self.sandbox_uid)
                settings.update(binds=self.binds, links=self.links, devices=self.devices, workdir_mb=lim.workdir_mb,
                                env={**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"},
                                pivot_root_nr=_PIVOT_ROOT.get(os.uname().machine, -1))
                cwd = "/"
            else:
                uid = -1
                if self.root:
                    uid, uid_fd = _take_uid(self.sandbox_uid + 1)
                settings.update(uid=uid, gid=uid)
                workdir = cwd = tempfile.mkdtemp(prefix="agentflow-py-")
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                    f.write(code)
                if uid >= 0:
                    os.chown(workdir, uid, uid)  # its own directory is the one place it may write
                settings["env"] = {**_ENV, "HOME": workdir, "TMPDIR": workdir}
            return self._supervise(settings, cwd, code, output_chars)
        finally:
            if uid_fd >= 0:
                _sweep_world_writable(settings["uid"])
                os.close(uid_fd)  # releases the uid
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)

    def _supervise(self, settings: dict, cwd: str, code: str, output_chars: int) -> Finished:
        report_r, report_w = os.pipe()
        settings["report_fd"] = report_w
        out, err = _HeadTail(4 * output_chars), _HeadTail(4096)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SUPERVISOR, json.dumps(settings)],
                                    cwd=cwd, env=settings["env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(report_w,), start_new_session=True)
        finally:
            os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            try:
                try:  # the supervisor reads all of it first thing
                    proc.stdin.write(code.encode("utf-8", "replace"))
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                # The supervisor stops the program at the timeout; the slack covers start-up and cleanup.
                _read_until(proc, time.monotonic() + self.limits.timeout_s + 5.0, out, err)
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise SandboxError(f"the sandbox did not stop after {self.limits.timeout_s:g}s")
            finally:
                proc.stdout.close()
                proc.stderr.close()
            raw = report.read()
        try:
            outcome = json.loads(raw)
        except ValueError:
            raise SandboxError(f"the sandbox supervisor failed (exit code {proc.returncode}): "
                               f"{err.text(300).strip()}") from None
        if "error" in outcome:
            raise SandboxError(_explain(outcome))
        stdout, stderr = out.text(output_chars), err.text(4096)
        if outcome["timed_out"]:
            return Finished(stdout, stderr, None, timed_out=True)
        status = outcome["status"]
        if status is None:  # PID 1 died without a word: killed from outside, e.g. by someone sharing the uid
            raise SandboxError("the sandbox ended before its program did (killed from outside?)")
        if os.WIFSIGNALED(status):
            return Finished(stdout, stderr, None, signal=signal.Signals(os.WTERMSIG(status)).name)
        return Finished(stdout, stderr, os.WEXITSTATUS(status))
