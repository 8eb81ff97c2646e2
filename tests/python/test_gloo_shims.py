"""The gloo shims' collectives (python/mcore_twin/gloo_shims.py) on two gloo processes: the
gathers Megatron's alltoall dispatcher runs under sequence parallelism, where an expert-parallel
rank may receive no token at all, so every rank's part is empty (gloo itself dies of SIGFPE on a
zero-size gather), and the uneven and bf16 gathers beside them, checked element by element.

    PYTHONPATH=python /usr/bin/python3 tests/python/test_gloo_shims.py
Exit 77 (CTest's skip) without torch, unless CI=true.
"""

import os
import sys

import mcore_twin  # noqa: F401  (before torch: sets the oneDNN ISA cap)

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    print("torch is not installed for this Python")
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

from mcore_twin import gloo_shims
from mcore_twin.bootstrap import _free_port

WORLD = 2


def part(rank, n, dtype):
    """Rank `rank`'s part: n values rank * 100 + 0, 1, ... (exact in bf16 up to 256)."""
    return (torch.arange(n, dtype=torch.float32) + rank * 100).to(dtype)


def check(rank, sizes, dtype):
    out = [torch.full((n,), -1.0).to(dtype) for n in sizes]
    gloo_shims.all_gather(out, part(rank, sizes[rank], dtype))
    for r, n in enumerate(sizes):
        assert torch.equal(out[r], part(r, n, dtype)), f"sizes {sizes} {dtype}: rank {r}'s part {out[r]}"


def rank_main(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    for dtype in (torch.float32, torch.bfloat16):
        check(rank, [0, 0], dtype)  # every part empty: nothing sent
        check(rank, [3, 3], dtype)
        check(rank, [0, 5], dtype)  # uneven, one part empty
    empty = torch.zeros(0, 4)
    got = gloo_shims._gathered(empty, None)
    assert len(got) == WORLD and all(g.shape == (0, 4) for g in got), got
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(_free_port(),), nprocs=WORLD, join=True)
    print("gloo shims: empty, even and uneven gathers in fp32 and bf16 on 2 ranks: ok")
