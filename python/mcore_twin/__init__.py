"""mcore-twin's Python side: capture Megatron-Core layers as golden files (mcore_twin.capture) and
the live property tests that run the real Megatron-Core against the twins (mcore_twin.live)."""

import os

# torch 1.13's CPU bf16 matmul dies of SIGILL on CPUs with AMX for some shapes (its oneDNN's AMX
# kernel; [24, 63] @ [63, 80] is one, reached by a Linear's weight gradient in Megatron's backward).
# Capping oneDNN at AVX-512 BF16 keeps the same arithmetic (bf16 products, fp32 accumulation) on
# vector units; a CPU without AVX-512 BF16 is unaffected. Set before torch loads oneDNN, which
# reads it once; an explicit setting in the environment wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

__version__ = "0.1.0"
