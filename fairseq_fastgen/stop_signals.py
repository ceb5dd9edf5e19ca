"""SIGTERM and SIGINT as an exception, so that a run with worker processes ends them and reports.

By default SIGTERM ends a Python process at once: no ``finally`` block runs, so
worker processes it started are left running (orphans), and what was finished is
never reported.  Inside :class:`StopSignals` the first SIGTERM or SIGINT raises
:class:`Stopped` in the main thread instead; the code around stops its workers
on the way out and says what was finished.  Further signals are ignored until the
block ends, so that cleaning up is not cut short.

Code that must not be cut in the middle (writing one batch of output lines and
counting it) runs in :meth:`StopSignals.held`: a signal arriving there raises
when the block ends.
"""

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """The process received SIGTERM or SIGINT.  ``finished``: what was finished, where the code it went through
    on its way out knew (raised again with it: ``raise Stopped(stop.signum, finished=...)``).

    Like KeyboardInterrupt, not an ``Exception``: code that handles any error (``logging`` prints a failed
    write of a log record and goes on) must not swallow it, or the stop is lost."""

    def __init__(self, signum: int, finished: Optional[str] = None):
        self.signum = signum
        self.finished = finished
        super().__init__(f"stopped by {self.name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's status for a process ended by that signal


class StopSignals:
    """While active (``with StopSignals() as signals:``), SIGTERM and SIGINT raise :class:`Stopped`."""

    def __init__(self):
        self.received = None  # the first signal's number
        self.holding = False
        self.previous = {}

    def __enter__(self):
        self.previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type, exc, tb):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False

    def _handle(self, signum, frame):
        if self.received is not None:
            return  # already stopping
        self.received = signum
        if not self.holding:
            raise Stopped(signum)

    @contextlib.contextmanager
    def held(self):
        """Run the block whole; a signal received meanwhile raises :class:`Stopped` after it."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.received is not None:
            raise Stopped(self.received)


def exit_stopped(program: str, stop, finished: str):
    """End the process after ``stop`` (a :class:`Stopped`, or any exception with an ``exit_status``): one line on
    stderr, ``PROGRAM: what stopped it; what was finished``, and the stop's exit status.

    The process ends here, without Python's interpreter shutdown: that shutdown ends daemon threads wherever
    they are, and fairseq's background batch reader (a daemon thread feeding ``--data-buffer-size`` batches)
    may be in the middle of unpickling a batch from its data-loader worker, freeing torch tensors; a thread
    ended there aborts the whole process ("terminate called without an active exception", status -6, once in
    about twenty stops).  So the child processes are ended and joined, the output streams and log handlers
    flushed, and the process exits at once.  Callers flush their own output files first."""
    sys.stdout.flush()
    print(f"{program}: {stop}; {finished}", file=sys.stderr, flush=True)
    end_child_processes()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(stop.exit_status)


def end_child_processes(timeout_s: float = 10.0):
    """Terminate the process's multiprocessing children (data-loader and post-processing workers) and wait
    for them, as ``multiprocessing`` does at a normal exit."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)


def ignore_in_worker():
    """In a forked worker: SIGTERM back to its default (the parent ends workers with it), SIGINT ignored
    (a Ctrl-C reaches the whole process group; the parent alone decides, and ends the workers)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
