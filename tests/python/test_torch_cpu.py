"""The live oracle's torch (Debian's 1.13, CPU) survives the bf16 matmuls Megatron's backward runs:
on CPUs with AMX its oneDNN dies of SIGILL on some shapes ([24, 63] @ [63, 80]) unless
`import mcore_twin` caps oneDNN's ISA first (python/mcore_twin/__init__.py). Each product is also
checked against float64, within the bound of a bf16 accumulation (see below).

    PYTHONPATH=python /usr/bin/python3 tests/python/test_torch_cpu.py
Exit 77 (CTest's skip) without torch, unless CI=true.
"""

import itertools
import os
import sys

import mcore_twin  # noqa: F401  (before torch: sets the oneDNN ISA cap)

try:
    import torch
except ImportError:
    print("torch is not installed for this Python")
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

u32, u16 = 2.0**-24, 2.0**-8
torch.manual_seed(20261203)
worst = 0.0
for m, k, n in itertools.product([1, 24, 63, 160], [1, 21, 24, 63, 80, 129], [24, 63, 80, 160]):
    a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    for lhs in (a, a.t().contiguous().t()):  # row-major and the transposed view a weight grad passes
        c = lhs.matmul(b).double()
        exact = a.double() @ b.double()
        mag = a.double().abs() @ b.double().abs()
        # Any summation order with the partial sums rounded to bf16 (gamma_k(2^-8)): torch 1.13's
        # small CPU bf16 products are not all fp32 accumulations ([2, 21] @ [21, 24] was seen at
        # 11x the fp32 accumulation bound), so this is the bound that holds for it.
        gamma = k * u16 / (1 - k * u16)
        bound = gamma * mag + u16 * exact.abs()
        share = ((c - exact).abs() / bound.clamp_min(1e-300)).max().item()
        worst = max(worst, share)
        if share > 1.0:
            print(f"FAIL: [{m}, {k}] @ [{k}, {n}] is off by {share:.2f} of its bound")
            sys.exit(1)
print(f"ok: {4 * 6 * 4 * 2} bf16 matmuls, largest share of the bound {worst:.3f} "
      f"(ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')})")
