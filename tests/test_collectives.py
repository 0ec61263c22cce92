"""``reduce_scatter_flat`` on Gloo runs as an all-to-all plus a local sum (Gloo's own
reduce-scatter is an all-reduce, twice the bytes): it must give every rank exactly its slice of
the sum, synchronously and through the asynchronous handle the gradient buckets wait on."""
from __future__ import annotations


def _reduce_scatter_cases() -> dict:
    import torch
    import torch.distributed as dist

    from hybridpar.parallel.collectives import all_gather_flat, reduce_scatter_flat

    dist.init_process_group("gloo")
    try:
        n, r = dist.get_world_size(), dist.get_rank()
        # integers: every summation order gives the same fp32 sum, so equality is exact
        inp = torch.arange(n * 6 * 5, dtype=torch.float32).view(n * 6, 5) * (r + 1)
        want = (torch.arange(n * 6 * 5, dtype=torch.float32).view(n * 6, 5)
                * sum(range(1, n + 1))).chunk(n)[r]
        out = torch.empty(6, 5)
        reduce_scatter_flat(out, inp, None)
        sync_ok = torch.equal(out, want)
        out2 = torch.full((6, 5), float("nan"))
        handle = reduce_scatter_flat(out2, inp.view(-1), None, async_op=True)
        handle.wait()
        async_ok = torch.equal(out2, want) and handle.wait()  # a second wait is harmless
        # random values: the same sums as all-reduce's slice, up to fp32 summation order
        g = torch.Generator().manual_seed(r)
        x = torch.randn(n * 1000, generator=g)
        full = x.clone()
        dist.all_reduce(full)
        got = torch.empty(1000)
        reduce_scatter_flat(got, x, None)
        err = float((got - full.chunk(n)[r]).abs().max())
        # and all-gather gives back the slices in rank order
        back = torch.empty(n * 1000)
        all_gather_flat(back, got, None)
        full_back = float((back - full).abs().max())
        # sequence parallelism's token shards: a flat run of the (B, T, d) stream per rank,
        # shaped (B, T/n, d); the all-gather puts the runs back in order
        from hybridpar.parallel.tensor_parallel.mappings import gather_tokens, reduce_scatter_tokens
        stream = torch.arange(2 * 3 * n * 4, dtype=torch.float32).view(2, 3 * n, 4)
        mine = reduce_scatter_tokens(stream * (r + 1), dist.group.WORLD, 1)
        total = stream * sum(range(1, n + 1))
        tokens_ok = (mine.shape == (2, 3, 4)
                     and torch.equal(mine.reshape(-1), total.reshape(-1).chunk(n)[r])
                     and torch.equal(gather_tokens(mine, dist.group.WORLD, 1), total))
        return {"sync": sync_ok, "async": async_ok, "err": err, "gather_err": full_back,
                "tokens": tokens_ok}
    finally:
        dist.destroy_process_group()


def test_gloo_reduce_scatter_gives_each_rank_its_slice_of_the_sum():
    from hybridpar.engine.launch import spawn

    got = spawn(_reduce_scatter_cases, 3)
    for rank, res in got.items():
        assert res["sync"] and res["async"] and res["tokens"], (rank, res)
        # three fp32 summands of |x| < ~5: reordering changes the sum by a few ulps of ~10
        assert res["err"] <= 4e-6 and res["gather_err"] <= 4e-6, (rank, res)
