"""The memory of a process tree, read from Linux's ``/proc``: shared by the benchmarks.

Two measures per process:

- **RSS** (resident set size): every page the process has in memory, shared ones
  included. Summed over processes it counts a page once per process that maps it: the
  code of torch's libraries, for example, once per Python process that imports torch.
- **PSS** (proportional set size, ``/proc/PID/smaps_rollup``): each shared page divided
  among the processes that map it. Summed over processes it is the memory the tree holds
  on the machine, each page once.

:func:`run_sampled` runs a command and samples its whole tree: RSS every 0.2 s, PSS every
2 s. Reading ``smaps_rollup`` walks a process's page tables under its memory lock, about
65 ms for a 3.9 GB process on a 2-core Xeon: sampled every 0.2 s over a Flower tree it
took a quarter of a core from the run it measured, and slowed what it timed. The sampler
runs at the lowest priority (nice 19) and reports its own CPU seconds
(``Peaks.sampler_cpu``), so a table can say what the measurement cost.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Peaks", "processes", "run_sampled", "tree", "tree_rss"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, resident bytes, name).

    The name is the first word of the command line (``ray::`` workers keep Ray's title);
    for ``python -m X`` / ``python X`` it is ``X``.
    """
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        name = argv[0].decode(errors="replace") if argv and argv[0] else "?"
        if not name.startswith("ray::"):
            name = Path(name.split()[0]).name if name.strip() else "?"
            if name.startswith("python") and len(argv) > 2:  # python -m X / python X
                name = (argv[2] if argv[1] == b"-m" else argv[1]).decode(errors="replace")
                name = Path(name).name
        out[int(entry)] = (ppid, pages * _PAGE, name)
    return out


def pss(pid: int) -> int:
    """Proportional resident bytes of ``pid`` (0 if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree(pid: int, *, proportional: bool = False) -> dict[int, tuple[str, int, int]]:
    """``pid`` and its descendants: pid -> (name, RSS bytes, PSS bytes or 0)."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    out, stack = {}, [pid]
    while stack:
        p = stack.pop()
        if p in procs:
            _, rss, name = procs[p]
            out[p] = (name, rss, pss(p) if proportional else 0)
        stack.extend(children.get(p, []))
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (RSS summed)."""
    return sum(rss for _, rss, _ in tree(pid).values())


@dataclass
class Peaks:
    """The peaks of a sampled tree: whole tree and a chosen group, by RSS and by PSS."""

    rss: int = 0
    pss: int = 0
    group_rss: int = 0  # processes whose name starts with the group prefix
    group_pss: int = 0
    by_name_rss: dict[str, int] = field(default_factory=dict)  # each name's peak (summed)
    by_name_pss: dict[str, int] = field(default_factory=dict)
    sampler_cpu: float = 0.0  # CPU seconds the sampling itself took

    def sample(self, procs: dict[int, tuple[str, int, int]], group: str | None) -> None:
        """Takes one sample's sums into the peaks (a PSS of 0: not read in this sample)."""
        rss, pss_, names_rss, names_pss = 0, 0, {}, {}
        g_rss = g_pss = 0
        for name, r, p in procs.values():
            rss, pss_ = rss + r, pss_ + p
            names_rss[name] = names_rss.get(name, 0) + r
            names_pss[name] = names_pss.get(name, 0) + p
            if group and name.startswith(group):
                g_rss, g_pss = g_rss + r, g_pss + p
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss_)
        self.group_rss, self.group_pss = max(self.group_rss, g_rss), max(self.group_pss, g_pss)
        for k, v in names_rss.items():
            self.by_name_rss[k] = max(self.by_name_rss.get(k, 0), v)
        for k, v in names_pss.items():
            self.by_name_pss[k] = max(self.by_name_pss.get(k, 0), v)


def run_sampled(
    cmd: list[str],
    env: dict,
    *,
    stdout=None,
    group: str | None = None,
    every: float = 0.2,
    pss_every: float = 2.0,
) -> tuple[subprocess.CompletedProcess, Peaks, float]:
    """Runs ``cmd`` in a new session, sampling its tree's RSS every ``every`` s and its
    PSS every ``pss_every`` s (at nice 19: the sampler yields to the run it measures).

    Returns the finished process (its ``stdout`` captured as text when ``stdout`` is
    ``subprocess.PIPE``), the peaks (with the sampler's own CPU seconds), and the wall
    seconds.
    """
    peaks, done = Peaks(), threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout is not subprocess.PIPE
        else None, text=True, start_new_session=True,
    )  # fmt: skip

    def sampler():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread alone
        last_pss = -pss_every
        while not done.is_set():
            now = time.perf_counter()
            with_pss = now - last_pss >= pss_every
            if with_pss:
                last_pss = now
            peaks.sample(tree(proc.pid, proportional=with_pss), group)
            peaks.sampler_cpu = time.thread_time()
            time.sleep(every)

    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    out, _ = proc.communicate()
    done.set()
    t.join()
    wall = time.perf_counter() - t0
    return subprocess.CompletedProcess(cmd, proc.returncode, out), peaks, wall
