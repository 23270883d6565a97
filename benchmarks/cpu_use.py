"""CPU time spent during a benchmark level, by process and by thread, from /proc (Linux).

Answers "which process is the bound" when the GPU is idle part of the time: the web server (this
process in app mode), the engine process, its preparer workers, or the benchmark's own clients.
"""

import collections
import os
import re
import resource
import threading
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str] | None:
    try:
        with open(path) as file:
            return file.read().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
    except OSError:
        return None


def _cpu_seconds(path: str) -> float:
    fields = _stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / TICKS if fields else 0.0  # utime + stime


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat_fields(f"/proc/{entry}/stat") if entry.isdigit() else None
        if fields and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _own_threads() -> dict[str, float]:
    """CPU seconds per thread of this process, by Python thread name (numbers folded: "AnyIO worker thread")."""
    names = {thread.native_id: re.sub(r"[-_ ]?\d+", "", thread.name) for thread in threading.enumerate()}
    used: dict[str, float] = collections.Counter()
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        used[names.get(int(tid), "other (not Python)")] += _cpu_seconds(f"/proc/self/task/{tid}/stat")
    return used


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process `pid`, all its threads together."""
    return _cpu_seconds(f"/proc/{pid}/stat")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuUse:
    """Cores used from its creation to `cores()`: this process, the engine process and its preparers, and
    any other groups of processes named."""

    def __init__(self, engine_pid: int, clients: tuple[int, ...] = (), serving: dict[str, tuple[int, ...]] | None = None):
        self.engine_pid = engine_pid
        self.serving = serving or {}  # more processes by group: {"web_processes": pids, "fronts": pids}
        # The engine's children are its preparers (with --in-process-engine, the clients' processes too).
        self.workers = [pid for pid in _children(engine_pid) if pid not in clients]
        self.started = time.time()
        self.start = self._read()

    def _read(self) -> dict:
        return {
            "this_process": own_cpu_seconds(),
            "engine_process": process_cpu_seconds(self.engine_pid) if self.engine_pid != os.getpid() else 0.0,
            "preparers": sum(process_cpu_seconds(pid) for pid in self.workers),
            **{group: sum(process_cpu_seconds(pid) for pid in pids) for group, pids in self.serving.items()},
            "threads": _own_threads(),
        }

    def cores(self) -> dict:
        """Average cores per process group, and this process's busiest threads."""
        end, elapsed = self._read(), time.time() - self.started
        used = {key: round((end[key] - self.start[key]) / elapsed, 2) for key in end if key != "threads"}
        threads = {name: (seconds - self.start["threads"].get(name, 0.0)) / elapsed for name, seconds in end["threads"].items()}
        used["this_process_threads"] = {name: round(cores, 2) for name, cores in
                                        sorted(threads.items(), key=lambda item: -item[1])[:5] if cores >= 0.01}
        return used
