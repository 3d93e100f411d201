"""The OpenAI-compatible HTTP API (FastAPI), over the same `Router` the gRPC servicer calls.

Every `/v1` route takes the deployment's API keys (`Authorization: Bearer`), as the gRPC API
does; `/health` and `/metrics` are open, like gRPC health. A client that disconnects cancels its
request: the stream's task is cancelled (Starlette), or, for a whole response, the handler is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdserve import logs
from pdserve.model.chat_template import ChatTemplate, TemplateError
from pdserve.runtime import auth
from services.router.http import schema
from services.router.http.choices import ChoiceJob, run
from services.router.http.errors import ApiError, describe, error_body, sse_error
from services.router.http.middleware import TOO_LARGE, Accounting, too_large_body
from services.router.http.responses import Shape
from services.router.router import Router

log = logs.get("router.http")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def build_app(router: Router, model_name: str, template: ChatTemplate | None, gauges=None) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Accounting, metrics=router.metrics, max_body_bytes=router.limits.encoder.max_request_bytes)
    started = int(time.time())
    metrics = router.metrics

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # never a traceback to the client
        log.exception("HTTP handler failed", path=request.url.path)
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500 else
                                       "server_error", None, None), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        decode = len(router.pool.usable("decode"))
        body = {"status": "ok" if decode else "unavailable", "decode_workers": decode,
                "prefill_workers": len(router.pool.usable("prefill"))}
        return JSONResponse(body, status_code=200 if decode else 503)

    @app.get("/metrics")
    async def prometheus():
        own = {"router_active_requests": len(router.active), "router_queued_requests": router.admission.queued}
        return PlainTextResponse(metrics.render({**(await gauges() if gauges else {}), **own}),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        if (refused := _refusal(request)) is not None:
            return refused
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                             "owned_by": "pdserve", "max_model_len": router.limits.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, schema.CompletionBody, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, schema.ChatBody, chat=True)

    async def _serve(request: Request, model_cls, chat: bool) -> Response:
        if (refused := _refusal(request)) is not None:
            return refused
        try:
            body = model_cls.model_validate_json(await request.body())
            if body.model != model_name:
                raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves "
                               f"{model_name!r}", param="model", code="model_not_found", kind="not_found_error")
            opts = schema.chat_options(body) if chat else schema.completion_options(body)
            prompts = await (_chat_prompt(body) if chat else _completion_prompts(body, opts.n))
            shape = Shape(chat, model_name, router.tokenizer, opts.logprobs, len(prompts) * opts.n, opts.include_usage,
                          router.cfg.stream_interval)
            shape.n, shape.prompt_tokens = opts.n, [len(p) for p in prompts]
            jobs = [_job(shape.id, p * opts.n + i, ids, opts) for p, ids in enumerate(prompts) for i in range(opts.n)]
            if opts.stream:
                return await _until_gone(request, _stream(shape, run(router, jobs)))
            return JSONResponse(await _until_gone(request, _whole(shape, run(router, jobs))))
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            return JSONResponse(error_body(f"{param}: {first.get('msg')}" if param else first.get("msg", str(e)),
                                           "invalid_request_error", param or None, None), status_code=400)
        except ClientGone:
            return Response(status_code=499)
        except ClientDisconnect:  # (or a body that ran past the limit: the middleware said so)
            if (limit := request.scope.get(TOO_LARGE)) is not None:
                return JSONResponse(too_large_body(limit), status_code=413)
            return Response(status_code=499)
        except Exception as e:
            return _error_response(e)

    def _job(base_id: str, index: int, ids: list[int], opts: schema.Options) -> ChoiceJob:
        wanted = opts.max_tokens
        if wanted is None:  # chat without a limit: what the context leaves, up to the cap
            wanted = max(1, min(router.cfg.max_tokens_cap, router.limits.max_model_len - len(ids)))
        seed = opts.params.seed + index % opts.n if opts.params.seed is not None else None
        params = router.limits.sampling(replace(opts.params, max_tokens=wanted, seed=seed), len(ids))
        return ChoiceJob(index, f"{base_id}-{index}", ids, params, opts.stop)

    async def _completion_prompts(body: schema.CompletionBody, n: int) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(p) * n > schema.MAX_CHOICES:  # (before any is tokenized: each would start a generation)
            raise ApiError(400, f"{len(p)} prompts with n={n} ask for {len(p) * n} generations, at most "
                           f"{schema.MAX_CHOICES} per request: send them in several", param="prompt")
        check = router.limits.prompt_ids
        return [await check(x, None) if isinstance(x, str) else await check(None, x) for x in p]

    async def _chat_prompt(body: schema.ChatBody) -> list[list[int]]:
        if template is None:
            raise ApiError(400, f"the model {model_name!r} has no chat template (no chat_template in its "
                           "tokenizer_config.json, no chat_template.jinja): use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            text = template.render(schema.message_text(body.messages), add_generation_prompt=True)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from e
        return [await router.limits.prompt_ids(text, None, add_special_tokens=False)]

    return app


def _refusal(request: Request) -> Response | None:
    """401 unless the request carries a key the deployment issued (None: it may go on)."""
    creds = auth.current()
    if creds.insecure:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        message = "no API key: send 'Authorization: Bearer <key>' (the key `pdserve up` printed)"
    elif creds.caller(token.strip()) is None:
        message = "the API key is not recognised"
    else:
        return None
    return JSONResponse(error_body(message, "authentication_error", None, "invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def _error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = describe(exc)
    if status >= 500 and not isinstance(exc, ApiError):
        log.warning("request failed", status=status, error=body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


async def _whole(shape: Shape, events: AsyncIterator) -> dict:
    async for ev in events:
        shape.add(ev)
    return shape.whole()


async def _stream(shape: Shape, events: AsyncIterator) -> StreamingResponse:
    """Waits for the first event, so a request refused before its first token gets its HTTP
    status; after that, an error is one SSE `error` event, then `[DONE]`."""
    first = await anext(events)

    async def body():
        try:
            for c in shape.opening():
                yield c
            ev = first
            while True:
                if chunk := shape.chunk(ev):
                    yield chunk
                try:
                    ev = await anext(events)
                except StopAsyncIteration:
                    break
            for c in shape.closing():
                yield c
        except Exception as e:
            for c in shape.pending_chunks():
                yield c
            yield sse_error(e)
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_gone(request: Request, work: Awaitable):
    """`work`'s result, unless the client disconnects first: then `work` is cancelled."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()

