"""The HTTP side of fastgen-serve: requests in, answers out, on one asyncio event loop.

Why aiohttp: it is asynchronous (thousands of waiting clients cost a coroutine each, not a thread), well kept
(releases every few weeks since 2014, an aio-libs project), serves and streams chunked responses itself, and it is
one dependency (no separate ASGI server, no validation framework).

``POST /translate`` takes ``{"text": ["...", ...]}`` and optionally ``beam``, ``nbest`` (within what the server's
decoder gives), ``timeout`` (seconds, at most ``--request-timeout``) and ``stream``; it answers
``{"translations": [{"text": D-line text, "tokens": H-line text, "score": base-2 score}, ...]}``, one per
sentence in order (with ``nbest`` above 1 each also has ``"nbest": [...]``).  With ``"stream": true`` the answer
is JSON lines as they come: ``{"sentence": i, "partial": text}`` as a one-hypothesis decoder decides tokens,
``{"sentence": i, "translation": {...}}`` as each sentence finishes (in any order), ``{"done": true}`` at the end
(or ``{"error": ..., "status": ...}`` where the request ends otherwise).

Every refusal is one JSON line ``{"error": "..."}`` with its status: 400 (not JSON, a field missing, of the wrong
type or unknown, a beam or nbest the decoder does not give), 413 (a body over ``--max-request-bytes``, more
sentences than ``--max-sentences-per-request``, a sentence longer than the model reads or ``--max-source-tokens``),
503 with Retry-After (the queue is full, or the server is stopping), 504 (the deadline passed: the request's
sentences leave the queue and the batch).  A client that disconnects has its sentences leave too.

The route's work is :meth:`Server.respond` (a body in, an answer out through an answer object: aiohttp's here,
Starlette's in ``ray_serve.py``), so that the Ray Serve replicas answer with the same code.

SIGTERM or SIGINT: the server stops listening, answers new requests on open connections 503, lets the requests
in flight finish for ``--grace-period`` seconds (a second signal ends it at once), answers those still unfinished
503, and exits 0.
"""

import asyncio
import json
import logging
import signal
import time
from typing import List

from aiohttp import web

from fairseq_fastgen.serve.batching import Job, QueueFull
from fairseq_fastgen.serve.translator import SentenceTooLong

logger = logging.getLogger("fairseq_fastgen.serve")

FIELDS = ("text", "beam", "nbest", "timeout", "stream")
ONE_HYPOTHESIS_DECODERS = ("greedy", "greedy-stream", "blockwise", "blockwise-stream")


class Refusal(Exception):
    """A request answered with an error: its status, one-line message and the refused counter's reason."""

    def __init__(self, status: int, message: str, reason: str, headers=None):
        super().__init__(message)
        self.status, self.reason, self.headers = status, reason, headers or {}


def error_response(status: int, message: str, headers=None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class Server:
    def __init__(self, args, translator, batching, metrics):
        self.args, self.translator, self.batching, self.metrics = args, translator, batching, metrics
        generation = translator.cfg.generation
        self.decoder = str(getattr(generation, "decoder", "beam"))
        self.one_hypothesis = self.decoder in ONE_HYPOTHESIS_DECODERS
        self.beam = 1 if self.one_hypothesis else generation.beam
        self.nbest = 1 if self.one_hypothesis else generation.nbest
        self.stopping = False  # SIGTERM: no new requests
        self.in_flight = set()  # the event queues of the requests being answered
        self.idle = asyncio.Event()  # set whenever no request is in flight
        self.idle.set()
        self.app = web.Application(client_max_size=args.max_request_bytes, middlewares=[self.json_errors])
        self.app.add_routes([web.post("/translate", self.translate), web.get("/health", self.health),
                             web.get("/metrics", self.metrics_text)])

    # ---- routes -------------------------------------------------------------------------------------
    async def health(self, request):
        return web.json_response(*self.health_status())

    def health_status(self):
        """(the payload of ``GET /health``, its status)."""
        if self.stopping:
            return {"status": "stopping"}, 503
        return {"status": "ok", "decoder": self.decoder, "batching": self.args.batching}, 200

    async def metrics_text(self, request):
        return web.Response(text=self.metrics.text(), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def translate(self, request):
        arrived = time.monotonic()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raw = None
        return await self.respond(raw, arrived, AiohttpAnswer(request))

    async def respond(self, raw, arrived: float, out):
        """A ``POST /translate`` whatever serves HTTP: its body (``raw``; None: larger than --max-request-bytes)
        in, the answer through ``out`` (:class:`AiohttpAnswer` here; the Ray Serve deployment's own)."""
        try:
            if self.stopping:
                raise Refusal(503, "the server is stopping; send the request to another replica",
                              "stopping", {"Retry-After": str(self.args.retry_after), "Connection": "close"})
            texts, nbest, timeout, stream = self.fields(self.body(raw))
            try:
                sources = self.translator.sources(texts)
            except SentenceTooLong as error:
                raise Refusal(413, str(error), "too_long") from None
        except Refusal as refusal:
            self.metrics.inc("fastgen_serve_refused_total", reason=refusal.reason)
            return out.reply(refusal.status, {"error": str(refusal)}, refusal.headers)
        return await self.answer(out, sources, nbest, arrived, timeout, stream)

    # ---- a request's fields ------------------------------------------------------------------------
    def body(self, raw) -> dict:
        if raw is None or len(raw) > self.args.max_request_bytes:
            raise Refusal(413, f"the request body is larger than --max-request-bytes {self.args.max_request_bytes}",
                          "too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise Refusal(400, f"the request body is not JSON: {error}", "bad_json") from None
        if not isinstance(body, dict):
            raise Refusal(400, 'the request body must be a JSON object: {"text": ["...", ...]}', "bad_field")
        return body

    def fields(self, body: dict):
        """(texts, nbest, timeout seconds, stream) of a request; a bad field raises :class:`Refusal`."""
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise Refusal(400, f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}", "bad_field")
        texts = body.get("text")
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
            raise Refusal(400, "'text' must be a non-empty list of strings", "bad_field")
        limit = self.args.max_sentences_per_request
        if len(texts) > limit:
            raise Refusal(413, f"{len(texts)} sentences in one request, more than --max-sentences-per-request "
                               f"{limit}", "too_many_sentences")
        beam = integer_field(body, "beam", self.beam)
        if beam != self.beam:
            given = "one hypothesis per sentence" if self.one_hypothesis else f"beam {self.beam}"
            raise Refusal(400, f"beam {beam}: this server decodes with --decoder {self.decoder} at {given}; "
                               f"'beam' must be {self.beam}", "bad_field")
        nbest = integer_field(body, "nbest", 1)
        if not 1 <= nbest <= self.nbest:
            raise Refusal(400, f"nbest {nbest}: this server's --decoder {self.decoder} gives at most {self.nbest} "
                               f"hypotheses per sentence (--nbest {self.nbest})", "bad_field")
        timeout = body.get("timeout", self.args.request_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= self.args.request_timeout:
            raise Refusal(400, f"'timeout' must be a number of seconds above 0 and at most --request-timeout "
                               f"{self.args.request_timeout}", "bad_field")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise Refusal(400, "'stream' must be true or false", "bad_field")
        return texts, nbest, float(timeout), stream

    # ---- answering ------------------------------------------------------------------------------------
    async def answer(self, out, sources, nbest: int, arrived: float, timeout: float, stream: bool):
        deadline = arrived + timeout
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # (kind, sentence, payload) from the decoding thread

        def on_thread(kind, index):
            return lambda payload: loop.call_soon_threadsafe(events.put_nowait, (kind, index, payload))

        jobs = [Job(source, on_thread("answer", index), on_thread("partial", index) if stream else None)
                for index, source in enumerate(sources)]
        try:
            self.batching.submit(jobs)
        except QueueFull as full:
            self.metrics.inc("fastgen_serve_refused_total", reason="queue_full")
            return out.reply(503, {"error": f"the server is busy: {full}"}, {"Retry-After": str(self.args.retry_after)})
        self.in_flight.add(events)
        self.idle.clear()
        try:
            if stream:
                return await self.streamed(out, jobs, events, nbest, arrived, timeout)
            translations = [None] * len(jobs)
            async for kind, index, payload in self.events(jobs, events, deadline, timeout):
                translations[index] = self.translator.translation(jobs[index].source, payload, nbest)
            self.metrics.observe("fastgen_serve_request_seconds", time.monotonic() - arrived)
            return out.reply(200, {"translations": translations})
        except Refusal as refusal:
            return out.reply(refusal.status, {"error": str(refusal)}, refusal.headers)
        except asyncio.CancelledError:  # the client disconnected (aiohttp cancels its handler)
            self.batching.cancel(jobs, "disconnect")
            raise
        finally:
            self.in_flight.discard(events)
            if not self.in_flight:
                self.idle.set()

    async def events(self, jobs: List[Job], events: asyncio.Queue, deadline: float, timeout: float):
        """The request's answers as they come (``("answer", i, hypotheses)``, with ``stream`` also
        ``("partial", i, tokens)``) until every sentence is answered; the deadline or the end of the grace period
        cancels the rest and raises :class:`Refusal`."""
        remaining = len(jobs)
        while remaining:
            try:
                kind, index, payload = await asyncio.wait_for(events.get(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                self.batching.cancel(jobs, "deadline")
                raise Refusal(504, f"the request was not answered within its deadline of {timeout:g} s; its "
                                   f"sentences left the batch", "deadline") from None
            if kind == "shutdown":
                self.batching.cancel(jobs, "shutdown")
                raise Refusal(503, f"the server stopped before the request was answered (--grace-period "
                                   f"{self.args.grace_period} s)", "shutdown",
                              {"Retry-After": str(self.args.retry_after), "Connection": "close"})
            if isinstance(payload, Exception):
                self.batching.cancel(jobs, "error")
                raise Refusal(500, f"decoding failed: {type(payload).__name__}: {payload}", "error")
            if kind == "answer":
                remaining -= 1
            yield kind, index, payload

    async def streamed(self, out, jobs, events, nbest, arrived, timeout):
        await out.open()
        line = out.line
        try:
            async for kind, index, payload in self.events(jobs, events, arrived + timeout, timeout):
                if kind == "partial":
                    await line({"sentence": index, "partial": self.translator.partial_text(payload)})
                else:
                    await line({"sentence": index,
                                "translation": self.translator.translation(jobs[index].source, payload, nbest)})
            await line({"done": True})
            self.metrics.inc("fastgen_serve_requests_total", code="200")
            self.metrics.observe("fastgen_serve_request_seconds", time.monotonic() - arrived)
        except Refusal as refusal:  # the status line went out already: the error is the last line
            self.metrics.inc("fastgen_serve_requests_total", code=str(refusal.status))
            await line({"error": str(refusal), "status": refusal.status})
        return await out.close()

    # ---- every error as one JSON line ------------------------------------------------------------
    @web.middleware
    async def json_errors(self, request, handler):
        try:
            response = await handler(request)
        except web.HTTPException as error:  # aiohttp's own: unknown path (404), method (405), ...
            response = error_response(error.status, f"{error.reason}: {request.method} {request.path}")
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as error:  # a bug: one line for the client, the traceback in the log
            logger.exception("%s %s failed", request.method, request.path)
            response = error_response(500, f"internal error: {type(error).__name__}: {error}")
        if request.path == "/translate" and isinstance(response, web.Response):  # (a streamed one counts itself)
            self.metrics.inc("fastgen_serve_requests_total", code=str(response.status))
        return response

    # ---- the server's life ---------------------------------------------------------------------------
    async def run(self):
        """Serve until SIGTERM or SIGINT, then stop as the module doc says."""
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, self.args.host, self.args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"fastgen-serve: listening on http://{host}:{port} (--decoder {self.decoder}, --batching "
              f"{self.args.batching})", flush=True)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, signals.put_nowait, signum)
        await signals.get()
        self.stopping = True
        print(f"fastgen-serve: stopping: no new requests; {len(self.in_flight)} in flight, --grace-period "
              f"{self.args.grace_period} s", flush=True)
        await site.stop()
        finished = asyncio.ensure_future(self.idle.wait())
        again = asyncio.ensure_future(signals.get())  # a second signal ends the grace period now
        await asyncio.wait({finished, again}, timeout=self.args.grace_period, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            for events in list(self.in_flight):
                events.put_nowait(("shutdown", None, None))
            await finished
        again.cancel()
        await runner.cleanup()
        await loop.run_in_executor(None, self.batching.stop)
        for signum in (signal.SIGTERM, signal.SIGINT):  # from here to the exit, a signal changes nothing
            loop.remove_signal_handler(signum)
            signal.signal(signum, signal.SIG_IGN)
        print("fastgen-serve: stopped", flush=True)


class AiohttpAnswer:
    """How :meth:`Server.respond` answers on aiohttp: a whole JSON answer, or JSON lines as they come."""

    def __init__(self, request):
        self.request, self.response = request, None

    def reply(self, status: int, payload: dict, headers=None) -> web.Response:
        return web.json_response(payload, status=status, headers=headers)

    async def open(self):
        self.response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await self.response.prepare(self.request)

    async def line(self, record: dict):
        await self.response.write(json_line(record))

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


def json_line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode()


def integer_field(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refusal(400, f"'{name}' must be an integer", "bad_field")
    return value
