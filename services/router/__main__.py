"""`python -m services.router`: the client-facing router process."""

from __future__ import annotations

import asyncio

from pdserve import logs
from pdserve.cluster import connect
from pdserve.cluster.index_mirror import IndexMirror
from pdserve.cluster.keys import RedisKeys
from pdserve.engine.mock_runner import served_profile
from pdserve.model.chat_template import ChatTemplate
from pdserve.model.config import parse_dtype
from pdserve.model.spec import describe
from pdserve.runtime import auth, gc_tuning
from pdserve.runtime.server import build_server
from pdserve.runtime.service import parse_config, pin_cpus, run, write_port_file
from pdserve.runtime.tasks import cancel_and_wait, measure_loop_lag
from pdserve.v1 import router_pb2, router_pb2_grpc
from services.router.config import RouterConfig
from services.router.http.app import build_app
from services.router.http.server import HttpServer
from services.router.metrics import Metrics
from services.router.router import Router
from services.router.servicer import RouterServicer
from services.router.status import status, store_gauges_shared
from services.router.workers import WorkerPool

log = logs.get("router")


async def main() -> None:
    cfg = parse_config(RouterConfig, "python -m services.router")
    pin_cpus(cfg.cpus)
    model = describe(cfg.model, parse_dtype(cfg.dtype))  # (no weights: config, tokenizer, fingerprint)
    profile = served_profile(model, cfg.block_size, mock=cfg.engine == "mock")
    redis = connect(cfg.redis_url, 0.5)
    keys = RedisKeys.for_url(cfg.redis_url, cfg.key_prefix)
    pool = WorkerPool(redis, keys, profile, cfg.refresh_s, auth.current().service_token)
    router: Router | None = None

    store = store_gauges_shared(cfg.store)

    async def gauges() -> dict[str, float]:
        return {**await store(), **(router.coef.gauges() if router else {})}

    metrics = Metrics(gauges=gauges)
    mirror = IndexMirror(connect(cfg.redis_url, 2.0),
                         keys) if cfg.index_mirror else None
    router = Router(cfg, model.tokenizer, profile, model.config.max_position_embeddings, model.config.vocab_size,
                    redis, pool, metrics, mirror)
    servicer = RouterServicer(router, lambda: status(router, cfg.store), cfg.stream_interval)

    def register(server) -> list[str]:
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        return [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name]

    # Accept messages well past our own prompt limit, so an oversized prompt gets a clear
    # INVALID_ARGUMENT from validation instead of the transport's bare RESOURCE_EXHAUSTED.
    handle = await build_server("router", register, cfg.host, cfg.port, cfg.grace_s,
                                max_message_bytes=4 * cfg.max_prompt_bytes + (1 << 20),
                                max_request_bytes=router.limits.encoder.max_request_bytes, client_facing=True)
    stopped = handle.install_signal_handlers()
    await pool.refresh()
    pool.start()
    if mirror is not None:
        mirror.start()
    if cfg.metrics_port >= 0:
        port = await metrics.serve(cfg.host, cfg.metrics_port)
        log.info("metrics", url=f"http://{cfg.host}:{port}/metrics")
    http = None
    if cfg.http_port >= 0:
        template = ChatTemplate.for_model(cfg.model)
        app = build_app(router, cfg.served_model_name or cfg.model, template, store)
        tls = auth.current().tls
        http = HttpServer(app, cfg.host, cfg.http_port, tls)
        await http.start()
        write_port_file(cfg.http_port_file, http.port)
        log.info("OpenAI-compatible HTTP API", url=f"{'https' if tls else 'http'}://{cfg.host}:{http.port}/v1",
                 chat_template="yes" if template else "none (chat requests refused)")
    lag = asyncio.create_task(measure_loop_lag(lambda ms: metrics.observe("loop_lag_ms", ms)), name="loop-lag")
    gc_tuning.tune()
    await handle.set_serving()
    write_port_file(cfg.port_file, handle.port)
    await stopped.wait()
    await cancel_and_wait(lag)
    if http is not None:
        await http.stop()
    router.limits.encoder.close()
    try:
        await asyncio.wait_for(pool.stop(), timeout=2.0)
        if mirror is not None:
            await asyncio.wait_for(mirror.stop(), timeout=2.0)
        await asyncio.wait_for(redis.aclose(), timeout=2.0)
    except TimeoutError:
        log.warning("teardown of the worker pool or Redis did not finish in time")


if __name__ == "__main__":
    run("router", main)
