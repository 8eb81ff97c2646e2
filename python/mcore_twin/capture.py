"""Capture a Megatron-Core layer as a golden file for mcore-twin.

Inside any running Megatron-Core process (GPU or CPU, torch 1.13 or later):

    from mcore_twin.capture import capture_layer
    capture_layer(model.decoder.layers[n], "layer_n.safetensors",
                  hidden_states=h, attention_mask=mask, rotary_pos_emb=rope, grad_seed=0)

records the layer (a `TransformerLayer`, dense or with an `MoELayer` mlp, a Retro decoder layer, or
a Retro decoder `TransformerBlock`) in the format of `fixtures/megatron-core/README.md`:

- `__metadata__`: kind, config (the config fields the twin reads, plus the run description:
  seq_length, micro_batch_size, attn_mask_type, position_embedding_type, rotary settings, Retro
  shapes), config_full (every config field), layer_number, training, notes, tap_order (the
  compared tensors in computation order); MoE adds aux_losses and tie_break_dependent; Retro
  blocks add layout.
- `param.<key>` from `state_dict()`; `input.*`; `output.*`.
- `tap.<module path>[.i]`: each submodule's output from forward hooks. Tuple and list outputs are
  flattened as `.0`, `.1`, dict outputs as `.key`, non-tensors and None are left out; a tensor name
  recorded a second time gets `#1`, then `#2`, ... Hooked: every submodule except identities,
  dropouts and the softmax module inside core attention (their outputs are not layer semantics).
- `tap_in.<experts path>.{dispatched_input,tokens_per_expert,permuted_probs}`,
  `tap.<router path>.logits` (the router's gating output), `aux.<name>` (the MoE losses as
  Megatron logs them: loss / coeff), `state.<router path>.local_tokens_per_expert_after`.
- `grad_in.output` (a fixed upstream gradient drawn from `grad_seed`), `grad.input.*` and
  `grad.param.<key>`: one backward of `sum(output.hidden_states * grad_in.output)`.

The capture leaves the training job as it found it: gradients come from `torch.autograd.grad`
(nothing is accumulated into `.grad` or Megatron's `main_grad` buffers), and the router's counters,
the aux-loss tracker, the aux-loss backward scale, dropout probabilities and gradient-accumulation
fusion flags are restored afterwards. Dropout runs at probability 0 during the capture (a twin
cannot replay torch's dropout masks) and the recorded config says so.

A dense or MoE layer whose self attention is multi-latent attention (`MLASelfAttention`, with
`config.multi_latent_attention`) computes its own RoPE from its config: it takes no rotary_pos_emb,
its config adds MLA_FIELDS (the MLA sizes, rope_type and the YaRN fields, under Megatron's names)
and records position_embedding_type "rope", and its notes say which attention modules ran (mla.py:
the CPU capture substitutes one, the core attention).
"""

import dataclasses
import enum
import functools
import json
import math

import torch

from . import st_io

KINDS = ("dense_layer", "moe_layer", "retro_decoder_layer_first", "retro_decoder_layer", "retro_block")


# The TransformerConfig fields a golden's `config` holds (the fields core/config.h reads), by kind.
BASE_FIELDS = (
    "activation_func", "activation_func_clamp_value", "add_bias_linear", "add_qkv_bias",
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm", "apply_rope_fusion",
    "attention_dropout", "attention_output_gate", "attention_softmax_in_fp32", "bf16",
    "bias_activation_fusion", "bias_dropout_fusion", "calculate_per_token_loss", "context_parallel_size",
    "expert_model_parallel_size", "ffn_hidden_size", "fp16", "fp32_residual_connection", "gated_linear_unit",
    "glu_linear_offset", "hidden_dropout", "hidden_size", "kv_channels", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "masked_softmax_fusion", "normalization", "num_attention_heads", "num_layers",
    "num_moe_experts", "num_query_groups", "params_dtype", "pipeline_model_parallel_size", "qk_l2_norm",
    "qk_layernorm", "rotary_interleaved", "sequence_parallel", "softmax_scale", "softmax_type",
    "tensor_model_parallel_size", "test_mode", "window_size",
)  # fmt: skip
MOE_FIELDS = (
    "moe_apply_probs_on_input", "moe_aux_loss_coeff", "moe_deepep_num_sms", "moe_expert_capacity_factor",
    "moe_ffn_hidden_size", "moe_grouped_gemm", "moe_input_jitter_eps", "moe_latent_size", "moe_layer_freq",
    "moe_pad_expert_input_to_capacity", "moe_per_layer_logging", "moe_permute_fusion",
    "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_enable_expert_bias",
    "moe_router_force_load_balancing", "moe_router_fusion", "moe_router_group_topk",
    "moe_router_load_balancing_type", "moe_router_num_groups", "moe_router_padding_for_fp8",
    "moe_router_padding_for_quantization", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_topk", "moe_router_topk_limited_devices", "moe_router_topk_scaling_factor",
    "moe_shared_expert_gate", "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap",
    "moe_token_dispatcher_type", "moe_token_drop_policy", "moe_use_legacy_grouped_gemm", "moe_z_loss_coeff",
)  # fmt: skip
RETRO_FIELDS = (
    "retro_block_size", "retro_chunk_length", "retro_encoder_attention_dropout", "retro_encoder_hidden_dropout",
    "retro_encoder_num_layers", "retro_neighbor_dirs", "retro_num_neighbors", "retro_num_retrieved_chunks",
    "retro_project_dir", "retro_retrieved_length", "retro_split_preprocessing", "retro_verify_neighbor_count",
)  # fmt: skip
# MLATransformerConfig fields a golden's config adds when multi_latent_attention is on (the MLA sizes and
# the RoPE MLA computes itself: rope_type "rope" or "yarn", the YaRN fields used by "yarn" only).
MLA_FIELDS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
)  # fmt: skip
# Run-description fields of a golden's config (not TransformerConfig fields).
RUN_FIELDS = (
    "seq_length", "micro_batch_size", "attn_mask_type", "position_embedding_type", "rotary_base", "rotary_percent",
    "context_shape", "retro_r", "retro_l_chunks", "moe_spec",
)  # fmt: skip
DROPOUT_FIELDS = ("hidden_dropout", "attention_dropout", "retro_encoder_hidden_dropout", "retro_encoder_attention_dropout")

RETRO_ATTN_MASK_TYPE = "causal (decoder self-attn); padding (encoder self-attn, decoder/encoder cross-attn, mask None)"
MOE_SPEC = (
    "get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False) -> "
    "TransformerLayer(mlp=MoELayer(SequentialMLP, SharedExpertMLP))"
)
MLA_MOE_SPEC = (
    "get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, multi_latent_attention=True) -> "
    "TransformerLayer(self_attention=MLASelfAttention, mlp=MoELayer(SequentialMLP, SharedExpertMLP))"
)

NOTES = {
    "dense_layer": "attention_mask: bool, True = masked (filled with -10000.0 before softmax). No mask given -> "
    "causal mask generated internally.",
    "moe_layer": "aux.<name> = loss/coeff exactly as Megatron logs it (save_to_aux_losses_tracker); the scaled "
    "loss (x coeff) is attached to the router probs via MoEAuxLossAutoScaler with backward scale 1.0, so grad.* "
    "INCLUDE the aux-loss (and z-loss) gradient. padding_mask: [b,s] bool, True = padding. tap.mlp.router.0/1 = "
    "(probs [T,E], routing_map [T,E]) with T = s*b tokens in [s,b] row-major order (token t = s_idx*b + b_idx). "
    "tap_in.mlp.experts.* = inputs of SequentialMLP (tokens permuted expert-major).",
    "retro": "Retro: input.context for the first retro layer / block = neighbor embeddings [r, k*bs*l, d] (batch "
    "index = (b*l + chunk)*k + neighbor); for a later layer = encoder output [r*k, bs*l, d]. output.context = "
    "encoder output [r*k, bs*l, d] returned by the layer. Loss for backward = sum(output.hidden_states * "
    "grad_in.output) only (output.context not in loss). Retro cross-attention masks are None "
    "(get_all_true_mask returns None).",
}
TIE_BREAK_NOTE = (
    "apply_router_token_dropping uses torch.topk(..., dim=0, sorted=False) over tied values (routing_map ints for "
    "'position', zero probs for padding): which tied tokens are kept is torch/CPU implementation-defined. Take "
    "tap.mlp.router.1 (final routing_map) as given when comparing."
)
TOPK_TIE_NOTE = (
    "router_topk_ties lists the tokens whose router scores are tied at a torch.topk cut (expert, group or "
    "aux-loss selection): which tied expert is chosen is implementation-defined; tap.mlp.router.1 is what "
    "Megatron chose."
)

# Submodules whose output is not recorded: identities (an absent layernorm or cross attention),
# dropout, the fused softmax inside core attention (its probabilities are internal to
# core_attention), containers (never called).
SKIP_CLASSES = {"IdentityOp", "IdentityFuncOp", "FusedScaleMaskSoftmax", "ModuleList", "ModuleDict"}
# Wrappers that apply their child once per Retro neighbour: the wrapper's output is the layer
# semantics, the child's calls are its internals.
WRAPPER_CLASSES = {"RetroEncoderLayerNorm"}


class CaptureError(RuntimeError):
    """The layer or its inputs cannot be captured as a golden (the message says why)."""


class NonFiniteError(CaptureError):
    """Megatron produced a NaN or an infinity: a golden with one proves nothing, none is written."""

    def __init__(self, names):
        self.names = list(names)
        super().__init__(
            "Megatron's own output is not finite in " + ", ".join(self.names[:6]) + (" ..." if len(self.names) > 6 else "")
        )


@dataclasses.dataclass
class CaptureResult:
    path: str
    kind: str
    tensors: dict  # name -> tensor (CPU), as written
    metadata: dict


# --------------------------------------------------------------------------------------------
# config


def _py_name(v):
    """A config value as JSON: dtypes and enums by name, functions by their name."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, (list, tuple)):
        return [_py_name(x) for x in v]
    if isinstance(v, functools.partial):
        return _py_name(v.func)
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    raise TypeError(type(v).__name__)


def config_full(config):
    """Every field of the config dataclass; values JSON cannot hold are written as their repr."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name, None)
        try:
            out[f.name] = _py_name(v)
        except TypeError:
            out[f.name] = repr(v)
    return out


def _activation_name(fn):
    name = _py_name(fn)
    aliases = {"swish": "silu", "erf_gelu": "erf_gelu"}
    return aliases.get(name, name)


def config_fields(config, kind):
    """The golden's `config` fields taken from `config` (a TransformerConfig / RetroConfig)."""
    names = list(BASE_FIELDS)
    mla = bool(getattr(config, "multi_latent_attention", False))
    if kind == "moe_layer":
        names += MOE_FIELDS
    if mla:
        names += MLA_FIELDS
    if kind.startswith("retro"):
        names += RETRO_FIELDS
    out = {}
    for name in names:
        if not hasattr(config, name):
            continue  # a field this Megatron version does not have: the twin takes its default
        v = getattr(config, name)
        if name == "activation_func":
            out[name] = _activation_name(v)
            continue
        try:
            out[name] = _py_name(v)
        except TypeError:
            raise CaptureError(f"config.{name} = {v!r} cannot be written as JSON for the twin") from None
    if kind == "moe_layer":
        out["moe_spec"] = MLA_MOE_SPEC if mla else MOE_SPEC
    return out


# --------------------------------------------------------------------------------------------
# what the layer is


def _cls(m):
    return type(m).__name__


def infer_kind(module):
    name = _cls(module)
    if name == "TransformerBlock":
        if any(_cls(getattr(layer, "cross_attention", None)) == "RetroDecoderCrossAttention" for layer in module.layers):
            return "retro_block"
        raise CaptureError(
            "a TransformerBlock is captured only as a Retro decoder block; capture its layers one by one instead"
        )
    xattn = getattr(module, "cross_attention", None)
    if _cls(xattn) == "RetroDecoderCrossAttention":
        return "retro_decoder_layer_first" if getattr(xattn, "encoder", None) is not None else "retro_decoder_layer"
    if _cls(xattn) not in ("IdentityOp", "NoneType"):
        raise CaptureError(f"cross attention {_cls(xattn)} is not a kind the twin knows")
    if not hasattr(module, "self_attention") or not hasattr(module, "mlp"):
        raise CaptureError(f"{name} is not a TransformerLayer (no self_attention / mlp)")
    if _cls(module.mlp) == "MoELayer":
        return "moe_layer"
    if _cls(module.mlp) == "MLP":
        return "dense_layer"
    raise CaptureError(f"mlp {_cls(module.mlp)} is not a kind the twin knows (MLP or MoELayer)")


def retro_layout(block):
    out = []
    for layer in block.layers:
        xattn = getattr(layer, "cross_attention", None)
        if _cls(xattn) == "RetroDecoderCrossAttention":
            out.append("retro_with_encoder" if getattr(xattn, "encoder", None) is not None else "retro")
        else:
            out.append("gpt")
    return out


def _check_world_size_one(config):
    for f in ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        if getattr(config, f, 1) not in (1, None):
            raise CaptureError(
                f"config.{f} = {getattr(config, f)}: capture_layer takes a layer of one rank; a tensor-parallel "
                "layer is captured on every rank with mcore_twin.parallel.capture_parallel"
            )
    etp = getattr(config, "expert_tensor_parallel_size", 1)
    if etp not in (1, None):
        raise CaptureError(f"config.expert_tensor_parallel_size = {etp}: the twins run experts on one rank")


# --------------------------------------------------------------------------------------------
# recording


class _Recorder:
    """Tensors in the order they are recorded; a name recorded again gets #1, #2, ..."""

    def __init__(self):
        self.tensors = {}
        self.order = []
        self._calls = {}

    def add(self, name, t):
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        key = name if n == 0 else f"{name}#{n}"
        self.tensors[key] = t.detach().clone()
        self.order.append(key)

    def add_output(self, name, out):
        """A module output: tensors as is, tuples / lists as .i, dicts as .key, the rest left out."""
        if isinstance(out, torch.Tensor):
            self.add(name, out)
        elif isinstance(out, (tuple, list)):
            for i, v in enumerate(out):
                self.add_output(f"{name}.{i}", v)
        elif isinstance(out, dict):
            for k, v in out.items():
                self.add_output(f"{name}.{k}", v)


def _is_dropout(m):
    return isinstance(m, torch.nn.modules.dropout._DropoutNd)


class _Restorer:
    """Undo list: every temporary change the capture makes to the layer and Megatron's globals."""

    def __init__(self):
        self._undo = []

    def setattr(self, obj, name, value):
        had = name in getattr(obj, "__dict__", {})
        old = getattr(obj, name, None)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def call(self, fn):
        self._undo.append(fn)

    def restore(self):
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # restore everything we can, then report
                errors.append(e)
        if errors:
            raise errors[0]


def _moe_tracker():
    """(moe_utils, the live dict of the aux-loss tracker: name -> entry with the per-layer values).
    Megatron-Core after the January pin keeps the entries in moe_logging's metrics tracker, and its
    get_moe_layer_wise_logging_tracker() returns a copy, which clearing would not clear."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return None, None
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return moe_utils, moe_utils.get_moe_layer_wise_logging_tracker()
    return moe_utils, get_moe_metrics_tracker().metrics


def _tracker_values(entry):
    """An aux-loss tracker entry's per-layer values: a dict at the January pin, a MetricEntry after."""
    return entry.get("values") if isinstance(entry, dict) else getattr(entry, "values", None)


def _tie_dependent(column_values, capacity, pad_to_capacity, routed):
    """Whether torch.topk(k=capacity, sorted=False) over one expert's column has a tie that straddles
    the cut and changes the result: tied kept / dropped values that are routed tokens (or any value
    with pad-to-capacity, where the kept set itself is the map)."""
    vals, _ = torch.sort(column_values.double(), descending=True)
    if capacity >= vals.numel():
        return False
    cut = vals[capacity - 1]
    if vals[capacity] != cut:
        return False
    tied = column_values.double() == cut
    return bool(pad_to_capacity or (tied & routed).any())


def capture_layer(
    layer,
    path,
    hidden_states,
    attention_mask=None,
    rotary_pos_emb=None,
    padding_mask=None,
    context=None,
    context_mask=None,
    *,
    grad_seed=0,
    grad_output=None,
    kind=None,
    case=None,
    group="capture",
    notes=None,
    position_embedding_type=None,
    rotary_base=None,
    rotary_percent=None,
    attn_mask_type=None,
    megatron_commit=None,
    require_finite=True,
    parallel=False,
):
    """Runs `layer` once forward and once backward on the given inputs and writes the golden to
    `path`. Inputs are Megatron's: hidden_states [s, b, h]; attention_mask bool [b, 1, s, s]
    (True = masked); rotary_pos_emb [s, 1, 1, rot_dim] (angles); padding_mask [b, s] (MoE, True =
    padding); context / context_mask (Retro). The upstream gradient is `grad_output`, or normal
    noise from a CPU generator seeded with `grad_seed`. Returns a CaptureResult; raises
    NonFiniteError (and writes nothing) when Megatron's own tensors are not finite and
    `require_finite`, CaptureError for a layer or input the twin cannot take. `parallel`: one
    rank's part of a multi-rank capture (parallel.capture_parallel): nothing is written, the
    CaptureResult holds this rank's tensors."""
    kind = kind or infer_kind(layer)
    if kind not in KINDS:
        raise CaptureError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    config = layer.config
    if not parallel:
        _check_world_size_one(config)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise CaptureError("hidden_states must be a tensor [s, b, h]")
    s, b, h = hidden_states.shape
    is_retro = kind.startswith("retro")
    if is_retro and context is None:
        raise CaptureError(f"{kind} needs context (neighbour embeddings or the encoder output)")
    if not is_retro and (context is not None or context_mask is not None):
        raise CaptureError(f"{kind} takes no context / context_mask")
    if kind != "moe_layer" and padding_mask is not None:
        raise CaptureError("padding_mask is an MoE layer input")
    if is_retro and (attention_mask is not None or rotary_pos_emb is not None):
        raise CaptureError("the Retro handlers take no attention_mask / rotary_pos_emb (causal self attention, no RoPE)")
    mla = bool(getattr(config, "multi_latent_attention", False))
    if mla and rotary_pos_emb is not None:
        raise CaptureError("multi-latent attention computes its own RoPE (config rope_type): pass no rotary_pos_emb")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise CaptureError("attention_mask must be bool (True = masked)")
    if padding_mask is not None and (padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != (b, s)):
        raise CaptureError(f"padding_mask must be bool [b, s] = [{b}, {s}]")

    device = hidden_states.device
    undo = _Restorer()
    rec = _Recorder()
    hooks = []
    try:
        # --- inputs
        x = hidden_states.detach().clone().requires_grad_(True)
        ctx = context.detach().clone().requires_grad_(True) if context is not None else None
        inputs = {"hidden_states": x}
        kwargs = {"hidden_states": x}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            inputs["attention_mask"] = attention_mask
        elif not is_retro or kind == "retro_block":
            kwargs["attention_mask"] = None  # TransformerBlock.forward requires the argument
        if rotary_pos_emb is not None:
            kwargs["rotary_pos_emb"] = rotary_pos_emb
            inputs["rotary_pos_emb"] = rotary_pos_emb
        if padding_mask is not None:
            kwargs["padding_mask"] = padding_mask
            inputs["padding_mask"] = padding_mask
        if ctx is not None:
            kwargs["context"] = ctx
            inputs["context"] = ctx
            kwargs["context_mask"] = context_mask
            if context_mask is not None:
                inputs["context_mask"] = context_mask

        # --- the run as a twin can repeat it: no dropout, no fused weight-gradient accumulation
        for m in layer.modules():
            if _is_dropout(m) and m.p != 0:
                undo.setattr(m, "p", 0.0)
            if isinstance(getattr(m, "hidden_dropout", None), float) and m.hidden_dropout != 0:
                undo.setattr(m, "hidden_dropout", 0.0)
            if getattr(m, "gradient_accumulation_fusion", False) is True:
                undo.setattr(m, "gradient_accumulation_fusion", False)

        # --- MoE: fresh router counters and aux-loss tracker, aux-loss backward scale 1.0
        moe_utils, tracker = _moe_tracker()
        routers = {n: m for n, m in layer.named_modules() if hasattr(m, "routing") and hasattr(m, "gating")}
        if routers and tracker is not None:
            saved = dict(tracker)
            tracker.clear()
            undo.call(lambda: (tracker.clear(), tracker.update(saved)))
            scaler = moe_utils.MoEAuxLossAutoScaler
            old_scale = scaler.main_loss_backward_scale
            scaler.main_loss_backward_scale = torch.tensor(1.0, device=device)

            def _restore_scale():
                scaler.main_loss_backward_scale = old_scale

            undo.call(_restore_scale)
        for rname, router in routers.items():
            for buf in ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
                t = getattr(router, buf, None)
                if isinstance(t, torch.Tensor):
                    old = t.detach().clone()
                    t.data.zero_()
                    undo.call(functools.partial(lambda t, old: t.data.copy_(old), t, old))

        # --- token dropping inputs, to tell whether a tie decided which tokens were kept
        drops = []
        router_mod = None
        try:
            from megatron.core.transformer.moe import router as router_mod
        except ImportError:
            pass
        if routers and router_mod is not None and hasattr(router_mod, "apply_router_token_dropping"):
            orig_drop = router_mod.apply_router_token_dropping

            def drop_spy(routing_probs, routing_map, *args, **kw):
                out = orig_drop(routing_probs, routing_map, *args, **kw)
                drops.append((routing_probs.detach().clone(), routing_map.detach().clone(), args, kw))
                return out

            undo.setattr(router_mod, "apply_router_token_dropping", drop_spy)

        # --- ties at the router's top-k cut (expert selection, group selection, aux-loss map):
        # which tied expert torch.topk returns is implementation-defined too.
        topk_tie_rows = set()
        in_routing = []
        if routers:
            orig_topk = torch.topk

            def topk_spy(*args, **kw):
                res = orig_topk(*args, **kw)
                if in_routing:
                    inp = args[0] if args else kw.get("input")
                    k = args[1] if len(args) > 1 else kw.get("k")
                    dim = args[2] if len(args) > 2 else kw.get("dim", -1)
                    largest = args[3] if len(args) > 3 else kw.get("largest", True)
                    if isinstance(inp, torch.Tensor) and inp.dim() == 2 and dim in (1, -1) and largest:
                        if k < inp.shape[1]:
                            v, _ = torch.sort(inp.detach(), dim=1, descending=True)
                            tied = (v[:, k - 1] == v[:, k]) & torch.isfinite(v[:, k - 1])
                            topk_tie_rows.update(tied.nonzero().flatten().tolist())
                return res

            undo.setattr(torch, "topk", topk_spy)
            for router in routers.values():

                def routing(*a, _orig=router.routing, **k):
                    in_routing.append(True)
                    try:
                        return _orig(*a, **k)
                    finally:
                        in_routing.pop()

                undo.setattr(router, "routing", routing)

        # --- hooks
        modules = dict(layer.named_modules())

        def out_hook(name):
            def hook(mod, args, out):
                rec.add_output(f"tap.{name}", out)
                if name in routers:
                    _record_router(name, mod)

            return hook

        def _record_router(name, router):
            if tracker is not None:
                lnum = getattr(router, "layer_number", None)
                for aux_name, entry in list(tracker.items()):
                    vals = _tracker_values(entry)
                    if lnum is None or vals is None:
                        continue
                    v = vals[lnum - 1].detach().clone()
                    rec.add(f"aux.{aux_name}", v.to(torch.float32))
                    vals[lnum - 1] = 0  # a later router of the same block starts from zero
            counter = getattr(router, "local_tokens_per_expert", None)
            if isinstance(counter, torch.Tensor) and getattr(router, "enable_expert_bias", False):
                rec.add(f"state.{name}.local_tokens_per_expert_after", counter)

        def experts_pre_hook(name):
            def hook(mod, args):
                for key, v in zip(("dispatched_input", "tokens_per_expert", "permuted_probs"), args):
                    if isinstance(v, torch.Tensor):
                        rec.add(f"tap_in.{name}.{key}", v)
                    elif isinstance(v, (list, tuple)):
                        rec.add(f"tap_in.{name}.{key}", torch.tensor(v, dtype=torch.int64))

            return hook

        wrapped = tuple(n + "." for n, m in modules.items() if _cls(m) in WRAPPER_CLASSES)
        for name, m in modules.items():
            if name == "" or _cls(m) in SKIP_CLASSES or _is_dropout(m) or name.startswith(wrapped or ("\0",)):
                continue
            if name in routers:
                orig_gating = m.gating

                def gating(*a, _orig=orig_gating, _name=name, **k):
                    logits = _orig(*a, **k)
                    rec.add(f"tap.{_name}.logits", logits)
                    return logits

                undo.setattr(m, "gating", gating)
            if _cls(m) in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP"):
                hooks.append(m.register_forward_pre_hook(experts_pre_hook(name)))
            hooks.append(m.register_forward_hook(out_hook(name)))

        # --- forward
        out = layer(**kwargs)
        for hnd in hooks:
            hnd.remove()
        hooks = []
        if isinstance(out, (tuple, list)):
            out_hidden, out_context = out[0], (out[1] if len(out) > 1 else None)
        else:
            out_hidden, out_context = out, None
        if not isinstance(out_hidden, torch.Tensor):
            raise CaptureError(f"the layer returned {type(out_hidden).__name__}, not a tensor")
        rec.add("output.hidden_states", out_hidden)
        if kind in ("retro_decoder_layer_first", "retro_decoder_layer") and isinstance(out_context, torch.Tensor):
            rec.add("output.context", out_context)

        # --- backward: sum(output.hidden_states * grad_in.output), nothing accumulated in .grad
        if grad_output is None:
            gen = torch.Generator().manual_seed(int(grad_seed))
            grad_output = torch.randn(tuple(out_hidden.shape), generator=gen, dtype=torch.float32)
        grad_output = grad_output.to(device=out_hidden.device, dtype=out_hidden.dtype)
        named_params = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
        wrt = [x] + ([ctx] if ctx is not None else []) + [p for _, p in named_params]
        grads = torch.autograd.grad(out_hidden, wrt, grad_outputs=grad_output, allow_unused=True)
        grad_tensors = {"grad_in.output": grad_output.detach().clone(), "grad.input.hidden_states": grads[0]}
        if ctx is not None:
            grad_tensors["grad.input.context"] = grads[1]
        for (n, _), g in zip(named_params, grads[len(wrt) - len(named_params) :]):
            if g is not None:
                grad_tensors[f"grad.param.{n}"] = g

        # --- ties at the capacity cut
        tie_dependent = False
        for probs, rmap, args, kw in drops:
            topk = kw.get("router_topk", args[0] if len(args) > 0 else 1)
            factor = kw.get("capacity_factor", args[1] if len(args) > 1 else None)
            policy = kw.get("drop_policy", args[2] if len(args) > 2 else "probs")
            pad = kw.get("pad_to_capacity", args[3] if len(args) > 3 else False)
            tokens, experts = probs.shape
            capacity = math.ceil((tokens * topk / experts) * factor)
            if capacity > tokens:
                continue  # nothing is dropped
            values = rmap.int() if policy == "position" else probs
            for e in range(experts):
                if _tie_dependent(values[:, e], capacity, pad, rmap[:, e]):
                    tie_dependent = True
            # "position" keeps tokens by torch.topk over 0/1 values: a tie whenever it cuts.
            if policy == "position":
                tie_dependent = True
    finally:
        for hnd in hooks:
            hnd.remove()
        undo.restore()

    # --- what is written
    tensors = {}
    for k, v in inputs.items():
        tensors[f"input.{k}"] = v
    for k, v in layer.state_dict().items():
        if isinstance(v, torch.Tensor):
            tensors[f"param.{k}"] = v
    for k in rec.order:
        tensors[k] = rec.tensors[k]
    tensors.update(grad_tensors)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}

    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad and require_finite:
        raise NonFiniteError(bad)

    cfg = config_fields(config, kind)
    for f in DROPOUT_FIELDS:
        if f in cfg and cfg[f] is not None:
            cfg[f] = 0.0  # what ran (see the module docstring)
    cfg["seq_length"] = int(s)
    cfg["micro_batch_size"] = int(b)
    if is_retro:
        cfg["attn_mask_type"] = attn_mask_type or RETRO_ATTN_MASK_TYPE
        cfg["position_embedding_type"] = position_embedding_type or "none"
        chunk = getattr(config, "retro_chunk_length", None)
        if chunk:
            cfg["retro_l_chunks"] = int(math.ceil(s / chunk))
        if getattr(config, "retro_retrieved_length", None):
            cfg["retro_r"] = int(config.retro_retrieved_length)
        cfg["context_shape"] = list(context.shape)
    else:
        if attn_mask_type is None:
            amt = getattr(getattr(layer.self_attention, "core_attention", None), "attn_mask_type", None)
            amt = getattr(layer.self_attention, "attn_mask_type", amt)
            attn_mask_type = _py_name(amt) if amt is not None else "causal"
        cfg["attn_mask_type"] = attn_mask_type
        pet = position_embedding_type or ("rope" if rotary_pos_emb is not None or mla else "none")
        cfg["position_embedding_type"] = pet
        if pet == "rope" and not mla:  # MLA's rotary_base / rotary_percent are its config's (MLA_FIELDS)
            if rotary_percent is None and rotary_pos_emb is not None:
                kv = config.kv_channels or config.hidden_size // config.num_attention_heads
                rotary_percent = rotary_pos_emb.shape[-1] / kv
            if rotary_base is not None:
                cfg["rotary_base"] = rotary_base
            if rotary_percent is not None:
                cfg["rotary_percent"] = float(rotary_percent)
    cfg = dict(sorted(cfg.items()))

    compared_prefixes = ("output.", "tap.", "tap_in.", "aux.", "state.")
    tap_order = [k for k in rec.order if k.startswith(compared_prefixes)]
    meta = {
        "case": case or str(path).rsplit("/", 1)[-1].rsplit(".", 1)[0],
        "group": group,
        "megatron_commit": megatron_commit or _megatron_version(),
        "kind": kind,
        "config": json.dumps(cfg),
        "config_full": json.dumps(config_full(config)),
        "training": "true" if layer.training else "false",
        "notes": notes or _notes(layer, kind, is_retro),
        "tap_order": json.dumps(tap_order),
        "grad_seed": str(int(grad_seed)),
    }
    if kind != "retro_block":
        meta["layer_number"] = str(int(getattr(layer, "layer_number", 1) or 1))
    else:
        meta["layout"] = json.dumps(retro_layout(layer))
    if kind == "moe_layer":
        aux = {k[len("aux.") :]: float(tensors[k].item()) for k in tap_order if k.startswith("aux.")}
        meta["aux_losses"] = json.dumps(aux)
        meta["tie_break_dependent"] = "true" if tie_dependent else "false"
        if topk_tie_rows:
            meta["tie_break_dependent"] = "true"
            meta["router_topk_ties"] = json.dumps(sorted(topk_tie_rows))
        if tie_dependent:
            meta["tie_break_note"] = TIE_BREAK_NOTE
        if topk_tie_rows:
            meta["tie_break_note"] = (meta.get("tie_break_note", "") + " " + TOPK_TIE_NOTE).strip()
    if bad:
        meta["non_finite"] = json.dumps(bad)
    written = dict(sorted(tensors.items()))
    if not parallel:
        st_io.write(str(path), written, meta)
    return CaptureResult(path=str(path), kind=kind, tensors=written, metadata=meta)


def _notes(layer, kind, is_retro):
    """The default notes: the kind's, and for an MLA layer what its self attention is."""
    text = NOTES["retro" if is_retro else kind]
    attn = getattr(layer, "self_attention", None)
    if not is_retro and getattr(getattr(layer, "config", None), "multi_latent_attention", False):
        if getattr(getattr(attn, "core_attention", None), "mcore_twin_substitute", False):
            from .mla import SUBSTITUTION_NOTE

            text += " " + SUBSTITUTION_NOTE
        else:
            text += (f" MLA: self_attention is Megatron's {_cls(attn)}, core attention "
                     f"{_cls(getattr(attn, 'core_attention', None))}; it computes its own RoPE from the config's "
                     "rope_type and YaRN fields (no input.rotary_pos_emb).")  # fmt: skip
    return text


def _megatron_version():
    """The running Megatron-Core's commit when bootstrap found it, else its package version."""
    from . import bootstrap

    if bootstrap._STATE.get("commit"):
        return bootstrap._STATE["commit"]
    try:
        from megatron.core import package_info

        return f"megatron-core {package_info.__version__}"
    except Exception:
        return "unknown"


def main(argv=None):
    from . import cli

    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
