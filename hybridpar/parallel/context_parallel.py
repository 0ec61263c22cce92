"""Context parallelism (cp): attention over a sequence sharded along time on a cp group.

Every rank holds T local tokens (queries, keys and values of the same tokens) whose *global*
positions are ``q_pos``; all ranks hold the same T. The causal mask is built from global
positions (key j is visible to query i iff ``pos_j <= pos_i``), so any sharding is exact; the
zigzag sharding (``zigzag_positions``) balances the causal work. Two exact methods:

* ``allgather``: all-gather K, V (and positions) once, attend, and reduce-scatter dK, dV back
  to their owners in backward. Holds the full K, V; one collective each way.
* ``ring``: K, V travel around the ring ``r -> r+1`` in cp steps, each step's block attended
  while the next transfer flies; partial results merged by the online softmax
  (``merge_partials``). Backward recomputes each block's probabilities from the saved
  log-sum-exp, and (K, V, dK, dV) travel the same ring so dK, dV end at their owner.

Shapes follow ``hybridpar.models.transformer.Attention.core``: q (B, T, H, hd), k/v
(B, T, Hkv, hd), H = Hkv * rep, kv head g serving query heads g*rep .. g*rep+rep-1 (GQA).
Arithmetic is float32 (float64 for float64 inputs); outputs come back in the input dtype.
The collectives are ``all_gather_flat`` / ``reduce_scatter_flat`` and ``batch_isend_irecv``:
one code path on Gloo and NCCL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .collectives import all_gather_flat, reduce_scatter_flat

__all__ = ["zigzag_positions", "zigzag_index", "attention_block", "merge_partials",
           "allgather_attention", "ring_attention", "context_attention", "SequenceShard",
           "apply_context_parallel"]

_METHODS = ("ring", "allgather")


# ---------------------------------------------------------------- zigzag sharding

def _check_zigzag(seq_len: int, cp: int) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if not isinstance(seq_len, int) or seq_len < 1 or seq_len % (2 * cp):
        raise ValueError(f"zigzag sharding cuts the sequence into 2*cp = {2 * cp} equal chunks: "
                         f"seq_len must be a positive multiple of {2 * cp}, got {seq_len!r}")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank ``rank``: with c = seq_len / (2 cp), chunk ``rank``
    then chunk ``2 cp - 1 - rank``, i.e. [r c, (r+1) c) ++ [(2cp-1-r) c, (2cp-r) c). Under a
    causal mask every rank then sees the same number of (query, key) pairs."""
    _check_zigzag(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank!r}")
    c = seq_len // (2 * cp)
    lo, hi = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(lo, lo + c), torch.arange(hi, hi + c)])


def zigzag_index(seq_len: int, cp: int) -> torch.Tensor:
    """The permutation ``cat(zigzag_positions(seq_len, cp, r) for r in range(cp))``:
    ``x[:, zigzag_index(T, cp)]`` puts rank r's tokens in columns [r T/cp, (r+1) T/cp);
    ``argsort`` of it undoes the permutation."""
    _check_zigzag(seq_len, cp)
    return torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)])


# ---------------------------------------------------------------- local block + merge

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q, k, v) -> int:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q (B,T,H,hd) and k, v (B,S,Hkv,hd); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, _, H, hd = q.shape
    if k.size(0) != B or k.size(3) != hd or H % k.size(2):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim, "
                         f"or {H} query heads are not a multiple of {k.size(2)} kv heads")
    return H // k.size(2)


def _allowed(q_pos, k_pos, causal: bool):
    """(T, S) boolean mask ``k_pos[j] <= q_pos[i]``, or None when not causal."""
    if not causal:
        return None
    return k_pos.view(1, -1) <= q_pos.view(-1, 1)


def _scores(q, k, allowed, scale, acc):
    """s[b, g, r, t, s] = scale * q[b, t, g*rep+r] . k[b, s, g], -inf where masked."""
    B, T, H, hd = q.shape
    G = k.size(2)
    qg = q.to(acc).view(B, T, G, H // G, hd)
    s = torch.einsum("btgrd,bsgd->bgrts", qg, k.to(acc)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _attend(q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """Differentiable block attention in the accumulation dtype: out (B,T,H,hd), lse (B,H,T).
    Rows with no visible key give out = 0, lse = -inf, and NaN-free gradients."""
    acc = _acc_dtype(q.dtype)
    B, T, H, hd = q.shape
    G = k.size(2)
    s = _scores(q, k, _allowed(q_pos, k_pos, causal), scale, acc)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    live = z > 0
    z1 = torch.where(live, z, torch.ones_like(z))
    lse = torch.where(live, torch.log(z1) + m, torch.full_like(z, float("-inf")))
    out = torch.einsum("bgrts,bsgd->btgrd", e / z1, v.to(acc))
    return out.reshape(B, T, H, hd), lse.reshape(B, H, T)


def attention_block(q, k, v, q_pos=None, k_pos=None, causal: bool = True, scale: float | None = None):
    """Attention of the local queries against one block of keys:
    ``out = softmax(scale q k^T + mask) v`` with mask -inf where ``k_pos[j] > q_pos[i]`` (causal
    only; positions unused otherwise), and ``lse[b,h,t] = log sum_j exp(scale q.k_j)`` over the
    visible keys. q (B,T,H,hd), k/v (B,S,Hkv,hd) with GQA; scale defaults to 1/sqrt(hd).
    Returns (out (B,T,H,hd) in q's dtype, lse (B,H,T) in float32, float64 for float64 input).
    A row with no visible key gives out = 0 and lse = -inf (no NaN). Differentiable."""
    _check_shapes(q, k, v)
    if causal and (q_pos is None or k_pos is None):
        raise ValueError("causal attention needs the global positions q_pos and k_pos")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if causal:
        q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    out, lse = _attend(q, k, v, q_pos, k_pos, causal, scale)
    return out.to(q.dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Online-softmax merge of two attentions over disjoint key sets:
    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    out (B,T,H,hd), lse (B,H,T); where both lse are -inf the result is out = 0, lse = -inf."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both -inf: weights exp(-inf) = 0
    wa = torch.exp(lse_a - ref).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).transpose(1, 2).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


# ---------------------------------------------------------------- group helpers

def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather_positions(q_pos, group, cp: int):
    """(cp, T) int64: row s = the global positions held by group rank s."""
    q_pos = q_pos.reshape(-1).to(torch.int64).contiguous()
    out = q_pos.new_empty(cp * q_pos.numel())
    all_gather_flat(out, q_pos, group)
    return out.view(cp, -1)


def _positions(q, q_pos, group, cp: int):
    """Default: the zigzag positions of this rank for a global sequence of cp*T tokens."""
    T = q.size(1)
    if q_pos is None:
        rank = dist.get_rank(group) if cp > 1 else 0
        q_pos = zigzag_positions(cp * T, cp, rank)
    q_pos = q_pos.reshape(-1).to(device=q.device, dtype=torch.int64)
    if q_pos.numel() != T:
        raise ValueError(f"q_pos has {q_pos.numel()} positions for {T} local tokens")
    return q_pos


# ---------------------------------------------------------------- all-gather method

class _GatherSeq(torch.autograd.Function):
    """y = concat over the group's ranks of x along ``dim``; backward: dx = this rank's slice of
    sum over ranks of dy (a reduce-scatter), so each key's gradient lands at its owner."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        xt = x.movedim(dim, 0).contiguous()
        out = xt.new_empty((n * xt.size(0),) + tuple(xt.shape[1:]))
        all_gather_flat(out, xt, group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size(ctx.group)
        gt = g.movedim(ctx.dim, 0).contiguous()
        out = gt.new_empty((gt.size(0) // n,) + tuple(gt.shape[1:]))
        reduce_scatter_flat(out, gt, ctx.group)
        return out.movedim(0, ctx.dim), None, None


def _prepare(q, k, v, q_pos, group, scale):
    """(cp, this rank's query positions, softmax scale), after checking the shapes."""
    _check_shapes(q, k, v)
    cp = _group_size(group)
    if cp > 1 and k.size(1) != q.size(1):
        raise ValueError("context parallelism shards q, k and v of the same tokens: T must agree")
    q_pos = _positions(q, q_pos, group, cp)
    return cp, q_pos, 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


def allgather_attention(q, k, v, q_pos, group, causal: bool = True, scale: float | None = None,
                        all_pos=None):
    """Context-parallel attention by all-gathering K and V over ``group`` (along time, in group-
    rank order, positions gathered alongside) and attending the local queries to all of them;
    autograd gives dQ locally and dK, dV through the gather's backward, a reduce-scatter
    (sum over ranks). Exact; holds the full K, V."""
    cp, q_pos, scale = _prepare(q, k, v, q_pos, group, scale)
    if cp == 1:
        return attention_block(q, k, v, q_pos, q_pos, causal, scale)[0]
    if causal:
        k_pos = (_gather_positions(q_pos, group, cp) if all_pos is None
                 else all_pos.to(q_pos.device)).reshape(-1)
    else:
        k_pos = None
    kv = _GatherSeq.apply(torch.stack([k, v]), 2, group)  # one collective for K and V
    out, _ = _attend(q, kv[0], kv[1], q_pos, k_pos, causal, scale)
    return out.to(q.dtype)


# ---------------------------------------------------------------- ring method

def _ring_peers(group):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return (rank, n, dist.get_global_rank(group, (rank + 1) % n),
            dist.get_global_rank(group, (rank - 1) % n))


def _shift(send, group, nxt, prv, tag: int):
    """Post send(send -> next) and recv(<- prev); returns (recv buffer, pending works)."""
    recv = torch.empty_like(send)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group, tag),
                                    dist.P2POp(dist.irecv, recv, prv, group, tag)])
    return recv, works


def _wait(works) -> None:
    for w in works:
        w.wait()


def _live_blocks(all_pos, q_pos, causal: bool) -> list[bool]:
    """live[s]: some key of rank s is visible to some local query (always, when not causal)."""
    if not causal:
        return [True] * all_pos.size(0)
    return (all_pos.min(dim=1).values <= q_pos.max()).tolist()


def _cut(q_pos, k_pos, causal: bool):
    """(rows, cols): the local queries with some visible key of this block and the keys visible
    to some local query, as index tensors, or None for "all". Under zigzag sharding an
    off-diagonal block is half live (all queries see the first half of the keys, or the second
    half of the queries sees all keys), so attending only the cut halves its work."""
    if not causal:
        return None, None
    allowed = _allowed(q_pos, k_pos, True)
    rows, cols = allowed.any(1).nonzero().view(-1), allowed.any(0).nonzero().view(-1)
    return (None if rows.numel() == q_pos.numel() else rows,
            None if cols.numel() == k_pos.numel() else cols)


def _rows(x, rows, dim: int):
    return x if rows is None else x.index_select(dim, rows)


class _RingAttention(torch.autograd.Function):
    """Ring attention, forward and backward in cp steps each.

    Forward, step s (src = r - s mod cp): post the transfer of the current (K, V) to r+1 and
    receive the next from r-1, attend q to the current block, merge with the online softmax.
    Backward, with P = exp(scale q k^T - lse) recomputed per block from the saved final lse,
    D = rowsum(dO * O): dS = P * (dO V^T - D), dQ += scale dS K, dK_src += scale dS^T Q,
    dV_src += P^T dO (summed over the query heads of each kv head). The (dK, dV) accumulator
    travels one hop behind its (K, V) and reaches the owner after cp hops. Fully-masked blocks
    (causal, every key after every query) are skipped in compute; the messages are the same on
    every rank, so no rank waits for a send that never comes."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, group, causal, scale, all_pos):
        rank, cp, nxt, prv = _ring_peers(group)
        acc = _acc_dtype(q.dtype)
        all_pos = _gather_positions(q_pos, group, cp) if all_pos is None else all_pos.to(q_pos.device)
        live = _live_blocks(all_pos, q_pos, causal)
        cuts = [_cut(q_pos, all_pos[s], causal) if live[s] else (None, None) for s in range(cp)]
        B, T, H, hd = q.shape
        out = torch.zeros(B, T, H, hd, dtype=acc, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                kv_next, works = _shift(kv, group, nxt, prv, tag=0)
            if live[src]:
                rows, cols = cuts[src]
                o, l = _attend(_rows(q, rows, 1), _rows(kv[0], cols, 1), _rows(kv[1], cols, 1),
                               _rows(q_pos, rows, 0), _rows(all_pos[src], cols, 0), causal, scale)
                if rows is None:
                    out, lse = merge_partials(out, lse, o, l)
                else:  # only the live rows change
                    o, l = merge_partials(out.index_select(1, rows), lse.index_select(2, rows), o, l)
                    out, lse = out.index_copy(1, rows, o), lse.index_copy(2, rows, l)
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        # contiguous, so that the output projection's input is a view of it, not a second copy
        out = out.to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, q_pos, all_pos)
        ctx.group, ctx.causal, ctx.scale, ctx.live, ctx.cuts = group, causal, scale, live, cuts
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse, q_pos, all_pos = ctx.saved_tensors
        group, causal, scale, live, cuts = ctx.group, ctx.causal, ctx.scale, ctx.live, ctx.cuts
        rank, cp, nxt, prv = _ring_peers(group)
        acc = lse.dtype
        B, T, H, hd = q.shape
        G = k.size(2)
        rep = H // G
        qg = q.to(acc).view(B, T, G, rep, hd)
        dog = d_out.to(acc).view(B, T, G, rep, hd)
        # D[b,g,r,t] = sum_d dO * O ; lse as (B,G,rep,T,1), -inf rows made harmless
        delta = (dog * out.to(acc).view(B, T, G, rep, hd)).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)
        lse5 = lse.view(B, G, rep, T).unsqueeze(-1)
        lse5 = torch.where(torch.isinf(lse5), torch.zeros_like(lse5), lse5)
        dq = torch.zeros(B, T, G, rep, hd, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(2, B, T, G, hd, dtype=acc, device=q.device)  # accumulator for own K, V
        dkv_works = []
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                kv_next, kv_works = _shift(kv, group, nxt, prv, tag=0)
            block = None
            if live[src]:  # on the cut of the block (its live rows and columns) only
                rows, cols = cuts[src]
                kr, vr = _rows(kv[0], cols, 1), _rows(kv[1], cols, 1)
                kb, vb = kr.to(acc), vr.to(acc)
                dog_r, qg_r = _rows(dog, rows, 1), _rows(qg, rows, 1)
                s = _scores(_rows(q, rows, 1), kr, _allowed(_rows(q_pos, rows, 0),
                                                            _rows(all_pos[src], cols, 0), causal),
                            scale, acc)
                p = torch.exp(s - _rows(lse5, rows, 3))                  # (B,G,rep,T',S')
                dp = torch.einsum("btgrd,bsgd->bgrts", dog_r, vb)
                ds = p * (dp - _rows(delta, rows, 3))
                dq_b = torch.einsum("bgrts,bsgd->btgrd", ds, kb) * scale
                if rows is None:
                    dq += dq_b
                else:
                    dq.index_add_(1, rows, dq_b)
                block = torch.stack([torch.einsum("bgrts,btgrd->bsgd", ds, qg_r) * scale,
                                     torch.einsum("bgrts,btgrd->bsgd", p, dog_r)])
                if cols is not None:
                    block = torch.zeros_like(dkv).index_copy(2, cols, block)
            if step > 0:  # the accumulator for src, sent by r-1 after its previous step
                _wait(dkv_works)
                dkv = dkv_recv
            if block is not None:
                dkv = dkv + block
            dkv_recv, dkv_works = _shift(dkv, group, nxt, prv, tag=1)
            if step < cp - 1:
                _wait(kv_works)
                kv = kv_next
        _wait(dkv_works)  # after cp hops: the sum of every rank's contribution to our K, V
        return (dq.view(B, T, H, hd).to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, q_pos, group, causal: bool = True, scale: float | None = None,
                   all_pos=None):
    """Context-parallel attention on a ring: never holds more than two K/V blocks; exact
    forward and backward (see ``_RingAttention``). ``q_pos`` None means zigzag sharding."""
    cp, q_pos, scale = _prepare(q, k, v, q_pos, group, scale)
    if cp == 1:
        return attention_block(q, k, v, q_pos, q_pos, causal, scale)[0]
    return _RingAttention.apply(q, k, v, q_pos, group, causal, scale, all_pos)


def context_attention(q, k, v, q_pos=None, group=None, *, causal: bool = True, method: str = "ring",
                      scale: float | None = None, all_pos=None):
    """softmax(scale q k^T + causal mask by global position) v over the whole sequence, the
    keys sharded over ``group`` like the queries. ``q_pos``: the global positions of the local
    tokens (None: zigzag sharding of cp*T tokens). ``method``: "ring" or "allgather". With no
    group, or a group of one rank, this is plain attention of the local tokens. ``all_pos``:
    (cp, T) positions of every group rank when the caller knows them (else all-gathered)."""
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    fn = ring_attention if method == "ring" else allgather_attention
    return fn(q, k, v, q_pos, group, causal, scale, all_pos)


# ---------------------------------------------------------------- the engine's cp axis

@dataclass(frozen=True, eq=False)
class SequenceShard:
    """This rank's share of every sequence under cp, as handed to a model's
    ``ModelSpec.context_parallel`` hook: the model takes the global ``positions`` of its local
    tokens (e.g. for rotary embeddings) and attends with ``attend`` instead of its own
    attention. ``index``: which tokens of the sequence are local (``take`` selects them along
    dim 1; the engine does it for the inputs and targets of a token model). ``positions``
    decide the mask: key j is visible to query i iff positions_j <= positions_i."""

    index: torch.Tensor          # (T/cp,) the local tokens' indices in the sequence
    positions: torch.Tensor      # (T/cp,) their positions for the mask (and rotary embeddings)
    all_positions: torch.Tensor  # (cp, T/cp): every cp rank's positions
    group: object                # the cp process group
    rank: int
    cp: int
    method: str = "ring"
    n_tokens: int = 0            # the sequence's real length (``padded``: before padding)

    @classmethod
    def zigzag(cls, seq_len: int, group, rank: int, cp: int, method: str, device) -> "SequenceShard":
        """Causal token sequences: chunks r and 2cp-1-r of 2cp (equal causal work per rank)."""
        every = torch.stack([zigzag_positions(seq_len, cp, r) for r in range(cp)]).to(device)
        return cls(every[rank], every[rank], every, group, rank, cp, method, seq_len)

    def padded(self, n_tokens: int) -> "SequenceShard":
        """Non-causal attention over ``n_tokens`` (any count, e.g. patches + a class token):
        padded to a multiple of cp, rank r holds the r-th contiguous block. Every real token
        gets mask position n and every pad n + 1, so under the causal rule a real query sees
        all real keys and no pad (a pad query sees everything; its output is discarded)."""
        per = -(-n_tokens // self.cp)
        idx = torch.arange(self.cp * per, device=self.index.device).view(self.cp, per)
        pos = torch.where(idx < n_tokens, n_tokens, n_tokens + 1)
        return SequenceShard(idx[self.rank], pos[self.rank], pos, self.group, self.rank, self.cp,
                             self.method, n_tokens)

    @property
    def padded_len(self) -> int:
        return self.cp * self.index.numel()

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (B, T, ...) tensor (T = the padded length for ``padded``)."""
        return x[:, self.index.to(x.device)]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n_tokens, d) -> (B, padded length, d), zeros appended."""
        return torch.nn.functional.pad(x, (0, 0, 0, self.padded_len - x.size(1)))

    def first_token(self, x: torch.Tensor) -> torch.Tensor:
        """Token 0 of the sequence (B, d) on every cp rank, from the rank that holds it (cp rank 0
        under ``padded``); backward sums every rank's gradient into its owner."""
        if x.is_meta:  # shapes only (the pipeline boundaries' inference): no collective
            return x[:, 0]
        return _GatherSeq.apply(x[:, :1].contiguous(), 1, self.group)[:, 0]

    def attend(self, q, k, v, *, causal: bool = True, scale: float | None = None) -> torch.Tensor:
        """Attention of the local queries to the whole sequence (q (B,T,H,hd), k/v (B,T,Hkv,hd)),
        masked by ``positions`` when ``causal``. Outside autocast: the online softmax and its
        merges run in float32 whatever the training precision (the result comes back in q's
        dtype)."""
        if q.is_meta:  # shapes only (the pipeline boundaries' inference): no collective
            return torch.empty_like(q)
        with torch.autocast(q.device.type, enabled=False):
            return context_attention(q, k, v, self.positions, self.group, causal=causal,
                                     method=self.method, scale=scale, all_pos=self.all_positions)


def apply_context_parallel(model, spec, mesh, *, seq_len: int, method: str = "ring") -> SequenceShard | None:
    """Shard every sequence of ``model`` over the mesh's cp group (None when cp = 1): the spec's
    ``context_parallel`` hook installs the shard (positions, attention) in the model."""
    cp = mesh.layout.cp
    if cp == 1:
        return None
    if spec.context_parallel is None:
        from ..config import ConfigError
        raise ConfigError(f"parallel.cp={cp}: model {spec.name!r} does not support context "
                          f"parallelism (its ModelSpec has no context_parallel hook); use cp=1")
    if spec.cp_split_batch:
        shard = SequenceShard.zigzag(seq_len, mesh.group("cp"), mesh.cp_rank, cp, method, mesh.device)
    else:  # the model makes its tokens and selects its share itself (``padded``)
        none = torch.empty(0, dtype=torch.long, device=mesh.device)
        shard = SequenceShard(none, none, none.view(cp, 0), mesh.group("cp"), mesh.cp_rank, cp, method)
    spec.context_parallel(model, shard)
    return shard
