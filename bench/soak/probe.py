"""What the soak samples each iteration: per process of the application on this machine (engine
replicas, TP workers, the ingress) its resident and anonymous memory, GPU memory where there is a
GPU, open file descriptors and threads (all read from /proc, Linux); per engine replica its free KV
pages (from /metrics)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Proc:
    role: str  # engine | tp_worker | ingress
    pid: int


def _processes() -> dict[int, tuple[int, str]]:
    """Every process on the machine: pid -> (parent pid, command line)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out[int(entry)] = (ppid, title)
    return out


def _descendants(root: int, procs: dict[int, tuple[int, str]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def app_processes(app: str, root: int | None = None) -> list[Proc]:
    """The application's processes on this machine, found by the titles Ray gives them
    (`ray::ServeReplica:<app>:<deployment>`, `ray::TPWorker`); with `root`, only descendants of that
    process (the one that started the Ray cluster: other clusters on the machine may serve an app of
    the same name). A TP worker counts when the raylet that started it also started one of the
    application's engine replicas."""
    procs = _processes()
    if root is not None:
        mine = _descendants(root, procs)
        procs = {pid: p for pid, p in procs.items() if pid in mine}
    found, raylets = [], set()
    for pid, (ppid, title) in procs.items():
        if f"ServeReplica:{app}:EngineServer" in title:
            found.append(Proc("engine", pid))
            raylets.add(ppid)
        elif f"ServeReplica:{app}:Ingress" in title:
            found.append(Proc("ingress", pid))
    found += [Proc("tp_worker", pid) for pid, (ppid, title) in procs.items()
              if title.startswith("ray::TPWorker") and ppid in raylets]
    return sorted(found, key=lambda q: (q.role, q.pid))


def _gpu_mb() -> dict[int, float]:
    """GPU memory per process id (nvidia-smi), {} without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and used.strip().isdigit():
            usage[int(pid)] = usage.get(int(pid), 0.0) + float(used)
    return usage


def _status(pid: int) -> dict[str, float]:
    """VmRSS and RssAnon (MB) and Threads of /proc/<pid>/status."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0]) / 1024
            elif name == "Threads":
                fields[name] = int(value)
    return fields


def sample_processes(procs: list[Proc]) -> dict[str, dict[str, float]]:
    """`role:pid` -> rss_mb, anon_mb, gpu_mb, fds, threads (a process that went away is left out)."""
    gpu = _gpu_mb()
    out = {}
    for proc in procs:
        try:
            status = _status(proc.pid)
            out[f"{proc.role}:{proc.pid}"] = {
                "rss_mb": status["VmRSS"], "anon_mb": status["RssAnon"], "gpu_mb": gpu.get(proc.pid, 0.0),
                "fds": len(os.listdir(f"/proc/{proc.pid}/fd")), "threads": status["Threads"]}
        except (OSError, KeyError):
            continue
    return out


def free_pages(client: httpx.Client, url: str) -> dict[str, float]:
    """Free and total KV pages per engine replica, as /metrics reports them."""
    text = client.get(url + "/metrics").text
    pages: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("blockserve_kv_pages_free", "blockserve_kv_pages_total"):
            for s in family.samples:
                key = family.name.rsplit("_", 1)[-1]
                pages[f"{key}:{s.labels.get('replica', '')}"] = s.value
    return pages
