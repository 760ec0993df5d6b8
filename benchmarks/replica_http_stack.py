"""Server CPU per request of three HTTP stacks, to pick the one kvyard's replica servers should share.

    .venv/bin/pip install -e '.[http-stacks]'   # FastAPI and uvicorn, which kvyard itself does not use
    .venv/bin/python benchmarks/replica_http_stack.py [--requests 2000] [--concurrency 32] [--output-tokens 32]
        [--step-ms 5] [--repeats 3] [--warmup 200] [--stacks fastapi aiohttp kvyard] [--port 18700]

Stacks, each on uvloop in its own process (this script run with `--serve STACK --port P`):

    fastapi  FastAPI + uvicorn (httptools); StreamingResponse for SSE, JSONResponse otherwise
    aiohttp  aiohttp web.Application; web.StreamResponse for SSE, web.Response(body=orjson.dumps(...)) otherwise
    kvyard   kvyard.net.http_server.HttpServer; Responder.start/write/end for SSE, send_json otherwise

Every stack does the same work for `POST /v1/completions`: read the body, `orjson.loads` it, validate it
with one pydantic model, then take `max_tokens` tokens from a per-request asyncio.Queue that one shared
"engine" task feeds, one token to every active request every `--step-ms` (continuous batching), and
answer with OpenAI text_completion SSE chunks + a usage chunk + `data: [DONE]`, or one JSON body.

The driver (this process) starts each stack in turn, warms it up, then sends `--requests` requests at
`--concurrency` over a keep-alive aiohttp pool, streaming and non-streaming separately, checking every
answer in full. The measure is the server process's user + system CPU time (/proc/PID/stat) over the
load, divided by the number of requests. Stacks are interleaved over `--repeats` rounds (the order
rotates each round); the report gives the median, min and max over rounds and the ratio of each
median to the best stack's. Results go to benchmarks/results/replica_http_stack.json.
"""

# No `from __future__ import annotations`: FastAPI reads the handler's annotations at run time, and
# its types are imported inside serve_fastapi, where a string annotation could not be resolved.
import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "replica_http_stack.json"
STACKS = ("fastapi", "aiohttp", "kvyard")
MODES = ("stream", "non_stream")
MODEL = "kvyard-sim"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
PROMPT_LEN = 64
PACKAGES = ("fastapi", "starlette", "uvicorn", "aiohttp", "httptools", "uvloop", "pydantic", "orjson")


# ---------------------------------------------------------------- the work every stack does


class CompletionRequest(BaseModel):
    prompt: list[int] | str
    max_tokens: int = Field(ge=1)
    stream: bool = False
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None


def parse_request(body: bytes) -> CompletionRequest:
    """Raises ValueError (orjson.JSONDecodeError and pydantic's ValidationError are both ValueErrors)."""
    return CompletionRequest.model_validate(orjson.loads(body))


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[int | None]
    left: int


@dataclass(slots=True)
class Engine:
    """Feeds one token every `step_s` to every active request's queue, then None when it has had them all."""

    step_s: float
    streams: list[_Stream] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def submit(self, max_tokens: int) -> asyncio.Queue[int | None]:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        stream = _Stream(asyncio.Queue(), max_tokens)
        self.streams.append(stream)
        self.wake.set()
        return stream.queue

    async def _run(self) -> None:
        for token in itertools.count():
            if not self.streams:  # idle: no timer wake-ups while nothing is running
                self.wake.clear()
                await self.wake.wait()
            await asyncio.sleep(self.step_s)
            self.streams = [stream for stream in self.streams if _deliver(stream, token)]


def _deliver(stream: _Stream, token: int) -> bool:
    """Put one token in the stream's queue; False (and the end marker) once it has all of them."""
    stream.queue.put_nowait(token)
    stream.left -= 1
    if stream.left > 0:
        return True
    stream.queue.put_nowait(None)
    return False


@dataclass(slots=True)
class Completion:
    request: CompletionRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        prompt = self.request.prompt
        return len(prompt) if isinstance(prompt, list) else len(prompt.split())

    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.request.max_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": MODEL, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


_IDS = itertools.count()


def token_text(token: int) -> str:
    return f" t{token % 1000}"


async def tokens(request: CompletionRequest, engine: Engine) -> AsyncIterator[int]:
    queue = engine.submit(request.max_tokens)
    while (token := await queue.get()) is not None:
        yield token


async def sse_chunks(request: CompletionRequest, engine: Engine) -> AsyncIterator[bytes]:
    """The streamed answer: one `data: {chunk}` per token, then a usage chunk and `data: [DONE]`."""
    completion = Completion(request, f"cmpl-{next(_IDS)}")
    sent = 0
    async for token in tokens(request, engine):
        sent += 1
        finish = "length" if sent == request.max_tokens else None
        choice = {"index": 0, "text": token_text(token), "finish_reason": finish, "logprobs": None}
        yield b"data: " + orjson.dumps(completion.body([choice])) + b"\n\n"
    yield b"data: " + orjson.dumps(completion.body([], completion.usage())) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def whole_completion(request: CompletionRequest, engine: Engine) -> dict[str, Any]:
    completion = Completion(request, f"cmpl-{next(_IDS)}")
    text = "".join([token_text(token) async for token in tokens(request, engine)])
    choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return completion.body([choice], completion.usage())


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


# ---------------------------------------------------------------- the three servers


def serve_fastapi(port: int, step_s: float) -> None:
    import uvicorn
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    engine = Engine(step_s)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        try:
            request = parse_request(await raw.body())
        except ValueError as error:
            return JSONResponse(error_body(str(error)), status_code=400)
        if request.stream:
            return StreamingResponse(sse_chunks(request, engine), headers=SSE_HEADERS)
        return JSONResponse(await whole_completion(request, engine))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    uvicorn.run(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning", access_log=False
    )


async def serve_aiohttp(port: int, step_s: float) -> None:
    from aiohttp import web

    engine = Engine(step_s)

    async def completions(raw: web.Request) -> web.StreamResponse:
        try:
            request = parse_request(await raw.read())
        except ValueError as error:
            return web.Response(status=400, body=orjson.dumps(error_body(str(error))), content_type="application/json")
        if not request.stream:
            body = orjson.dumps(await whole_completion(request, engine))
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(raw)
        async for chunk in sse_chunks(request, engine):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"status": "ok"}), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def serve_kvyard(port: int, step_s: float) -> None:
    from kvyard.net.http_server import HttpRequest, HttpServer, Responder

    engine = Engine(step_s)

    async def handle(raw: HttpRequest, responder: Responder) -> None:
        if (raw.method, raw.path) == ("GET", "/health"):
            return responder.send_json(200, {"status": "ok"})
        if (raw.method, raw.path) != ("POST", "/v1/completions"):
            return responder.send_json(404, error_body(f"{raw.method} {raw.path}: not found"))
        try:
            request = parse_request(raw.body)
        except ValueError as error:
            return responder.send_json(400, error_body(str(error)))
        if not request.stream:
            return responder.send_json(200, await whole_completion(request, engine))
        responder.start(200, SSE_HEADERS)
        async for chunk in sse_chunks(request, engine):
            responder.write(chunk)
        responder.end()

    server = HttpServer(handle)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def serve(stack: str, port: int, step_s: float) -> None:
    import uvloop

    if stack == "fastapi":
        serve_fastapi(port, step_s)
    elif stack == "aiohttp":
        uvloop.run(serve_aiohttp(port, step_s))
    else:
        uvloop.run(serve_kvyard(port, step_s))


# ---------------------------------------------------------------- the driver


class BenchmarkError(RuntimeError):
    pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Load:
    url: str
    stream: bool
    requests: int
    concurrency: int
    output_tokens: int
    prompt: list[int] = field(default_factory=lambda: [(7 * i + 11) % 32000 for i in range(PROMPT_LEN)])

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.output_tokens,
            "stream": self.stream,
            "temperature": 0.0,
        }


async def check_stream(response: aiohttp.ClientResponse, output_tokens: int) -> None:
    """Read the SSE stream to the end: `output_tokens` token chunks, one usage chunk, then [DONE]."""
    token_chunks, usage, done = 0, None, False
    async for raw in response.content:
        line = raw.strip()
        if not line:
            continue
        if done or not line.startswith(b"data: "):
            raise BenchmarkError(f"unexpected line in SSE stream: {line[:100]!r}")
        if line == b"data: [DONE]":
            done = True
            continue
        chunk = orjson.loads(line[6:])
        if chunk["choices"]:
            token_chunks += 1
        else:
            usage = chunk["usage"]
    if not done or token_chunks != output_tokens or usage is None or usage["completion_tokens"] != output_tokens:
        raise BenchmarkError(f"bad stream: done={done} token_chunks={token_chunks}/{output_tokens} usage={usage}")


async def check_whole(response: aiohttp.ClientResponse, output_tokens: int) -> None:
    body = orjson.loads(await response.read())
    choice = body["choices"][0]
    if choice["finish_reason"] != "length" or body["usage"]["completion_tokens"] != output_tokens:
        raise BenchmarkError(f"bad completion: {body}")


async def one_request(session: aiohttp.ClientSession, load: Load) -> None:
    async with session.post(f"{load.url}/v1/completions", data=orjson.dumps(load.body())) as response:
        if response.status != 200:
            raise BenchmarkError(f"HTTP {response.status}: {await response.text()}")
        check = check_stream if load.stream else check_whole
        await check(response, load.output_tokens)


async def run_load(session: aiohttp.ClientSession, load: Load) -> None:
    """`load.requests` requests from `load.concurrency` workers, each sending its next one when the last is done."""
    counter = itertools.count()

    async def worker() -> None:
        while next(counter) < load.requests:
            await one_request(session, load)

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))


@dataclass(slots=True)
class Sample:
    cpu_us_per_request: float
    wall_s: float


async def measure(session: aiohttp.ClientSession, load: Load, pid: int) -> Sample:
    cpu, start = cpu_seconds(pid), time.monotonic()
    await run_load(session, load)
    wall, cpu = time.monotonic() - start, cpu_seconds(pid) - cpu
    return Sample(cpu / load.requests * 1e6, wall)


async def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BenchmarkError(f"server exited with {process.returncode} before it was healthy")
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise BenchmarkError(f"{url}/health did not answer within {timeout_s} s")


async def bench_stack(stack: str, port: int, args: argparse.Namespace) -> dict[str, Sample]:
    """Start one stack's server, warm it up, measure each mode, stop it."""
    command = [sys.executable, __file__, "--serve", stack, "--port", str(port), "--step-ms", str(args.step_ms)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, process)
        connector = aiohttp.TCPConnector(limit=args.concurrency, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session:
            loads = {
                mode: Load(url, mode == "stream", args.requests, args.concurrency, args.output_tokens) for mode in MODES
            }
            for load in loads.values():
                await run_load(session, Load(url, load.stream, args.warmup, args.concurrency, args.output_tokens))
            return {mode: await measure(session, load, process.pid) for mode, load in loads.items()}
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def bench(args: argparse.Namespace) -> dict[str, dict[str, list[Sample]]]:
    samples: dict[str, dict[str, list[Sample]]] = {stack: {mode: [] for mode in MODES} for stack in args.stacks}
    for round_index in range(args.repeats):
        shift = round_index % len(args.stacks)
        for stack in args.stacks[shift:] + args.stacks[:shift]:
            port = args.port + STACKS.index(stack)
            result = await bench_stack(stack, port, args)
            for mode, sample in result.items():
                samples[stack][mode].append(sample)
                print(
                    f"round {round_index + 1}/{args.repeats} {stack:8} {mode:10} "
                    f"{sample.cpu_us_per_request:8.0f} µs CPU/request  wall {sample.wall_s:5.1f} s",
                    flush=True,
                )
    return samples


# ---------------------------------------------------------------- the report


def summarize(samples: dict[str, dict[str, list[Sample]]]) -> dict[str, dict[str, dict[str, Any]]]:
    summary: dict[str, dict[str, dict[str, Any]]] = {stack: {} for stack in samples}
    for mode in MODES:
        medians = {stack: statistics.median(s.cpu_us_per_request for s in samples[stack][mode]) for stack in samples}
        best = min(medians.values())
        for stack, runs in samples.items():
            cpu = [round(s.cpu_us_per_request, 1) for s in runs[mode]]
            summary[stack][mode] = {
                "cpu_us_per_request_median": round(medians[stack], 1),
                "cpu_us_per_request_min": min(cpu),
                "cpu_us_per_request_max": max(cpu),
                "ratio_to_best": round(medians[stack] / best, 2),
                "cpu_us_per_request_rounds": cpu,
                "wall_s_rounds": [round(s.wall_s, 2) for s in runs[mode]],
            }
    return summary


def table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [f"{'stack':9} {'mode':11} {'CPU µs/req (median)':>20} {'min':>7} {'max':>7} {'× best':>7}"]
    for mode in MODES:
        for stack, modes in summary.items():
            row = modes[mode]
            lines.append(
                f"{stack:9} {mode:11} {row['cpu_us_per_request_median']:20.0f} "
                f"{row['cpu_us_per_request_min']:7.0f} {row['cpu_us_per_request_max']:7.0f} "
                f"{row['ratio_to_best']:7.2f}"
            )
    return "\n".join(lines)


def git_commit() -> str | None:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    return result.stdout.strip() or None


def conditions(args: argparse.Namespace) -> dict[str, Any]:
    parameters = {
        name: getattr(args, name)
        for name in ("requests", "concurrency", "output_tokens", "step_ms", "repeats", "warmup", "stacks")
    }
    return {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "python": platform.python_version(),
        "packages": {name: version(name) for name in PACKAGES},
        "parameters": {**parameters, "prompt_tokens": PROMPT_LEN},
        "git_commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per stack, mode and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the simulated engine's step: one token each")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; stacks are interleaved across them")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests per mode before measuring")
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    parser.add_argument("--port", type=int, default=18700, help="base port; stack i listens on port + i")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)  # internal: run one server
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.serve is not None:
        serve(args.serve, args.port, args.step_ms / 1e3)
        return
    before = conditions(args)
    samples = asyncio.run(bench(args))
    summary = summarize(samples)
    print(table(summary))
    report = {
        "benchmark": "replica_http_stack",
        "measure": "server process user+system CPU µs per request",
        "conditions": before,
        "load_average_after": os.getloadavg(),
        "results": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
