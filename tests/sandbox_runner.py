"""Runs one program in the sandbox for tests/test_sandbox.py and reports what happened,
either in the test's own process or, run as a script by an unprivileged user, in a
helper process: one code path, so an attack reads the same as root and as a user.

The program's text may name three host pids, filled in here: HOLDER_PID (a sleeping
process of the same outside uid as the program, which it must not be able to signal),
CALLER_PID (this process) and SUPERVISOR_PID (the sandbox's supervisor, known only once
it started, so it is put into the code on its way to the supervisor's stdin).
"""

import dataclasses
import json
import os
import subprocess
import sys
import time


class _FillPid:
    """The supervisor's stdin, with SUPERVISOR_PID replaced by its pid as the code passes."""

    def __init__(self, stream, pid: int):
        self.stream, self.pid = stream, pid

    def write(self, data: bytes):
        return self.stream.write(data.replace(b"SUPERVISOR_PID", str(self.pid).encode()))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run(req: dict) -> dict:
    from support import sandbox

    holder = None
    if req.get("holder"):
        holder = subprocess.Popen(["/bin/sleep", "60"], user=req.get("holder_uid"), stdin=subprocess.DEVNULL)
    code = req["code"].replace("HOLDER_PID", str(holder.pid if holder else -1)).replace("CALLER_PID", str(os.getpid()))
    real_popen = sandbox.subprocess.Popen

    class Spy(real_popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self.stdin is not None:
                self.stdin = _FillPid(self.stdin, self.pid)

    result = {}
    start = time.monotonic()
    sandbox.subprocess.Popen = Spy
    try:
        box = sandbox.Sandbox(sandbox.Limits(**req.get("limits", {})), interpreter=req.get("interpreter", ""),
                              isolation=req.get("isolation", "namespaces"))
        result = dataclasses.asdict(box.run(code, req.get("chars", 100_000)))
    except sandbox.SandboxError as e:
        result = {"error": str(e)}
    finally:
        sandbox.subprocess.Popen = real_popen
        result["elapsed"] = time.monotonic() - start
        if holder is not None:
            result["holder_alive"] = holder.poll() is None
            holder.kill()
            holder.wait()
    return result


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    sys.path.insert(0, request["lib"])
    print(json.dumps(run(request)))
