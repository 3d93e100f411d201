"""`pdserve up`: the whole stack on one machine — Redis, the store, N prefill and M decode workers
and the router, each its own process. Ctrl-C / SIGTERM stops everything it started, by pid, in
reverse order.

Redis: without `--redis-url` (or REDIS_URL) it starts a redis-server of its own, with a password
made for the run, which leaves with it. Given a URL, the stack's keys live under a prefix unique to
the run, or the one `--key-prefix` names if it holds no key there yet (one that does is refused:
the stack would join, and on exit delete, a deployment not its own); `up` deletes every key under
that prefix once its processes have stopped, so a user's Redis keeps nothing of the run
(`--keep-keys` to keep them).

`--store-nodes N` runs N store nodes (node-0 ... node-N-1), the workers spread over them in turn;
with `--cluster-store mooncake` it also starts a mooncake_master (from the transfer-engine wheel)
and every node puts the blocks leaving its DRAM into that shared cluster tier and fetches from it.

It makes the stack's credentials (a service token, one client API key) and prints the key as
`PDSERVE_API_KEY=<key>`, a line to paste into a shell for the SDK and the CLI."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import uuid

from pdserve.cluster import REDIS_DOWN
from pdserve.cluster.cleanup import delete_prefix, prefix_in_use
from pdserve.runtime import auth
from pdserve.runtime.launch import MooncakeMaster, RedisServer, ServiceProcess, redis_reachable


class Stack:
    """Owns every process `up` started."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.redis: RedisServer | None = None
        self.master: MooncakeMaster | None = None
        self.procs: list[ServiceProcess] = []
        self.router: ServiceProcess | None = None
        self.redis_url = ""  # set once the stack's Redis is known
        self.key_prefix = args.key_prefix or f"pdserve-up-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.log_dir = ""  # made once the arguments pass: a refused run leaves none behind
        self.http_port = 0  # the router's HTTP API port, once it serves

    def start(self) -> str:
        a = self.args
        if not 1 <= a.store_nodes <= min(a.prefill, a.decode):
            raise ValueError(f"--store-nodes {a.store_nodes}: each store node needs a prefill and a decode worker of "
                             f"its own (have {a.prefill} prefill, {a.decode} decode)")
        self.log_dir = a.log_dir or tempfile.mkdtemp(prefix=f"pdserve-up-{time.strftime('%Y%m%d-%H%M%S')}-")
        os.makedirs(self.log_dir, exist_ok=True)
        say(f"logs in {self.log_dir} (kept after stop)")
        if a.redis_url:
            if not redis_reachable(a.redis_url):
                raise RuntimeError(f"no Redis answers at {auth.redact_url(a.redis_url)}")
            # (Checked before redis_url is set: stop() deletes the prefix of a run that has one.)
            if a.key_prefix and self._prefix_in_use(a.redis_url, a.key_prefix):
                raise ValueError(f"--key-prefix {a.key_prefix}: {auth.redact_url(a.redis_url)} already holds keys "
                                 "under it (another deployment's?); name a prefix of this run's own, or none")
            self.redis_url = a.redis_url
            say(f"redis {auth.redact_url(a.redis_url)}, keys under {self.key_prefix}:")
        else:
            # Any local user can reach a loopback port: our Redis wants a password, given on its stdin.
            self.redis = RedisServer(password=secrets.token_urlsafe(24))  # (held before start: stop() ends it)
            self.redis.start()
            self.redis_url = self.redis.url
            say(f"started our own redis at {auth.redact_url(self.redis.url)}")
        # Secrets reach the processes by environment only: the Redis URL may hold a password, and
        # the stack's own service token and API key are fresh for this run.
        os.environ.update({**auth.stack_secrets(), "PDSERVE_REDIS_URL": self.redis_url})
        common = ["--key-prefix", self.key_prefix]
        model = ["--model", a.model, "--dtype", a.dtype, "--block-size", str(a.block_size), "--engine", a.engine]
        cluster: list[str] = []
        if a.cluster_store:
            self.master = MooncakeMaster(log_path=os.path.join(self.log_dir, "mooncake_master.log"))
            self.master.start()
            say(f"mooncake_master {self.master.address}")
            cluster = ["--cluster-store", a.cluster_store, "--cluster-master", self.master.address,
                       "--cluster-segment-bytes", str(a.cluster_segment_mib << 20)]
        stores = [self._add(ServiceProcess(
            "services.kvstore", *model, *common, "--device-bytes", str(a.store_device_mib << 20),
            "--dram-bytes", str(a.store_dram_mib << 20), *cluster,
            *(("--node", f"node-{n}") if a.store_nodes > 1 else ()),
            name=f"kvstore-{n}" if a.store_nodes > 1 else "kvstore", log_dir=self.log_dir))
            for n in range(a.store_nodes)]
        for s in stores:
            s.spawn()
        for s in stores:
            s.wait_ready()
            say(f"{s.name:<10}{s.address}")
        store = stores[0]
        workers = [self._add(ServiceProcess(f"services.{role}", *model, *common,
                                            "--store", stores[i % len(stores)].address,
                                            "--num-blocks", str(a.num_blocks), "--threads", str(a.threads),
                                            "--device", a.device, name=f"{role}-{i}", log_dir=self.log_dir))
                   for role, n in (("prefill", a.prefill), ("decode", a.decode)) for i in range(n)]
        for w in workers:
            w.spawn()
        for w in workers:
            w.wait_ready()
            say(f"{w.name:<10}{w.address}")
        http_port_file = os.path.join(self.log_dir, "router.http-port")
        self.router = self._add(ServiceProcess(
            "services.router", *model, *common, "--store", store.address, "--port", str(a.port),
            "--host", a.host, "--policy", a.policy, "--metrics-port", str(a.metrics_port),
            "--http-port", str(a.http_port), "--http-port-file", http_port_file, log_dir=self.log_dir))
        self.router.start()
        if a.http_port >= 0:
            self.http_port = int(open(http_port_file).read())
        address = f"{dial_host(a.host)}:{self.router.port}"
        self._wait_for_pool(address)
        return address

    @staticmethod
    def _prefix_in_use(url: str, prefix: str) -> bool:
        try:
            return prefix_in_use(url, prefix)
        except (*REDIS_DOWN, TimeoutError) as e:
            raise RuntimeError(f"could not check {auth.redact_url(url)} for keys under {prefix}: ({e})") from None

    def _add(self, proc: ServiceProcess) -> ServiceProcess:
        self.procs.append(proc)
        return proc

    def _wait_for_pool(self, address: str, timeout_s: float = 60) -> None:
        from pdserve.client import Client

        want = self.args.prefill + self.args.decode
        with Client(address) as c:
            deadline = time.time() + timeout_s
            while True:
                healthy = sum(1 for w in c.status().workers if w.healthy)
                if healthy == want:
                    return
                if time.time() > deadline:
                    raise RuntimeError(f"only {healthy} of {want} workers became healthy")
                time.sleep(0.2)

    def exited(self) -> list[str]:
        """What the stack cannot serve without and has lost: its services, and a Redis of its own
        (a mooncake_master is not among them: the services serve on without the cluster tier)."""
        dead = [p.name for p in self.procs if p.proc and p.proc.poll() is not None]
        if self.redis and self.redis.proc.poll() is not None:
            dead.append(f"redis-server (code {self.redis.proc.returncode})")
        return dead

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.master:
            self.master.stop()
        if self.redis:
            self.redis.stop()
        elif self.redis_url and not self.args.keep_keys:
            try:
                n = delete_prefix(self.redis_url, self.key_prefix)
                say(f"deleted {n} redis keys under {self.key_prefix}:")
            except (*REDIS_DOWN, TimeoutError) as e:
                say(f"could not delete the keys under {self.key_prefix}: ({e}); they expire on their own")


def say(msg: str) -> None:
    print(f"pdserve up: {msg}", file=sys.stderr, flush=True)


class Interrupted(BaseException):
    """SIGINT/SIGTERM before the stack serves: raised from the handler, so a wait in startup ends
    at once. A BaseException, like KeyboardInterrupt: no `except Exception` eats it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run(args: argparse.Namespace) -> int:
    stack = Stack(args)
    serving = threading.Event()  # set once the stack serves: a signal then stops it as the serving loop does (0)
    done = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        if not serving.is_set():
            raise Interrupted(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        address = stack.start()
        serving.set()  # (a signal from here on, during the demo too, is a plain stop)
        print(f"router at {address}", flush=True)
        print(f"{auth.ENV_API_KEY}={os.environ[auth.ENV_API_KEY]}", flush=True)  # to paste into a shell
        if stack.http_port:
            print(f"OpenAI API at http://{dial_host(args.host)}:{stack.http_port}/v1", flush=True)
        if args.demo_prompt and not done.is_set():
            _demo(address, args.demo_prompt, args.demo_max_tokens)
        if not args.exit_after_demo:
            say("serving; Ctrl-C stops everything")
            return _serve(stack, done)
        return 0
    except Interrupted as e:
        serving.set()
        say(f"{signal.Signals(e.signum).name} before the stack served: stopping what started")
        return 128 + e.signum  # as a shell reports a process a signal ended
    finally:
        serving.set()  # (a second signal must not cut stop() short)
        stack.stop()
        say(f"stopped; logs kept in {stack.log_dir}" if stack.log_dir else "stopped")


def _serve(stack: Stack, done: threading.Event) -> int:
    """Until a signal (0) or until a process the stack needs exits (1, naming it)."""
    master_gone = False
    while not done.wait(0.5):
        dead = stack.exited()
        if dead:
            say(f"stopping: {', '.join(dead)} exited")
            return 1
        if stack.master and not master_gone and stack.master.proc.poll() is not None:
            master_gone = True
            say(f"mooncake_master exited (code {stack.master.proc.returncode}): serving on without the cluster tier")
    return 0


def dial_host(host: str) -> str:
    """How a client on this machine writes the host of a server listening on `host`: a wildcard
    is reached over loopback, an IPv6 address is bracketed for host:port."""
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _demo(address: str, prompt: str, max_tokens: int) -> None:
    from pdserve.client import Client, Result

    say(f"first request: {prompt!r}")
    with Client(address) as c:
        for item in c.generate_streamed(prompt, max_tokens=max_tokens, ignore_eos=True):
            if isinstance(item, Result):
                print(flush=True)
                say(f"{item.usage['completion_tokens']} tokens, TTFT {item.timings['ttft_ms']:.1f} ms, "
                    f"total {item.timings['total_ms']:.1f} ms, prefill {item.route['prefill'] or '-'}, "
                    f"decode {item.route['decode']}")
            else:
                sys.stdout.write(printable(item.text))
                sys.stdout.flush()


def printable(text: str) -> str:
    """`text` as a terminal can show it: control characters (ESC sequences included) and other
    unprintable characters escaped, newlines and tabs kept."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else ascii(ch)[1:-1] for ch in text)


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start the whole stack on this machine")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--engine", default="real", choices=["real", "mock"], help="mock: cost-model timing, no compute")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="workers' device: auto (CUDA when torch sees a GPU) | cpu | "
                                                    "cuda | cuda:N")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV pages per worker")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050, help="router port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=-1, help="router /metrics port (-1: off)")
    p.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API's port (-1: off, "
                                                               "0: any free port)")
    p.add_argument("--log-dir", default="", help="where the services' logs go (default: a new directory in /tmp, "
                                                 "printed at start); kept after stop")
    p.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_loaded"])
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""),
                   help="a Redis to use (default: env REDIS_URL, else a redis-server of our own); its keys "
                        "under the run's prefix are deleted on exit")
    p.add_argument("--key-prefix", default="", help="Redis key prefix (default: one per run); refused when "
                                                    "--redis-url already holds keys under it")
    p.add_argument("--keep-keys", action="store_true", help="leave the run's keys in --redis-url on exit")
    p.add_argument("--store-device-mib", type=int, default=256)
    p.add_argument("--store-dram-mib", type=int, default=1024)
    p.add_argument("--store-nodes", type=int, default=1, help="store nodes; workers are spread over them in turn "
                                                               "(a prefill hands off to a decode of its own node)")
    p.add_argument("--cluster-store", default="", choices=["", "mooncake"],
                   help="mooncake: start a mooncake_master and give every store node the cluster tier below DRAM")
    p.add_argument("--cluster-segment-mib", type=int, default=256,
                   help="memory each store node gives the cluster tier (with --cluster-store)")
    p.add_argument("--demo-prompt", default="", help="send this request once the stack is up, streaming it")
    p.add_argument("--demo-max-tokens", type=int, default=48)
    p.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo request")
    p.set_defaults(func=run)
