"""Triton kernels of the CUDA path (imported only where Triton is installed; see triton_attention)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _rope(x, partner, cos, sin, sign):
    """The rotary embedding of x (rotate-half: partner is x with its halves swapped, sign -1 on the
    first half), each product rounded to x's dtype before the sum, as the model's modules round it."""
    dtype = x.dtype
    return (
        (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
        + (sign * partner.to(tl.float32) * sin).to(dtype).to(tl.float32)
    ).to(dtype)


@triton.jit
def paged_decode(
    q_ptr,
    kn_ptr,
    vn_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    blocks_ptr,
    lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    cos_ptr,
    sin_ptr,
    scale,
    window,
    chunk,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_cb,
    KVH: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FUSED_WRITE: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTARY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (sequence, kv head, split): the split's `chunk` keys of the context. With SPLIT,
    each program leaves its running maximum, sum and unnormalised output for merge_splits; the
    first split also stores the new key and value and counts the new token. ROTARY: the query and
    the new key come unrotated, with each sequence's cos and sin rows (the new token's position);
    the rotary embedding is applied as they are read (the stored key rotated). PDL (programmatic
    dependent launch, Hopper on): launched before the kernel before it (the qkv product) ends, the
    program waits for it before it reads anything."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, D_PAD)
    g = tl.arange(0, G_PAD)
    dmask = d < D
    gmask = g < G
    heads = kvh * G + g
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    if ROTARY:
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * stride_cb + d, mask=dmask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_cb + d, mask=dmask, other=0.0).to(tl.float32)
        q = _rope(
            q,
            tl.load(q_rows + partner[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0),
            cos[None, :],
            sin[None, :],
            sign[None, :],
        )
    length = tl.load(lens_ptr + b)
    pos = length - 1  # the new token's position
    row = KVH * D  # one cache slot
    if FUSED_WRITE:
        k_new = tl.load(kn_ptr + b * stride_kb + kvh * stride_kh + d, mask=dmask, other=0.0)
        if ROTARY:
            k_new = _rope(
                k_new,
                tl.load(kn_ptr + b * stride_kb + kvh * stride_kh + partner, mask=dmask, other=0.0),
                cos,
                sin,
                sign,
            )
        v_new = tl.load(vn_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask, other=0.0)
        slot = tl.load(slots_ptr + b).to(tl.int64)  # offsets past 2**31 elements in a large cache
        first = dmask & (split == 0)
        tl.store(kc_ptr + slot * row + kvh * D + d, k_new, mask=first)
        tl.store(vc_ptr + slot * row + kvh * D + d, v_new, mask=first)
        end = pos  # the cache holds [0, pos); the new token comes from registers
    else:
        end = length  # the cache was written before: [0, length)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)  # key j is visible when j > pos - window
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    lo = tl.maximum(lo, split * chunk)  # this split's keys: [lo, end)
    end = tl.minimum(end, split * chunk + chunk)
    t0 = (lo // TILE) * TILE
    for start in range(t0, end, TILE):
        t = start + tl.arange(0, TILE)
        tmask = (t < end) & (t >= lo)
        block = tl.load(blocks_ptr + b * stride_tb + t // BLOCK, mask=tmask, other=0)
        slots = block.to(tl.int64) * BLOCK + t % BLOCK
        kv_off = slots[:, None] * row + kvh * D + d[None, :]
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        s = s * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # rows that have seen no visible key yet keep m = -inf; exp(-inf - -inf) would be nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if FUSED_WRITE:
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        s_new = tl.where(split == 0, s_new, float("-inf"))  # the new token counts once, in the first split
        m_new = tl.maximum(m, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p_new = tl.exp(s_new - m_safe)
        total = total * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    if SPLIT:
        part = ((b * KVH + kvh) * tl.num_programs(2) + split) * G_PAD + g
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, total)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc)
    else:
        out = acc / total[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )


@triton.jit
def merge_splits(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    splits,
    KVH: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
):
    """One program per (sequence, kv head): paged_decode's splits combined into the attention output."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    g = tl.arange(0, G_PAD)
    base = (b * KVH + kvh) * splits
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    for i in range(splits):
        m = tl.maximum(m, tl.load(part_m_ptr + (base + i) * G_PAD + g))
    m = tl.where(m == float("-inf"), 0.0, m)  # (every row has a key, the new token at least: a guard)
    total = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    for i in range(splits):
        part = (base + i) * G_PAD + g
        w = tl.exp(tl.load(part_m_ptr + part) - m)  # a split with no key: exp(-inf) = 0
        total += w * tl.load(part_l_ptr + part)
        acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :])
    out = acc / total[:, None]
    heads = kvh * G + g
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < G)[:, None] & (d < D)[None, :],
    )


@triton.jit
def _gemv_weights(rows, k, nmask, K, EVEN_K: tl.constexpr):
    """One BLOCK_N x BLOCK_K tile of the weight's rows, read once (evicted first from the cache)."""
    if EVEN_K:
        return tl.load(rows + k[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
    return tl.load(rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _gemv_input(
    x_ptr, nw_ptr, k, K, rstd, dtype: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr
):
    """The product's input at columns k, in float32, after its prologue: NORM, the RMS norm (x * rstd,
    rounded to the model's dtype, times the norm's weight, rounded again, as the model computes it);
    SILU, silu(gate) * up of x = [gate | up] (K each), each rounded as the model rounds it."""
    kmask = k < K
    if EVEN_K:  # noqa: SIM108 (a constexpr branch: one load compiled)
        x = tl.load(x_ptr + k).to(tl.float32)
    else:
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
    if SILU:
        up = tl.load(x_ptr + K + k, mask=kmask, other=0.0).to(tl.float32)
        x = ((x * tl.sigmoid(x)).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    return x


@triton.jit
def gemv(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    nw_ptr,
    res_ptr,
    N,
    K,
    stride_w,
    eps,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """out [N] = W [N, K] @ f(x) [K] (+ bias) (+ residual), one program per BLOCK_N rows of W: each
    streams its rows' BLOCK_N x BLOCK_K tiles once, multiplying in float32 into a tile-shaped
    accumulator that is summed across K only at the end. f: the input's prologue (_gemv_input); the
    residual is added to the product rounded to the output's dtype, as the model's sum is.

    PDL (programmatic dependent launch, Hopper on): the program reads its first weight tile, which no
    earlier kernel writes, before waiting for the kernel before it to finish; EARLY, it then lets the
    next kernel launched so start at once (in a chain of products the next weights stream while this
    one ends)."""
    dtype = out_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    k = tl.arange(0, BLOCK_K)
    w = _gemv_weights(rows, k, nmask, K, EVEN_K)
    if PDL:
        gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    rstd = 0.0
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = w.to(tl.float32) * _gemv_input(x_ptr, nw_ptr, k, K, rstd, dtype, EVEN_K, NORM, SILU)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _gemv_weights(rows, k0 + k, nmask, K, EVEN_K)
        acc += w.to(tl.float32) * _gemv_input(x_ptr, nw_ptr, k0 + k, K, rstd, dtype, EVEN_K, NORM, SILU)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(dtype), mask=nmask)
