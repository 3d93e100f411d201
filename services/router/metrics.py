"""Router metrics (TTFT, TPOT, ITL, routing time histograms; token and hit counters), exposed in the
Prometheus text format on a small HTTP endpoint (`GET /metrics`)."""

from __future__ import annotations

import asyncio
import bisect

READ_TIMEOUT_S, MAX_HEADER_LINES = 5.0, 100  # a scrape's request: read within, at most
BUCKETS_MS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
HELP = {
    "ttft_ms": "time to first token seen by the router",
    "tpot_ms": "time per output token after the first, per request",
    "itl_ms": "gap between consecutive tokens",
    "route_ms": "routing decision (prefix look-up in Redis + scoring)",
    "route_lookup_ms": "the prefix look-up's round trip to Redis, part of route_ms",
    "loop_lag_ms": "how late the router's event loop woke a 20 ms sleep (what every handler waits)",
    "refusal_ms": "from a request's arrival in the router to its refusal (RESOURCE_EXHAUSTED)",
    "before_handler_ms": "how long a call waited in gRPC's queue before the router's handler took it",
}


class Metrics:
    """Owns the router's histograms and counters."""

    def __init__(self, gauges=None) -> None:
        self.hist: dict[str, list] = {}
        self.counters: dict[str, int] = {}
        self.labeled: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}  # (name, labels) -> count
        self.gauges = gauges  # optional async () -> {name: value}, read at each scrape
        self._server: asyncio.base_events.Server | None = None

    def observe(self, name: str, value_ms: float) -> None:
        h = self.hist.setdefault(name, [[0] * (len(BUCKETS_MS) + 1), 0.0, 0])
        h[0][bisect.bisect_left(BUCKETS_MS, value_ms)] += 1
        h[1] += value_ms
        h[2] += 1

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def count_labeled(self, name: str, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.labeled[key] = self.labeled.get(key, 0) + 1

    def render(self, gauges: dict[str, float] | None = None) -> str:
        lines = []
        for name, (buckets, total, count) in sorted(self.hist.items()):
            metric = f"pdserve_router_{name}"
            lines += [f"# HELP {metric} {HELP.get(name, name)}", f"# TYPE {metric} histogram"]
            cum = 0
            for bound, n in zip(BUCKETS_MS, buckets, strict=False):
                cum += n
                lines.append(f'{metric}_bucket{{le="{bound}"}} {cum}')
            lines.append(f'{metric}_bucket{{le="+Inf"}} {count}')
            lines += [f"{metric}_sum {total}", f"{metric}_count {count}"]
        for name, value in sorted(self.counters.items()):
            lines += [f"# TYPE pdserve_router_{name}_total counter", f"pdserve_router_{name}_total {value}"]
        typed = set()
        for (name, labels), value in sorted(self.labeled.items()):
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE pdserve_router_{name}_total counter")
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"pdserve_router_{name}_total{{{text}}} {value}")
        for name, value in sorted((gauges or {}).items()):
            lines += [f"# TYPE pdserve_{name} gauge", f"pdserve_{name} {value}"]
        return "\n".join(lines) + "\n"

    async def serve(self, host: str, port: int) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                try:  # (no credential here: a caller that sends nothing, or without end, is let go)
                    async with asyncio.timeout(READ_TIMEOUT_S):
                        request = await reader.readline()
                        for _ in range(MAX_HEADER_LINES):
                            if await reader.readline() in (b"\r\n", b"\n", b""):
                                break
                except (TimeoutError, ValueError, ConnectionError):
                    return
                ok = request.split(b" ")[1:2] == [b"/metrics"]
                gauges = await self.gauges() if ok and self.gauges else None
                body = self.render(gauges).encode() if ok else b"not found\n"
                status = b"200 OK" if ok else b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                await writer.drain()
            finally:
                writer.close()

        self._server = await asyncio.start_server(handle, host, port)
        return self._server.sockets[0].getsockname()[1]
