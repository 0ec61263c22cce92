"""Context-parallel attention (``hybridpar.parallel.context_parallel``) against full attention.

Unit tests run in this process. The multi-process cases run in ONE spawn of 4 Gloo ranks
(module fixture): cp=2 on two sub-groups {0,1}, {2,3} at once and cp=4 on all four; for each
case every rank builds the full q, k, v and dO from the case's seed, computes full attention
(SDPA, as ``Attention.core``) and its gradients as the reference, runs ``context_attention`` on
its shard, and records the max abs error of its output and dQ/dK/dV rows against the
reference's rows. Float64 throughout: the bound 1e-12 is ~1e4 x the rounding seen. Injected
bugs (wrong positions, wrong reference rows, dK/dV not summed over ranks) must give large
errors, so the checks can fail.
"""
from __future__ import annotations

import math
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridpar.parallel import context_parallel as cpmod
from hybridpar.parallel.context_parallel import (attention_block, context_attention, merge_partials,
                                                 zigzag_index, zigzag_positions)

WORLD = 4
B, T, H, HKV, HD = 2, 16, 4, 2, 8
TOL = 1e-12
BUG_MIN = 1e-3  # an injected bug must move some compared value by at least this


def _reference(q, k, v, causal):
    """Full attention as the model computes it (``Attention.core``), with is_causal a flag."""
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal)
    return y.transpose(1, 2)


def _qkv(seed, t=T, s=None):
    g = torch.Generator().manual_seed(seed)
    s = t if s is None else s
    q = torch.randn(B, t, H, HD, generator=g, dtype=torch.float64)
    k = torch.randn(B, s, HKV, HD, generator=g, dtype=torch.float64)
    v = torch.randn(B, s, HKV, HD, generator=g, dtype=torch.float64)
    return q, k, v


# ---------------------------------------------------------------- unit tests (one process)

def test_zigzag_positions_and_index():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(8, 1, 0).tolist() == list(range(8))
    for n, cp in [(8, 2), (16, 4), (24, 3), (4, 1)]:
        idx = zigzag_index(n, cp)
        assert idx.dtype == torch.int64
        assert sorted(idx.tolist()) == list(range(n))  # a permutation
        for r in range(cp):  # rank r's positions are its T/cp contiguous columns
            assert torch.equal(idx.view(cp, -1)[r], zigzag_positions(n, cp, r))
    # causal balance: equal (query, key) pair counts per rank
    pos = zigzag_index(32, 4).view(4, -1)
    pairs = [int((p.view(-1, 1) >= torch.arange(32).view(1, -1)).sum()) for p in pos]
    assert len(set(pairs)) == 1


@pytest.mark.parametrize("seq_len,cp,rank", [(10, 2, 0), (6, 4, 0), (0, 2, 0), (8, 0, 0), (8, 2, 2),
                                             (8, 2, -1)])
def test_zigzag_rejects_bad_arguments(seq_len, cp, rank):
    with pytest.raises(ValueError):
        zigzag_positions(seq_len, cp, rank)


def test_zigzag_index_rejects_bad_seq_len():
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_index(10, 2)


def test_attention_block_equals_sdpa_with_gqa():
    q, k, v = _qkv(1)
    pos = torch.arange(T)
    for causal in (True, False):
        out, lse = attention_block(q, k, v, pos, pos, causal, 1 / math.sqrt(HD))
        assert out.dtype == torch.float64 and lse.dtype == torch.float64 and lse.shape == (B, H, T)
        assert (out - _reference(q, k, v, causal)).abs().max() < TOL
    # float32 input: lse in float32, output in the input dtype
    out, lse = attention_block(q.float(), k.float(), v.float(), pos, pos, True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_merge_of_two_key_halves_equals_whole():
    """Queries at positions 4..9 against 12 keys (positions 0..11); halves by key position.
    Causal: row 4 sees no key of the second half (6..11) and the second half is fully masked for
    queries 4, 5; a third split puts all keys after every query (a fully-masked half)."""
    q, _, _ = _qkv(2, t=6)
    _, k, v = _qkv(3, t=12)
    q_pos, k_pos = torch.arange(4, 10), torch.arange(12)
    scale = 0.3
    for causal in (True, False):
        whole, lse_whole = attention_block(q, k, v, q_pos, k_pos, causal, scale)
        for cut in (6, 3):
            a = attention_block(q, k[:, :cut], v[:, :cut], q_pos, k_pos[:cut], causal, scale)
            b = attention_block(q, k[:, cut:], v[:, cut:], q_pos, k_pos[cut:], causal, scale)
            out, lse = merge_partials(*a, *b)
            assert (out - whole).abs().max() < TOL
            assert (lse - lse_whole).abs().max() < TOL
            out, lse = merge_partials(*b, *a)  # symmetric
            assert (out - whole).abs().max() < TOL
    # a half that is fully masked for every query: the merge returns the other half unchanged
    far = attention_block(q, k, v, q_pos, k_pos + 100, True, scale)
    assert torch.isinf(far[1]).all() and (far[0] == 0).all()
    near = attention_block(q, k, v, q_pos, k_pos, True, scale)
    out, lse = merge_partials(*near, *far)
    assert (out - near[0]).abs().max() < TOL and torch.equal(lse, near[1])


def test_fully_masked_rows_give_zero_and_minus_inf_without_nan():
    q, k, v = _qkv(4)
    for t in (q, k, v):
        t.requires_grad_(True)
    q_pos = torch.arange(T)
    k_pos = torch.arange(T) + 8  # queries 0..7 see nothing
    out, lse = attention_block(q, k, v, q_pos, k_pos, True, 0.25)
    assert (out[:, :8] == 0).all() and torch.isneginf(lse[..., :8]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., 8:]).all()
    (out.sum() + lse[..., 8:].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    # merging two empty partials stays empty, NaN-free
    out2, lse2 = merge_partials(out[:, :8], lse[..., :8], out[:, :8], lse[..., :8])
    assert (out2 == 0).all() and torch.isneginf(lse2).all()


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_no_group_is_plain_attention(method):
    q, k, v = _qkv(5)
    d_out = torch.randn(B, T, H, HD, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for fn in (lambda a, b, c: _reference(a, b, c, True),
               lambda a, b, c: context_attention(a, b, c, None, None, method=method)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(d_out)
        grads.append([out.detach()] + [t.grad for t in leaves])
    for ref, got in zip(*grads):
        assert (ref - got).abs().max() < TOL
    with pytest.raises(ValueError, match="method"):
        context_attention(q, k, v, None, None, method="ulysses")


# ---------------------------------------------------------------- multi-process cases

def _cases():
    """(name, cp, method, causal, layout, bug)."""
    cases = [(f"cp{cp}-{method}-{'causal' if causal else 'full'}-{layout}", cp, method, causal, layout, None)
             for cp in (2, 4) for method in ("ring", "allgather") for causal in (True, False)
             for layout in ("zigzag", "contiguous")]
    for cp in (2, 4):
        for method in ("ring", "allgather"):
            # zigzag shards but the positions claimed are contiguous: causal mask wrong
            cases.append((f"bug-positions-cp{cp}-{method}", cp, method, True, "zigzag", "positions"))
    # the shard is right but compared with the reference rows of another permutation
    cases.append(("bug-reference-rows-cp4-ring", 4, "ring", True, "zigzag", "reference_rows"))
    # dK, dV not summed over ranks in the all-gather backward (output still right)
    cases.append(("bug-no-dkv-sum-cp2-allgather", 2, "allgather", True, "zigzag", "no_dkv_sum"))
    return cases


CASES = _cases()


def _shard_positions(layout, cp, r):
    if layout == "zigzag":
        return zigzag_positions(T, cp, r)
    return torch.arange(r * T // cp, (r + 1) * T // cp)


def _run_case(seed, group, cp, method, causal, layout, bug):
    import torch.distributed as dist

    r = dist.get_rank(group)
    q, k, v = _qkv(seed)
    d_out = torch.randn(B, T, H, HD, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, causal)
    ref.backward(d_out)
    pos = _shard_positions(layout, cp, r)
    claimed = torch.arange(r * T // cp, (r + 1) * T // cp) if bug == "positions" else pos
    rows = torch.roll(pos, 1) if bug == "reference_rows" else pos
    loc = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
    saved = cpmod.reduce_scatter_flat
    if bug == "no_dkv_sum":  # keep this rank's slice of its own gradient, not the sum over ranks
        def local_slice(out, inp, group, async_op=False):
            out.copy_(inp.view(dist.get_world_size(group), *out.shape)[dist.get_rank(group)])
        cpmod.reduce_scatter_flat = local_slice
    try:
        out = context_attention(*loc, claimed, group, causal=causal, method=method)
        out.backward(d_out[:, pos])
    finally:
        cpmod.reduce_scatter_flat = saved
    errs = {"out": (out.detach() - ref.detach()[:, rows]).abs().max().item()}
    for name, got, want in zip(("dq", "dk", "dv"), loc, full):
        errs[name] = (got.grad - want.grad[:, rows]).abs().max().item()
    return errs


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hybridpar.testing import join_world

    join_world(rank, WORLD, port, out)
    results = {}
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        quad = dist.new_group(list(range(WORLD)))
        for i, (name, cp, method, causal, layout, bug) in enumerate(CASES):
            group = quad if cp == 4 else pairs[rank // 2]
            seed = 1000 + 10 * i + (rank // 2 if cp == 2 else 0)  # the two pairs differ in data
            t0 = time.perf_counter()
            results[name] = _run_case(seed, group, cp, method, causal, layout, bug)
            results[name]["time_s"] = time.perf_counter() - t0
        dist.barrier()
    except BaseException:
        results["__error__"] = traceback.format_exc()
    torch.save(results, Path(out, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{case: {rank: {"out", "dq", "dk", "dv": max abs error}}} from one spawn of 4 ranks."""
    from hybridpar.engine.launch import free_port, rank_context

    out = tmp_path_factory.mktemp("context_attention")
    port, deadline = free_port(), time.time() + 120
    ctx = rank_context()  # ranks fork from the engine-preloaded server
    procs = [ctx.Process(target=_worker, args=(r, port, str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
    for p in procs:  # a hang must not leave processes behind
        if p.exitcode is None:
            p.kill()
            p.join()
    got = {}
    for r in range(WORLD):
        f = Path(out, f"{r}.pt")
        if not f.exists():
            err = Path(out, f"stderr-rank{r}.txt")
            pytest.fail(f"rank {r} wrote no results (exit {procs[r].exitcode}):\n"
                        f"{err.read_text() if err.exists() else ''}")
        res = torch.load(f, weights_only=False)
        if "__error__" in res:
            pytest.fail(f"rank {r} failed:\n{res['__error__']}")
        got[r] = res
    return {name: {r: got[r][name] for r in range(WORLD)} for name, *_ in CASES}


@pytest.mark.parametrize("case", [c for c in CASES if c[5] is None], ids=lambda c: c[0])
def test_context_attention_matches_full_attention(results, case):
    errs = results[case[0]]
    worst = {k: max(e[k] for e in errs.values()) for k in ("out", "dq", "dk", "dv")}
    assert all(v < TOL for v in worst.values()), (case[0], worst)


@pytest.mark.parametrize("case", [c for c in CASES if c[5] is not None], ids=lambda c: c[0])
def test_injected_bug_is_detected(results, case):
    errs = results[case[0]]
    worst = {k: max(e[k] for e in errs.values()) for k in ("out", "dq", "dk", "dv")}
    if case[5] == "no_dkv_sum":  # the forward is untouched; only dK, dV must be wrong
        assert worst["out"] < TOL and worst["dq"] < TOL, worst
        assert worst["dk"] > BUG_MIN and worst["dv"] > BUG_MIN, worst
    else:
        assert max(worst.values()) > BUG_MIN, (case[0], worst)
