"""Multi-latent attention (MLA) layers for the capture tool, on the CPU.

Megatron-Core's `get_gpt_layer_local_spec(..., multi_latent_attention=True)` with an
`MLATransformerConfig` builds a `TransformerLayer` whose self attention is `MLASelfAttention`. Three
things keep that layer from running on the CPU with the project's Megatron-Core and torch 1.13;
this module mends them, and nothing else:

- The local core attention, `DotProductAttention`, takes no `k_channels` / `v_channels` at the
  January pin (nor at d98e8a64), but `MultiLatentAttention` builds its core attention with them
  (queries and keys are `qk_head_dim + qk_pos_emb_head_dim` wide per head, values `v_head_dim`):
  only Transformer Engine's attention takes them, and it needs CUDA. `core_attention_class()` is
  the local one with those two arguments: the same module (baddbmm with alpha = softmax_scale,
  divided by layer_number under apply_query_key_layer_scaling; FusedScaleMaskSoftmax with
  attention_mask_func; attention dropout; bmm with the values), whose output is
  [sq, b, np * v_channels] instead of [sq, b, np * kv_channels]. `layer_spec()` puts it in the
  spec as `core_attention` (so its tap is still `tap.self_attention.core_attention`); a golden
  captured with it says so in its `notes` (SUBSTITUTION_NOTE).
- `YarnRotaryEmbedding.__init__` (rope_type "yarn") runs under `with torch.device(device):`,
  which torch 1.13 lacks (a torch.device is a context manager from torch 2.0). On the CPU that
  block changes nothing (the default device is the CPU already), so `apply_yarn_shim()` runs the
  same `__init__` with `torch.device(...)` a no-op context there; bootstrap applies it on a torch
  without the context manager. (Its `torch.cuda.current_device()` is the January shims' CPU
  redirect.)
- At the January pin `multi_latent_attention.py` sets `HAVE_TE = True` whenever
  `megatron.core.extensions.transformer_engine` imports, which it does without Transformer Engine
  (its `te` is then a MagicMock, and `TELinear` a MagicMock instance), so `MultiLatentAttention`
  raises TypeError on `isinstance(self.linear_proj, TELinear)`. `apply_te_absent_shim()` sets the
  names as the module's own `except ImportError` branch does (HAVE_TE False, the TE classes None)
  when the extension says Transformer Engine is absent; later Megatron-Core (d98e8a64) takes
  HAVE_TE from the extension itself.

`apply_shims()` applies both shims (bootstrap calls it; each is a no-op where not needed) and
returns their notes.
"""

import types

SUBSTITUTION_NOTE = (
    "MLA: self_attention is Megatron's MLASelfAttention (get_gpt_layer_local_spec(..., "
    "multi_latent_attention=True), MLATransformerConfig); it computes its own RoPE from the config's rope_type "
    "and YaRN fields (no input.rotary_pos_emb). One module substituted: self_attention.core_attention is "
    "mcore_twin.mla.MLADotProductAttention, Megatron's local DotProductAttention with the k_channels / "
    "v_channels arguments MLA passes (at this commit only Transformer Engine's attention takes them, and it "
    "needs CUDA): same math (baddbmm alpha = softmax_scale [MLA's mscale^2 / sqrt(qk_head_dim + "
    "qk_pos_emb_head_dim)], / layer_number under apply_query_key_layer_scaling; FusedScaleMaskSoftmax unfused "
    "torch path; attention dropout; bmm with v), output [sq, b, np * v_head_dim]."
)


_CLASS = {}


def core_attention_class():
    """Megatron's local DotProductAttention taking MLA's k_channels / v_channels (see the module
    docstring). Defined on first use: Megatron-Core must be importable (bootstrap) by then."""
    if "cls" in _CLASS:
        return _CLASS["cls"]
    import math

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        """DotProductAttention whose queries / keys are k_channels and values v_channels wide per
        head. Its forward is Megatron's, unchanged: the head widths are read from the tensors
        there, except the output width, hidden_size_per_partition, which is np * v_channels here."""

        mcore_twin_substitute = True  # the capture says so in the golden's notes

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                     pg_collection=None):  # fmt: skip
            super().__init__(
                config=config,
                layer_number=layer_number,
                attn_mask_type=attn_mask_type,
                attention_type=attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            heads = self.config.num_attention_heads
            self.k_channels = k_channels if k_channels is not None else self.hidden_size_per_attention_head
            self.v_channels = v_channels if v_channels is not None else self.hidden_size_per_attention_head
            if self.num_query_groups_per_partition != self.num_attention_heads_per_partition:
                raise ValueError("MLA's keys and values have a head per query head: num_query_groups must be "
                                 "num_attention_heads")  # fmt: skip
            world_size = self.pg_collection.tp.size()
            # What the local module derives from kv_channels, from MLA's head widths instead.
            self.hidden_size_per_attention_head = self.k_channels
            self.hidden_size_per_partition = divide(self.v_channels * heads, world_size)
            if softmax_scale is None:  # as the local module does, over the query / key width
                self.softmax_scale = 1.0 / math.sqrt(self.k_channels)
                if self.config.apply_query_key_layer_scaling:
                    self.softmax_scale /= self.layer_number

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if query.size(-1) != self.k_channels or key.size(-1) != self.k_channels:
                raise ValueError(f"MLA core attention: query / key heads must be {self.k_channels} wide, got "
                                 f"{query.size(-1)} / {key.size(-1)}")  # fmt: skip
            if value.size(-1) != self.v_channels:
                raise ValueError(f"MLA core attention: value heads must be {self.v_channels} wide, got "
                                 f"{value.size(-1)}")  # fmt: skip
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)  # fmt: skip

    _CLASS["cls"] = MLADotProductAttention
    return MLADotProductAttention


def layer_spec(num_experts=None, qk_layernorm=False, normalization=None, attn_mask_type=None):
    """Megatron's `get_gpt_layer_local_spec(num_experts, moe_grouped_gemm=False, qk_layernorm,
    multi_latent_attention=True, normalization)` with core_attention substituted (module
    docstring); attn_mask_type (an AttnMaskType name) replaces the spec's causal."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=True,
        normalization=normalization,
    )
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = core_attention_class()
    if attn_mask_type not in (None, "causal"):
        attn.params["attn_mask_type"] = AttnMaskType[attn_mask_type]
    return spec


class _CpuDevice:
    """torch.device(d) as the context manager torch 2 makes it, for a CPU device: the default
    device is the CPU already, so entering it changes nothing."""

    def __init__(self, torch, *args, **kwargs):
        self.device = torch.device(*args, **kwargs)
        if self.device.type != "cpu":
            raise RuntimeError(f"mcore_twin YaRN shim: torch.device({self.device}) as a context needs torch >= 2")

    def __enter__(self):
        return self.device

    def __exit__(self, *exc):
        return False


YARN_SHIM_NOTE = (
    "YarnRotaryEmbedding.__init__: `with torch.device(device)` (torch>=2) is a no-op context on the CPU "
    "(mcore_twin.mla.apply_yarn_shim); the same __init__ otherwise"
)


def apply_yarn_shim():
    """Makes YarnRotaryEmbedding constructible on a torch whose torch.device is no context
    manager (torch < 2). Returns the note of what was patched, or None where nothing was needed.
    Idempotent."""
    import torch

    if hasattr(torch.device, "__enter__"):
        return None
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    except ImportError:
        return None
    cls = yarn.YarnRotaryEmbedding
    if getattr(cls.__init__, "_mcore_twin_yarn_shim", False):
        return YARN_SHIM_NOTE
    orig = cls.__init__

    # The module's `torch`, except that torch.device(...) may be entered; only while __init__ runs.
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # module __getattr__ (PEP 562)
    proxy.device = lambda *a, **k: _CpuDevice(torch, *a, **k)

    def __init__(self, *args, **kwargs):
        saved = yarn.torch
        yarn.torch = proxy
        try:
            orig(self, *args, **kwargs)
        finally:
            yarn.torch = saved

    __init__._mcore_twin_yarn_shim = True
    __init__.__wrapped__ = orig
    cls.__init__ = __init__
    return YARN_SHIM_NOTE


TE_ABSENT_NOTE = (
    "megatron.core.transformer.multi_latent_attention: HAVE_TE = False and TEColumnParallelLinear, TELinear, "
    "Linear, set_save_original_input = None (its own no-TE branch; it took the extension's MagicMock stand-ins "
    "for Transformer Engine) (mcore_twin.mla.apply_te_absent_shim)"
)


def apply_te_absent_shim():
    """At a Megatron-Core whose multi_latent_attention.py believes in Transformer Engine when the
    extension module imports without it: the module's names as its no-TE branch sets them.
    Returns the note, or None where nothing was needed. Idempotent."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.transformer import multi_latent_attention as mla_mod
    except ImportError:
        return None
    if getattr(te_ext, "HAVE_TE", True) or not getattr(mla_mod, "HAVE_TE", False):
        return None
    if "TELinear" not in vars(mla_mod):  # a commit that takes HAVE_TE from the extension
        mla_mod.HAVE_TE = False
        return TE_ABSENT_NOTE
    mla_mod.TEColumnParallelLinear, mla_mod.TELinear, mla_mod.Linear, mla_mod.set_save_original_input = (
        None, None, None, None,
    )  # fmt: skip
    mla_mod.HAVE_TE = False
    return TE_ABSENT_NOTE


def apply_shims():
    """The shims an MLA layer needs on this CPU (module docstring): their notes, [] if none."""
    return [n for n in (apply_yarn_shim(), apply_te_absent_shim()) if n]
