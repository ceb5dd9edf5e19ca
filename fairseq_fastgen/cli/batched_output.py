"""fairseq-generate and fairseq-interactive stopped by SIGTERM or SIGINT between whole answers.

Stock, SIGTERM ends either command at once: the lines still in the output
buffer are lost, the last one written may stop in the middle, and the
data-loader worker processes run on until they notice their parent is gone;
SIGINT ends them with a KeyboardInterrupt traceback.

Under the plugin the run is inside :func:`stopped_between_batches`: SIGTERM and
SIGINT raise :class:`~fairseq_fastgen.stop_signals.Stopped`, and what the run
prints goes to a :class:`BatchedOutput`, which holds the lines of the batch being
printed and writes them to the real output, whole, when the next batch starts
(fairseq-generate: its generator is called again; fairseq-interactive: it asks
for more input lines) or the run ends.  A stop drops the lines held: the output
holds whole batches only, every line of every sentence in them.  One line on
stderr then says what stopped the run and how many sentences were written, and
the process exits with status 128 + the signal.  Its data-loader workers
(daemon processes) are ended by ``multiprocessing`` as it exits.
"""

import contextlib
import fileinput
import io

from fairseq_fastgen.stop_signals import StopSignals, Stopped, exit_stopped


class WrittenTally:
    """How many sentences were written whole, for the report of a run that stopped early."""

    def __init__(self, total=None):
        self.written = 0
        self.total = total  # sentences of the split, once it is loaded

    def summary(self) -> str:
        if self.total is None:
            return "stopped before the data was loaded; no sentence was written"
        return (f"{self.written} of {self.total} sentences were written, each with all its lines; "
                f"the other {self.total - self.written} were not")


class AnsweredTally(WrittenTally):
    """fairseq-interactive's tally: the total is the input lines read so far (``lines_read()``), counted as each
    is read, not when its buffer is handed over: a stop while a buffer fills counts the lines already in it."""

    def __init__(self, lines_read):
        self.written = 0
        self.lines_read = lines_read

    @property
    def total(self) -> int:
        return self.lines_read()

    def summary(self) -> str:
        return (f"the answers to {self.written} of the {self.total} input lines read were written, each with all "
                f"its lines; the other {self.total - self.written} lines were not answered")


class BatchedOutput(io.TextIOBase):
    """A text file that writes what it is given a batch at a time (see the module's docstring)."""

    def __init__(self, output_file, signals: StopSignals, tally: WrittenTally):
        self.output_file, self.signals, self.tally = output_file, signals, tally
        self.held = []  # text of the batch being printed
        self.batch_sentences = 0  # sentences of that batch
        self.passing_through = False  # after the run: written at once

    def writable(self):
        return True

    def write(self, text):
        if self.passing_through:
            return self.output_file.write(text)
        self.held.append(text)
        return len(text)

    def start_batch(self, sentences: int):
        """The previous batch is printed whole: write it; the next one has ``sentences``."""
        self.end_batch()
        self.batch_sentences = sentences

    def end_batch(self):
        with self.signals.held():  # written and counted together, or neither
            self.output_file.write("".join(self.held))
            self.output_file.flush()
            self.held.clear()
            self.tally.written += self.batch_sentences
            self.batch_sentences = 0

    def close_batches(self):
        """The run has ended (a stop, an error): drop what is held; every later write goes out at once (a log
        handler that the run set up may still hold this file)."""
        self.held.clear()
        self.passing_through = True


@contextlib.contextmanager
def stopped_between_batches(program: str, output_file, tally: WrittenTally):
    """Run the block with SIGTERM and SIGINT raising ``Stopped``; yields the :class:`BatchedOutput` the run prints
    to.  At the end of the block its last batch is written; a stop drops the batch being printed instead,
    reports on stderr and exits with the stop's status."""
    with StopSignals() as signals:
        output = BatchedOutput(output_file, signals, tally)
        try:
            yield output
            output.end_batch()
        except Stopped as stop:
            output.close_batches()
            output_file.flush()
            exit_stopped(program, stop, tally.summary())
        finally:
            output.close_batches()


class CountedLines:
    """fairseq-interactive's ``buffered_read`` (``fairseq_cli.interactive``: the same buffers of stripped lines),
    counting each line as it is read: fairseq's holds a buffer's lines until it is full, out of any count."""

    def __init__(self):
        self.lines_read = 0

    def buffered_read(self, input, buffer_size):
        buffer = []
        with fileinput.input(files=[input], openhook=fileinput.hook_encoded("utf-8")) as lines:
            for line in lines:
                self.lines_read += 1
                buffer.append(line.strip())
                if len(buffer) >= buffer_size:
                    yield buffer
                    buffer = []
        if buffer:
            yield buffer


def answered_buffers(buffered_read, output: BatchedOutput):
    """fairseq-interactive's ``buffered_read(input, buffer_size)`` for a run that prints to ``output``: each buffer
    of input lines is a batch, printed whole when the run asks for the next buffer (or the input ends)."""

    def read(input, buffer_size):
        for buffer in buffered_read(input, buffer_size):
            output.start_batch(len(buffer))
            yield buffer
            output.end_batch()  # the answers to this buffer are printed: fairseq asks for more input

    return read
