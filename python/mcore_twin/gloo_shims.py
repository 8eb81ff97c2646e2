"""What torch 1.13's gloo lacks for Megatron-Core's tensor-parallel layers on the CPU, supplied from
what it has (measured: all_reduce, list all_gather and all_to_all_single, each for fp32 but for no
16-bit tensor; no _all_gather_base, no _reduce_scatter_base).

Applied in each process of a multi-rank run after Megatron-Core is imported (apply()). Each shim
says what it computes; the collectives that move data move it bit for bit, and the two that sum
(a bf16 all_reduce, any reduce-scatter) sum the ranks' partial values in rank order in fp32 and
round once to the tensor's dtype, as NCCL's reduction of two ranks does (one rounding of the
exact sum of two values); at more ranks NCCL's ring rounds each partial sum, which differs from
this by at most one rounding per added rank: the twins' bounds count one store per all-reduce.
"""

import torch
import torch.distributed as dist

APPLIED = []
gloo_all_gather = dist.all_gather  # gloo's own, before apply() replaces torch.distributed's


# Types gloo does not carry, and the type that carries each exactly.
WIRE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.bool: torch.int32}


def _wire(t):
    return t.contiguous().to(WIRE.get(t.dtype, t.dtype))


def _gathered(t, group):
    """Every rank's `t` (same shape on all), in rank order, carried exactly (WIRE); empty ones not
    sent (gloo dies of SIGFPE on a zero-size gather)."""
    if t.numel() == 0:
        return [t.clone() for _ in range(dist.get_world_size(group))]
    wire = _wire(t)
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    gloo_all_gather(parts, wire, group=group)
    return [p.to(t.dtype) for p in parts]


def _rank_order_sum(parts, dtype):
    total = parts[0].to(torch.float32)
    for p in parts[1:]:
        total = total + p.to(torch.float32)
    return total.to(dtype)


class _Done:
    """The handle of a collective that already ran (what async_op=True callers wait on)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def _handle(async_op):
    return _Done() if async_op else None


def all_gather_into_tensor(output, input_, group=None, async_op=False):
    """_all_gather_base: the ranks' inputs concatenated along dim 0, in rank order."""
    output.copy_(torch.cat(_gathered(input_, group), dim=0))
    return _handle(async_op)


def reduce_scatter_tensor(output, input_, group=None, async_op=False):
    """_reduce_scatter_base: the rank-order sum of the ranks' inputs, this rank's dim-0 slice."""
    total = _rank_order_sum(_gathered(input_, group), input_.dtype)
    rank = dist.get_rank(group)
    output.copy_(total.chunk(dist.get_world_size(group), dim=0)[rank])
    return _handle(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """torch.distributed.all_gather for what gloo lacks: bf16, fp16 and bool carried as fp32 /
    int32 (exactly), uneven sizes padded to the largest; nothing at all when every rank's part is
    empty (gloo dies of SIGFPE on a zero-size gather; the sizes are the caller's list, the same on
    every rank, so all ranks skip together)."""
    if all(t.numel() == 0 for t in tensor_list):
        return _handle(async_op)
    uneven = any(t.numel() != tensor.numel() for t in tensor_list)
    if tensor.dtype not in WIRE and not uneven:
        return gloo_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    # gloo gathers equal sizes only: every rank's flattened tensor padded to the largest (the
    # caller's list says each rank's size), then cut back.
    n = max(t.numel() for t in tensor_list)
    flat = torch.zeros(n, dtype=WIRE.get(tensor.dtype, tensor.dtype))
    flat[: tensor.numel()] = _wire(tensor).reshape(-1)
    parts = [torch.empty_like(flat) for _ in tensor_list]
    gloo_all_gather(parts, flat, group=group)
    for dst, src in zip(tensor_list, parts):
        dst.copy_(src[: dst.numel()].reshape(dst.shape).to(dst.dtype))
    return _handle(async_op)


def apply():
    """Patches Megatron-Core's collective entry points and torch.distributed where gloo falls
    short. Idempotent."""
    if APPLIED:
        return APPLIED
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import layers, mappings

    # Each module binds torch's function to its own global at import.
    for module in (mappings, layers, mutils):
        if hasattr(module, "dist_all_gather_func"):
            module.dist_all_gather_func = all_gather_into_tensor
        if hasattr(module, "dist_reduce_scatter_func"):
            module.dist_reduce_scatter_func = reduce_scatter_tensor
    APPLIED.append("tensor_parallel mappings, layers, utils: _all_gather_base / _reduce_scatter_base from gloo's "
                   "list all_gather")  # fmt: skip

    gloo_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype != torch.bfloat16:
            return gloo_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op != dist.ReduceOp.SUM:
            raise NotImplementedError(f"gloo shim: bf16 all_reduce with {op}")
        tensor.copy_(_rank_order_sum(_gathered(tensor, group), tensor.dtype))
        return _handle(async_op)

    dist.all_reduce = all_reduce
    APPLIED.append("torch.distributed.all_reduce: bf16 summed in rank order in fp32, rounded once (gloo has no bf16)")

    dist.all_gather = all_gather
    APPLIED.append("torch.distributed.all_gather: bf16, fp16 and bool carried as fp32 / int32 (exactly); "
                   "uneven sizes padded to the largest")

    gloo_all_to_all_single = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        # Split sizes as Python ints (Megatron may pass a numpy array or a tensor's list).
        out_splits = None if output_split_sizes is None else [int(x) for x in output_split_sizes]
        in_splits = None if input_split_sizes is None else [int(x) for x in input_split_sizes]
        if input.dtype not in WIRE:
            return gloo_all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=async_op)
        wire = torch.empty(output.shape, dtype=WIRE[input.dtype])
        gloo_all_to_all_single(wire, _wire(input), out_splits, in_splits, group=group)
        output.copy_(wire.to(output.dtype))
        return _handle(async_op)

    dist.all_to_all_single = all_to_all_single

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """List reduce-scatter (gloo has none): rank i gets the rank-order sum of every rank's
        input_list[i] (its size the same on every rank), in fp32, rounded once."""
        if op != dist.ReduceOp.SUM:
            raise NotImplementedError(f"gloo shim: reduce_scatter with {op}")
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        flat = torch.cat([t.reshape(-1) for t in input_list])
        mine = [p[start : start + output.numel()] for p in _gathered(flat, group)]
        output.copy_(_rank_order_sum(mine, output.dtype).reshape(output.shape))
        return _handle(async_op)

    dist.reduce_scatter = reduce_scatter
    APPLIED.append("torch.distributed.reduce_scatter (list, uneven): rank-order sum in fp32, rounded once")
    APPLIED.append("torch.distributed.all_to_all_single: split sizes as ints; bf16, fp16, bool carried exactly")
    _allow_torch_norms_under_sequence_parallel()
    return APPLIED


def _allow_torch_norms_under_sequence_parallel():
    """The local spec without apex builds its norms as WrappedTorchNorm, which asserts
    `not config.sequence_parallel`: apex's FusedLayerNorm is what Megatron runs with sequence
    parallelism. A norm is per token, so under sequence parallelism it is the same module on each
    rank's slice of the sequence; what sequence parallelism adds is the `sequence_parallel`
    attribute on its parameters (their gradients are partial sums over the rank's tokens, summed
    across the tensor-parallel ranks after the backward). Built with sequence_parallel off, then
    marked as FusedLayerNorm marks them."""
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
    APPLIED.append("WrappedTorchNorm under sequence parallelism: built without it, parameters marked sequence_parallel")
