"""A store client in its own process, for kvstore tests: `python -m tests.kv_peer OP ...`.

Blocks are deterministic from (seed, index), so any process can check what another wrote.
Prints one JSON line with the result; `hold-*` ops print READY and wait to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys

import grpc
import torch

from pdserve.kv.checksum import checksums_at
from pdserve.kv.layout import HashProfile, KVLayout
from pdserve.kvclient.store_client import StoreClient
from pdserve.kvclient.transfer import Transfer

LAYOUT = KVLayout(2, 2, 16, 64, "float32")  # 32 KiB blocks
PROFILE = HashProfile("f" * 64, LAYOUT)
LAYOUT_FLAG = "2,2,16,64,float32"
FINGERPRINT_FLAG = "f" * 64


def block_hash(seed: int, i: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest()


def block_data(seed: int, i: int, nbytes: int = LAYOUT.block_nbytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class Buffers:
    """Registered local memory holding n blocks (+1 for a tail)."""

    def __init__(self, transfer: Transfer, n: int, nbytes: int = LAYOUT.block_nbytes):
        self.nbytes = nbytes
        self.tensor = torch.zeros((n + 1) * nbytes, dtype=torch.uint8)
        transfer.register(self.tensor)

    def addr(self, i: int) -> int:
        return self.tensor.data_ptr() + i * self.nbytes

    def block(self, i: int) -> torch.Tensor:
        return self.tensor[i * self.nbytes : (i + 1) * self.nbytes]


def read_back(buf: Buffers, seed: int, start: int, n: int, res) -> dict:
    """A get's result, with `ok`: every block it counted (and its tail) holds the expected bytes."""
    ok = all(torch.equal(buf.block(j), block_data(seed, start + j)) for j in range(res.num_blocks))
    if res.has_tail:
        ok = ok and torch.equal(buf.block(n), block_data(seed, -1))
    return {"num_blocks": res.num_blocks, "has_tail": res.has_tail, "ok": ok, "slices": res.slices,
            "corrupt": res.corrupt}


async def run(args: argparse.Namespace) -> dict:
    transfer = Transfer()
    client = StoreClient(args.store, PROFILE, transfer)
    await client.connect()
    try:
        return await run_op(args, client, transfer)
    finally:
        await client.close()  # waits for releases still in flight


async def run_op(args: argparse.Namespace, client: StoreClient, transfer: Transfer) -> dict:
    hashes = [block_hash(args.seed, i) for i in range(args.start, args.start + args.n)]
    buf = Buffers(transfer, args.n)
    tail = f"req-{args.seed}" if args.tail else ""
    if args.op in ("put", "hold-put"):
        for j in range(args.n):
            buf.block(j).copy_(block_data(args.seed, args.start + j))
        if args.tail:
            buf.block(args.n).copy_(block_data(args.seed, -1))
        if args.op == "hold-put":
            alloc = await client.allocate(hashes, tail)
            half = len(alloc.slots) // 2
            await client.write(alloc.slots[:half], [buf.addr(j) for j in range(half)])
            print("READY", flush=True)
            await hold(client, alloc.lease_id)
        res = await client.put(hashes, [buf.addr(j) for j in range(args.n + (1 if tail else 0))], tail,
                               tail_ttl_ms=30_000)
        return {"written": res.written, "present": res.present, "pending": res.pending, "slices": res.slices}
    if args.op == "stale-put":  # a writer that stalls past its lease, then writes and commits anyway
        for j in range(args.n):
            buf.block(j).copy_(block_data(args.seed, args.start + j))
        alloc = await client.allocate(hashes, lease_ms=args.lease_ms)
        print("READY", flush=True)
        sys.stdin.readline()  # stalled (the test decides for how long)
        await client.write(alloc.slots, [buf.addr(j) for j in range(args.n)])
        try:
            await client.commit(alloc.lease_id, hashes, checksums_at([buf.addr(j) for j in range(args.n)], buf.nbytes))
        except grpc.aio.AioRpcError as e:
            return {"commit": e.code().name, "details": e.details()}
        return {"commit": "OK"}
    if args.op == "hold-get":
        resp = await client.pin(hashes, tail)
        print("READY", resp.lease_id, len(resp.slots), flush=True)
        await hold(client, resp.lease_id)
    if args.op == "get":
        res = await client.get(hashes, [buf.addr(j) for j in range(args.n)], tail, buf.addr(args.n))
        return read_back(buf, args.seed, args.start, args.n, res)
    if args.op == "watch":
        order, ok = [], True
        print("READY", flush=True)
        async for batch in client.watch(hashes, tail, timeout_s=args.timeout):  # (its lease ends with it)
            ok = ok and not await client.read_slots(batch.slots, [buf.addr(i) for i in batch.indices])
            for i in batch.indices:
                expected = block_data(args.seed, -1 if i == args.n else args.start + i)
                ok = ok and torch.equal(buf.block(i), expected)
                order.append(i)
        return {"order": order, "ok": ok}
    raise SystemExit(f"unknown op {args.op}")


async def hold(client: StoreClient, lease_id: str) -> None:
    """Keep the lease alive, as a live reader or writer does, until killed."""
    while True:
        await client.renew(lease_id)
        await asyncio.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("op")
    p.add_argument("--store", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tail", action="store_true")
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--lease-ms", type=int, default=0)
    result = asyncio.run(run(p.parse_args()))
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
