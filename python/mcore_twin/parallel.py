"""Layers of multi-rank jobs: a layer captured on every rank of a tensor-parallel job (dense, with
or without sequence parallelism) or an expert-parallel job (MoE), its parts gathered in rank order
into one golden of the whole layer, as if it had run on one rank (an MoE layer at TP x EP too).

Inside a running Megatron-Core job, on every rank of the model-parallel group:

    from mcore_twin.parallel import capture_parallel
    capture_parallel(model.decoder.layers[n], "layer_n.safetensors", hidden_states=h,
                     attention_mask=mask, rotary_pos_emb=rope, grad_seed=0)

`hidden_states` is the rank's own input to the layer (its slice of the sequence under sequence
parallelism). Rank 0 writes the golden; every rank returns (rank 0 the CaptureResult, the others
None). How each tensor is gathered follows Megatron's layout:

- parameters and their gradients by the `tensor_model_parallel` / `partition_dim` attributes
  Megatron sets on them (concatenated along that dimension in rank order; a gated linear unit's
  fc1 holds [gate shard; up shard] on each rank and is put back as [gate; up]; core attention's
  learnable softmax offset holds the rank's heads); a parameter with neither is replicated, and
  where each rank's gradient is a part (a sequence-parallel parameter's over the rank's tokens, a
  q/k layernorm's over the rank's heads) the parts are summed in rank order in fp32 and rounded
  once, as Megatron's finalize_model_grads all-reduces them. Multi-latent attention (MLA, the
  local spec): every projection is column parallel (rows), linear_proj row parallel: the down
  projections (gather_output=False) by rows of their output, linear_kv_down_proj's
  [kv_lora_rank + qk_pos_emb_head_dim] split anywhere (inside the latent or the RoPE part), the up
  projections (linear_q_up_proj, linear_q_proj, linear_kv_up_proj) by heads; its q / kv
  layernorms, on the gathered latent, are replicated (their gradients whole on every rank, summed
  under sequence parallelism, where each rank normalises its own tokens);
- taps by the module that produced them: a column-parallel linear's output along its last
  dimension (MLA's down projections' [s, b, width / tp], recorded before MLA gathers them; its up
  projections' heads) and its bias along dim 0, core attention's along its last (MLA's substitute too),
  SelfAttention's q/k layernorm's along the heads; MLA's rotary_pos_emb (the whole sequence's
  angles on every rank) replicated; a row-parallel linear's output (and SelfAttention's,
  MLASelfAttention's and MLP's) and every other tap (MLA's q / kv layernorms included)
  replicated, or under sequence parallelism along the sequence (dim 0);
- inputs, outputs, the upstream gradient and the input gradient replicated, or along the sequence;
- MoE under sequence parallelism: the load-balancing losses and expert-bias counts each rank
  logs summed, the z-loss averaged (see _rule);
- expert parallelism (every EP rank given the same tokens, checked: a golden holds one set of tokens,
  and an expert's gradient sums every rank's): each rank's local experts under their global index
  (rank r holds experts [r L, (r + 1) L)), their gradients divided by ep (each rank's copy of the
  tokens contributed one share); the experts' own taps and inputs, which depend on the layout, are
  left out.

MLA at tp > 1 has a tensor-parallel bug of Megatron's own (Megatron-LM #1699, K_POS_EMB_BUG):
k_pos_emb's gradient is left partial on each rank, so the input gradient and linear_kv_down_proj's
and input_layernorm's are not the one-rank layer's; the golden holds them as Megatron computed them
and `megatron_tp_bug` names them, or, with `mend_mla_k_pos_emb=True` (the live tests), the capture
runs with the proposed fix (mend_k_pos_emb_grad: that gradient summed across the ranks) and the
golden's notes and `mended` say so.

A replicated tensor must be equal on every rank; where it is not (a tensor-parallel bug: a
gradient left partial, a missing all-reduce), rank 0's is written and the metadata's
`ranks_disagree` lists the names: `twin diff` against a one-rank capture then names the first.
The upstream gradient is drawn at the full output shape from `grad_seed`, as a one-rank capture
draws it, and each rank takes its slice: captures of one layer at any layout hold the same
`grad_in.output`. The layout is in `__metadata__.parallel` and in the config
(`tensor_model_parallel_size`, `sequence_parallel`, `expert_model_parallel_size`).

Not yet: experts sharded otherwise than the rest of the layer (expert_tensor_parallel_size != tp), an
MoE expert capacity or sinkhorn routing under sequence parallelism (each rank cuts or balances its
own slice of the tokens),
context and pipeline parallelism, data-parallel ranks within the call, expert-parallel ranks with
different tokens: each refused with a one-line message.
"""

import dataclasses
import hashlib
import json
import re

import torch
import torch.distributed as dist

from .capture import CaptureError, CaptureResult, capture_layer, infer_kind

COLUMN_PARALLEL = {"ColumnParallelLinear"}
# The attentions and the MLP return their row-parallel output (linear_proj's, linear_fc2's).
ROW_PARALLEL = {"RowParallelLinear", "SelfAttention", "MLASelfAttention", "MLP"}
CORE_ATTENTION = {"DotProductAttention", "MLADotProductAttention"}  # the latter: mla.py's (k / v channels)
ROTARY = {"RotaryEmbedding", "YarnRotaryEmbedding"}  # MLA's own: the whole sequence's angles on every rank


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    sp: bool = False
    ep: int = 1

    @property
    def world_size(self):
        return self.tp * self.ep

    def metadata(self, config):
        """The golden's `parallel` metadata: the layout, the MoE dispatcher, whose tokens it holds."""
        tokens = ("the sequence gathered from the tensor-parallel ranks in rank order" if self.sp else "the ranks share them")
        if self.ep > 1:
            tokens += "; every expert-parallel rank held the same tokens"
        moe = bool(getattr(config, "num_moe_experts", None))
        return {"tp": self.tp, "sp": self.sp, "ep": self.ep, "etp": self.tp if moe else 1, "dp": 1, "cp": 1,
                "world_size": self.world_size, "dispatcher": config.moe_token_dispatcher_type if moe else None,
                "tokens": tokens}  # fmt: skip


# A local expert's tensors: "...mlp.experts.local_experts.<i>.<rest>".
EXPERT = re.compile(r"^(.*\bexperts\.local_experts\.)(\d+)(\..*)$")


def global_expert_name(name, ep_rank, local_experts):
    """A rank's local expert tensor under its global expert index (rank r holds experts
    [r L, (r + 1) L))."""
    m = EXPERT.match(name)
    return name if not m else f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"


# --------------------------------------------------------------------------------------------
# Megatron's tensor-parallel layout of one tensor, and its inverse


# Parameters Megatron shards without marking them: core attention's learnable softmax offset holds
# the rank's heads (num_attention_heads_per_partition).
UNMARKED_SHARDS = {"core_attention.softmax_offset": 0}


def partition_dim(t, key):
    """The dimension Megatron shards parameter `t` (state-dict key `key`) along, or None for a
    replicated one."""
    if getattr(t, "tensor_model_parallel", False):
        return t.partition_dim
    return next((d for suffix, d in UNMARKED_SHARDS.items() if key.endswith(suffix)), None)


def is_glu_fc1(key, config):
    """fc1 of a gated linear unit: each rank holds [its gate shard; its up shard]."""
    return bool(config.gated_linear_unit) and key.rsplit(".", 1)[0].endswith("linear_fc1")


def full_shape(t, key, tp):
    shape = list(t.shape)
    d = partition_dim(t, key)
    if d is not None:
        shape[d] *= tp
    return tuple(shape)


def shard(full, t, key, config, rank, tp):
    """This rank's shard of the full tensor `full` of parameter `t` (state-dict key `key`)."""
    d = partition_dim(t, key)
    if d is None or tp == 1:
        return full
    halves = full.chunk(2, d) if is_glu_fc1(key, config) else (full,)
    return torch.cat([h.chunk(tp, d)[rank] for h in halves], d)


def unshard(shards, dim, glu):
    if glu:
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(shards, dim)


# --------------------------------------------------------------------------------------------
# gathering a capture's tensors


def _module_of(name, modules):
    """(module path, output index) of a tap name: "tap.self_attention.linear_qkv.0#1" ->
    ("self_attention.linear_qkv", "0")."""
    parts = name.split("#")[0].split(".", 1)[1].split(".")
    for i in range(len(parts), 0, -1):
        path = ".".join(parts[:i])
        if path in modules:
            return path, ".".join(parts[i:])
    return None, ".".join(parts)


def _tap_rule(name, modules, config, layout):
    """("cat", dim, glu) or ("same",) for a tap."""
    along_sequence = ("cat", 0, False) if layout.sp else ("same",)
    path, index = _module_of(name, modules)
    cls = type(modules[path]).__name__ if path is not None else ""
    if cls in COLUMN_PARALLEL:
        return ("cat", -1 if index == "0" else 0, is_glu_fc1(path + ".weight", config))
    if cls in ROW_PARALLEL:
        return along_sequence if index in ("", "0") else ("same",)
    if cls in CORE_ATTENTION:
        return ("cat", -1, False)
    if cls in ROTARY:
        return ("same",)
    if path is not None and path.endswith(("q_layernorm", "k_layernorm")) and not _is_mla(config):
        return ("cat", 2, False)  # SelfAttention's, on [s, b, heads, head dim]
    # MLA's q / kv layernorms act on the whole latent (replicated), under SP on the rank's tokens
    return along_sequence


def _is_mla(config):
    return bool(getattr(config, "multi_latent_attention", False))


def _rule(name, layer, modules, params, layout):
    config = layer.config
    along_sequence = ("cat", 0, False) if layout.sp else ("same",)
    if name.startswith(("param.", "grad.param.")):
        key = name.split("param.", 1)[1]
        p = params.get(key)
        d = partition_dim(p, key) if p is not None else None
        if d is not None:
            return ("cat", d, is_glu_fc1(key, config))
        if name.startswith("grad.") and layout.tp > 1:
            # A replicated parameter whose gradient each rank holds in part, reduced across the
            # tensor-parallel ranks after the backward as finalize_model_grads does: summed for
            # sequence-parallel parameters and q/k layernorms (each rank's heads), averaged where
            # Megatron marks average_gradients_across_tp_domain. (MLA's q / kv layernorms act on
            # the whole latent, gathered: replicated, each rank's gradient whole but under SP.)
            if getattr(p, "average_gradients_across_tp_domain", False):
                return ("mean",)
            if (layout.sp and getattr(p, "sequence_parallel", False)) or (
                config.qk_layernorm and not _is_mla(config) and ("q_layernorm" in key or "k_layernorm" in key)
            ):
                return ("sum",)
        return ("same",)
    if name in ("input.hidden_states", "output.hidden_states", "grad_in.output", "grad.input.hidden_states"):
        return along_sequence
    if layout.sp and name.startswith(("aux.", "state.")):
        # MoE under sequence parallelism: each rank's router sees its slice of the tokens. Megatron
        # logs each load-balancing loss as the sum of the ranks' parts (its tracker all-reduces
        # them over the tensor-parallel group); the z-loss each rank logs is the mean over its own
        # tokens (its coefficient divided by tp), so the whole layer's is their mean; the
        # expert-bias token counts add up.
        return ("mean",) if name == "aux.z_loss" else ("sum",)
    if name.startswith("tap."):
        return _tap_rule(name, modules, config, layout)
    return ("same",)


def _expert_parallel_parts(parts, layer, layout):
    """Expert parallelism (every EP rank holding the same tokens; `parts` one per EP rank, each its
    tensor-parallel group's put together): each rank's local experts renamed to
    their global index and merged into rank 0's tensors. An expert's gradient on a rank sums the
    contributions of every rank's copy of the tokens: divided by ep (exact for powers of two), it
    is the one-rank layer's. The experts' own taps and inputs depend on the layout (how many copies
    of a token an expert sees, in which order) and are left out."""
    local = 1 + max((int(m.group(2)) for n in parts[0] for m in [EXPERT.match(n)] if m), default=0)
    merged = {}
    for ep_rank, part in enumerate(parts):
        for name, t in part.items():
            if name.startswith(("tap.mlp.experts.", "tap_in.mlp.experts.")):
                continue
            if EXPERT.match(name):
                merged[global_expert_name(name, ep_rank, local)] = t / layout.ep if name.startswith("grad.") else t
            elif ep_rank == 0:
                merged[name] = t
    return merged


def _gather_tensor_parallel(parts, layer, layout):
    """One tensor-parallel group's tensors (a list in rank order) put together, and the names of
    the replicated ones its ranks disagree on."""
    modules = dict(layer.named_modules())
    params = dict(layer.named_parameters())
    out, disagree = {}, []
    for name in parts[0]:
        shards = [p[name] for p in parts]
        rule = _rule(name, layer, modules, params, layout)
        if rule[0] == "cat":
            out[name] = unshard(shards, rule[1], rule[2]).contiguous()
        elif rule[0] in ("sum", "mean"):  # in rank order in fp32, rounded once
            total = shards[0].to(torch.float32)
            for s in shards[1:]:
                total = total + s.to(torch.float32)
            out[name] = (total / len(shards) if rule[0] == "mean" else total).to(shards[0].dtype)
        else:
            out[name] = shards[0]
            if any(s.shape != shards[0].shape or not torch.equal(s, shards[0]) for s in shards[1:]):
                disagree.append(name)
    return out, disagree


def gather(parts, layer, layout):
    """The whole layer's tensors from every rank's (a list in rank order: tensor-parallel ranks
    fastest, as Megatron orders them), and the names of the replicated ones the ranks disagree on."""
    groups = [_gather_tensor_parallel(parts[e * layout.tp : (e + 1) * layout.tp], layer, layout) for e in range(layout.ep)]
    disagree = sorted({n for _, d in groups for n in d})
    if layout.ep == 1:
        return groups[0][0], disagree
    per_ep_rank = [g for g, _ in groups]
    merged = _expert_parallel_parts(per_ep_rank, layer, layout)
    for name in merged:  # what EP rank 0 holds of the non-expert tensors, every EP rank must hold
        if not EXPERT.match(name) and any(name in g and not torch.equal(g[name], merged[name]) for g in per_ep_rank[1:]):
            disagree.append(name)
    return merged, disagree


# --------------------------------------------------------------------------------------------
# a tensor-parallel bug of Megatron-Core's MLA: named in the golden, or mended for the capture

K_POS_EMB_BUG = (
    "Megatron-LM issue #1699: MLA's k_pos_emb (the RoPE part of linear_kv_down_proj's output, one key head "
    "shared by all heads) gets on each tensor-parallel rank the gradient of that rank's heads only, never summed "
    "across the ranks (gather_from_tensor_model_parallel_region's backward splits it), so at tp > 1 the "
    "k_pos_emb rows of linear_kv_down_proj.weight's gradient, the layer's input gradient and the gradients "
    "before the attention (input_layernorm's) are not the one-rank layer's"
)
K_POS_EMB_MEND = (
    "MLA k_pos_emb gradient mended for this capture (mcore_twin.parallel.mend_k_pos_emb_grad, the fix proposed "
    "for Megatron-LM #1699): its gradient summed across the tensor-parallel ranks before the gather's backward "
    "splits it; the forward unchanged. Without it: " + K_POS_EMB_BUG
)


def _k_pos_emb_bug(layer, tp):
    """Whether `layer` has the k_pos_emb gradient bug (K_POS_EMB_BUG) at tensor parallel `tp`: MLA
    with a column-parallel linear_kv_down_proj (the local spec), at a Megatron-Core that does not
    sum k_pos_emb's gradient across the ranks (the fix proposed upstream wraps it in
    copy_to_tensor_model_parallel_region; the January pin has none)."""
    import inspect

    down = getattr(getattr(layer, "self_attention", None), "linear_kv_down_proj", None)
    if tp == 1 or not _is_mla(layer.config) or type(down).__name__ not in COLUMN_PARALLEL:
        return False
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    src = inspect.getsource(MLASelfAttention.get_query_key_value_tensors)
    return not any(f"{fn}(k_pos_emb" in src for fn in ("copy_to_tensor_model_parallel_region",
                                                       "reduce_from_tensor_model_parallel_region"))  # fmt: skip


def k_pos_emb_bug_gradients(names):
    """The gradients among `names` that K_POS_EMB_BUG makes wrong."""
    wrong = ("grad.input.hidden_states", "grad.param.self_attention.linear_kv_down_proj.")
    return [n for n in names if n.startswith(wrong) or n.startswith("grad.param.input_layernorm.")]


class _SumTrailingGrad(torch.autograd.Function):
    """Forward: the tensor as is. Backward: its gradient's last channels from `start` on summed
    across `group` (the others as they are)."""

    @staticmethod
    def forward(ctx, x, start, group):
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad[..., ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start :] = part
        return grad, None, None


class mend_k_pos_emb_grad:
    """While entered, `layer`'s MLA sums k_pos_emb's gradient across the tensor-parallel ranks (the
    fix proposed for Megatron-LM #1699, K_POS_EMB_BUG): the gathered output of its
    linear_kv_down_proj, [s, b, kv_lora_rank + qk_pos_emb_head_dim], gets a backward that all-reduces
    the last qk_pos_emb_head_dim channels of its gradient (kv_compressed's, the others, are whole on
    every rank already: linear_kv_up_proj's backward all-reduced them) before the gather's backward
    keeps the rank's slice. The forward is unchanged. Only this layer, only while entered: the
    module's gather_from_tensor_model_parallel_region is restored on exit. For a layer with the bug
    (_k_pos_emb_bug); a no-op unless `active`."""

    def __init__(self, layer, active=True):
        self.layer, self.active = layer, active

    def __enter__(self):
        if not self.active:
            return self
        from megatron.core import parallel_state as ps
        from megatron.core.transformer import multi_latent_attention as mla_module

        attn = self.layer.self_attention
        start, group = attn.config.kv_lora_rank, ps.get_tensor_model_parallel_group()
        down_out = []
        self._hook = attn.linear_kv_down_proj.register_forward_hook(lambda m, a, out: down_out.append(out[0]))
        self._module, self._orig = mla_module, mla_module.gather_from_tensor_model_parallel_region
        orig = self._orig

        def gather_from_tensor_model_parallel_region(input_, *args, **kwargs):
            out = orig(input_, *args, **kwargs)
            if any(input_ is t for t in down_out):
                out = _SumTrailingGrad.apply(out, start, group)
            return out

        mla_module.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
        return self

    def __exit__(self, *exc):
        if self.active:
            self._hook.remove()
            self._module.gather_from_tensor_model_parallel_region = self._orig
        return False


# --------------------------------------------------------------------------------------------
# the capture on every rank


def _check_layout(config, kind):
    from megatron.core import parallel_state as ps

    for f in ("context_parallel_size", "pipeline_model_parallel_size"):
        if getattr(config, f, 1) not in (1, None):
            raise CaptureError(f"config.{f} = {getattr(config, f)}: multi-rank capture takes tensor, sequence and "
                               "expert parallelism only (for now)")  # fmt: skip
    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    if kind not in ("dense_layer", "moe_layer"):
        raise CaptureError(f"multi-rank capture takes dense and MoE layers (for now), not {kind}")
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    if kind == "moe_layer" and config.sequence_parallel and getattr(config, "moe_expert_capacity_factor", None):
        raise CaptureError("an expert capacity under sequence parallelism cuts each rank's slice of the tokens, not "
                           "the layer's: the gathered layer is not a one-rank layer (capture it without the capacity)")  # fmt: skip
    if kind == "moe_layer" and config.sequence_parallel and config.moe_router_load_balancing_type == "sinkhorn":
        raise CaptureError("sinkhorn routing under sequence parallelism balances each rank's slice of the tokens, "
                           "not the layer's: the gathered layer is not a one-rank layer")  # fmt: skip
    if kind == "moe_layer" and etp != tp:
        raise CaptureError(f"config.expert_tensor_parallel_size = {etp}: multi-rank capture takes experts sharded "
                           f"like the rest of the layer (tp {tp}) only (for now)")  # fmt: skip
    if dist.get_world_size() != tp * ep:
        raise CaptureError(f"world size {dist.get_world_size()} is not tp {tp} x ep {ep}: data parallel ranks are "
                           "not gathered (for now); call it in a job of one model-parallel group")  # fmt: skip
    return Layout(tp=tp, sp=bool(config.sequence_parallel), ep=ep)


def _same_tokens_on_every_rank(hidden_states, tp):
    """Expert parallelism: a golden holds one set of tokens, so every EP rank must have been given
    the same (the expert-parallel ranks of a job usually hold different batches); the ranks of one
    tensor-parallel group hold their slices of them."""
    digest = hashlib.sha1(hidden_states.detach().float().contiguous().numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if any(d != digests[r % tp] for r, d in enumerate(digests)):
        raise CaptureError("the expert-parallel ranks hold different tokens: a golden of one set of tokens cannot "
                           "hold the experts' gradients, which sum every rank's; give every rank the same input")  # fmt: skip


def _all_or_none(ok, error):
    """Every rank learns whether every rank succeeded; raises the first error on all of them."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (ok, error))
    for rank, (ok_r, err_r) in enumerate(outcomes):
        if not ok_r:
            raise CaptureError(f"rank {rank}: {err_r}")


def capture_parallel(layer, path, hidden_states, *, grad_seed=0, mend_mla_k_pos_emb=False, **kwargs):
    """Captures `layer` on this rank and writes the gathered golden on rank 0 (see the module
    docstring). Call on every rank with the same arguments but the rank's own hidden_states.
    mend_mla_k_pos_emb: an MLA layer at tp > 1 with Megatron-LM #1699 (K_POS_EMB_BUG) is captured
    with the fix (mend_k_pos_emb_grad; the golden's notes and `mended` say so), so that its gradients
    are the one-rank layer's; without it the golden holds Megatron's and `megatron_tp_bug` names
    the gradients the bug makes wrong."""
    from megatron.core import parallel_state as ps

    error, bug, mended = None, False, False
    try:
        kind = kwargs.pop("kind", None) or infer_kind(layer)
        layout = _check_layout(layer.config, kind)
        if layout.ep > 1:
            _same_tokens_on_every_rank(hidden_states, layout.tp)
        rank = ps.get_tensor_model_parallel_rank()
        s_local, b, h = hidden_states.shape
        s = s_local * layout.tp if layout.sp else s_local
        gen = torch.Generator().manual_seed(int(grad_seed))
        grad = torch.randn((s, b, h), generator=gen, dtype=torch.float32)
        if layout.sp:
            grad = grad.chunk(layout.tp, dim=0)[rank]
        bug = _k_pos_emb_bug(layer, layout.tp)
        mended = bug and bool(mend_mla_k_pos_emb)
        with mend_k_pos_emb_grad(layer, active=mended):
            mine = capture_layer(layer, path, hidden_states, grad_seed=grad_seed, grad_output=grad, kind=kind,
                                 parallel=True, **kwargs)  # fmt: skip
    except Exception as e:  # every rank must reach the gather below, or the others wait forever
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    _all_or_none(error is None, error)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine.tensors, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    tensors, disagree = gather(parts, layer, layout)
    meta = dict(mine.metadata)
    cfg = json.loads(meta["config"])
    cfg["seq_length"] = int(s)
    meta["config"] = json.dumps(dict(sorted(cfg.items())))
    meta["parallel"] = json.dumps(layout.metadata(layer.config))
    meta["tap_order"] = json.dumps([n for n in json.loads(meta["tap_order"]) if n in tensors])
    if disagree:
        meta["ranks_disagree"] = json.dumps(disagree)
    if mended:
        meta["notes"] = (meta.get("notes", "") + " " + K_POS_EMB_MEND).strip()
        meta["mended"] = json.dumps({"k_pos_emb_grad": "Megatron-LM #1699"})
    elif bug:
        wrong = k_pos_emb_bug_gradients(tensors)
        meta["megatron_tp_bug"] = json.dumps({"issue": "Megatron-LM #1699", "gradients": wrong, "why": K_POS_EMB_BUG})
    from . import st_io

    written = dict(sorted(tensors.items()))
    st_io.write(str(path), written, meta)
    return CaptureResult(path=str(path), kind=kind, tensors=written, metadata=meta)


# --------------------------------------------------------------------------------------------
# running ranks as processes (the live parallel tests; a job of one's own has its own launcher)


def _rank_main(rank, layout, port, fn, args):
    from . import bootstrap

    bootstrap.bootstrap(rank=rank, world_size=layout.world_size, tensor_parallel=layout.tp,
                        expert_parallel=layout.ep, master_port=port)  # fmt: skip
    fn(rank, *args)
    # Every rank leaves the group together and tears gloo down before the interpreter exits: a
    # process exiting with gloo's threads still joinable aborts ("terminate called without an
    # active exception"), at random, which spawn reports as the whole run's failure.
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_ranks(layout, fn, *args):
    """Runs fn(rank, *args) in layout.world_size processes over gloo, Megatron's parallel state at
    `layout`. A rank that raises ends the others (torch.multiprocessing.spawn) and raises here."""
    import torch.multiprocessing as mp

    from .bootstrap import _free_port

    mp.spawn(_rank_main, args=(layout, _free_port(), fn, args), nprocs=layout.world_size, join=True)
