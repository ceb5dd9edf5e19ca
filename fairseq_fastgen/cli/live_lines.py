"""fairseq-interactive with a streaming decoder: input lines enter the stream as they arrive.

Stock fairseq-interactive reads ``--buffer-size`` lines, translates them, prints the answers and only then
reads on; with a streaming decoder each such block would be a pool of its own, filled and drained alone.
With ``--decoder greedy-stream``, ``blockwise-stream``, ``var-stream`` or ``fixed-stream`` the plugin gives
fairseq-interactive's loop a :class:`LiveLines` instead:

* a thread reads the input, at most ``--buffer-size`` lines ahead of the stream (a line counts as waiting
  until the stream admits it, or until it is refused as too long);
* fairseq's loop is handed one line at a time (``buffered_read``), batches it (``make_batches``) and asks the
  generator for its answer; the generator keeps one stream across these calls
  (:mod:`fairseq_fastgen.sequence_generators.live_stream`) and, whenever it has room for new sentences,
  takes in the lines read meanwhile (:meth:`LiveLines.arrivals`, tokenized by fairseq's own ``make_batches``
  through the plugin's refusal of over-long lines);
* so every line is answered once, in input order, printed as soon as it and every earlier line are done, in
  stock's output format (``S-``, ``W-``, ``H-``, ``D-``, ``P-`` lines; ``W-`` is the time from the request of
  the line's answer to it).
"""

import fileinput
import queue
import threading
from collections import deque
from typing import Callable, List, Optional

END = None  # put in the queue after the last line


class LiveLines:
    """fairseq-interactive's ``buffered_read`` and ``make_batches`` for a streaming generator (module doc)."""

    def __init__(self, make_batches: Callable, buffer_size: int, go_live: Callable):
        self.make_batches_of = make_batches  # fairseq's make_batches (through OversizedLines)
        self.go_live = go_live  # (arrivals, admitted, cfg) -> None: the generator keeps one stream from now on
        self.room = threading.Semaphore(max(1, buffer_size))  # lines that may wait outside the stream
        self.queue: "queue.Queue" = queue.Queue()
        self.ahead = deque()  # (line, its batches): taken in by the stream before fairseq's loop asked for it
        self.handed: Optional[List] = None  # the batches of the read-ahead line just handed to fairseq's loop
        self.batching = None  # (cfg, task, max_positions, encode_fn) of fairseq's first make_batches call
        self.ended = False
        self.lines_read = 0

    # ---- fairseq-interactive's side ---------------------------------------------------------------------
    def buffered_read(self, input, buffer_size):
        """One line at a time, in input order: first those the stream took in, then the next one read."""
        threading.Thread(target=self._read, args=(input,), name="fastgen-input", daemon=True).start()
        while True:
            if self.ahead:
                line, self.handed = self.ahead.popleft()
                yield [line]
                continue
            line = END if self.ended else self._next(block=True)
            if line is END:
                return
            yield [line]

    def make_batches(self, lines, cfg, task, max_positions, encode_fn):
        if self.batching is None:
            self.batching = (cfg, task, max_positions, encode_fn)
            self.go_live(self.arrivals, self.admitted, cfg)
        if self.handed is not None:  # tokenized when the stream took the line in
            batches, self.handed = self.handed, None
        else:
            batches = self._batches(lines)
        yield from batches

    # ---- the stream's side ------------------------------------------------------------------------------
    def arrivals(self):
        """The lines read since the last call (never waits), tokenized: a list of net_input dicts."""
        net_inputs = []
        while not self.ended:
            line = self._next(block=False)
            if line is END:
                break
            batches = self._batches([line])
            self.ahead.append((line, batches))
            net_inputs += [{"src_tokens": batch.src_tokens, "src_lengths": batch.src_lengths} for batch in batches]
        return net_inputs

    def admitted(self, count: int):
        """``count`` lines entered the stream: as many more may be read ahead."""
        for _ in range(count):
            self.room.release()

    # ---- reading ------------------------------------------------------------------------------------
    def _read(self, input):
        try:
            with fileinput.input(files=[input], openhook=fileinput.hook_encoded("utf-8")) as lines:
                for line in lines:
                    self.room.acquire()
                    self.lines_read += 1
                    self.queue.put(line.strip())
        except Exception as error:  # an unreadable input: raised in the main thread
            self.queue.put(error)
        self.queue.put(END)

    def _next(self, block: bool):
        """The next line read, END at the end of the input (also when nothing waits and ``block`` is False)."""
        try:
            line = self.queue.get(block=block)
        except queue.Empty:
            return END
        if isinstance(line, Exception):
            raise line
        if line is END:
            self.ended = True
        return line

    def _batches(self, lines):
        batches = list(self.make_batches_of(lines, *self.batching))
        if not batches:  # refused as too long: it never enters the stream
            self.admitted(len(lines))
        return batches
