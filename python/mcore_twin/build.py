"""Builds a Megatron-Core layer and its inputs from a golden-style config and a seed (the CLI and
the live tests). Call bootstrap.bootstrap() first.

The config is what a golden's `__metadata__.config` holds: TransformerConfig (and RetroConfig)
fields plus the run description (seq_length, micro_batch_size, attn_mask_type,
position_embedding_type, rotary_base, rotary_percent; Retro context_shape, retro_r,
retro_l_chunks). The layer is built as the project's goldens were: local specs, CPU
initialisation, no fusions, dropout 0 (what the capture records), bf16 models cast with
`.bfloat16()` as Float16Module does. A config with `multi_latent_attention` true builds an
`MLATransformerConfig` (its rotary_base / rotary_percent are config fields there, not the run's)
and the MLA local spec with the CPU core attention of mla.py; the layer computes its own RoPE, so
no rotary_pos_emb is passed.

The seed decides everything random, from one CPU generator in a fixed order: parameters (weights
N(0, 0.05^2), norm weights 1 + N(0, 0.1^2), biases and the expert bias N(0, 0.02^2) / N(0, 0.05^2);
Megatron's own init would leave norms at 1 and biases at 0 and hide their handling), then
hidden_states N(0, 1), masks, context.
"""

import dataclasses
import math

import torch

from .capture import MLA_FIELDS, RUN_FIELDS, CaptureError

# Run-description fields the CLI takes beside the config (not TransformerConfig fields).
EXTRA_FIELDS = set(RUN_FIELDS)

FORCED = dict(
    use_cpu_initialization=True,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
)


def _activation(name):
    """The activation function Megatron-Core names `name` (torch's for gelu / silu / relu)."""
    import torch.nn.functional as F

    from megatron.core import activations
    from megatron.core.transformer import utils as tutils

    torch_fns = {"gelu": F.gelu, "silu": F.silu, "swish": F.silu, "relu": F.relu}
    fn = torch_fns.get(name) or getattr(activations, name, None) or getattr(tutils, name, None)
    if fn is None or not callable(fn):
        raise CaptureError(f"activation_func {name!r}: no such function in this Megatron-Core")
    return fn


# Config fields a later Megatron-Core dropped, each with the value that kept its default
# behaviour: a config recorded before carries them, and at a commit without the field that value
# changes nothing (moe_use_legacy_grouped_gemm: the legacy GroupedMLP, gone with the field).
REMOVED_FIELDS = {"moe_use_legacy_grouped_gemm": False}


def _running_commit():
    from . import bootstrap

    return (bootstrap._STATE.get("commit") or "this Megatron-Core")[:8]


def make_config(cfg, kind):
    """TransformerConfig / RetroConfig from a golden-style config dict."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cls = TransformerConfig
    mla = bool(cfg.get("multi_latent_attention")) and not kind.startswith("retro")
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as cls
    if kind.startswith("retro"):
        try:
            from megatron.core.models.retro.config import RetroConfig
        except ImportError:
            raise CaptureError(
                f"Retro is not in Megatron-Core {_running_commit()} (removed after the January pin): the retro kinds "
                "run on 93ddc247 (MCORE_COMMIT=93ddc247)"
            ) from None
        cls = RetroConfig
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in cfg.items():
        if (k in EXTRA_FIELDS and not (mla and k in MLA_FIELDS)) or (
            k not in known and k in REMOVED_FIELDS and v == REMOVED_FIELDS[k]
        ):
            continue
        if k not in known:
            raise CaptureError(f"config field {k!r} is not a {cls.__name__} field at Megatron-Core {_running_commit()}")
        if k == "activation_func":
            v = _activation(v)
        elif k == "params_dtype":
            v = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[v]
        elif k == "window_size" and v is not None:
            v = tuple(v)
        kwargs[k] = v
    for k in ("hidden_dropout", "attention_dropout", "retro_encoder_hidden_dropout", "retro_encoder_attention_dropout"):
        if k in known:
            kwargs[k] = 0.0
    kwargs.update({k: v for k, v in FORCED.items() if k in known})
    if kwargs.get("bf16") and "params_dtype" not in kwargs:
        kwargs["params_dtype"] = torch.bfloat16
    return cls(**kwargs)


def _spec(config, kind, attn_mask_type):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    if kind in ("dense_layer", "moe_layer") and getattr(config, "multi_latent_attention", False):
        from . import mla

        return mla.layer_spec(
            num_experts=config.num_moe_experts if kind == "moe_layer" else None,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
            attn_mask_type=attn_mask_type,
        )
    if kind in ("dense_layer", "moe_layer"):
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if kind == "moe_layer" else None,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        )
        if attn_mask_type not in (None, "causal"):
            spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType[attn_mask_type]
        return spec
    from megatron.core.models.retro.decoder_spec import (
        get_retro_decoder_block_spec,
        get_retro_decoder_layer_local_spec,
    )
    from megatron.core.models.retro.encoder_spec import get_retro_encoder_block_spec

    if kind == "retro_decoder_layer_first":
        return get_retro_decoder_layer_local_spec(get_retro_encoder_block_spec(config, False))
    if kind == "retro_decoder_layer":
        return get_retro_decoder_layer_local_spec()
    return get_retro_decoder_block_spec(config, False)


def _one_rank_order(state):
    """(key, template tensor, this rank's tensor or None) in the one-rank layer's state-dict order:
    under expert parallelism the rank holds experts [r L, (r + 1) L) of L x ep, and the others'
    are drawn too (into nothing), so every parameter gets the values of the one-rank layer."""
    from megatron.core import parallel_state as ps

    from .parallel import EXPERT

    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    keys = list(state)
    experts = [k for k in keys if EXPERT.match(k)]
    if ep == 1 or not experts:
        return [(k, state[k], state[k]) for k in keys]
    first, last = keys.index(experts[0]), keys.index(experts[-1])
    local = 1 + max(int(EXPERT.match(k).group(2)) for k in experts)
    block = []
    for g in range(local * ep):
        mine = ep_rank * local <= g < (ep_rank + 1) * local
        for k in experts:
            m = EXPERT.match(k)
            if int(m.group(2)) == 0:  # one expert's tensors, in order
                local_key = f"{m.group(1)}{g - ep_rank * local}{m.group(3)}"
                block.append((f"{m.group(1)}{g}{m.group(3)}", state[k], state[local_key] if mine else None))
    return [(k, state[k], state[k]) for k in keys[:first]] + block + [(k, state[k], state[k]) for k in keys[last + 1 :]]


def _init_params(module, gen, config):
    """Draws every parameter at its full (unsharded) shape, in the one-rank layer's state-dict
    order, and keeps this rank's part (its tensor-parallel shard, its experts): a layer built at
    any layout holds the same weights as the one-rank layer of the same seed."""
    from megatron.core import parallel_state as ps

    from .parallel import full_shape, shard

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, template, t in _one_rank_order(module.state_dict(keep_vars=True)):
            if not isinstance(template, torch.Tensor) or not template.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            noise = torch.randn(full_shape(template, name, tp), generator=gen, dtype=torch.float32)
            if t is None:
                continue  # another expert-parallel rank's expert
            noise = shard(noise, t, name, config, rank, tp)
            if leaf == "expert_bias":
                v = 0.05 * noise
            elif "norm" in owner and leaf == "weight":
                v = 1.0 + 0.1 * noise
            elif leaf == "bias" or leaf == "softmax_offset":
                v = 0.02 * noise
            else:
                v = 0.05 * noise
            t.data.copy_(v.to(t.dtype))


def build(kind, cfg, seed, *, layer_number=None, padding_mask=False, context_mask=False, explicit_mask=False):
    """(module, capture kwargs) for `kind` from a golden-style config dict and a seed."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlock

    s = int(cfg["seq_length"])
    b = int(cfg.get("micro_batch_size", 1))
    config = make_config(cfg, kind)
    is_retro = kind.startswith("retro")
    attn_mask_type = cfg.get("attn_mask_type", "causal")
    gen = torch.Generator().manual_seed(int(seed))
    torch.manual_seed(int(seed))  # anything Megatron draws itself (init before ours)
    spec = _spec(config, kind, None if is_retro else attn_mask_type)
    if kind == "retro_block":
        module = TransformerBlock(config=config, spec=spec)
    else:
        if layer_number is None:  # Retro layers where get_retro_decoder_block_spec puts them
            first = 6 if config.num_layers <= 15 else 9
            layer_number = {"retro_decoder_layer_first": first, "retro_decoder_layer": first + 3}.get(kind, 1)
        module = build_module(spec, config=config, layer_number=layer_number)
    _init_params(module, gen, config)
    dtype = torch.float32
    if config.bf16:
        module = module.bfloat16()
        dtype = torch.bfloat16
    elif config.fp16:
        module = module.half()
        dtype = torch.float16
    module.train()

    h = config.hidden_size
    kw = {"hidden_states": torch.randn(s, b, h, generator=gen).to(dtype)}
    if config.sequence_parallel:  # this rank's slice of the sequence
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        kw["hidden_states"] = kw["hidden_states"].chunk(tp, dim=0)[rank].contiguous()
    if not is_retro:
        if attn_mask_type == "padding" or explicit_mask:
            if attn_mask_type == "padding":
                # random keys masked, never a query's own position (no fully masked row)
                m = torch.rand(b, 1, s, s, generator=gen) < 0.3
                m &= ~torch.eye(s, dtype=torch.bool).view(1, 1, s, s)
            else:
                # causal plus a padded tail of keys per batch entry
                m = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).repeat(b, 1, 1, 1)
                for i in range(b):
                    pad = int(torch.randint(0, max(1, s // 2), (1,), generator=gen))
                    if pad:
                        m[i, :, :, s - pad :] = True
                        m[i, :, :, 0] = False  # every query keeps one key
            kw["attention_mask"] = m
        mla = getattr(config, "multi_latent_attention", False)  # MLA computes its own RoPE
        if cfg.get("position_embedding_type", "none") == "rope" and not mla:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            rope = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=float(cfg.get("rotary_percent", 1.0)),
                rotary_interleaved=config.rotary_interleaved,
                rotary_base=cfg.get("rotary_base", 10000),
                use_cpu_initialization=True,
            )
            kw["rotary_pos_emb"] = rope(s)
            kw["rotary_base"] = cfg.get("rotary_base", 10000)
            kw["rotary_percent"] = float(cfg.get("rotary_percent", 1.0))
        if kind == "moe_layer" and padding_mask:
            pm = torch.zeros(b, s, dtype=torch.bool)
            for i in range(b):
                pad = int(torch.randint(0, max(1, s // 2) + 1, (1,), generator=gen))
                if pad:
                    pm[i, s - pad :] = True
            pm[0, 0] = False  # at least one real token
            kw["padding_mask"] = pm
    else:
        m = config.retro_chunk_length
        k = config.retro_num_neighbors
        r = config.retro_retrieved_length
        l = int(math.ceil(s / m))
        if kind == "retro_decoder_layer":
            shape = (r * k, b * l, h)  # the encoder output
        else:
            shape = (r, k * b * l, h)  # neighbour embeddings
        kw["context"] = torch.randn(*shape, generator=gen).to(dtype)
        if context_mask and kind != "retro_decoder_layer":
            cm = torch.rand(k * b * l, 1, r, r, generator=gen) < 0.2
            kw["context_mask"] = cm
    return module, kw
