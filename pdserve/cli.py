"""`pdserve` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from pdserve.engine.sampling_params import SamplingParams


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.router:
        return _generate_remote(args)
    if not args.local:
        print("pdserve generate: give --router HOST:PORT, or --local to run the engine here", file=sys.stderr)
        return 2
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.model.config import parse_dtype
    from pdserve.model.loader import load_model
    from pdserve.model.tokenizer import TextStream

    params = _sampling(args)
    loaded = load_model(args.model, parse_dtype(args.dtype))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size))
    prompt_ids = loaded.tokenizer.encode(args.prompt)
    t0 = time.perf_counter()
    engine.add_request("local", prompt_ids, params)
    stream = TextStream(loaded.tokenizer)
    token_ids: list[int] = []
    logprobs: list[float] = []
    ttft = None
    finish = None
    while engine.has_work():
        for ev in engine.step():
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            token_ids.append(ev.token_id)
            logprobs.append(ev.logprob)
            finish = ev.finish_reason
            piece = stream.push(ev.token_id)
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    total = time.perf_counter() - t0
    text = loaded.tokenizer.decode(token_ids)
    if args.json:
        print(json.dumps({
            "model": args.model, "prompt_tokens": len(prompt_ids), "token_ids": token_ids, "text": text,
            "logprobs": logprobs, "finish_reason": finish.value if finish else None,
            "ttft_ms": round((ttft or 0.0) * 1e3, 3), "total_ms": round(total * 1e3, 3),
        }))
    else:
        sys.stdout.write(stream.flush() + "\n")
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    from pdserve.client import Client, Result

    params = _sampling(args)  # validates before any call
    kwargs = dict(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                  top_p=params.top_p, seed=params.seed, ignore_eos=params.ignore_eos)
    with Client(args.router, timeout_s=args.timeout_s, api_key=args.api_key, ca_path=args.tls_ca or None) as c:
        for item in c.generate_streamed(args.prompt, **kwargs):
            if isinstance(item, Result):
                if args.json:
                    print(json.dumps({"request_id": item.request_id, "token_ids": item.token_ids, "text": item.text,
                                      "logprobs": item.logprobs, "finish_reason": item.finish_reason,
                                      "prompt_tokens": item.usage["prompt_tokens"], "usage": item.usage,
                                      "ttft_ms": item.timings["ttft_ms"], "timings": item.timings,
                                      "route": item.route}))
                else:
                    sys.stdout.write("\n")
            elif not args.json:
                sys.stdout.write(item.text)
                sys.stdout.flush()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pdserve.client import Client
    from pdserve.status_table import render

    with Client(args.router, api_key=args.api_key, ca_path=args.tls_ca or None) as c:
        print(render(c.status()))
    return 0


def _add_router_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--router", required=required, default="", help="HOST:PORT of a pdserve router")
    p.add_argument("--api-key", default=None, help="the router's API key (default: env PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=os.environ.get("PDSERVE_TLS_CA", ""),
                   help="PEM CA of a router serving TLS (default: env PDSERVE_TLS_CA; none: plaintext)")


def build_parser(benches: bool = True) -> argparse.ArgumentParser:
    """Every subcommand; `benches` False leaves out the benches' own flags (`main` for a non-bench command)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="prefill/decode-disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text")
    _add_router_flags(gen, required=False)
    gen.add_argument("--local", action="store_true", help="run the engine in this process")
    gen.add_argument("--model", default="tiny", help="'tiny' (built in) or a Hugging Face checkpoint directory")
    gen.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--num-blocks", type=int, default=2048)
    gen.add_argument("--timeout-s", type=float, default=120.0, help="--router: the request's deadline, in seconds")
    _add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="workers, store and hit rates of a running deployment")
    _add_router_flags(st, required=True)
    st.set_defaults(func=cmd_status)

    from pdserve import up

    up.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (numbers, not tests)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    if not benches:
        return parser
    # (only for a bench: they import torch, which costs a client command seconds to start)
    from pdserve.bench import (
        api_bench,
        capacity_bench,
        compare_bench,
        engine_bench,
        handoff_bench,
        kvstore_bench,
        row_ops_bench,
        serve_bench,
    )

    engine_bench.add_parser(bench_sub)
    kvstore_bench.add_parser(bench_sub)
    handoff_bench.add_parser(bench_sub)
    serve_bench.add_parser(bench_sub)
    api_bench.add_parser(bench_sub)
    compare_bench.add_parser(bench_sub)
    capacity_bench.add_parser(bench_sub)
    row_ops_bench.add_parser(bench_sub)
    return parser


def prepare_bench() -> None:
    """A bench process: its logs (a slow collection's warning, say) to stderr, since stdout
    carries the --json document alone; the stacks it starts run with auth on, like any other."""
    from pdserve import logs
    from pdserve.runtime import auth

    logs.configure("bench", level="WARNING")
    auth.ensure_stack_secrets()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(benches=argv[:1] == ["bench"]).parse_args(argv)
    if args.command == "bench":
        prepare_bench()
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # stdout closed early (`pdserve status | head`): ended as by SIGPIPE, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's own flush would fail too)
        return 128 + signal.SIGPIPE
    except (ValueError, FileNotFoundError) as e:  # bad arguments: a model path that is not there, say
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - typed client errors, one line for the terminal
        from pdserve.errors import PdserveError

        if isinstance(e, PdserveError):
            print(f"pdserve: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
