"""Child processes of a command under test: which it started, and whether they outlived it."""

import os
import re
import signal
import subprocess
import threading
import time


def children(pid):
    """The process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid:
            found.append(int(entry))
    return sorted(found)


def descendants(pid):
    """Every process below ``pid``: its children, theirs, and so on."""
    found = []
    for child in children(pid):
        found += [child] + descendants(child)
    return found


def wait_for_children(pid, poll_s=0.05):
    """The children of ``pid`` once it has one (polled), or [] once it has ended."""
    while running(pid):
        found = children(pid)
        if found:
            return found
        time.sleep(poll_s)
    return []


def wait_for_descendants(pid, count, timeout_s=300, poll_s=0.05):
    """The processes below ``pid`` once there are ``count`` of them at once (polled: a short-lived child, such as a
    probe run before the one awaited, does not end the wait), or whatever is there once ``pid`` has ended or
    ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    found = descendants(pid)
    while len(found) < count and running(pid) and time.monotonic() < deadline:
        time.sleep(poll_s)
        found = descendants(pid)
    return found


class OutputReader(threading.Thread):
    """Reads a piped output to its end in a thread, so that a full pipe never blocks the process writing it."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self):
        for line in iter(self.stream.readline, ""):
            self.lines.append(line)

    def text(self) -> str:
        self.join()
        return "".join(self.lines)


def start_reading_until(command, pattern, stderr, env=None, stdin=None):
    """Start ``command`` with its output piped and read it up to its first line in which the regular expression
    ``pattern`` is found (``stderr=subprocess.STDOUT``: in its output or its log); returns the process, the lines
    read (all of them when no such line came) and an :class:`OutputReader` of the rest."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, stdin=stdin, text=True, env=env)
    lines = []
    for line in iter(process.stdout.readline, ""):
        lines.append(line)
        if re.search(pattern, line):
            break
    return process, lines, OutputReader(process.stdout)


def process_state(pid):
    """(parent pid, state letter) from /proc/PID/stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def parent_of(pid):
    state = process_state(pid)
    return state[0] if state else None


def running(pid):
    state = process_state(pid)
    return state is not None and state[1] != "Z"  # a zombie has ended


def finish(process, pids, reader=None):
    """The rest of the output, once the process has ended, and which of ``pids`` were still running 10 s later.
    Those (what the test reports as a failure) are then killed, so that no orphan outlives the test; orphans
    hold the output pipe open, so it is read in a thread (``reader``, else a new one), not waited for."""
    reader = reader or OutputReader(process.stdout)
    survivors = list(pids)
    try:
        process.wait(timeout=600)
        deadline = time.monotonic() + 10  # a data-loader worker ends itself within seconds of its parent
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in pids if running(pid)]
    finally:
        for pid in [process.pid] + pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    return reader.text(), survivors
