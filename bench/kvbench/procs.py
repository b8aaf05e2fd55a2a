"""Processes the benchmark starts: each in its own session with its output in a log file,
remembered by PID and stopped by PID (SIGTERM, then SIGKILL after a grace), never by name."""

import os
import signal
import socket
import subprocess
import time
import urllib.request


def session_cpu_seconds(sid, proc="/proc"):
    """CPU time (user + system, with reaped children's) of every live process in session
    `sid`, in seconds: a launcher's workers count with it (each child starts its own session)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat")) as f:
                stat = f.read()
        except OSError:  # gone since the listing
            continue
        # The command name may hold spaces and parentheses; the fields follow its last ')'.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) < 15 or fields[3] != str(sid):
            continue
        total += sum(int(v) for v in fields[11:15])
    return total / tick


class Procs:
    """The processes of one system's run; `stop_all` ends exactly those."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.children = []

    def start(self, name, argv, env=None):
        os.makedirs(self.log_dir, exist_ok=True)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        child = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.children.append((name, child, log))
        return child

    def cpu_seconds(self):
        """{name: CPU seconds so far} of each running child's session."""
        return {name: session_cpu_seconds(child.pid) for name, child, _ in self.children if child.poll() is None}

    def forget(self, child):
        """Stops watching a child that was ended on purpose (a killed engine), so
        `check_alive` does not report it."""
        for entry in [c for c in self.children if c[1] is child]:
            entry[2].close()
            self.children.remove(entry)

    def check_alive(self):
        """Raises naming the first process that exited (and where its log is)."""
        for name, child, _ in self.children:
            code = child.poll()
            if code is not None:
                raise RuntimeError(
                    f"{name} (pid {child.pid}) exited with {code}; see {self.log_dir}/{name}.log"
                )

    def stop_all(self, grace=5.0):
        for name, child, log in reversed(self.children):
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    child.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(child.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    child.wait()
            log.close()
        self.children = []


def free_ports(n, host="127.0.0.1"):
    """n distinct free TCP ports (bound at once, then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port_run(n, start=20000, stop=60000, host="127.0.0.1"):
    """A base port b with b..b+n-1 all free (kvpick-sim numbers its pods' ports that way)."""
    base = start
    while base + n < stop:
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind((host, p))
                socks.append(s)
            return base
        except OSError:
            base += n + 7
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode("utf-8", "replace")


def wait_until(what, check, procs, timeout=60.0, interval=0.2):
    """Polls `check()` until it is true; fails early if one of `procs` exited."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 - any failure means "not yet"
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready within {timeout}s (last error: {last})")
