"""Child processes of a command under test: which it started, and whether they outlived it."""

import os
import signal
import threading


def children(pid):
    """The process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid:
            found.append(int(entry))
    return sorted(found)


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


def finish(process, pids):
    """The rest of the output, once the process has ended, and which of ``pids`` were still running then.
    Those (what the test reports as a failure) are then killed, so that no orphan outlives the test; orphans
    hold the output pipe open, so it is read in a thread, not waited for."""
    rest = []
    reader = threading.Thread(target=lambda: rest.append(process.stdout.read()))
    reader.start()
    survivors = list(pids)
    try:
        process.wait(timeout=600)
        survivors = [pid for pid in pids if running(pid)]
    finally:
        for pid in [process.pid] + pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        reader.join()
    return "".join(rest), survivors
