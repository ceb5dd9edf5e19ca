"""fastgen-serve --ray-replicas 2 (the Ray Serve deployment, when the extra is installed): two replicas on this
machine behind Ray Serve's proxy; 16 concurrent clients get fairseq-interactive's answers, sentence by sentence,
from both replicas; a streamed answer and a refusal are the server's own; SIGTERM stops it with exit status 0."""

import asyncio
import json
import socket

import aiohttp
import pytest

from tests.serve.servers import Server, error_line
from tests.serve.test_app import CLIENTS, TIMEOUT, assert_offline_answers, random_batches

pytest.importorskip("ray.serve", reason="the Ray Serve extra (pip install 'fairseq_fastgen[ray]') is not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def client(url, batches):
    """One client's requests one after another: [(sentences, status, body)] and the replicas that answered."""
    answers, replicas = [], set()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for sentences in batches:
            async with session.post(url + "/translate", json={"text": sentences}) as response:
                answers.append((sentences, response.status, await response.read()))
                replicas.add(response.headers.get("X-Fastgen-Replica"))
    return answers, replicas


def test_two_ray_serve_replicas_answer_as_fairseq_interactive(toy_model, plugin_dir, tmp_path, sources, offline):
    server = Server(toy_model, plugin_dir, tmp_path, "--decoder", "greedy-stream", "--beam", "1", "--batch-size", "8",
                    "--ray-replicas", "2", "--ray-cpus-per-replica", "0", "--port", str(free_port()))
    try:
        async def run():
            clients = [client(server.url, random_batches(sources, 500 + seed)) for seed in range(CLIENTS)]
            results = await asyncio.gather(*clients)
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async with session.post(server.url + "/translate", json={"text": sources[:2], "stream": True}) as reply:
                    assert reply.status == 200 and reply.content_type == "application/x-ndjson"
                    lines = [json.loads(line) async for line in reply.content]
                async with session.post(server.url + "/translate", json={"text": ["a"], "beam": 5}) as reply:
                    refused = reply.status, error_line(await reply.read())
            return results, lines, refused

        results, lines, refused = asyncio.run(run())
    finally:
        status, output = server.stop()
    assert status == 0, server.log()[-3000:]
    assert "fastgen-serve: stopped" in output
    answers = [answer for client_answers, _ in results for answer in client_answers]
    assert len(answers) == CLIENTS * 3
    assert_offline_answers(answers, offline)
    replicas = set().union(*(names for _, names in results))
    assert len(replicas) == 2 and None not in replicas  # both replicas answered
    assert lines[-1] == {"done": True}
    finals = {line["sentence"]: line["translation"]["text"] for line in lines if "translation" in line}
    assert finals == {0: offline[sources[0]][0], 1: offline[sources[1]][0]}
    assert refused[0] == 400 and "'beam' must be 1" in refused[1]
