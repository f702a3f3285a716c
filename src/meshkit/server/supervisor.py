"""
Several router processes on one port
====================================

``meshkit serve --processes N`` (``[server] processes``) runs N children, each a
whole gateway (its own :class:`~meshkit.Mesh`, prepare pool and event loop), on
the one listening socket this parent binds and hands down (pre-fork, as gunicorn
and uvicorn's ``--workers`` do). One shared accept queue, not ``SO_REUSEPORT``: a
connection the kernel queued is accepted by whichever child is free, so a child
that dies leaves no queued connection behind (with per-child sockets, the
connections queued on a dead child's socket are reset).
The children share the connections out evenly by handing one another accepted
sockets over inboxes this parent makes and holds (:mod:`meshkit.server.accept`).

The parent serves nothing itself. It

* starts the children and prints ``meshkit gateway listening on <url>`` once
  every one of them is accepting (each writes one byte to its ready pipe);
* restarts a child that exits while the gateway runs, after a back-off that
  doubles while the child keeps dying within :data:`STABLE_S` of its start (up to
  :data:`MAX_BACKOFF_S`), so a child that cannot start does not spin;
* forwards SIGTERM / SIGINT (the grace applies in every child, at the same time)
  and SIGHUP (each child reloads the same flags, file and environment), closes its
  copy of the listening socket when shutdown starts, and kills what is still
  running ``grace_s`` + :data:`KILL_AFTER_S` seconds later.

With KV events to take (:func:`meshkit.server.cli._wants_relay`), the parent also
runs one more child, the KV-event relay (:mod:`meshkit.lifecycle.kv_relay`) on
``ipc://`` sockets in the run directory: started first, restarted like the others,
and the routers' ``[kv] relay``, so each engine is subscribed to once per gateway.

A child learns its place from :data:`CHILD_ENV` (a JSON object: the listening
socket's file descriptor, its index, the count, the run directory of the
siblings' private sockets, its ready pipe, its role, the relay's endpoints). The
run directory is created with mode 0700 and removed when the parent exits.

Exit codes: the parent exits 0 after a graceful shutdown, or with the code of a
child that failed before the gateway was up (2 for a configuration error, 1 when
it could not serve).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshkit.server.accept import ABSENT, SHARES_FILE, Shares

__all__ = [
    "CHILD_ENV",
    "KILL_AFTER_S",
    "MAX_BACKOFF_S",
    "MAX_UNIX_PATH",
    "RELAY_INDEX",
    "RELAY_METRICS_SOCKET",
    "STABLE_S",
    "ChildPlace",
    "Supervisor",
    "child_place",
    "leave_run_dir",
]

log = logging.getLogger("meshkit.server")

#: the environment variable that makes ``meshkit serve`` a supervised child
CHILD_ENV = "_MESHKIT_CHILD"
#: a child that ran this long before it died is restarted without back-off
STABLE_S = 10.0
#: the longest wait before a child that keeps dying is started again
MAX_BACKOFF_S = 10.0
#: after the grace, how long children may take to close before they are killed
KILL_AFTER_S = 10.0
#: how long the first start of all children may take before the parent gives up
START_TIMEOUT_S = 120.0
_TICK_S = 0.1
#: the relay child's index (not a router: it holds no connections)
RELAY_INDEX = -1
#: AF_UNIX paths are at most 108 bytes on Linux, 104 on macOS (NUL included)
MAX_UNIX_PATH = 103
#: in the run directory: where the relay child answers ``GET /metrics``
RELAY_METRICS_SOCKET = "kv-relay.sock"


@dataclass(frozen=True)
class ChildPlace:
    """What a supervised child is told by its parent."""

    fd: int
    index: int
    count: int
    run_dir: str
    #: write one byte here once accepting
    ready_fd: int
    #: reads EOF when the parent is gone
    lifeline_fd: int
    #: started again after a crash (it copies its siblings' fleet)
    restarted: bool = False
    #: the connections its siblings hand it arrive here (meshkit.server.accept)...
    inbox_fd: int = -1
    #: ...and it hands them on through these, one per child
    outbox_fds: tuple[int, ...] = ()
    #: "router" (a gateway) or "kv-relay" (the children's one KV-event relay)
    role: str = "router"
    #: where the children's KV-event relay publishes and answers replays
    kv_relay: tuple[str, str] | None = None


def child_place(environ: dict[str, str] | None = None) -> ChildPlace | None:
    """This process's place among the children, or ``None`` when not supervised."""
    raw = (os.environ if environ is None else environ).get(CHILD_ENV)
    if not raw:
        return None
    obj = json.loads(raw)
    relay = obj.get("kv_relay")
    return ChildPlace(
        int(obj["fd"]),
        int(obj["index"]),
        int(obj["count"]),
        str(obj["run_dir"]),
        int(obj["ready_fd"]),
        int(obj["lifeline_fd"]),
        bool(obj.get("restarted", False)),
        int(obj.get("inbox_fd", -1)),
        tuple(int(fd) for fd in obj.get("outbox_fds", ())),
        str(obj.get("role", "router")),
        None if relay is None else (str(relay[0]), str(relay[1])),
    )


def leave_run_dir(run_dir: str) -> None:
    """Remove what a killed parent left of the run directory. Each child unlinks its
    own sockets before trying, so the last one out finds the directory empty."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(run_dir, SHARES_FILE))  # siblings keep their mappings
    with contextlib.suppress(OSError):
        os.rmdir(run_dir)


def _name(child: _Child) -> str:
    return "the KV-event relay" if child.index == RELAY_INDEX else f"process {child.index}"


class _Child:
    __slots__ = (
        "backoff_s",
        "index",
        "lifeline_w",
        "popen",
        "ready",
        "ready_r",
        "start_after",
        "started_at",
        "starts",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.popen: subprocess.Popen[bytes] | None = None
        self.ready_r: int | None = None
        self.lifeline_w: int | None = None
        self.starts = 0
        self.ready = False
        self.started_at = 0.0
        self.start_after = 0.0
        self.backoff_s = 0.5


class Supervisor:
    """Run ``count`` children of ``argv`` (the ``meshkit`` arguments) on ``sock``.

    :param on_ready: called with the URL once every child accepts requests.
    :param kv_relay: also run the children's KV-event relay, a child of its own,
        started (and up) before them and restarted as they are.
    :param clock: monotonic seconds (tests may pass their own).
    :raises ValueError: the run directory (in ``TMPDIR``) is too long a path for
        the Unix sockets it holds.
    """

    def __init__(
        self,
        argv: Sequence[str],
        sock: Any,
        url: str,
        count: int,
        grace_s: float,
        *,
        on_ready: Callable[[str], None] | None = None,
        kv_relay: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.argv = list(argv)
        self.sock = sock
        self.url = url
        self.count = count
        self.grace_s = grace_s
        self.on_ready = on_ready
        self.clock = clock
        self.run_dir = tempfile.mkdtemp(prefix="meshkit-serve-")  # mode 0700
        # The siblings' sockets and the relay's live there (meshkit.server.peers).
        names = (f"p{count - 1}.sock", RELAY_METRICS_SOCKET, "kv.replay")
        longest = max(len(os.fsencode(os.path.join(self.run_dir, n))) for n in names)
        if longest > MAX_UNIX_PATH:
            os.rmdir(self.run_dir)
            raise ValueError(
                f"the run directory {self.run_dir} is too long a path for a Unix socket "
                f"({MAX_UNIX_PATH} bytes): set TMPDIR to a shorter directory"
            )
        #: each child's open connections, and the socket pairs that carry the
        #: connections one hands to another; held here for the gateway's life, so a
        #: connection handed to a child that dies waits for its successor
        #: (meshkit.server.accept)
        self.shares = Shares.create(os.path.join(self.run_dir, SHARES_FILE), count)
        self.inboxes = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(count)]
        self.children = [_Child(i) for i in range(count)]
        #: the KV-event relay's child and its endpoints (in the 0700 run directory)
        self.kv_endpoints = (
            f"ipc://{self.run_dir}/kv.pub",
            f"ipc://{self.run_dir}/kv.replay",
        )
        self.relay = _Child(RELAY_INDEX) if kv_relay else None
        self.restarts = 0
        self._signals: list[int] = []
        self._stopping = False
        self._announced = False
        self._exit_code = 0

    # -- children ---------------------------------------------------------------------

    @property
    def _all(self) -> list[_Child]:
        return self.children if self.relay is None else [self.relay, *self.children]

    def _start(self, child: _Child) -> None:
        r, w = os.pipe()
        life_r, life_w = os.pipe()
        place: dict[str, Any] = {
            "fd": -1,
            "index": child.index,
            "count": self.count,
            "run_dir": self.run_dir,
            "ready_fd": w,
            "lifeline_fd": life_r,
            "restarted": child.starts > 0,
        }
        if self.relay is not None:
            place["kv_relay"] = self.kv_endpoints
        if child is self.relay:
            place["role"] = "kv-relay"
            fds: tuple[int, ...] = (w, life_r)
        else:
            fd = self.sock.fileno()
            inbox = self.inboxes[child.index][0].fileno()
            outboxes = [pair[1].fileno() for pair in self.inboxes]
            place.update(fd=fd, inbox_fd=inbox, outbox_fds=outboxes)
            fds = (fd, w, life_r, inbox, *outboxes)
        env = {**os.environ, CHILD_ENV: json.dumps(place)}
        try:
            # The arguments are this process's own command line, run again.
            child.popen = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", "meshkit", *self.argv],
                env=env,
                pass_fds=fds,
                # Signals come from this parent only: a terminal's Ctrl-C reaches the
                # whole foreground group, and the children would each see it first.
                start_new_session=True,
            )
        except BaseException:
            os.close(r)
            os.close(life_w)
            raise
        finally:
            os.close(w)
            os.close(life_r)
        child.ready_r = r
        child.lifeline_w = life_w
        child.starts += 1
        child.ready = False
        child.started_at = self.clock()

    def _reap(self, child: _Child) -> int | None:
        """The child's exit code once it has exited (its pipe closed), else None."""
        p = child.popen
        if p is None:
            return None
        code = p.poll()
        if code is None:
            return None
        for fd in (child.ready_r, child.lifeline_w):
            if fd is not None:
                os.close(fd)
        child.ready_r = child.lifeline_w = None
        child.popen = None
        if child.index >= 0:
            # Its connections are gone: the siblings no longer leave any to it.
            self.shares.set_open(child.index, ABSENT)
        return code

    def _read_ready(self) -> None:
        pending = {c.ready_r: c for c in self._all if c.ready_r is not None and not c.ready}
        if not pending:
            return
        readable, _, _ = select.select(list(pending), [], [], 0)
        for fd in readable:
            child = pending[fd]
            data = os.read(fd, 1)
            if data:
                child.ready = True
            # EOF without a byte: the child died before it was up; _reap sees it.

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self, sig: int, _frame: object) -> None:
        self._signals.append(sig)

    def _forward(self, sig: int) -> None:
        for c in self._all:
            if c.popen is not None and c.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.popen.send_signal(sig)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT; returns the exit code."""
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            return self._loop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._stop_all(force=True)
            self.close()

    def _loop(self) -> int:
        # The relay first: a router that joins asks it for what its engines sent.
        for c in self.children if self.relay is None else [self.relay]:
            self._start(c)
        started = self.clock()
        deadline: float | None = None
        while True:
            while self._signals:
                sig = self._signals.pop(0)
                if sig == signal.SIGHUP:
                    log.info("SIGHUP: every process reloads its configuration")
                    self._forward(signal.SIGHUP)
                    continue
                if not self._stopping:
                    self._stopping = True
                    # No new connection: the children close theirs as they drain.
                    self.sock.close()
                    deadline = self.clock() + self.grace_s + KILL_AFTER_S
                self._forward(sig)  # a second SIGINT: the children cut their grace
            self._read_ready()
            now = self.clock()
            for c in self._all:
                code = self._reap(c)
                if code is None:
                    continue
                if self._stopping:
                    continue
                if not self._announced:
                    # A child that cannot start: the others would not either.
                    log.error("%s exited with code %d while starting", _name(c), code)
                    self._stopping = True
                    self._forward(signal.SIGTERM)
                    deadline = now + self.grace_s + KILL_AFTER_S
                    self._exit_code = code or 1
                    continue
                lived = now - c.started_at
                c.backoff_s = 0.5 if lived >= STABLE_S else min(c.backoff_s * 2, MAX_BACKOFF_S)
                c.start_after = now + (0.0 if lived >= STABLE_S else c.backoff_s)
                self.restarts += 1
                log.warning(
                    "%s exited with code %d after %.1f s; restarting", _name(c), code, lived
                )
            if not self._stopping:
                # Once the gateway is up, a router restarts whether the relay is up
                # or not (it then takes its events when the relay is back).
                routers = self._announced or self.relay is None or self.relay.ready
                for c in self._all:
                    if c.popen is None and now >= c.start_after and (routers or c is self.relay):
                        self._start(c)
                if not self._announced and all(c.ready for c in self.children):
                    self._announced = True
                    if self.on_ready is not None:
                        self.on_ready(self.url)
                if not self._announced and now - started > START_TIMEOUT_S:
                    log.error("the processes did not start within %.0f s", START_TIMEOUT_S)
                    self._stopping = True
                    self._exit_code = 1
                    self._forward(signal.SIGTERM)
                    deadline = now + KILL_AFTER_S
            if self._stopping:
                if all(c.popen is None for c in self._all):
                    return self._exit_code
                if deadline is not None and now >= deadline:
                    log.warning("processes still running after the grace: killed")
                    self._stop_all(force=True)
            time.sleep(_TICK_S)

    def close(self) -> None:
        """Release what the children shared: the counts, the inboxes, the run directory."""
        self.shares.close()
        for pair in self.inboxes:
            for end in pair:
                end.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_all(self, *, force: bool) -> None:
        for c in self._all:
            p = c.popen
            if p is None:
                continue
            if p.poll() is None and force:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
            self._reap(c)
