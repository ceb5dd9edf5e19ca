"""fastgen-serve as a Ray Serve deployment (``--ray-replicas N``): N replicas of the server, one model and one
running batch each, behind Ray Serve's HTTP proxy on ``--host``/``--port``.

Why Ray Serve: it is the maintained Python serving engine that runs the same deployment on one machine or a
cluster (``--ray-address``), starts and restarts replicas, routes each request to a replica with few requests
open, and drains replicas on shutdown.  It is an optional extra (``pip install 'fairseq_fastgen[ray]'``); without
it ``fastgen-serve`` serves alone (``app.py``).

Each replica builds what ``fastgen-serve`` builds (:func:`~fairseq_fastgen.serve.server_setup.build_server`: the
translator, the batching thread, the :class:`~fairseq_fastgen.serve.app.Server`) from the same command line, and
answers the same routes with the same code (:meth:`Server.respond`); only the HTTP objects are Starlette's (Ray Serve's
proxy).  Each answer names its replica (``X-Fastgen-Replica``); ``GET /metrics`` is that replica's.

The driver (this process) checks the options as ``fastgen-serve`` does, deploys, prints the ``listening on`` line
and waits; SIGTERM or SIGINT shuts the deployment down (Ray Serve lets each replica finish its requests for
``--grace-period`` seconds) and exits 0.
"""

import asyncio
import signal
import threading
import time

from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.serve.app import json_line
from fairseq_fastgen.serve.options import parse_command_line
from fairseq_fastgen.serve.server_setup import build_server, prepare

JSON = "application/json"


class Replica:
    """One server: the model, its batch and the routes of ``app.py`` (module doc); a Ray Serve deployment once
    :func:`serve_replicas` wraps it (Ray and Starlette are imported where they are used: an optional extra)."""

    def __init__(self, argv):
        from ray import serve

        args, cfg = parse_command_line(list(argv) + ["--ray-replicas", "0"])
        self.server = build_server(args, cfg)
        self.name = str(serve.get_replica_context().replica_id.unique_id)

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        path, method = request.url.path, request.method
        headers = {"X-Fastgen-Replica": self.name}
        if path == "/translate" and method == "POST":
            arrived = time.monotonic()
            raw = await request.body()
            answer = StarletteAnswer(headers)
            response = await answer.response(self.server.respond(raw, arrived, answer))
            if not isinstance(response, StreamingResponse):  # (a streamed one counts itself)
                self.server.metrics.inc("fastgen_serve_requests_total", code=str(response.status_code))
            return response
        if path == "/health" and method == "GET":
            payload, status = self.server.health_status()
            return Response(json_line(payload), status_code=status, media_type=JSON, headers=headers)
        if path == "/metrics" and method == "GET":
            return Response(self.server.metrics.text(), media_type="text/plain; charset=utf-8",
                            headers=dict(headers, **{"X-Prometheus-Format": "0.0.4"}))
        known = path in ("/translate", "/health", "/metrics")
        status, reason = (405, "Method Not Allowed") if known else (404, "Not Found")
        return Response(json_line({"error": f"{reason}: {method} {path}"}), status_code=status, media_type=JSON,
                        headers=headers)


class StarletteAnswer:
    """How :meth:`Server.respond` answers through Ray Serve's proxy.  A whole answer is returned as it is; a
    streamed one becomes a ``StreamingResponse`` that reads the lines :meth:`Server.respond` writes as they come.
    A client that disconnects cancels the request (Ray Serve cancels the call), and with it the request's
    sentences (``Server.answer`` cancels its jobs)."""

    def __init__(self, headers: dict):
        self.headers = headers
        self.opened = asyncio.get_running_loop().create_future()
        self.lines: asyncio.Queue = asyncio.Queue()  # bytes; None after the last

    def reply(self, status: int, payload: dict, headers=None):
        from starlette.responses import Response

        return Response(json_line(payload), status_code=status, media_type=JSON,
                        headers=dict(self.headers, **(headers or {})))

    async def open(self):
        self.opened.set_result(None)

    async def line(self, record: dict):
        self.lines.put_nowait(json_line(record))

    async def close(self):
        self.lines.put_nowait(None)

    async def response(self, responding):
        from starlette.responses import StreamingResponse

        task = asyncio.ensure_future(responding)
        try:
            await asyncio.wait({task, self.opened}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not self.opened.done():
            self.opened.cancel()
            return task.result()
        return StreamingResponse(self.streamed(task), media_type="application/x-ndjson", headers=self.headers)

    async def streamed(self, task):
        try:
            while True:
                line = await self.lines.get()
                if line is None:
                    return
                yield line
        finally:
            if not task.done():
                task.cancel()


def serve_replicas(args, cfg, argv):
    """The driver: check the options, deploy ``--ray-replicas`` replicas, serve until SIGTERM or SIGINT."""
    prepare(args, cfg)  # a misuse is one line here, before any replica starts
    try:
        import ray
        from ray import serve
    except ImportError as missing:
        raise UsageError(f"--ray-replicas runs on Ray Serve, which is not installed ({missing}): "
                         f"pip install 'fairseq_fastgen[ray]'") from None

    try:
        if args.ray_address is None:
            ray.init(num_cpus=max(1, int(args.ray_replicas * args.ray_cpus_per_replica + 0.999)),
                     include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)
        else:
            ray.init(address=args.ray_address, log_to_driver=False)
    except ConnectionError as error:
        raise UsageError(f"--ray-address {args.ray_address}: {error}") from None
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # (after ray.init, which sets its own handlers)
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployment = serve.deployment(Replica).options(
            num_replicas=args.ray_replicas, ray_actor_options={"num_cpus": args.ray_cpus_per_replica},
            max_ongoing_requests=args.max_queue, graceful_shutdown_timeout_s=args.grace_period)
        serve.run(deployment.bind(list(argv)), name="fastgen", route_prefix="/")
        decoder = getattr(args, "decoder", "beam")
        print(f"fastgen-serve: listening on http://{args.host}:{args.port} (--decoder {decoder}, --batching "
              f"{args.batching}, {args.ray_replicas} Ray Serve replicas)", flush=True)
        while not stop.wait(0.5):
            pass
        print(f"fastgen-serve: stopping: the replicas finish their requests (--grace-period {args.grace_period} s)",
              flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()
    print("fastgen-serve: stopped", flush=True)
