"""The decoding thread: sentences of every client in, hypotheses out.

The model is not thread-safe, so one thread runs it.  The event loop hands it :class:`Job` s (one per sentence)
through :meth:`Batching.submit` and hears back through each job's ``answered`` callback (called on this thread;
the server's callback moves the answer onto the event loop).  Two ways of batching:

* :class:`ContinuousBatching` (``--batching continuous``): one stream of a streaming decoder that outlives the
  requests (:class:`~fairseq_fastgen.sequence_generators.live_stream.LiveStream`, as fairseq-interactive's lines
  enter it).  At each refill the stream asks for the sentences that arrived (``arrivals``), at most as many as it
  has room for and a quarter more, whichever client sent them: those wait in the stream for rows, so that it
  encodes arrivals several at a time (``EncodedAhead``) rather than one encoder call per refill of one or two
  sentences.  Every finished sentence goes back to its own job at once.  A job
  cancelled (its deadline, its client gone) leaves the queue, or its rows leave the stream
  (``LiveStream.cancel``).  The whole loop runs inside one ``generator.generate`` call, so that everything the
  plugin attaches to a generator's ``generate`` (inference mode, ``--quantize``, ``--onednn-linear``, the cluster
  projection) holds for it.
* :class:`FixedBatching` (``--batching fixed``): up to ``--fixed-batch-size`` sentences, or what arrived within
  ``--fixed-batch-wait-ms`` of the first, decoded as one batch by ``task.inference_step`` (fairseq-interactive's
  call), then the next.  A cancelled job leaves the queue; a batch already decoding runs to its end (its answer
  is dropped).
"""

import logging
import threading
import time
from collections import deque
from typing import Callable, List, Optional

import torch

from fairseq_fastgen.sequence_generators.live_stream import RETURNED, LiveStream
from fairseq_fastgen.sequence_generators.streaming import JOINED_EPS

logger = logging.getLogger("fairseq_fastgen.serve")

QUEUED, DECODING, DONE = "queued", "decoding", "done"
AHEAD_SHARE = 4  # the stream holds its room and a quarter more sentences (ContinuousBatching.ahead)
# --stream-eps where not given, for a stream whose refills take finished rows' places (greedy-stream on a step
# engine, blockwise-stream; offline their default refills as soon as a row is free): a refill once half the rows
# are free. On the CPU each refill costs an encoder call, a start and a join, whatever its size; at 32 rows, base
# shapes, int8, this saturated at 90-92 sentences/s against 76-78 with a refill at every free row (docs/serving.md)
SERVED_EPS = 0.5


class QueueFull(Exception):
    """The admission queue has no room for a request's sentences (503)."""


class Job:
    """One sentence of a request on its way through the batch."""

    def __init__(self, source, answered: Callable, progress: Optional[Callable] = None):
        self.source = source  # translator.Source: net_input, src_str
        self.answered = answered  # (hypotheses list, or an Exception) -> None, on the decoding thread
        self.progress = progress  # (tokens (length,)) -> None: its first tokens as they are decided; or None
        self.stage = QUEUED
        self.position: Optional[int] = None  # its position in the stream's pool (continuous batching)
        self.cancelled: Optional[str] = None  # why its client gave up on it
        self.reported = 0  # tokens already handed to ``progress``


class Batching:
    """What both ways of batching share: the queue of jobs, its limit, cancelling, the thread."""

    removes_rows = False  # whether a job cancelled while decoding leaves the batch (else its answer is dropped)

    def __init__(self, translator, metrics, max_queue: int):
        self.translator, self.metrics, self.max_queue = translator, metrics, max_queue
        self.condition = threading.Condition()
        self.waiting: deque = deque()  # jobs not yet handed to the decoder, in arrival order
        self.leaving: List[Job] = []  # jobs cancelled while decoding, for the decoding thread to remove
        self.stopping = False
        self.thread = threading.Thread(target=self._thread, name="fastgen-decode", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, jobs: List[Job]):
        """Queue a request's jobs, all or none (:class:`QueueFull`)."""
        with self.condition:
            if self.stopping:
                raise QueueFull("the server is stopping")
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} sentences wait for the batch; --max-queue {self.max_queue} "
                                f"leaves no room for {len(jobs)} more")
            self.waiting.extend(jobs)
            self.metrics.set("fastgen_serve_queue_sentences", len(self.waiting))
            self.condition.notify()

    def cancel(self, jobs: List[Job], reason: str):
        """The jobs' client gave up on them (``reason``: deadline, disconnect, shutdown): those waiting leave the
        queue now, those decoding leave the batch at the decoding thread's next iteration."""
        with self.condition:
            for job in jobs:
                if job.stage == DONE or job.cancelled is not None:
                    continue
                job.cancelled = reason
                if job.stage == QUEUED:
                    self.waiting.remove(job)
                    job.stage = DONE
                    self.metrics.inc("fastgen_serve_removed_sentences_total", reason=reason, where="queue")
                elif self.removes_rows:
                    self.leaving.append(job)
            self.metrics.set("fastgen_serve_queue_sentences", len(self.waiting))
            self.condition.notify()

    def stop(self):
        """Once every job submitted is answered or cancelled, the thread ends; waits for it."""
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.thread.join()

    def _thread(self):
        with torch.no_grad():
            self.run()

    def run(self):
        raise NotImplementedError

    def _answer(self, job: Job, result):
        """Hand a job its hypotheses (or the error that ended its batch), unless its client gave up."""
        with self.condition:
            job.stage = DONE
            if job.cancelled is not None:
                return
        if not isinstance(result, Exception):
            self.metrics.inc("fastgen_serve_sentences_total")
        job.answered(result)


class ContinuousBatching(Batching):
    """Every sentence of every client enters one running stream (module doc)."""

    removes_rows = True

    def __init__(self, translator, metrics, max_queue: int):
        super().__init__(translator, metrics, max_queue)
        scheduler = translator.generator.scheduler
        limits = [c for c in (scheduler.capacity, scheduler.capacity_rows, scheduler.capacity_tokens) if c is not None]
        self.room = min(limits)  # a sentence counts at least one source, row and token
        if translator.cfg.generation.stream_eps is None and scheduler.eps == JOINED_EPS:
            scheduler.eps = SERVED_EPS
        # sentences let into the stream beyond its room, waiting there for rows: the stream encodes them together
        # (EncodedAhead) instead of one encoder call per refill of one or two sentences
        self.ahead = max(1, self.room // AHEAD_SHARE)
        self.in_stream = {}  # pool position -> job, from its arrival in the stream to its answer
        self.stream: Optional[ServedStream] = None

    def run(self):
        generator = self.translator.generator
        while True:
            self.stream = generator.live = ServedStream(self)
            try:
                generator.generate(self.translator.models, {"net_input": None})  # the loop, until stopped
                return
            except RestartStream:
                continue
            except Exception as error:  # the stream cannot go on: its sentences get the error, the next a new stream
                logger.exception("decoding failed; %d sentences in the batch are answered with the error",
                                 len(self.in_stream))
                for job in list(self.in_stream.values()):
                    self._answer(job, error)
                self.in_stream.clear()
            finally:
                generator.live = None

    # ---- called by the stream ---------------------------------------------------------------------
    def next_work(self) -> Optional[List[Job]]:
        """Waits while there is nothing to decode; the jobs that left since the last call, or None once the
        server stops and nothing is left."""
        with self.condition:
            while not self.waiting and not self.in_stream and not self.leaving:
                if self.stopping:
                    return None
                self.condition.wait()
            leaving, self.leaving = self.leaving, []
            return leaving

    def arrivals(self, next_position: int):
        """The jobs that may enter the stream now (at most its room and ``ahead`` more), the first at pool position
        ``next_position``: their net_inputs."""
        with self.condition:
            count = min(len(self.waiting), max(0, self.room + self.ahead - len(self.in_stream)))
            jobs = [self.waiting.popleft() for _ in range(count)]
            for offset, job in enumerate(jobs):
                job.stage, job.position = DECODING, next_position + offset
                self.in_stream[job.position] = job
            self.metrics.set("fastgen_serve_queue_sentences", len(self.waiting))
        return [job.source.net_input for job in jobs]

    def finished(self, position: int, hypotheses):
        job = self.in_stream.pop(position)
        self._answer(job, hypotheses)

    def left(self, job: Job, where: str):
        self.in_stream.pop(job.position, None)
        self.metrics.inc("fastgen_serve_removed_sentences_total", reason=job.cancelled, where=where)


class ServedStream(LiveStream):
    """The stream of :class:`ContinuousBatching`: its ``answer`` is the server's decoding loop (the module doc)."""

    RESTART_AFTER = 100_000  # sentences: an idle stream starts afresh past this (its pool keeps a few bytes each)

    def __init__(self, batching: ContinuousBatching):
        translator = batching.translator
        self.batching = batching
        self.leaving = {}  # pool position -> job: cancelled before the stream admitted it
        super().__init__(translator.generator, self._arrivals, lambda count: None, translator.left_pad,
                         translator.device)

    def _arrivals(self):
        return self.batching.arrivals(self.pool.size)

    def answer(self, net_input):
        batching, metrics = self.batching, self.batching.metrics
        while True:
            leaving = batching.next_work()
            if leaving is None:
                return []
            if not leaving and not self.leaving and not batching.in_stream and self.pool.size > self.RESTART_AFTER:
                raise RestartStream()  # nothing runs in this stream: the next sentences start a new one
            self._remove(leaving)
            self.pool.ahead.clear()  # (matched against generate() calls in fairseq-interactive only)
            if self.run.iterate():
                metrics.inc("fastgen_serve_iterations_total")
            self._deliver()
            metrics.set("fastgen_serve_batch_sentences", len(batching.in_stream))
            metrics.set("fastgen_serve_batch_rows", self.rows)

    def _remove(self, leaving: List[Job]):
        """Cancelled jobs' rows leave the stream; one not admitted yet leaves when it is."""
        for job in leaving:
            self.leaving[job.position] = job
        admitted = [position for position in self.leaving if position < self.run.next_source]
        if not admitted:
            return
        self.cancel(admitted)
        for position in admitted:
            job = self.leaving.pop(position)
            self.pool.results[position] = RETURNED  # (its hypotheses, where it finished before it could leave)
            self.batching.left(job, "batch")

    def _deliver(self):
        batching, results = self.batching, self.pool.results
        streamed = set()
        for position, job in list(batching.in_stream.items()):
            if results[position] is not None and position not in self.leaving:
                hypotheses, results[position] = results[position], RETURNED
                batching.finished(position, hypotheses)
            elif job.progress is not None:
                streamed.add(position)
        if streamed:
            for position, tokens in self.decided_tokens(streamed).items():
                job = batching.in_stream[position]
                if tokens.numel() > job.reported:
                    job.reported = tokens.numel()
                    job.progress(tokens)


class RestartStream(Exception):
    """Ends an idle stream's ``generate`` call so that a fresh one starts (``ServedStream.RESTART_AFTER``)."""


class FixedBatching(Batching):
    """Up to ``size`` sentences or ``wait_s`` after the first, decoded as one batch (module doc)."""

    def __init__(self, translator, metrics, max_queue: int, size: int, wait_s: float):
        super().__init__(translator, metrics, max_queue)
        self.size, self.wait_s = size, wait_s

    def submit(self, jobs: List[Job]):
        now = time.monotonic()
        for job in jobs:
            job.queued_at = now
        super().submit(jobs)

    def next_batch(self) -> Optional[List[Job]]:
        with self.condition:
            while not self.waiting:
                if self.stopping:
                    return None
                self.condition.wait()
            due = self.waiting[0].queued_at + self.wait_s
            while len(self.waiting) < self.size and not self.stopping:
                remaining = due - time.monotonic()
                if remaining <= 0 or not self.waiting:
                    break
                self.condition.wait(remaining)
            batch = [self.waiting.popleft() for _ in range(min(self.size, len(self.waiting)))]
            for job in batch:
                job.stage = DECODING
            self.metrics.set("fastgen_serve_queue_sentences", len(self.waiting))
            return batch

    def run(self):
        translator, metrics = self.translator, self.metrics
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            if not batch:  # every job of the batch was cancelled while it waited
                continue
            metrics.set("fastgen_serve_batch_sentences", len(batch))
            metrics.set("fastgen_serve_batch_rows", len(batch))
            sample = translator.sample([job.source for job in batch])
            try:
                answers = translator.task.inference_step(translator.generator, translator.models, sample)
                metrics.inc("fastgen_serve_iterations_total")
            except Exception as error:
                logger.exception("decoding failed; the %d sentences of the batch are answered with the error",
                                 len(batch))
                answers = [error] * len(batch)
            for job, hypotheses in zip(batch, answers):
                if job.cancelled is not None:
                    metrics.inc("fastgen_serve_removed_sentences_total", reason=job.cancelled, where="batch")
                self._answer(job, hypotheses)
            metrics.set("fastgen_serve_batch_sentences", 0)
            metrics.set("fastgen_serve_batch_rows", 0)
