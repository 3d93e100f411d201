"""What a prefill or decode worker sets up before serving: model, engine thread, KV pages
registered with the transfer engine, the store client, and its Redis registration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import logs
from pdserve.cluster.keys import RedisKeys
from pdserve.cluster.registry import Registration
from pdserve.engine.config import EngineConfig, Role
from pdserve.engine.device import describe
from pdserve.engine.engine import LLMEngine
from pdserve.engine.mock_runner import CostModel
from pdserve.kv.layout import HashProfile
from pdserve.kvclient.store_client import StoreClient
from pdserve.kvclient.transfer import Transfer
from pdserve.model.config import parse_dtype
from pdserve.model.loader import LoadedModel, load_model
from pdserve.runtime import auth
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_thread import EngineThread
from pdserve.worker.kv_pages import DirectPages, StagedPages, kv_pages

log = logs.get("worker")


@dataclass
class Worker:
    cfg: WorkerConfig
    role: Role
    model: LoadedModel
    engine: EngineThread
    profile: HashProfile
    transfer: Transfer
    store: StoreClient
    pages: DirectPages | StagedPages
    store_node: str = "local"  # the store node it is attached to (from the store's Info)
    device: str = "cpu"  # where its engine runs, as `pdserve status` shows it

    def registration(self, address: str) -> Registration:
        worker_id = self.cfg.worker_id or f"{self.role.value}-{address}"
        engine = self.engine.engine
        keys = RedisKeys.for_url(self.cfg.redis_url, self.cfg.key_prefix)
        return Registration(self.cfg.redis_url, keys, worker_id, self.role.value,
                            address, self.profile, lambda: self.engine.load,
                            lambda: engine.scheduler.pool.cached_hashes(), self.cfg.heartbeat_s,
                            service_token=auth.current().service_token, store_node=self.store_node,
                            shown={"device": self.device, "kv_path": self.pages.path})


async def start_worker(cfg: WorkerConfig, role: Role) -> Worker:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_model(cfg.model, parse_dtype(cfg.dtype))
    mock = CostModel.load(cfg.mock_cost).scaled(cfg.mock_scale) if cfg.engine == "mock" else None
    engine = LLMEngine(model, EngineConfig(role=role, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                                           max_num_batched_tokens=cfg.max_num_batched_tokens,
                                           max_num_seqs=cfg.max_num_seqs, mock_cost=mock, device=cfg.device,
                                           attention_backend=cfg.attention_backend,
                                           linear_weights=cfg.linear_weights))
    transfer = Transfer(cfg.te_host, cfg.te_protocol)
    longest = -(-engine.max_model_len // cfg.block_size)
    pages = kv_pages(engine.kv_cache, transfer, cfg.kv_path, cfg.kv_staging_blocks or 4 * longest,
                     cfg.store_timeout_ms / 1000)
    store = StoreClient(cfg.store, engine.profile, transfer, timeout_s=cfg.store_timeout_ms / 1000)
    info = await store.connect()
    if engine.profile.mismatch(info.profile):
        raise SystemExit(f"store at {cfg.store} serves another hash profile: {engine.profile.mismatch(info.profile)}")
    thread = EngineThread(engine)
    thread.start()
    device = describe(engine.device)
    attention = getattr(getattr(engine.runner, "attention_backend", None), "name", "none (mock)")
    linears = getattr(engine.runner, "linear_weights", "none (mock)")
    log.info("worker ready", role=role.value, model=cfg.model, fingerprint=model.fingerprint[:12], device=device,
             kv_path=pages.path, attention=attention, linears=linears, num_blocks=cfg.num_blocks, store=cfg.store,
             store_node=info.node, segment=transfer.segment)
    return Worker(cfg, role, model, thread, engine.profile, transfer, store, pages, info.node, device)
