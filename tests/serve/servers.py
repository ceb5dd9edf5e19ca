"""fastgen-serve processes on the toy model, on ephemeral loopback ports; reading their answers and metrics."""

import json
import re
import signal
import sys
from pathlib import Path

from tests.processes import start_reading_until

SENTENCES = 48  # test sentences the server tests send (the toy test set's first ones)


def serve_command():
    script = Path(sys.executable).parent / "fastgen-serve"
    return [str(script)] if script.exists() else [sys.executable, "-c",
                                                  "from fairseq_fastgen.serve import cli_main; cli_main()"]


def model_options(toy_model, plugin_dir):
    return [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--user-dir", plugin_dir, "--cpu",
            "--source-lang", "en", "--target-lang", "fr"]


class Server:
    """A fastgen-serve process; ``url`` once it listens.  Its log goes to a file (read on failure)."""

    def __init__(self, toy_model, plugin_dir, tmp_path, *options):
        self.log_path = tmp_path / "server.log"
        command = serve_command() + model_options(toy_model, plugin_dir) + ["--port", "0", *options]
        with open(self.log_path, "w") as log:
            self.process, lines, self.reader = start_reading_until(command, r"listening on http://", log)
        found = re.search(r"listening on (http://[0-9.]+:\d+)", "".join(lines))
        if found is None:
            self.process.kill()
            raise AssertionError(f"the server did not start: {''.join(lines)}{self.log_path.read_text()[-3000:]}")
        self.url = found.group(1)

    def stop(self, signum=signal.SIGTERM, timeout=120):
        """Send ``signum`` (None: it was sent already); the exit status and the rest of its output."""
        if signum is not None and self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            status = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return status, self.reader.text()

    def log(self) -> str:
        return self.log_path.read_text()


def metric_values(text):
    from fairseq_fastgen.serve.metrics import parse

    return parse(text)


def error_line(body: bytes) -> str:
    """The message of a one-line JSON error body."""
    assert body.count(b"\n") <= 1, body
    return json.loads(body)["error"]
