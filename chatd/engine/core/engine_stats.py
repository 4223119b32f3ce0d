"""EngineStats: the counters a server's metrics are made of, as one snapshot.

The scheduler fills it (`Scheduler.stats`: its queues, the KV pool and the prefix cache, the host
tier, speculative decoding's drafts), the engine adds how fast its queue drains, AsyncEngine its
open streams. Plain values: chatd/http reads them without knowing where each was counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters for metrics; totals count since the engine started."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by sequences
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_prompt_tokens: int  # tokens computed in prefill (including recompute after preemption)
    num_generation_tokens: int  # tokens sampled
    num_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_drafts: int = 0  # verify steps of a sequence (proposals of one or more tokens)
    num_request_streams: int = 0  # AsyncEngine only: requests whose output stream is still open
    # Prompt tokens computed per second in recent steps that left requests waiting: how fast a
    # queue drains (LLMEngine measures it; None until a queue has formed).
    queued_prefill_rate: float | None = None
    # The host KV tier (0 blocks: off).
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0
    host_cache_hits: int = 0  # prompt tokens copied back from the host instead of recomputed
    num_blocks_to_host: int = 0  # blocks copied out to the host
    num_blocks_from_host: int = 0  # blocks copied back to the device
