"""`python -m mcore_twin.capture`: build a layer from a config and a seed, capture it as a golden.

    /usr/bin/python3 -m mcore_twin.capture --config cfg.json --seed 3 --out case.safetensors \\
        [--kind dense_layer|moe_layer|retro_decoder_layer_first|retro_decoder_layer|retro_block]

`--config` is a JSON object in the form of a golden's `__metadata__.config` (or a golden
`.safetensors` file, whose config, kind and layer number are taken); `multi_latent_attention` true
with the MLA fields (capture.MLA_FIELDS) builds a layer whose self attention is Megatron's
MLASelfAttention (mla.py). The config is checked before Megatron-Core builds anything: field names,
dtypes as the golden format spells them, sizes, and that it fits the kind. Exit codes: 0 written;
2 bad arguments or config (one line `error: ...` on stderr, naming the option or config field); 3
Megatron-Core raised (one line: its exception, the config fields its message names, where it
raised; `--traceback` adds the traceback); 4 Megatron-Core's own output is not finite (nothing
written; a golden with a NaN proves nothing).
"""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import traceback
import warnings

from . import bootstrap, st_io
from .capture import (
    BASE_FIELDS, KINDS, MLA_FIELDS, MOE_FIELDS, RETRO_FIELDS, RUN_FIELDS, CaptureError, NonFiniteError,
    capture_layer,
)  # fmt: skip

# --------------------------------------------------------------------------------------------
# the config, checked before Megatron-Core runs
#
# Megatron-Core does not check what the capture needs: a misspelt params_dtype is a KeyError, a
# missing num_layers a ZeroDivisionError in its init, normalization "rmsnorm" silently builds a
# LayerNorm and moe_router_dtype "float32" silently routes in params_dtype. So every field a
# golden's config holds is checked here, by the type the goldens give it.

# Every layer needs these (build.py reads the last two; TransformerConfig divides by the others).
REQUIRED_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")
# Positive integers; the nullable ones where Megatron-Core's default is None (it derives them).
SIZES = (
    "context_parallel_size", "expert_model_parallel_size", "moe_router_topk", "pipeline_model_parallel_size",
    "retro_l_chunks", "retro_r", "tensor_model_parallel_size",
)  # fmt: skip
NULLABLE_SIZES = (
    "ffn_hidden_size", "kv_channels", "moe_ffn_hidden_size", "moe_router_group_topk", "moe_router_num_groups",
    "moe_shared_expert_intermediate_size", "num_moe_experts", "num_query_groups", "retro_chunk_length",
    "retro_encoder_num_layers", "retro_num_neighbors", "retro_num_retrieved_chunks", "retro_retrieved_length",
)  # fmt: skip
# The capture builds the layer on one rank, as the twins run it (capture._check_world_size_one).
ONE_RANK = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
)  # fmt: skip
BOOLS = (
    "add_bias_linear", "add_qkv_bias", "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm",
    "apply_rope_fusion", "attention_output_gate", "attention_softmax_in_fp32", "bf16", "bias_activation_fusion",
    "bias_dropout_fusion", "calculate_per_token_loss", "fp16", "fp32_residual_connection", "gated_linear_unit",
    "layernorm_zero_centered_gamma", "masked_softmax_fusion", "moe_apply_probs_on_input", "moe_grouped_gemm",
    "moe_pad_expert_input_to_capacity", "moe_per_layer_logging", "moe_permute_fusion", "moe_router_enable_expert_bias",
    "moe_router_force_load_balancing", "moe_router_fusion", "moe_router_padding_for_fp8",
    "moe_router_padding_for_quantization", "moe_router_pre_softmax", "moe_shared_expert_gate",
    "moe_shared_expert_overlap", "moe_use_legacy_grouped_gemm", "qk_l2_norm", "qk_layernorm",
    "retro_verify_neighbor_count", "rotary_interleaved", "sequence_parallel", "test_mode",
)  # fmt: skip
NUMBERS = (
    "attention_dropout", "glu_linear_offset", "hidden_dropout", "moe_aux_loss_coeff", "moe_router_bias_update_rate",
    "retro_encoder_attention_dropout", "retro_encoder_hidden_dropout",
)  # fmt: skip
NULLABLE_NUMBERS = (
    "activation_func_clamp_value", "moe_expert_capacity_factor", "moe_input_jitter_eps",
    "moe_router_topk_scaling_factor", "moe_z_loss_coeff", "softmax_scale",
)  # fmt: skip
POSITIVE_NUMBERS = ("layernorm_epsilon", "rotary_base")
STRINGS = (
    "activation_func", "moe_router_load_balancing_type", "moe_router_score_function", "moe_spec",
    "moe_token_dispatcher_type", "moe_token_drop_policy", "retro_split_preprocessing", "softmax_type",
)  # fmt: skip
# Spellings as goldens write them. params_dtype: the torch dtype's name (what build.py maps and
# capture writes). moe_router_dtype: Megatron's router casts for "fp32" and "fp64" only; any other
# string routes in params_dtype without a word. normalization: Megatron builds a LayerNorm for
# anything but "RMSNorm". attn_mask_type: the masks the twin takes (Retro's are fixed, the field a
# note). position_embedding_type: within a layer only "rope" acts.
CHOICES = {
    "params_dtype": ("float32", "bfloat16", "float16"),
    "moe_router_dtype": (None, "fp32", "fp64"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "attn_mask_type": ("causal", "padding", "no_mask", "padding_causal", "arbitrary"),
    "position_embedding_type": ("none", "rope", "learned_absolute"),
}
GOLDEN_FIELDS = frozenset(BASE_FIELDS + MOE_FIELDS + RETRO_FIELDS + RUN_FIELDS + MLA_FIELDS)
# Multi-latent attention (MLA_FIELDS, MLATransformerConfig): sizes, and the RoPE MLA computes itself.
MLA_SIZES = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "original_max_position_embeddings")
MLA_POSITIVE_NUMBERS = ("rotary_scaling_factor", "beta_fast", "beta_slow")
MLA_NUMBERS = ("mscale", "mscale_all_dim")
MLA_CHOICES = {"rope_type": ("rope", "yarn")}


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad(name, value, wanted):
    return CaptureError(f"config field {name!r} = {json.dumps(value)}: {wanted}")


def _check_value(name, value, retro):
    if name in REQUIRED_SIZES or name in SIZES or (name in NULLABLE_SIZES and value is not None):
        if not _is_int(value) or value < 1:
            raise _bad(name, value, "must be a positive integer" + (" or null" if name in NULLABLE_SIZES else ""))
    elif name in BOOLS:
        if not isinstance(value, bool):
            raise _bad(name, value, "must be true or false")
    elif name in NUMBERS or (name in NULLABLE_NUMBERS and value is not None):
        if not _is_number(value):
            raise _bad(name, value, "must be a finite number" + (" or null" if name in NULLABLE_NUMBERS else ""))
    elif name in POSITIVE_NUMBERS:
        if not _is_number(value) or value <= 0:
            raise _bad(name, value, "must be a positive number")
    elif name == "rotary_percent":
        if not _is_number(value) or not 0 < value <= 1:
            raise _bad(name, value, "must be a number in (0, 1]")
    elif name in STRINGS:
        if not isinstance(value, str):
            raise _bad(name, value, "must be a string")
    elif name == "multi_latent_attention":
        if not isinstance(value, bool):
            raise _bad(name, value, "must be true or false")
    elif name == "q_lora_rank":
        if value is not None and (not _is_int(value) or value < 1):
            raise _bad(name, value, "must be a positive integer, or null (no query down / up projection)")
    elif name in MLA_SIZES:
        if not _is_int(value) or value < 1:
            raise _bad(name, value, "must be a positive integer")
    elif name in MLA_POSITIVE_NUMBERS:
        if not _is_number(value) or value <= 0:
            raise _bad(name, value, "must be a positive number")
    elif name in MLA_NUMBERS:
        if not _is_number(value):
            raise _bad(name, value, "must be a finite number")
    elif name in MLA_CHOICES:
        if value not in MLA_CHOICES[name]:
            raise _bad(name, value, f"must be one of {', '.join(MLA_CHOICES[name])}")
    elif name in CHOICES and not (name == "attn_mask_type" and retro):
        if value not in CHOICES[name]:
            spelt = ", ".join("null" if v is None else v for v in CHOICES[name])
            raise _bad(name, value, f"must be one of {spelt} (as goldens spell it)")


def check_config(cfg, kind, megatron_fields=None):
    """Raises CaptureError naming the first config field the capture of `kind` cannot take.

    A name outside the fields a golden's config holds must be a field of Megatron-Core's
    TransformerConfig (RetroConfig for Retro kinds), what a golden's `config_full` holds:
    `megatron_fields(kind)` returns those names (raising bootstrap.MegatronNotFound without
    Megatron-Core); None takes no other name."""
    if kind not in KINDS:
        raise CaptureError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    retro = kind.startswith("retro")
    # Names first: a misspelt field is reported as one, not as the field it misses or by another's type.
    others = sorted(k for k in cfg if k not in GOLDEN_FIELDS)
    if others:
        cls = "RetroConfig" if retro else "TransformerConfig"
        known, why = set(), f"and {cls}'s fields not consulted"
        try:
            if megatron_fields:
                known, why = megatron_fields(kind), f"nor a {cls} field"
        except bootstrap.MegatronNotFound as e:
            why = f"and {cls}'s fields cannot be read: {e}"
        unknown = [k for k in others if k not in known]
        if unknown:
            raise CaptureError(f"config field {unknown[0]!r} is unknown: not a field of a golden's config, {why}")
    for name in REQUIRED_SIZES:
        if name not in cfg:
            raise CaptureError(f"config field {name!r} is missing: {', '.join(REQUIRED_SIZES)} are required")
    if not retro:
        for name in RETRO_FIELDS:
            if cfg.get(name) is not None:
                raise CaptureError(f"config field {name!r} is a Retro field: --kind {kind} is not a Retro kind")
    for name, value in cfg.items():
        _check_value(name, value, retro)
    for name in ONE_RANK:
        if cfg.get(name, 1) != 1:
            raise _bad(name, cfg[name], "must be 1: the capture builds the layer on one rank, as the twins run it")
    if cfg.get("bf16") and cfg.get("fp16"):
        raise CaptureError("config fields 'bf16' and 'fp16' are both true: at most one may be")
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_query_groups") or heads
    if heads % groups:
        raise CaptureError(f"config field 'num_query_groups' = {groups} does not divide num_attention_heads = {heads}")
    if cfg.get("kv_channels") is None and cfg["hidden_size"] < heads:
        raise CaptureError(
            f"config field 'kv_channels' is null and hidden_size // num_attention_heads = {cfg['hidden_size']} // "
            f"{heads} = 0: set kv_channels or a larger hidden_size"
        )
    experts = cfg.get("num_moe_experts")
    if kind == "moe_layer" and experts is None:
        raise CaptureError("config field 'num_moe_experts' is missing or null: --kind moe_layer needs experts")
    if kind != "moe_layer" and experts is not None:
        raise CaptureError(f"config field 'num_moe_experts' = {experts}: --kind {kind} builds a dense MLP")
    if experts is not None and cfg.get("moe_router_topk", 2) > experts:
        raise CaptureError(f"config field 'moe_router_topk' = {cfg.get('moe_router_topk', 2)} is more than "
                           f"num_moe_experts = {experts}")  # fmt: skip
    _check_mla(cfg, kind)
    if retro:
        for name in ("retro_chunk_length", "retro_split_preprocessing"):
            if cfg.get(name) is None:
                raise CaptureError(f"config field {name!r} is missing or null: --kind {kind} needs it")


def _check_mla(cfg, kind):
    """An MLA config (multi_latent_attention true) as the MLA local spec takes it on the CPU; the
    MLA fields without it."""
    mla = cfg.get("multi_latent_attention") is True
    if not mla:
        # rotary_base / rotary_percent are also the run's RoPE settings for a layer without MLA
        only = [k for k in MLA_FIELDS if k in cfg and k not in RUN_FIELDS and k != "multi_latent_attention"]
        if only:
            raise CaptureError(f"config field {only[0]!r} is a multi-latent attention field: set "
                               "multi_latent_attention true (or leave it out)")  # fmt: skip
        return
    if kind not in ("dense_layer", "moe_layer"):
        raise CaptureError(f"config field 'multi_latent_attention' = true: --kind {kind} is not a dense or MoE layer")
    if cfg.get("position_embedding_type", "rope") != "rope":
        raise _bad("position_embedding_type", cfg["position_embedding_type"], "must be \"rope\" with "
                   "multi_latent_attention: MLA always applies its own RoPE (rope_type), GPTModel then adds "
                   "none")  # fmt: skip
    if cfg.get("rope_type", "yarn") == "yarn" and cfg.get("rotary_percent", 1.0) != 1.0:
        raise _bad("rotary_percent", cfg["rotary_percent"], "must be 1.0 with rope_type \"yarn\": MLA's "
                   "YarnRotaryEmbedding ignores it and rotates all of qk_pos_emb_head_dim")  # fmt: skip
    if cfg.get("softmax_scale") is not None:
        raise _bad("softmax_scale", cfg["softmax_scale"], "must be null with multi_latent_attention: MLA sets "
                   "its own (mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim + "
                   "qk_pos_emb_head_dim))")  # fmt: skip
    dim = cfg.get("qk_pos_emb_head_dim", 64)
    rot = int(dim * cfg.get("rotary_percent", 1.0)) if cfg.get("rope_type", "yarn") == "rope" else dim
    if rot % 2:
        raise CaptureError(f"config field 'qk_pos_emb_head_dim' = {dim}: the rotated width "
                           f"({rot}) must be even (RoPE rotates halves)")  # fmt: skip
    heads = cfg["num_attention_heads"]
    if cfg.get("num_query_groups") not in (None, heads):
        raise _bad("num_query_groups", cfg["num_query_groups"], f"must be null or num_attention_heads = {heads} "
                   "with multi_latent_attention (MLA's keys and values have a head per query head)")  # fmt: skip
    for name, why in (
        ("apply_rope_fusion", "the fused MLA RoPE needs Triton on a GPU"),
        ("attention_output_gate", "MLATransformerConfig raises: no output gate with MLA"),
        ("rotary_interleaved", "TransformerConfig raises: MLA's RoPE rotates halves"),
        ("qk_l2_norm", "the MLA spec asserts qk_l2_norm is false"),
    ):
        if cfg.get(name) is True:
            raise _bad(name, True, f"must be false with multi_latent_attention: {why}")


def megatron_config_fields(kind):
    """The TransformerConfig (RetroConfig for Retro kinds) field names of the pinned Megatron-Core."""
    with quiet_megatron():
        bootstrap.bootstrap()
        if kind.startswith("retro"):
            from megatron.core.models.retro.config import RetroConfig as cls
        else:
            from megatron.core.transformer.transformer_config import TransformerConfig as cls
    return {f.name for f in dataclasses.fields(cls)}


@contextlib.contextmanager
def quiet_megatron():
    """Megatron-Core's import and configs warn about what the capture never uses (no Transformer
    Engine or Apex, CUDA_HOME, deprecated defaults): the CLI's output is its result or one error
    line. Python's -W or PYTHONWARNINGS keeps them."""
    if sys.warnoptions:
        yield
        return
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def megatron_error_line(e, cfg):
    """One line for an exception Megatron-Core raised: the config fields its message names (as
    field or as --option), its type and message, where it raised."""
    msg = " ".join(str(e).split())
    words = re.findall(r"[A-Za-z][A-Za-z0-9_]*", msg.replace("-", "_"))
    fields = [w for w in dict.fromkeys(words) if w in cfg or w in GOLDEN_FIELDS]
    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        path = f.filename
        i = path.find("megatron" + os.sep)
        where = f" (at {path[i:] if i >= 0 else os.path.basename(path)}:{f.lineno})"
    about = f" on config field{'s' if len(fields) > 1 else ''} {', '.join(fields)}" if fields else ""
    return f"error: Megatron-Core failed{about}: {type(e).__name__}: {msg or '(no message)'}{where}"


# --------------------------------------------------------------------------------------------


def infer_kind(cfg):
    if cfg.get("num_moe_experts"):
        return "moe_layer"
    if cfg.get("retro_chunk_length"):
        raise CaptureError("a Retro config needs --kind (retro_decoder_layer_first, retro_decoder_layer, retro_block)")
    return "dense_layer"


def load_config(path):
    """(config dict, kind or None, layer_number or None) from a JSON file or a golden."""
    if path.endswith(".safetensors"):
        _, meta = st_io.read(path)
        if "config" not in meta:
            raise CaptureError(f"{path}: no __metadata__.config")
        ln = meta.get("layer_number")
        return json.loads(meta["config"]), meta.get("kind"), int(ln) if ln else None
    with open(path) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise CaptureError(f"--config {path}: not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CaptureError(f"--config {path}: the config must be a JSON object")
    return cfg, None, None


def capture_config(cfg, kind, seed, out, *, layer_number=None, grad_seed=None, case=None, padding_mask=False,
                   context_mask=False, explicit_mask=False, require_finite=True):  # fmt: skip
    """Builds `kind` from `cfg` and `seed` and captures it to `out` (the CLI and the live tests)."""
    state = bootstrap.bootstrap()
    from .build import build

    module, kw = build(kind, cfg, seed, layer_number=layer_number, padding_mask=padding_mask,
                       context_mask=context_mask, explicit_mask=explicit_mask)  # fmt: skip
    commit = state.get("commit")
    return capture_layer(
        module,
        out,
        kind=kind,
        grad_seed=seed if grad_seed is None else grad_seed,
        case=case,
        group="capture-cli",
        attn_mask_type=cfg.get("attn_mask_type"),
        megatron_commit=commit,
        require_finite=require_finite,
        **kw,
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad arguments are one line, like a bad config
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def check_arguments(a, cfg, kind):
    """Options that the kind would silently ignore, and an output folder that is not there."""
    if a.padding_mask and kind != "moe_layer":
        raise CaptureError(f"--padding-mask is an MoE input: --kind {kind} takes none")
    if a.context_mask and kind not in ("retro_decoder_layer_first", "retro_block"):
        raise CaptureError(f"--context-mask is the Retro encoder's: --kind {kind} takes none")
    if a.explicit_mask and (kind.startswith("retro") or cfg.get("attn_mask_type", "causal") != "causal"):
        raise CaptureError(f"--explicit-mask is a causal dense / MoE layer's: --kind {kind} with attn_mask_type "
                           f"{cfg.get('attn_mask_type', 'causal')!r} takes none")  # fmt: skip
    if a.layer_number is not None and a.layer_number < 1:
        raise CaptureError(f"--layer-number {a.layer_number}: layers are numbered from 1")
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        raise CaptureError(f"--out {a.out}: no folder {folder}")


def main(argv=None):
    p = _Parser(prog="python -m mcore_twin.capture", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="config JSON (a golden's __metadata__.config) or a golden file")
    p.add_argument("--seed", type=int, required=True, help="seed of parameters, inputs and the upstream gradient")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--kind", choices=KINDS, help="default: from the golden, else moe_layer / dense_layer by config")
    p.add_argument("--layer-number", type=int, help="default: 1; Retro layers where the block spec puts them")
    p.add_argument("--grad-seed", type=int, help="seed of grad_in.output (default: --seed)")
    p.add_argument("--case", help="__metadata__.case (default: the file name)")
    p.add_argument("--padding-mask", action="store_true", help="MoE: a random padded tail per sequence")
    p.add_argument("--context-mask", action="store_true", help="Retro first layer / block: a random encoder mask")
    p.add_argument("--explicit-mask", action="store_true", help="dense / MoE causal: pass a causal + padding mask")
    p.add_argument("--allow-nonfinite", action="store_true", help="write the file even when Megatron's output is not finite")
    p.add_argument("--traceback", action="store_true", help="print Megatron-Core's traceback when it raises")
    a = p.parse_args(argv)
    try:
        cfg, golden_kind, golden_layer = load_config(a.config)
        kind = a.kind or golden_kind or infer_kind(cfg)
        check_config(cfg, kind, megatron_config_fields)
        check_arguments(a, cfg, kind)
    except (OSError, ValueError, CaptureError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # importing Megatron-Core for its field names failed
        print(megatron_error_line(e, {}), file=sys.stderr)
        return 3
    try:
        with quiet_megatron():
            bootstrap.bootstrap()
    except bootstrap.MegatronNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(megatron_error_line(e, cfg), file=sys.stderr)
        return 3
    try:
        with warnings.catch_warnings():
            if not sys.warnoptions:
                warnings.simplefilter("ignore")
            r = capture_config(cfg, kind, a.seed, a.out, layer_number=a.layer_number or golden_layer,
                               grad_seed=a.grad_seed, case=a.case, padding_mask=a.padding_mask,
                               context_mask=a.context_mask, explicit_mask=a.explicit_mask,
                               require_finite=not a.allow_nonfinite)  # fmt: skip
    except NonFiniteError as e:
        print(f"not written: {e}", file=sys.stderr)
        return 4
    except CaptureError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # Megatron-Core rejected the config or failed running it
        if a.traceback:
            traceback.print_exc()
        print(megatron_error_line(e, cfg), file=sys.stderr)
        return 3
    n = sum(1 for k in r.tensors if k.startswith(("tap.", "tap_in.", "output.", "aux.", "state.")))
    print(f"{r.path}: {r.kind}, {len(r.tensors)} tensors ({n} compared)")
    return 0
