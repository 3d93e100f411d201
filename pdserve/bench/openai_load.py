"""Open-loop load against any OpenAI-compatible server (`/v1/completions`, streamed), recorded
exactly as the gRPC load is (serve_bench), so another server runs the same workload on the same
machine and lands in the same report.

Each request sends the workload's token ids as its prompt (the OpenAI API takes them; so do
vLLM and SGLang), `temperature: 0`, and `ignore_eos` (vLLM's extension, which pdserve honours
too) so outputs run to `max_tokens`. A chunk is one token when the server says so (pdserve's
`pdserve.token_ids`), else one token per chunk is assumed; usage, when sent, is the count."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from urllib.parse import urlsplit

from pdserve.bench.serve_stats import Record, gather_progress
from pdserve.bench.workloads import BenchRequest


def api_key(explicit: str = "") -> str:
    return explicit or os.environ.get("PDSERVE_API_KEY", "") or os.environ.get("OPENAI_API_KEY", "")


async def served_model(client, url: str) -> str:
    r = await client.get(f"{url}/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def _httpx_events(client, url: str, body: dict, timeout_s: float) -> AsyncIterator[str]:
    async with client.stream("POST", f"{url}/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                yield line[6:]


async def _raw_events(url: str, body: dict, headers: dict[str, str]) -> AsyncIterator[str]:
    """The same request over a bare HTTP/1.1 socket (one per request): a client whose own cost is
    near nothing, so what it measures is the server's (httpx, which the openai SDK uses, adds
    milliseconds per request of its own)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        payload = json.dumps(body).encode()
        head = (f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
        writer.write(head.encode() + payload)
        status = int((await reader.readline()).split()[1])
        fields = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            fields[k.strip().lower()] = v.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read()).decode(errors='replace')[:300]}")
        chunked, buf = fields.get("transfer-encoding") == "chunked", b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            elif not (data := await reader.read(65536)):
                break
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    yield event[6:].decode()
    finally:
        writer.close()


async def openai_one(client, url: str, model: str, req: BenchRequest, t_start: float, timeout_s: float,
                     raw_headers: dict[str, str] | None = None) -> Record:
    """One streamed completion; `raw_headers` given: over a bare socket (`_raw_events`) with them."""
    rec = Record(req.arrival_s, len(req.prompt_ids), req.max_tokens, req.kind)
    delay = t_start + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    last, counted, usage = None, 0, None
    events = (_raw_events(url, body, raw_headers) if raw_headers is not None
              else _httpx_events(client, url, body, timeout_s))
    try:
        async with asyncio.timeout(timeout_s), aclosing(events):
            async for data in events:
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # (pdserve's says its HTTP status: a refusal mid-stream is still a 429)
                    err = chunk["error"]
                    status = f"HTTP {err['status']}: " if "status" in err else ""
                    raise RuntimeError(f"stream error: {status}{err.get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    ext = choice.get("pdserve") or {}
                    n = len(ext["token_ids"]) if "token_ids" in ext else (1 if choice.get("text") else 0)
                    if n:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_ms = (now - t0) * 1e3
                        else:
                            rec.itl_ms.append((now - last) * 1e3)
                        # A chunk's further tokens came with it: a gap of 0 each, one gap per token
                        # as the gRPC load records them (a message of N tokens is N events there).
                        rec.itl_ms += [0.0] * (n - 1)
                        last = now
                        counted += n
                    if "route" in ext:
                        rec.prefill_worker = ext["route"]["prefill"]
                        rec.expected_hit_tokens = ext["route"]["expected_hit_tokens"]
                        rec.cached_local, rec.cached_store = ext["cached_tokens_local"], ext["cached_tokens_store"]
                        rec.computed = ext["computed_tokens"]
                        rec.route_ms = ext["timings_ms"].get("route_ms", rec.route_ms)
        rec.output_tokens = usage["completion_tokens"] if usage else counted
        rec.finish(t0)
    except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash
        rec.fail(t0, e)
    return rec


async def run_openai_load(url: str, reqs: list[BenchRequest], max_seconds: float, timeout_s: float,
                          progress: bool = True, model: str = "", key: str = "",
                          raw: bool = False) -> tuple[list[Record], float]:
    """`raw`: each request over a bare socket (plain http:// only), not httpx."""
    import httpx

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key(key)}"} if api_key(key) else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout_s) as client:
        model = model or await served_model(client, url)
        t_start = time.perf_counter()
        reqs = [r for r in reqs if r.arrival_s <= max_seconds]
        raw_headers = dict(headers) if raw else None
        records = await gather_progress([openai_one(client, url, model, r, t_start, timeout_s, raw_headers)
                                         for r in reqs], progress)
        return records, time.perf_counter() - t_start
