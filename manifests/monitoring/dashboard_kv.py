"""The dashboard's KV row: the gateway's held-aware routing and its KV index, each runtime's KV tiers, and
peer pulls (a replica pulling a prompt's prefix from another's cache; docs/kv-cache.md)."""

from __future__ import annotations

from typing import Any

from dashboard_panels import GATEWAY, RATE, RUNTIME, panel, q


def kv_panels(y: int) -> list[dict[str, Any]]:
    """Routing by what is held (the gateway's decisions, lookups and index), then the runtimes' tiers: hits by
    tier, blocks held, the offload tier's traffic, occupancy and failures, its bytes resident; then peer
    pulls (peer_panels)."""
    moved = f"sum by (direction) (rate(goodput_kv_offload_bytes_total{{{RUNTIME}}}[{RATE}]))"
    spent = f"sum by (direction) (rate(goodput_kv_offload_seconds_total{{{RUNTIME}}}[{RATE}]))"
    used, bound = (f"sum(goodput_kv_offload_{s}_bytes{{{RUNTIME}}})" for s in ("used", "capacity"))
    return [
        panel(
            "Held routing: decisions and lookups",
            [
                q(
                    f'sum by (decision) (rate(goodput_gateway_routing_decisions_total{{{GATEWAY}, decision=~"held_.*"}}'
                    f"[{RATE}]))",
                    "{{decision}}",
                ),
                q(
                    f"sum by (result) (rate(goodput_gateway_held_lookups_total{{{GATEWAY}}}[{RATE}]))",
                    "lookup: {{result}}",
                ),
            ],
            "reqps",
            0,
            y,
            w=8,
            description="held_device / held_offload: the replica holding the longest run of the prompt's blocks "
            "won, its run starting on the device or in the offload tier. Lookups: hit, miss (the ring chose), "
            "stale (no replica's index synced), no_digests (the prompt's digests could not be had).",
        ),
        panel(
            "Gateway KV index: blocks",
            [q("max by (tier) (goodput_gateway_kv_index_blocks)", "{{tier}}")],
            "short",
            8,
            y,
            w=8,
            description="Prefix blocks the gateway's index holds over every synced replica, by tier (the largest "
            "over gateway pods: each holds its own index of the same replicas).",
        ),
        panel(
            "Gateway KV index: staleness",
            [q("max(goodput_gateway_kv_index_staleness_seconds)", "least recently heard replica")],
            "s",
            16,
            y,
            w=8,
            description="Seconds since the least recently heard replica's cache events; past three heartbeats "
            "(6 s) a replica's entries are ignored and its subscription made again.",
        ),
        panel(
            "Prefix cache hits by tier",
            [
                q(f"sum(rate(goodput_prefix_cache_hits_total{{{RUNTIME}}}[{RATE}]))", "every tier (tokens/s)"),
                q(f"sum(rate(goodput_kv_offload_hit_tokens_total{{{RUNTIME}}}[{RATE}]))", "offload tier (tokens/s)"),
                q(f"sum by (tier) (goodput_kv_tier_blocks{{{RUNTIME}}})", "blocks held: {{tier}}"),
            ],
            "short",
            0,
            y + 8,
            w=8,
            description="Prompt tokens served from cache instead of prefilled, and those loaded from the offload "
            "tier; the prefix blocks the runtimes hold per tier.",
        ),
        panel(
            "Offload tier: bytes moved",
            [
                q(moved, "{{direction}} (bytes/s)"),
                q(f"{moved} / {spent}", "{{direction}} throughput (bytes per busy second)"),
            ],
            "Bps",
            8,
            y + 8,
            w=8,
            description="Bytes written to the tier (offload, on its writer thread) and read back (reload: read, "
            "checked and copied into the KV cache), and the rate each runs at while busy.",
        ),
        panel(
            "Offload tier: occupancy and failures",
            [
                q(f"{used} / {bound}", "used / bound"),
                q(f"sum(rate(goodput_kv_offload_corrupt_total{{{RUNTIME}}}[{RATE}]))", "failed checks/s"),
                q(f"sum(rate(goodput_kv_offload_dropped_saves_total{{{RUNTIME}}}[{RATE}]))", "dropped saves/s"),
            ],
            "short",
            16,
            y + 8,
            w=8,
            description="The share of the tiers' bound in use; entries that failed their check (recomputed, never "
            "served) and evicted blocks not saved because the writer was behind.",
        ),
        panel(
            "Offload tier: bytes resident",
            [q(used, "resident"), q(bound, "bound")],
            "bytes",
            0,
            y + 16,
            w=8,
            description="Bytes of KV blocks the runtimes keep in their offload tiers, against the tiers' bound "
            "(--kv-offload-bytes) summed over the replicas; the oldest entries go first at the bound.",
        ),
        *peer_panels(y + 16),
    ]


def peer_panels(y: int) -> list[dict[str, Any]]:
    """Peer pulls: the gateway's (requests sent with one and the blocks they name, per service) and the
    runtimes' (pulls made and served, blocks and bytes moved, the time a pull takes)."""
    peer = f'{RUNTIME}, role=~"peer|holder"'
    seconds = "goodput_kv_transfer_seconds"
    pulled = f'{RUNTIME}, role="peer"'
    return [
        panel(
            "Peer pulls: requests and outcomes",
            [
                q(
                    f"sum by (service) (rate(goodput_gateway_peer_pulls_total{{{GATEWAY}}}[{RATE}]))",
                    "sent with a pull: {{service}}",
                ),
                q(
                    f"sum by (role, outcome) (rate(goodput_kv_transfers_total{{{peer}}}[{RATE}]))",
                    "{{role}}: {{outcome}}",
                ),
            ],
            "reqps",
            8,
            y,
            w=8,
            description="Requests the gateway sent with a peer pull (the chosen replica held at least "
            "--peer-pull-min-blocks fewer of the prompt's leading blocks than a holder); peer: pulls the "
            "chosen replicas made (failure: recomputed instead; why, by reason, in the hand-off panel), "
            "holder: pulls served from a replica's prefix cache.",
        ),
        panel(
            "Peer pulls: blocks",
            [
                q(
                    f"sum by (service) (rate(goodput_gateway_peer_pull_blocks_total{{{GATEWAY}}}[{RATE}]))",
                    "named by the gateway: {{service}}",
                ),
                q(f"sum by (role) (rate(goodput_kv_transfer_blocks_total{{{peer}}}[{RATE}]))", "{{role}}"),
            ],
            "short",
            16,
            y,
            w=8,
            description="Blocks per second: those the gateway's pulls named beyond what the chosen replica held "
            "(at most what moves), those the receivers landed (peer) and the holders read (holder).",
        ),
        panel(
            "Peer pulls: bytes",
            [q(f"sum by (role) (rate(goodput_kv_transfer_bytes_total{{{peer}}}[{RATE}]))", "{{role}}")],
            "Bps",
            0,
            y + 8,
            w=12,
            description="KV bytes received by the pulling replicas (peer) and sent by the holders (holder).",
        ),
        panel(
            "Peer pulls: time",
            [
                *(
                    q(
                        f"histogram_quantile({p}, sum by (le) (rate({seconds}_bucket{{{pulled}}}[{RATE}])))",
                        f"p{p * 100:g}",
                    )
                    for p in (0.5, 0.9)
                ),
                q(
                    f"sum(rate({seconds}_sum{{{pulled}}}[{RATE}])) / sum(rate({seconds}_count{{{pulled}}}[{RATE}]))",
                    "mean",
                ),
            ],
            "s",
            12,
            y + 8,
            w=12,
            description="A successful peer pull from its start to its blocks landing in the pulling replica's "
            "cache, bounded by --kv-transfer-timeout (role peer; a disaggregated hand-off is role decode).",
        ),
    ]
