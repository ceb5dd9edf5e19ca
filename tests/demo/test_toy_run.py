"""A killed test run (or demo) left the fairseq-train of a fixture running on its own; the
commands toy.run starts end with the process that started them."""

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO
from tests.processes import running, wait_for_children

STARTS_A_CHILD = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from fastgen_demo import toy; "
                  "toy.run([sys.executable, '-c', 'import time; time.sleep(300)'])")


def test_a_command_ends_with_the_process_that_ran_it():
    parent = subprocess.Popen([sys.executable, "-c", STARTS_A_CHILD])
    child = None
    try:
        [child] = wait_for_children(parent.pid)
        parent.send_signal(signal.SIGKILL)  # as a killed pytest: no finally block, no cleanup of its own
        parent.wait(timeout=60)
        deadline = time.monotonic() + 30
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(child), "the command outlived the process that started it"
    finally:
        for pid in (parent.pid, child):
            if pid is not None and running(pid):
                os.kill(pid, signal.SIGKILL)
