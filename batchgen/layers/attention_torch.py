"""Paged-KV-cache attention in plain PyTorch: runs on CPU and GPU, and is the correctness reference for the Triton ops.

Cache layout: k_cache, v_cache are (num_blocks, block_size, num_kv_heads, head_dim); token slot s lives at
block s // block_size, offset s % block_size. Grouped-query attention maps query head h to kv head h // group.
With a sliding window W, the query at position p attends to key positions p - W < k <= p (transformers' and vLLM's
convention); the cache still holds every position. With a soft cap C (Gemma 2's attn_logit_softcapping), each scaled
score s becomes C * tanh(s / C) before the mask and softmax, as transformers computes it.

An fp8 cache (float8_e4m3fn, engine.kv_cache_dtype=fp8) holds K/V with a per-tensor scale of 1.0, as vLLM's does
without calibrated scales: storing clamps to the format's range, reading converts back.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; fp8 has no infinity, so values past its range are clamped rather than made NaN."""
    if cache_dtype == FP8_DTYPE:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def _as_copyable(x: torch.Tensor) -> torch.Tensor:
    """x itself, or an fp8 tensor's bytes: index_copy_ has no float8 kernel on CPU."""
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x


def store_kv(
    k: torch.Tensor,  # (T, KVH, D)
    v: torch.Tensor,  # (T, KVH, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 for padding rows
) -> None:
    """Writes each token's K/V into its cache slot; rows with slot -1 write nothing.

    Fixed shapes and no host sync, so a decode step that includes it can be captured in a CUDA graph: instead of
    dropping padding rows (a data-dependent shape), they rewrite exactly what the first real row writes (or, with no
    real row, the value already in the target slot), and duplicate writes of identical values are harmless.
    """
    if slot_mapping.numel() == 0:
        return
    valid = slot_mapping >= 0  # (T,)
    # Indexing with 0-dim tensors would sync with the host; index_select with (1,) indices does not.
    first_valid = torch.argmax(valid.to(torch.int32)).view(1)  # (1,), row 0 when no row is valid
    first_is_valid = valid.index_select(0, first_valid)[:, None, None]  # (1, 1, 1)
    fallback_slot = slot_mapping.index_select(0, first_valid).clamp(min=0)  # (1,)
    target = torch.where(valid, slot_mapping, fallback_slot)  # (T,)
    row_valid = valid[:, None, None]  # (T, 1, 1)
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat_cache = cache.view(-1, *cache.shape[2:])  # (NB * BS, KVH, D)
        rows = to_cache_dtype(new, cache.dtype)
        first_row = rows.index_select(0, first_valid)  # (1, KVH, D)
        fallback = torch.where(first_is_valid, first_row, flat_cache.index_select(0, fallback_slot))  # (1, KVH, D)
        _as_copyable(flat_cache).index_copy_(0, target, _as_copyable(torch.where(row_valid, rows, fallback)))


def _eager_fused(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether attention runs through torch's fused kernel (_attend_fused): on CPU, where steps are eager and the
    masked products (_attend) cost several passes over the gathered K and V (their permuted copies, the masked
    fill). CUDA (the reference for the Triton kernels, captured in graphs) and soft caps keep the masked products."""
    return softcap is None and q.device.type == "cpu"


def _attend(
    q: torch.Tensor,  # (B, L, KVH, G, D)
    k: torch.Tensor,  # (B, N, KVH, D)
    v: torch.Tensor,  # (B, N, KVH, D)
    allowed: torch.Tensor,  # (B, L, N) bool
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # (B, L, KVH, G, D) float32; rows with nothing allowed are zeros
    # .float() also dequantizes an fp8 cache's K/V (scale 1.0): every fp8 value is exact in fp32.
    scores = torch.einsum("blkgd,bnkd->bkgln", q.float(), k.float()) * scale  # (B, KVH, G, L, N)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = allowed[:, None, None]  # (B, 1, 1, L, N)
    # A finite fill keeps fully masked rows NaN-free; zeroing masked probabilities afterwards makes those rows zeros.
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    # Slots never written (uninitialized cache memory) may hold NaN, and 0 * NaN is NaN: zero the unread values.
    v = v.float().masked_fill(~allowed.any(dim=1)[:, :, None, None], 0.0)
    return torch.einsum("bkgln,bnkd->blkgd", probs, v)


def _attend_fused(
    q: torch.Tensor,  # (B, L, KVH, G, D)
    k: torch.Tensor,  # (B, N, KVH, D): every position written (an unwritten slot's NaN would reach the output)
    v: torch.Tensor,  # (B, N, KVH, D): as k
    allowed: torch.Tensor,  # (B, L, N) bool
    scale: float,
) -> torch.Tensor:  # (B, L, KVH, G, D) float32; rows with nothing allowed are zeros
    """_attend by torch's scaled_dot_product_attention (query head h reads KV head h // G)."""
    batch, length, num_kv_heads, group, head_dim = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().reshape(batch, length, num_kv_heads * group, head_dim).transpose(1, 2),
        k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=allowed[:, None], scale=scale,
        enable_gqa=True)  # (B, H, L, D)
    out = out.transpose(1, 2).reshape(batch, length, num_kv_heads, group, head_dim)
    # A row with nothing allowed (a padding row) read only its first slot, which may be unwritten.
    return out.masked_fill(~allowed.any(dim=-1)[:, :, None, None, None], 0.0)


def _written_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                   block_size: int) -> torch.Tensor:  # (B, N) int64
    """The cache slot of each row's positions; a position past seq_len (a block's unwritten tail, the table's unused
    columns) takes the row's first slot instead, which is written, so a gather of these slots holds no
    uninitialized value."""
    slots = block_tables.long()[:, positions // block_size] * block_size + positions % block_size
    return torch.where(positions[None, :] < seq_lens[:, None], slots, slots[:, :1])


def decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    block_tables: torch.Tensor,  # (B, M) int32
    seq_lens: torch.Tensor,  # (B,) int, 0 for padding rows
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,
    shared_prefix_len: torch.Tensor | None = None,
    split_arrivals: torch.Tensor | None = None,
) -> torch.Tensor:  # (B, H, D)
    """One query token per sequence, attending to its first seq_len cache positions (the last sliding_window of
    them with a window), scores soft-capped at softcap when it is set; vectorized for CUDA graphs.
    shared_prefix_len (cascade attention's hint that every row starts with the same blocks) and split_arrivals (the
    Triton kernel's scratch counters) change nothing here: the reference reads every row's blocks in one pass (on
    CPU in two, where the rows' contexts differ enough: _halves_by_context)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    grouped_q = q.view(num_seqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, 1, KVH, G, D)
    fused = _eager_fused(q, softcap)
    halves = fused and _halves_by_context(seq_lens, k_cache.shape[1], block_tables.shape[1])
    if not halves:
        out = _decode_rows(grouped_q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, fused)
    else:
        out = torch.empty(grouped_q.shape, dtype=torch.float32, device=q.device)
        for rows, width in halves:
            out[rows] = _decode_rows(grouped_q[rows], k_cache, v_cache, block_tables[rows, :width], seq_lens[rows],
                                     scale, sliding_window, softcap, fused)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _halves_by_context(seq_lens: torch.Tensor, block_size: int, width: int) -> list[tuple[torch.Tensor, int]]:
    """The rows in two halves, the shorter contexts first, each with the table width its longest row needs, where the
    shorter half needs at most half the blocks of the longest row; else none. The fused path gathers every row's K
    and V up to the step's longest context, so a batch of mixed lengths would gather and attend over padding for
    most of its rows."""
    if seq_lens.shape[0] < 2:
        return []
    order = torch.argsort(seq_lens)
    half = seq_lens.shape[0] // 2
    short_width = max(1, -(-int(seq_lens[order[half - 1]]) // block_size))
    if 2 * short_width > width:
        return []
    return [(order[:half], short_width), (order[half:], width)]


def _decode_rows(
    grouped_q: torch.Tensor,  # (B, 1, KVH, G, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, M): M blocks cover every row's context
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    fused: bool,  # _eager_fused's answer for the step
) -> torch.Tensor:  # (B, 1, KVH, G, D) float32
    """decode_attention over these rows, their K and V gathered up to the table's width."""
    num_seqs, _, num_kv_heads, _, head_dim = grouped_q.shape
    block_size = k_cache.shape[1]
    max_positions = block_tables.shape[1] * block_size
    positions = torch.arange(max_positions, device=grouped_q.device)
    allowed = positions[None, :] < seq_lens[:, None]  # (B, M * BS)
    if sliding_window is not None:
        allowed &= positions[None, :] >= seq_lens[:, None] - sliding_window
    allowed = allowed[:, None, :]  # (B, 1, M * BS)
    gathered = (num_seqs, max_positions, num_kv_heads, head_dim)
    if fused:
        slots = _written_slots(block_tables, seq_lens, positions, block_size).view(-1)
        k, v = (cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(gathered)
                for cache in (k_cache, v_cache))
        return _attend_fused(grouped_q, k, v, allowed, scale)
    blocks = block_tables.reshape(-1).long()  # index_select gathers several times faster than fancy indexing
    k, v = (cache.index_select(0, blocks).view(gathered) for cache in (k_cache, v_cache))
    return _attend(grouped_q, k, v, allowed, scale, softcap)


def decode_early_read_limit(batch: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype,
                            cache_dtype: torch.dtype, device: torch.device) -> int:
    """As attention_triton's: these ops never launch with PDL, so they read nothing before a wait (0)."""
    return 0


def prefill_warm_up_contexts(head_dim: int, q_dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """As attention_triton's: one way to run every prefill step, which the start's short warm-up step covers."""
    return ()


def prefill_attention(
    q: torch.Tensor,  # (T, H, D)
    k_cache: torch.Tensor,  # (NB, BS, KVH, D)
    v_cache: torch.Tensor,  # (NB, BS, KVH, D)
    block_tables: torch.Tensor,  # (B, M) int32
    query_start_loc: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:  # (T, H, D)
    """Causal attention of each sequence's new tokens over its cached context (which includes the new tokens),
    scores soft-capped at softcap when it is set.

    Sequence b's queries q[qsl[b]:qsl[b+1]] sit at positions seq_len_b - q_len_b + i. max_query_len and max_seq_len
    are part of the shared ops interface (the Triton kernels size their grids with them); this loop does not need them.
    """
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    fused = _eager_fused(q, softcap)  # k and v below hold positions 0..seq_len - 1, all written
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        query_len = end - start
        if query_len == 0 or seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # (S, KVH, D)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)  # (L,)
        key_positions = torch.arange(seq_len, device=q.device)  # (S,)
        allowed = key_positions[None, :] <= query_positions[:, None]  # (L, S)
        if sliding_window is not None:
            allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
        grouped_q = q[start:end].view(1, query_len, num_kv_heads, group, head_dim)
        if fused:
            attended = _attend_fused(grouped_q, k[None], v[None], allowed[None], scale)  # (1, L, KVH, G, D)
        else:
            attended = _attend(grouped_q, k[None], v[None], allowed[None], scale, softcap)
        out[start:end] = attended.reshape(query_len, num_heads, head_dim).to(q.dtype)
    return out
