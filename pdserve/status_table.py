"""`pdserve status` as a readable table."""

from __future__ import annotations

from pdserve.v1 import common_pb2, router_pb2

_ROLE = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode"}


def render(s: router_pb2.StatusResponse) -> str:
    rows = [("ROLE", "ADDRESS", "HEALTH", "DEVICE", "KV PATH", "QUEUED TOK", "RUNNING", "FREE KV", "NOTE")]
    for w in s.workers:
        rows.append((_ROLE.get(w.role, "?"), w.address, "ok" if w.healthy else "DOWN", w.device or "?",
                     w.kv_path or "?", str(w.load.queued_tokens),
                     str(w.load.running_requests), f"{w.load.free_kv_blocks}/{w.load.total_kv_blocks}",
                     ("refused: " + w.refused_reason[:60]) if w.refused_reason else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    index = f"   prefix index: {s.prefix_index}" if s.prefix_index else ""
    lines.append(f"redis: {'connected' if s.redis_connected else 'UNREACHABLE'}   routing: {s.routing}{index}")
    st = s.store
    if st.address:
        lines.append(f"store {st.address}: " + (
            f"device {st.device_used_blocks}/{st.device_capacity_blocks} blocks, dram {st.dram_used_blocks}/"
            f"{st.dram_capacity_blocks}, hits {st.hits}, misses {st.misses}, leases {st.active_leases}"
            if st.reachable else "UNREACHABLE"))
    for h in s.hit_rates:
        lines.append(f"hit rate {h.scope}: {h.ratio:.1%} ({h.hit_tokens}/{h.lookup_tokens} prompt tokens)")
    return "\n".join(lines)
