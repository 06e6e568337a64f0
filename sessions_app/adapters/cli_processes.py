"""The processes of one Claude Code run, held so that none outlives it.

Claude Code runs each shell command in a session of its own, and a command may clear its
environment and detach (`env -i job &`): neither the CLI's process group nor a variable in
the environment holds such a process. What a child cannot shed, best first:

1. a cgroup (v2, where this process may make one: as root, or in a delegated subtree): the
   launcher enters `paperclip-cli-<mark>` beside this process's own cgroup before it starts
   the CLI, every descendant is born in it, and `cgroup.kill` ends them all at once;
2. otherwise the process tree recorded as it grows (Linux's /proc, polled while the CLI
   runs): its descendants, their sessions and process groups, and what carries the run's
   mark. The launcher makes the CLI a child subreaper, so a command whose parent exits is
   adopted by the CLI, not by init, and is still found under it;
3. and always the CLI's own process group.

Each run is recorded in `PAPERCLIP_HOME/cli-runs/<host>/<mark>.json` (its run, its worker
process, its cgroup and the processes found), so that the runs of a worker that died (a
SIGKILL, a deploy) are found and killed by the maintenance pass on that host
(`cli_orphans_kill`): a process is killed only when its start time still matches, never a
stranger that reused its pid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from django.conf import settings

logger = logging.getLogger(__name__)

CGROUP_PREFIX = "paperclip-cli-"
TRACK_EVERY_SECONDS = 0.05
# The variable that marks every process of one CLI run (what a command does not clear).
RUN_MARK = "PAPERCLIP_CLI_RUN"


def records_dir() -> Path:
    """This host's run records: a shared PAPERCLIP_HOME keeps each host's apart."""
    return Path(settings.PAPERCLIP_HOME) / "cli-runs" / socket.gethostname()


# --- /proc --------------------------------------------------------------------------------


def process_stat(pid: int) -> tuple[int, int, int, int] | None:
    """(parent, process group, session, start time) of a live process, None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # the command name may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None  # exited, not yet reaped: nothing left to kill
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def started_at(pid: int) -> int | None:
    stat = process_stat(pid)
    return stat[3] if stat else None


def all_processes() -> dict[int, tuple[int, int, int, int]]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := process_stat(int(entry.name))) is not None:
            found[int(entry.name)] = stat
    return found


def marked_processes(mark: bytes) -> list[int]:
    """The processes whose environment holds `mark` (Linux's /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def kill_if_same(pid: int, start: int) -> None:
    """SIGKILL `pid` if it is still the process that started at `start`."""
    if started_at(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --- cgroup v2 ----------------------------------------------------------------------------


def cgroup_base() -> Path | None:
    """The cgroup v2 directory this process is in, when it may make cgroups under it (None:
    no cgroup v2 mounted, or no write access)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] != ["cgroup2"] or len(fields) < 5:
            continue
        root, mount = fields[3], fields[4].replace("\\040", " ")
        if own != root and not own.startswith(root.rstrip("/") + "/"):
            continue
        base = Path(mount) / own[len(root) :].lstrip("/")
        # Making a cgroup needs the directory; moving the launcher into it needs the
        # cgroup.procs of the common ancestor, this one.
        if (base / "cgroup.procs").is_file() and os.access(base, os.W_OK) and os.access(base / "cgroup.procs", os.W_OK):
            return base
    return None


def cgroup_kill(path: Path) -> None:
    """End every process in the cgroup and remove it (as it is: a gone cgroup is done)."""
    try:
        (path / "cgroup.kill").write_text("1")
    except FileNotFoundError:
        if not path.exists():
            return
        # A kernel before 5.14: freeze it (no fork races the kill), kill each, thaw.
        _cgroup_write(path / "cgroup.freeze", "1")
        for _ in range(10):
            pids = _cgroup_pids(path)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _cgroup_write(path / "cgroup.freeze", "0")
    except OSError:
        logger.warning("Could not kill the processes of cgroup %s", path, exc_info=True)
    deadline = time.monotonic() + 5
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:  # left for the next sweep
                logger.warning("The cgroup %s is still busy after its kill", path)
                return
            time.sleep(0.02)


def _cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _cgroup_write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


# --- one run ------------------------------------------------------------------------------


class RunProcesses:
    """The processes of one CLI run: contained in a cgroup, or tracked from /proc as they
    appear (`track`), and killed together (`kill`); `close` kills them and forgets the run."""

    def __init__(self, *, mark: str, run_id: str, pidfile: Path, cgroup: Path | None) -> None:
        self.mark = mark
        self.run_id = run_id
        self.pidfile = pidfile
        self.cgroup = cgroup
        self.tracked: dict[int, int] = {}  # pid -> start time
        self.worker = (os.getpid(), started_at(os.getpid()))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tracker: threading.Thread | None = None

    @classmethod
    def start(cls, *, mark: str, run_id: str) -> RunProcesses:
        """A run's processes, in a new cgroup where this host offers one; recorded. The
        launcher's pid is written beside the record, out of the agent's folders (which go
        when an agent is removed entirely, even under a run in flight: `agent_files`)."""
        pidfile = records_dir() / f"{mark}.pid"
        cgroup = None
        if (base := cgroup_base()) is not None:
            try:
                (base / f"{CGROUP_PREFIX}{mark}").mkdir()
                cgroup = base / f"{CGROUP_PREFIX}{mark}"
            except OSError:
                logger.warning("Could not make a cgroup under %s; tracking the process tree", base, exc_info=True)
        processes = cls(mark=mark, run_id=run_id, pidfile=pidfile, cgroup=cgroup)
        processes.record()
        return processes

    @property
    def record_path(self) -> Path:
        return records_dir() / f"{self.mark}.json"

    def launcher_environment(self) -> dict[str, str]:
        """What the launcher needs: where to say its pid, and the cgroup to enter."""
        return {"PAPERCLIP_CLI_PIDFILE": str(self.pidfile), "PAPERCLIP_CLI_CGROUP": str(self.cgroup or "")}

    def record(self) -> None:
        record = {
            "mark": self.mark,
            "run_id": self.run_id,
            "worker": list(self.worker),
            "pidfile": str(self.pidfile),
            "cgroup": str(self.cgroup) if self.cgroup else None,
            "tracked": sorted(self.tracked.items()),
        }
        path = self.record_path
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps(record))
        os.replace(staged, path)

    @classmethod
    def from_record(cls, record: dict) -> RunProcesses:
        processes = cls(
            mark=record["mark"],
            run_id=record.get("run_id") or "",
            pidfile=Path(record["pidfile"]),
            cgroup=Path(record["cgroup"]) if record.get("cgroup") else None,
        )
        processes.worker = tuple(record["worker"])
        processes.tracked = {int(pid): int(start) for pid, start in record.get("tracked") or []}
        return processes

    def leader(self) -> int | None:
        """The launcher's pid (the CLI's, its process group's and its session's id)."""
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    # Tracking, when there is no cgroup.

    def track(self) -> None:
        """Without a cgroup: record the run's processes as they appear, until `close`."""
        if self.cgroup is None and self._tracker is None and Path("/proc/self/stat").exists():
            self._tracker = threading.Thread(target=self._track, name=f"cli-track-{self.mark}", daemon=True)
            self._tracker.start()

    def take_stock(self) -> None:
        """Without a cgroup, find the run's processes now: after each of the CLI's tools (a
        PostToolUse hook, which the CLI waits for), while what the tool left running is
        under the CLI (once the CLI exits, init adopts it). Found then, a job that detached
        (`env -i job &`) is found however long the tracker's next poll, or the engine's
        reading of the CLI's messages, waits for the CPU."""
        if self.cgroup is None and self._tracker is not None:
            self.scan()

    def _track(self) -> None:
        while not self._stop.wait(TRACK_EVERY_SECONDS):
            self.scan()

    def scan(self) -> None:
        """Add to the tracked processes every one that is the run's: the launcher, each
        child of a tracked process, each member of a tracked leader's session or group, and
        whatever carries the run's mark."""
        leader = self.leader()
        if leader is None:
            return
        with self._lock:
            before = len(self.tracked)
            processes = all_processes()
            if leader in processes and leader not in self.tracked:
                self.tracked[leader] = processes[leader][3]
            alive = {pid for pid, start in self.tracked.items() if processes.get(pid, (0, 0, 0, -1))[3] == start}
            marked = set(marked_processes(f"{RUN_MARK}={self.mark}".encode()))
            grew = True
            while grew:
                grew = False
                for pid, (parent, group, session, start) in processes.items():
                    if pid in self.tracked:
                        continue
                    if parent in alive or group in alive or session in alive or pid in marked:
                        self.tracked[pid] = start
                        alive.add(pid)
                        grew = True
            if len(self.tracked) != before:
                self.record()

    # Ending.

    def kill(self) -> None:
        """End every process of the run (its worker's own threads go on)."""
        if self.cgroup is not None:
            try:
                (self.cgroup / "cgroup.kill").write_text("1")
                return
            except FileNotFoundError:
                if not self.cgroup.exists():
                    return
            except OSError:
                logger.warning("Could not kill through cgroup %s", self.cgroup, exc_info=True)
        leader = self.leader()
        if leader is not None and leader in self.tracked and started_at(leader) == self.tracked[leader]:
            try:
                os.killpg(leader, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # Twice: a process the first round missed may have forked meanwhile.
        for _ in range(2):
            if self.worker[0] == os.getpid():
                self.scan()
            for pid, start in list(self.tracked.items()):
                kill_if_same(pid, start)

    def close(self) -> None:
        """Kill what is left of the run, then forget it: its cgroup, pidfile and record."""
        self._stop.set()
        if self.cgroup is None and self.worker[0] == os.getpid():
            self.scan()  # a last look: what started since the tracker's last poll
        if self._tracker is not None:
            self._tracker.join(timeout=5)
        self.kill()
        if self.cgroup is not None:
            cgroup_kill(self.cgroup)
        self.pidfile.unlink(missing_ok=True)
        self.record_path.unlink(missing_ok=True)

    def worker_alive(self) -> bool:
        pid, start = self.worker
        return start is not None and started_at(pid) == start


# --- runs whose worker is gone ------------------------------------------------------------


def cli_orphans_kill(*, ended: Callable[[Iterable[str]], set[str]] | None = None) -> int:
    """Kill the processes of this host's recorded runs whose worker process is gone, or
    (with `ended`, which names the given run ids that are no longer running) whose run
    ended; returns how many runs' processes were ended. A record of a live worker's
    running run is left alone; one that cannot be read is removed."""
    runs = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            runs.append(RunProcesses.from_record(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("Removing the unreadable Claude Code run record %s", path)
            path.unlink(missing_ok=True)
    living = [run for run in runs if run.worker_alive()]
    over = ended([run.run_id for run in living if run.run_id]) if ended is not None and living else set()
    orphans = [run for run in runs if not run.worker_alive() or run.run_id in over]
    for run in orphans:
        logger.warning("Killing the Claude Code processes of run %s: its worker is gone or the run ended", run.run_id)
        run.close()
    return len(orphans)
