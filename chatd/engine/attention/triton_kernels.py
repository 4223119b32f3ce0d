"""Triton kernels for the paged KV cache: store this step's K/V, and attend over each sequence's pages.

`store_kv` writes new keys and values into their cache slots in one launch. `paged_attention`
is one kernel for a whole mixed batch (decodes and prefill chunks alike): a program owns one
(sequence, kv head, tile of queries) and its rows are (query token, query head) pairs of that kv
head's group, so every query head sharing a kv head reuses each K/V tile it loads (grouped-query
attention without copying K/V). It walks the context in tiles with an online softmax (flash
attention): a running row max `m`, a running denominator `l` and an unnormalised output, rescaled
whenever the max grows, so the scores are never materialised for the whole context.

A decode-only batch may split each context into parts (flash-decoding): grid axis 2 then names
the part, each part stores its normalised output and log-sum-exp, and `_merge_splits_kernel`
weighs them together. At small batches that gives every SM work instead of one program per
(sequence, kv head) reading a whole context alone.

An fp8 cache (float8_e4m3fn or float8_e5m2) is stored as clamp(x / scale) and read by widening
each tile to the queries' dtype (exact: every fp8 value is a bf16, fp16 and fp32 value); the key
scale joins the score scale and the value scale multiplies the output, so no tile is rescaled.

KV layout per layer: `[num_blocks, block_size, kv_heads, head_dim]`; slot = block * block_size +
offset. The launch shape depends only on the batch size, kv heads and the longest query run, and
nothing is read back to the host, so a decode-only step can be captured in a CUDA graph. This
module knows nothing of models, scheduling or `AttentionMetadata`; the backend adapts them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot on a GPU needs every tile dimension >= 16: smaller tiles are padded and masked
PREFILL_BLOCK_M = 64  # rows (query token x query head) per program when a step has prefill chunks
BLOCK_N = 64  # context positions per K/V tile; may span several pages
MAX_SPLITS = 16  # most parts a decode's context is split into (each gets at least one key tile)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,  # new K/V: [T, kv_heads, head_dim], last dim contiguous
    stride_cb, stride_cs, stride_ch,  # caches: [num_blocks, block_size, kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SATURATE_AT: tl.constexpr,  # an fp8 or float16 cache's largest finite value; 0 for another cache
):
    """One program per new token: its keys and values for every kv head, to the token's slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token)  # int64; < 0 for a padding token
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A padding token writes no heads (a where, not `slot >= 0 & ...`: the interpreter mistypes scalar & tensor).
    num_heads_written = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads_written) & (dims[None, :] < HEAD_DIM)
    page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    cache_at = page * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    new_k = tl.load(k + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    new_v = tl.load(v + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if SATURATE_AT > 0:  # scaled (fp8; 1.0 for float16), and saturated: a too-large value is stored as the largest, not inf or NaN
        new_k = tl.clamp(new_k.to(tl.float32) / k_scale, -SATURATE_AT, SATURATE_AT)
        new_v = tl.clamp(new_v.to(tl.float32) / v_scale, -SATURATE_AT, SATURATE_AT)
    tl.store(k_cache + cache_at, new_k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + cache_at, new_v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write this step's keys and values ([T, kv_heads, head_dim], views allowed) into their slots, one launch.

    slot_mapping: [T] int64; a negative slot is a padding token (CUDA-graph batches) and writes nothing.
    An fp8 cache gets clamp(k / k_scale) and clamp(v / v_scale), saturated at the format's largest value;
    a float16 cache gets k and v saturated at 65504 (unscaled, as `quantize_kv` stores them).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "the head_dim of new K/V must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    if num_tokens == 0:
        return
    saturate_at = torch.finfo(k_cache.dtype).max if k_cache.dtype in (*FP8_DTYPES, torch.float16) else 0.0
    if k_cache.dtype not in FP8_DTYPES:  # only fp8 is stored scaled
        k_scale = v_scale = 1.0
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), SATURATE_AT=saturate_at,
    )  # fmt: skip


@triton.jit
def _paged_attention_kernel(
    q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
    qk_scale,  # softmax scale x log2(e) x the key scale of an fp8 cache
    v_scale,  # the value scale of an fp8 cache (1.0 otherwise): multiplies the output
    split_out, split_lse,  # NUM_SPLITS > 1: per split, [T, heads, NUM_SPLITS, BLOCK_D] and [T, heads, NUM_SPLITS] fp32
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out: [T, heads, head_dim], last dim contiguous
    stride_cb, stride_cs, stride_ch,  # caches: [num_blocks, block_size, kv_heads, head_dim]
    stride_table,  # block_tables: [B, max_blocks]
    GROUP: tl.constexpr,  # query heads per kv head
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 caches: tl.dot would otherwise round to TF32
    NUM_SPLITS: tl.constexpr,  # > 1 only for decode-only launches: grid axis 2 splits the context
):
    """Program (sequence, kv head, query tile): rows are BLOCK_Q query tokens x GROUP query heads.

    Query j of a sequence with q_len new tokens and seq_len context sits at position
    seq_len - q_len + j and sees key positions 0 .. that position. Key tiles past the causal limit
    of the tile's last query are never loaded; a padding row (q_len 0) loads and stores nothing.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        first_token = 0
    else:
        split = 0
        first_token = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    num_prefix = seq_len - q_len  # cached context before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP  # which new token of the sequence each row serves
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = num_prefix + token  # [BLOCK_M]: the last key position each row may see
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q_at = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    queries = tl.load(q + q_at, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # Context this tile needs: up to its last query's position; none when the tile has no queries.
    num_tile_tokens = tl.minimum(tl.maximum(q_len - first_token, 0), BLOCK_Q)
    context_end = tl.where(num_tile_tokens > 0, num_prefix + first_token + num_tile_tokens, 0)

    # A split takes its share of the context, in whole key tiles; the last splits may get none.
    split_len = tl.cdiv(tl.cdiv(context_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_start = split * split_len
    key_end = tl.minimum(key_start + split_len, context_end)

    # Every row sees its range's first key (keys before a decode are all visible, and a prefill
    # row sees key 0), so the first tile makes each row max finite: no -inf - -inf below.
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_table
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < key_end
        # Each column finds its own page, so a tile may span pages; entries past the end are never read.
        page = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_at = page * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        # [BLOCK_N, BLOCK_D], in the queries' dtype (an fp8 cache widens exactly; its scales apply outside)
        keys = tl.load(k_cache + kv_at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(queries.dtype)
        values = tl.load(v_cache + kv_at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(queries.dtype)

        scores = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
        # Causal, and for every real row also "before context_end" (the tile's last query sees no further).
        visible = key_pos[None, :] <= query_pos[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        correction = tl.exp2(row_max - new_max)  # rescales what was summed under the old max
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        row_max = new_max

    result = acc * (v_scale / tl.where(row_sum > 0, row_sum, 1.0))[:, None]
    if NUM_SPLITS > 1:
        # This split's normalised output and its log2-sum-exp; _merge_splits_kernel weighs them.
        at = ((q_start + token).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        lse = row_max + tl.log2(tl.maximum(row_sum, 1e-30))  # -inf for a split with no keys
        tl.store(split_lse + at, lse, mask=row_valid)
        tl.store(split_out + at[:, None] * BLOCK_D + dims[None, :], result, mask=row_valid[:, None])
    else:
        out_at = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out + out_at, result.to(out.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _merge_splits_kernel(
    out, split_out, split_lse, query_start_loc, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (sequence, head) of a decode batch: out = sum of the splits' outputs, each weighted
    by its share of the softmax denominator, exp2(lse_split - max lse) / sum of those."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc + seq)
    has_query = tl.load(query_start_loc + seq + 1) > token  # a padding row has none
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    at = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits  # [BLOCK_S]
    # Scalar conditions enter masks through where(), not `&` (the interpreter mistypes scalar & tensor).
    split_valid = splits < tl.where(has_query, NUM_SPLITS, 0)
    lse = tl.load(split_lse + at, mask=split_valid, other=float("-inf"))
    # Splits with no keys (lse -inf) weigh 0; the floor keeps a padding row's all -inf from NaN.
    weights = tl.exp2(lse - tl.maximum(tl.max(lse, axis=0), -1e30))
    parts = tl.load(split_out + at[:, None] * BLOCK_D + dims[None, :], mask=split_valid[:, None], other=0.0)
    result = tl.sum(parts * weights[:, None], axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)  # [BLOCK_D]
    out_at = token.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out + out_at, result.to(out.dtype.element_ty), mask=dims < tl.where(has_query, HEAD_DIM, 0))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of each sequence's new queries over its whole paged context, into `out`.

    q, out: [T, heads, head_dim]; query_start_loc: [B + 1] int32; seq_lens: [B] int32 (context after
    this step, new K/V already stored); block_tables: [B, max_blocks] int32. Rows with seq_len 0 are
    padding and leave `out` untouched. The grid depends only on B, kv heads and max_query_len.
    num_splits: for a decode-only batch, how many parts each context is split into (None: enough
    to give the GPU's SMs work, see decode_splits). k_scale, v_scale: an fp8 cache holds K / k_scale
    and V / v_scale.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, f"heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
    assert q.stride(-1) == 1 and out.stride(-1) == 1, "the head_dim of q and out must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    if k_cache.dtype not in FP8_DTYPES:
        k_scale = v_scale = 1.0  # scales belong to fp8 caches; store_kv stores other caches as they are
    # A decode has one token, so its rows are just the group's query heads (padded up to a dot tile);
    # prefill chunks pack several tokens per program so K/V tiles serve more rows.
    block_m = max(MIN_DOT, triton.next_power_of_2(group))
    if max_query_len > 1:
        block_m = max(block_m, PREFILL_BLOCK_M)
    block_q = block_m // group
    if num_seqs == 0 or max_query_len == 0:
        return
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if max_query_len > 1:
        num_splits = 1
    elif num_splits is None:
        num_splits = decode_splits(num_seqs * num_kv_heads, q.device)
    split_out = split_lse = out  # unused unless the context is split
    if num_splits > 1:
        split_out = torch.empty(q.shape[0], num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        split_lse = torch.empty(q.shape[0], num_heads, num_splits, dtype=torch.float32, device=q.device)
    grid = (num_seqs, num_kv_heads, num_splits if num_splits > 1 else triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale * math.log2(math.e) * k_scale, v_scale,
        split_out, split_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=num_splits, num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, split_out, split_lse, query_start_loc, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip


def decode_splits(num_programs: int, device: torch.device) -> int:
    """Context splits per decode so a launch has about two programs per SM (flash-decoding).

    At batch 1 an 8-kv-head model has 8 programs for a GPU of 132 SMs: each reads its whole
    context alone. Splitting the context and merging the parts' softmax sums puts every SM to
    work. Depends only on the batch's shape, never its contents, so it is CUDA-graph safe.
    """
    if device.type != "cuda":
        return 1  # the CPU interpreter gains nothing from it; tests ask for splits explicitly
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, 2 * num_sms // max(num_programs, 1)))
