"""EngineStats: the counters a server's metrics are made of, as one snapshot.

`scheduler_stats` reads it off the scheduler (its queues, the KV pool and the prefix cache, the host
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


def scheduler_stats(scheduler) -> EngineStats:
    """A snapshot of a Scheduler's queues, its KV pool, prefix cache and host tier, and its counters."""
    blocks, host = scheduler.block_manager, scheduler.block_manager.host
    drafts = scheduler.drafts
    return EngineStats(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting, num_preemptions=scheduler.num_preemptions,
        kv_cache_usage=blocks.usage, num_blocks=blocks.num_blocks, num_free_blocks=blocks.num_free_blocks,
        prefix_cache_queries=blocks.num_prefix_queries, prefix_cache_hits=blocks.num_prefix_hits,
        num_prompt_tokens=scheduler.num_prompt_tokens, num_generation_tokens=scheduler.num_generation_tokens,
        num_drafts=drafts.num_drafts, num_draft_tokens=drafts.num_draft_tokens,
        num_accepted_tokens=drafts.num_accepted_tokens,
        num_host_blocks=host.num_blocks, num_host_blocks_used=len(host.slots), host_cache_hits=host.num_hits,
        num_blocks_to_host=host.num_blocks_to_host, num_blocks_from_host=host.num_blocks_from_host,
    )
