"""Live property tests: the real Megatron-Core against the twins, on random configurations.

    /usr/bin/python3 -m mcore_twin.live --twin build/bin/twin [--cases 50] [--seed S] [--kept DIR]

In one Python process: draws configurations over the features the reference twin supports (dense,
MoE, Retro; fp32 and bf16; the distributions of shared/fixtures/megatron-core-random/README.md),
captures each with mcore_twin.capture on the Megatron-Core bootstrap finds (the January pin, or
the commit MCORE_COMMIT names: Retro only where it exists), and runs `twin fixture --json` on the
file (`--twin both` for dense and MoE layers, the reference twin for Retro's), which holds it to
that commit's semantics.
It draws until `--cases` cases were checked by a twin; a case meeting a difference from the pin
the twins do not implement yet (their `unsupported`) is counted apart, not checked.

About 1 case in 5 is a dense or MoE layer with multi-latent attention (MLA, draw_mla: case seeds
from MLA_SEEDS = 2^31 up, so the seeds below draw as they did before MLA was drawn), and every run
checks at least MLA_MIN of them (forced at fixed positions: by the 2nd case checked and by the
middle). Both twins check the dense and MoE cases, MLA's too; a config the optimized twin refuses
(its `unsupported`: an MLA v_head_dim above the query's head dim, an MoE router feature it lacks)
is taken and counted, the reference twin checking it alone; the summary line says how many MLA
cases were checked.

- A case Megatron-Core rejects or fails to run, or whose Megatron output is not finite, proves
  nothing: it is skipped and counted by reason.
- A failing case prints its case seed and config and is kept in `--kept` (the file reruns with
  `twin fixture FILE`; `--replay SEED` redraws and recaptures it).
- A routing decision the twin took otherwise on a near tie is the golden engine's finding (its
  JSON `routing`, parity/routing_ties.h): the case is compared on Megatron's routing and passes or
  fails on that; such cases are counted. A capacity cut decided otherwise (capacity_cut_flip: the
  engine does not resolve those yet) is reported apart, kept, and not failed.
- Dense cases with a feature the optimized twin does not implement (OPTIMIZED_UNSUPPORTED), and
  MoE cases it refuses, run the reference twin alone (counted).
- The capture API's promises are checked on the first case of each kind: a second capture of the
  same layer writes the same tensors (the router counters, aux-loss tracker and dropout were
  restored) and no parameter has a `.grad` afterwards.

Exit codes: 0 pass; 1 a failure, or fewer cases checked than asked; 77 Megatron-Core not found
(a failure instead when CI=true).
"""

import argparse
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

SKIP = 77

# ---------------------------------------------------------------------------------------------
# drawing configurations


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _attention(r, cfg, *, allow_gqa=True):
    heads = r.choice([1, 2, 3, 4, 6, 8])
    cfg["num_attention_heads"] = heads
    cfg["num_query_groups"] = r.choice(_divisors(heads)) if allow_gqa else heads
    cfg["kv_channels"] = r.choice([8, 16, 24, 32])
    cfg["hidden_size"] = r.choice([16, 24, 32, 48, 64, 96, 112])


def _common(r, cfg):
    cfg["num_layers"] = 2
    cfg["normalization"] = r.choice(["LayerNorm", "RMSNorm"])
    cfg["layernorm_epsilon"] = r.choice([1e-5, 1e-6])
    cfg["ffn_hidden_size"] = 16 * r.randint(2, 16)
    cfg["gated_linear_unit"] = r.random() < 0.6
    cfg["activation_func"] = r.choices(["gelu", "silu", "relu", "squared_relu", "quick_gelu"], [4, 4, 1, 1, 1])[0]
    cfg["add_bias_linear"] = r.random() < 0.4
    cfg["add_qkv_bias"] = r.random() < 0.3
    cfg["qk_layernorm"] = r.random() < 0.3
    cfg["apply_query_key_layer_scaling"] = r.random() < 0.15
    cfg["seq_length"] = r.randint(4, 24)
    cfg["micro_batch_size"] = r.randint(1, 3)
    if r.random() < 0.25:
        cfg["bf16"] = True
        cfg["params_dtype"] = "bfloat16"
    else:
        cfg["params_dtype"] = "float32"


def _rope(r, cfg):
    if r.random() < 0.65:
        cfg["position_embedding_type"] = "rope"
        cfg["rotary_interleaved"] = r.random() < 0.3
        cfg["rotary_percent"] = r.choice([1.0, 1.0, 0.5])
        cfg["rotary_base"] = 10000
    else:
        cfg["position_embedding_type"] = "none"


def _rare_attention_features(r, cfg):
    """Features Megatron's local spec and the reference both have, drawn rarely."""
    if r.random() < 0.08:
        cfg["softmax_type"] = r.choice(["off-by-one", "learnable"])
    if r.random() < 0.08:
        left = r.randint(1, max(1, cfg["seq_length"] // 2))
        cfg["window_size"] = [left, 0]
    if r.random() < 0.05:
        cfg["apply_residual_connection_post_layernorm"] = True
    if r.random() < 0.05:
        cfg["softmax_scale"] = r.choice([0.1, 0.25])
    if r.random() < 0.05 and not cfg["qk_layernorm"]:
        cfg["qk_l2_norm"] = True
    if r.random() < 0.05:
        cfg["attention_output_gate"] = True
    if r.random() < 0.05:
        cfg["fp32_residual_connection"] = True
    if cfg["gated_linear_unit"] and r.random() < 0.08:
        cfg["glu_linear_offset"] = r.choice([0.5, 1.0])
    if cfg["gated_linear_unit"] and r.random() < 0.08:
        cfg["activation_func_clamp_value"] = r.choice([1.0, 2.0])


def draw_dense(r):
    cfg = {}
    _attention(r, cfg)
    _common(r, cfg)
    _rope(r, cfg)
    _rare_attention_features(r, cfg)
    opts = {}
    mask = r.choices(["causal", "padding", "explicit"], [6, 3, 1])[0]
    cfg["attn_mask_type"] = "padding" if mask == "padding" else "causal"
    opts["explicit_mask"] = mask == "explicit"
    return "dense_layer", cfg, opts


def draw_moe(r, sqrtsoftplus=False):
    cfg = {}
    _attention(r, cfg)
    _common(r, cfg)
    _rope(r, cfg)
    cfg["add_bias_linear"] = False  # Megatron-Core limit: expert biases fail in backward
    cfg["attn_mask_type"] = "causal"
    e = r.randint(2, 8)
    cfg["num_moe_experts"] = e
    cfg["moe_grouped_gemm"] = False
    cfg["moe_ffn_hidden_size"] = 16 * r.randint(1, 8)
    score = r.choice(["softmax", "softmax", "sigmoid"])
    if sqrtsoftplus and score == "sigmoid" and r.random() < 0.5:
        score = "sqrtsoftplus"
    cfg["moe_router_score_function"] = score
    topk = r.randint(1, min(4, e))
    cfg["moe_router_topk"] = topk
    cfg["moe_router_pre_softmax"] = topk == 1 or r.random() < 0.3  # softmax top-1 requires pre-softmax
    if r.random() < 0.2:
        groups = [g for g in _divisors(e) if 1 < g < e]
        if groups:
            g = r.choice(groups)
            per_group = e // g
            gt = r.randint(1, g)
            if topk <= gt * per_group:
                cfg["moe_router_num_groups"] = g
                cfg["moe_router_group_topk"] = gt
    if score != "softmax" and r.random() < 0.5:
        cfg["moe_router_enable_expert_bias"] = True
    if r.random() < 0.2:
        cfg["moe_router_topk_scaling_factor"] = r.choice([1.5, 2.0])
    cfg["moe_router_dtype"] = r.choice([None, None, "fp32", "fp64"])
    lb = r.choices(["aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn"], [3, 3, 3, 3, 1])[0]
    cfg["moe_router_load_balancing_type"] = lb
    cfg["moe_aux_loss_coeff"] = 0.0 if lb in ("none", "sinkhorn") else r.choice([0.01, 0.03, 0.1])
    if r.random() < 0.1:
        cfg["calculate_per_token_loss"] = True
    if r.random() < 0.3:
        cfg["moe_z_loss_coeff"] = r.choice([0.001, 0.01])
    if r.random() < 0.3 and lb != "sinkhorn":  # capacity needs an aux-loss type or none
        cfg["moe_expert_capacity_factor"] = r.choice([0.5, 0.75, 1.0, 1.5])
        cfg["moe_token_drop_policy"] = r.choice(["probs", "position"])
        cfg["moe_pad_expert_input_to_capacity"] = r.random() < 0.3
    cfg["moe_token_dispatcher_type"] = r.choice(["allgather", "alltoall"])
    if r.random() < 0.25:
        cfg["moe_shared_expert_intermediate_size"] = 16 * r.randint(2, 8)
        cfg["moe_shared_expert_gate"] = r.random() < 0.4
    if topk == 1 and r.random() < 0.15:
        cfg["moe_apply_probs_on_input"] = True
    # Megatron-Core limit: the expert-bias counter ANDs the [T, E] routing map with the [T]
    # padding mask and fails on the shapes, so padding masks only without expert bias.
    padding = not cfg.get("moe_router_enable_expert_bias") and r.random() < 0.2
    return "moe_layer", cfg, {"padding_mask": padding}


def draw_retro(r):
    cfg = {}
    heads = r.choice([1, 2, 4])
    cfg["num_attention_heads"] = heads
    cfg["num_query_groups"] = heads  # Retro cross attention has no GQA
    cfg["hidden_size"] = r.choice([16, 32, 48, 64])
    cfg["kv_channels"] = cfg["hidden_size"] // heads
    # LayerNorm only: the reference builds the Retro local spec's norm as FusedLayerNorm (apex),
    # which has no RMSNorm; Megatron without apex would run RMSNorm through WrappedTorchNorm.
    cfg["normalization"] = "LayerNorm"
    cfg["layernorm_epsilon"] = 1e-5
    cfg["ffn_hidden_size"] = 16 * r.randint(2, 8)
    cfg["gated_linear_unit"] = r.random() < 0.3
    cfg["activation_func"] = r.choice(["gelu", "silu"])
    cfg["add_bias_linear"] = r.random() < 0.5
    cfg["position_embedding_type"] = "none"
    if r.random() < 0.2:
        cfg["bf16"] = True
        cfg["params_dtype"] = "bfloat16"
    else:
        cfg["params_dtype"] = "float32"
    m = r.choice([2, 3, 4])
    cfg["retro_chunk_length"] = m
    cfg["retro_num_neighbors"] = r.choice([1, 2])
    cfg["retro_num_retrieved_chunks"] = r.choice([1, 2])
    cfg["retro_retrieved_length"] = cfg["retro_num_retrieved_chunks"] * m
    cfg["retro_encoder_num_layers"] = r.choice([1, 2])
    cfg["retro_split_preprocessing"] = "98,2,0"
    cfg["retro_verify_neighbor_count"] = True
    cfg["seq_length"] = m * r.randint(1, 3) + r.choice([0, 0, r.randint(1, m - 1)])
    cfg["micro_batch_size"] = r.choice([1, 1, 2])
    kind = r.choice(["retro_decoder_layer_first", "retro_decoder_layer", "retro_block"])
    cfg["num_layers"] = r.choice([6, 9]) if kind == "retro_block" else 12
    opts = {"context_mask": kind != "retro_decoder_layer" and r.random() < 0.3}
    return kind, cfg, opts


# Multi-latent attention (MLA): mcore_twin.mla, the MLA goldens of fixtures/megatron-core-partial/.
# Features of the dense / MoE draws MLA does not take (cli._check_mla) or computes otherwise.
MLA_DROPPED = ("kv_channels", "rotary_interleaved", "softmax_scale", "qk_l2_norm", "attention_output_gate",
               "apply_rope_fusion")  # fmt: skip
MLA_RANKS = [8, 12, 16, 24, 32]
MLA_HEAD_DIMS = [8, 12, 16, 24, 32]
MLA_MSCALES = [0.0, 0.5, 0.707, 1.0, 2.0]


def _mla(r, cfg, qk_norm_needs_q_lora=False):
    """Makes a dense or MoE draw's layer multi-latent attention (MLATransformerConfig): small heads
    and latent ranks, q_lora_rank or none (40%), qk_layernorm on or off (half; off without
    q_lora_rank where qk_norm_needs_q_lora, see _mla_qk_norm_needs_q_lora), rope_type "rope" (40%)
    or "yarn" (original_max_position_embeddings below or above seq_length, scaling factor > 1, mscale /
    mscale_all_dim varied, 0 and equal ones included, beta_fast / beta_slow at their defaults or
    varied). Every YaRN field is in the config under either rope_type, as a golden records it: the
    softmax scale is mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(q/k head width) for
    both, so "rope" draws those two (at MLATransformerConfig's defaults, 40 and 0, half the time)."""
    for k in MLA_DROPPED:
        cfg.pop(k, None)
    heads = r.choice([1, 2, 3, 4])
    cfg["num_attention_heads"] = heads
    cfg["num_query_groups"] = heads  # MLA: a key / value head per query head
    cfg["hidden_size"] = r.choice([16, 24, 32, 48, 64])
    cfg["seq_length"] = r.randint(4, 16)
    cfg["multi_latent_attention"] = True
    cfg["q_lora_rank"] = None if r.random() < 0.4 else r.choice(MLA_RANKS)
    cfg["kv_lora_rank"] = r.choice(MLA_RANKS)
    cfg["qk_head_dim"] = r.choice(MLA_HEAD_DIMS)
    cfg["qk_pos_emb_head_dim"] = r.choice([4, 6, 8, 10, 12, 14, 16])
    cfg["v_head_dim"] = cfg["qk_head_dim"] if r.random() < 0.3 else r.choice(MLA_HEAD_DIMS)
    cfg["qk_layernorm"] = r.random() < 0.5 and not (qk_norm_needs_q_lora and cfg["q_lora_rank"] is None)
    cfg["position_embedding_type"] = "rope"
    cfg["rotary_base"] = r.choice([100, 500, 10000])
    s = cfg["seq_length"]
    if r.random() < 0.4:
        cfg["rope_type"] = "rope"
        # half the rotated width must be even (RoPE rotates halves)
        cfg["rotary_percent"] = 0.5 if cfg["qk_pos_emb_head_dim"] % 4 == 0 and r.random() < 0.3 else 1.0
        if r.random() < 0.5:
            cfg["rotary_scaling_factor"] = r.choice([0.5, 1.0, 2.0, 4.0])
            cfg["mscale_all_dim"] = r.choice(MLA_MSCALES)
        else:
            cfg["rotary_scaling_factor"], cfg["mscale_all_dim"] = 40.0, 0.0
        cfg["original_max_position_embeddings"], cfg["mscale"] = 4096, 1.0
        cfg["beta_fast"], cfg["beta_slow"] = 32.0, 1.0
    else:
        cfg["rope_type"] = "yarn"
        cfg["rotary_percent"] = 1.0
        cfg["rotary_scaling_factor"] = r.choice([1.5, 2.0, 4.0, 8.0, 40.0])
        if r.random() < 0.5:
            cfg["original_max_position_embeddings"] = r.randint(1, s - 1)
        else:
            cfg["original_max_position_embeddings"] = r.choice([s + r.randint(1, 16), 64, 4096])
        cfg["mscale"] = r.choice(MLA_MSCALES)
        cfg["mscale_all_dim"] = cfg["mscale"] if r.random() < 0.3 else r.choice(MLA_MSCALES)
        if r.random() < 0.5:
            cfg["beta_fast"], cfg["beta_slow"] = 32.0, 1.0
        else:
            cfg["beta_fast"] = r.choice([2.0, 4.0, 8.0, 16.0, 64.0])
            cfg["beta_slow"] = r.choice([0.25, 0.5, 1.0, 2.0])


def _deepseek_moe(r, cfg):
    """DeepSeek's router (the MLA MoE goldens'): sigmoid scores, expert bias, group-limited top-k
    over 2 to 4 groups, a top-k scaling factor, fp32 router, a shared expert."""
    e = r.choice([4, 6, 8])
    g = r.choice([g for g in _divisors(e) if 1 < g < e])
    gt = r.randint(1, g - 1)
    # top-k a multiple of the groups' top-k, as DeepSeek's: a group scores the sum of its
    # topk // group_topk best experts, all groups 0 (a tie broken by torch.topk) below it
    topk = gt * r.randint(1, min(e // g, 4 // gt))
    cfg.update(num_moe_experts=e, moe_router_num_groups=g, moe_router_group_topk=gt, moe_router_topk=topk,
               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
               moe_router_topk_scaling_factor=r.choice([1.0, 2.5]), moe_router_dtype="fp32",
               moe_ffn_hidden_size=8 * r.randint(1, 4), moe_shared_expert_intermediate_size=16 * r.randint(1, 2),
               moe_shared_expert_gate=False)  # fmt: skip
    if cfg.get("moe_router_load_balancing_type") == "sinkhorn":  # sinkhorn routes by its own scores
        cfg["moe_router_load_balancing_type"] = "seq_aux_loss"
        cfg["moe_aux_loss_coeff"] = 0.01
    cfg.pop("moe_apply_probs_on_input", None)


def draw_mla(r, sqrtsoftplus=False, qk_norm_needs_q_lora=False):
    """An MLA case: half dense (draw_dense's layer and masks), half MoE (draw_moe's, a third of
    them with DeepSeek's router); a third bf16."""
    if r.random() < 0.5:
        kind, cfg, opts = draw_dense(r)
    else:
        kind, cfg, opts = draw_moe(r, sqrtsoftplus)
        if r.random() < 0.35:
            _deepseek_moe(r, cfg)
            opts["padding_mask"] = False  # the expert-bias counter takes no padding mask (draw_moe)
    _mla(r, cfg, qk_norm_needs_q_lora)
    cfg.pop("bf16", None)
    if r.random() < 1 / 3:
        cfg["bf16"], cfg["params_dtype"] = True, "bfloat16"
    else:
        cfg["params_dtype"] = "float32"
    return kind, cfg, opts


# Case seeds from MLA_SEEDS up are MLA cases (draw_mla): the others draw as before MLA was drawn.
MLA_SEEDS = 1 << 31
MLA_SHARE = 0.2  # of a run's cases
MLA_MIN = 2  # MLA cases checked by every run (of at least as many cases), by fixed positions


def is_mla(case_seed):
    return case_seed >= MLA_SEEDS


def draw(case_seed, retro=True, sqrtsoftplus=False, qk_norm_needs_q_lora=False):
    """A case: 40% dense, 35% MoE, 25% Retro; without Retro (a Megatron-Core after the January
    pin) dense and MoE in the same proportion. With sqrtsoftplus (after the pin) half the sigmoid
    routers use it. A case seed from MLA_SEEDS up draws an MLA case (draw_mla; qk_layernorm only
    with q_lora_rank where qk_norm_needs_q_lora, after the pin)."""
    r = random.Random(case_seed)
    if is_mla(case_seed):
        kind, cfg, opts = draw_mla(r, sqrtsoftplus, qk_norm_needs_q_lora)
        return kind, dict(sorted(cfg.items())), opts
    u = r.random() * (1.0 if retro else 0.75)
    kind, cfg, opts = draw_dense(r) if u < 0.4 else draw_moe(r, sqrtsoftplus) if u < 0.75 else draw_retro(r)
    return kind, dict(sorted(cfg.items())), opts


# ---------------------------------------------------------------------------------------------
# running one case


def _first_line(e):
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


def run_twin(twin, path, both):
    cmd = [twin, "fixture", "--json", "--twin", "both" if both else "reference", path]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    results = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            results.append(json.loads(line))
    if not results:
        results.append({"twin": "?", "status": "error", "message": f"no JSON from twin (exit {p.returncode}): "
                        + (p.stderr.strip() or p.stdout.strip())[:300], "tensors": []})  # fmt: skip
    return results


# Features the optimized twin rejects (optimized/transformer_layer.cpp): a dense case with one is
# checked by the reference twin alone.
OPTIMIZED_UNSUPPORTED = {
    "window_size": lambda v: v is not None,
    "softmax_type": lambda v: v not in (None, "vanilla"),
    "attention_output_gate": bool,
    "qk_l2_norm": bool,
    "activation_func_clamp_value": lambda v: v is not None,
    "glu_linear_offset": lambda v: bool(v),
}


def optimized_unsupported(cfg):
    return [k for k, bad in OPTIMIZED_UNSUPPORTED.items() if k in cfg and bad(cfg[k])]


def capacity_cut_flip(cfg, result):
    """An expert capacity cut decided otherwise among close values: the twin's logits are Megatron's
    up to rounding (every tensor before the first failing one within its bound) and the first
    failing one is the router's, in a config with a capacity. The golden engine resolves near ties
    in the top-k choice (parity/routing_ties.h), not yet at the capacity cut, whose ranking values
    a golden records after the drop only; such a case is reported apart, kept, and not failed."""
    if not cfg.get("moe_expert_capacity_factor"):
        return False
    if result["status"] == "error" and "recorded routing map" in result.get("message", ""):
        return True
    rows = result.get("tensors", [])
    first = next((i for i, t in enumerate(rows) if not t.get("pass")), None)
    return first is not None and ".router." in rows[first]["name"]


def describe_failure(result):
    rows = [t for t in result.get("tensors", []) if not t.get("pass")]
    out = [f"{result['twin']} twin: {result['status']}: {result.get('message', '')}"]
    for t in rows[:4]:
        out.append(
            f"    {t['name']} {t['shape']}: max_abs {t['max_abs']:.4g} max_rel {t['max_rel']:.4g} "
            f"(tolerance {t['tol_abs']:.3g} + {t['tol_rel']:.3g}|e|)"
        )
    return "\n".join(out)


# torch 1.13's CPU baddbmm now and then returns NaN for the strided batches core attention
# passes it (finite inputs; the same call on contiguous copies is finite, and its finite results
# agree with a float64 bmm to rounding). The NaN is not repeatable, so a non-finite capture is
# retried before the case is skipped.
NONFINITE_TRIES = 3


def capture_retrying(fn, *args, **kwargs):
    from .capture import NonFiniteError

    for attempt in range(NONFINITE_TRIES):
        try:
            return fn(*args, **kwargs)
        except NonFiniteError:
            if attempt == NONFINITE_TRIES - 1:
                raise


def api_checks(kind, cfg, seed, opts, first_path, workdir):
    """A second capture of the same layer writes the same tensors; no .grad is left behind."""
    import torch

    from . import st_io
    from .build import build
    from .capture import capture_layer

    module, kw = build(kind, cfg, seed, **opts)
    paths = [os.path.join(workdir, f"api_{i}.safetensors") for i in range(2)]
    for p in paths:
        capture_retrying(capture_layer, module, p, kind=kind, grad_seed=seed,
                         attn_mask_type=cfg.get("attn_mask_type"), **kw)  # fmt: skip
    problems = [f"parameter {n} has a .grad after the capture" for n, q in module.named_parameters() if q.grad is not None]
    (t0, _), (t1, _) = st_io.read(paths[0]), st_io.read(paths[1])
    (tf, _) = st_io.read(first_path)
    for name in sorted(set(t0) | set(t1)):
        if name not in t0 or name not in t1:
            problems.append(f"{name} is in one capture only")
        elif not torch.equal(t0[name], t1[name]):
            problems.append(f"{name} differs between two captures of the same layer")
    if set(t0) != set(tf):
        problems.append("the API capture and the CLI-path capture of the same case name different tensors")
    return problems


def golden_name_checks(workdir, commit):
    """The capture of each golden's own config, on the Megatron-Core commit it came from (the
    goldens of `commit`, the running one), names what the golden names: the same tensors for dense
    layers (their hooks are the same), a superset for MoE and Retro (the goldens hooked fewer
    modules). Returns (goldens checked, problems)."""
    import glob

    from . import bootstrap, st_io
    from .cli import capture_config, load_config

    problems, n = [], 0
    folder = os.path.join(bootstrap.SOURCE_ROOT, "fixtures", "megatron-core")
    for g in sorted(glob.glob(os.path.join(folder, "*.safetensors")) + glob.glob(os.path.join(folder, "*", "*.safetensors"))):
        tensors, meta = st_io.read(g)
        if meta.get("megatron_commit", bootstrap.PINNED_COMMIT) != commit or "random" in os.path.relpath(g, folder):
            continue
        cfg, kind, layer_number = load_config(g)
        out = os.path.join(workdir, "golden_" + os.path.basename(g))
        explicit = "input.attention_mask" in tensors and cfg.get("attn_mask_type") == "causal"
        try:
            r = capture_retrying(capture_config, cfg, kind, 1, out, layer_number=layer_number,
                                 padding_mask="input.padding_mask" in tensors,
                                 context_mask="input.context_mask" in tensors, explicit_mask=explicit)  # fmt: skip
        except Exception as e:
            problems.append(f"{os.path.basename(g)}: its config does not capture: {_first_line(e)}")
            continue
        n += 1
        mine, theirs = set(r.tensors), set(tensors)
        missing, extra = sorted(theirs - mine), sorted(mine - theirs)
        if missing or (kind == "dense_layer" and extra):
            problems.append(f"{os.path.basename(g)}: capture lacks {missing[:4]}, adds {extra[:4] if kind == 'dense_layer' else []}")
        for k in theirs & mine:
            if tensors[k].dtype != r.tensors[k].dtype or tensors[k].dim() != r.tensors[k].dim():
                problems.append(f"{os.path.basename(g)}: {k} is {r.tensors[k].dtype} rank {r.tensors[k].dim()}, "
                                f"the golden's {tensors[k].dtype} rank {tensors[k].dim()}")  # fmt: skip
        for key in ("kind", "config", "layer_number", "training", "tie_break_dependent"):
            if key == "config":
                if json.loads(meta[key]) != json.loads(r.metadata[key]):
                    problems.append(f"{os.path.basename(g)}: config differs from the golden's")
            elif meta.get(key) != r.metadata.get(key) and not (key == "tie_break_dependent" and "router_topk_ties" in r.metadata):
                problems.append(f"{os.path.basename(g)}: {key} {r.metadata.get(key)!r}, the golden's {meta.get(key)!r}")
    return n, problems


def _has_retro():
    try:
        import megatron.core.models.retro  # noqa: F401
    except ImportError:
        return False
    return True


def _has_sqrtsoftplus():
    from megatron.core.transformer.moe import moe_utils

    return '"sqrtsoftplus"' in inspect.getsource(moe_utils.topk_routing_with_score_function)


def _mla_qk_norm_needs_q_lora():
    """Whether this Megatron-Core rejects MLA's qk_layernorm without q_lora_rank on the local spec
    (d98e8a64: mla_qk_norm_config.QKNormConfigResolver wants the Q norm fused into linear_q_proj
    there, which only Transformer Engine has; the January pin normalises the latent keys / values
    alone then)."""
    try:
        import megatron.core.transformer.mla_qk_norm_config  # noqa: F401
    except ImportError:
        return False
    return True


def megatron_missing():
    """Where torch or Megatron-Core cannot be had: the exit code missing_dependency gives (a skip,
    or under CI=true a failure); else None, Megatron-Core's location found."""
    from . import bootstrap

    try:
        import torch  # noqa: F401
    except ImportError:
        return missing_dependency(f"{sys.executable} cannot import torch (install python3-torch: ci/setup does)")
    try:
        bootstrap.find_megatron()
    except bootstrap.MegatronNotFound as e:
        return missing_dependency(str(e))
    return None


def missing_dependency(why):
    """SKIP (exit 77) for a missing dependency, or FAIL under CI=true."""
    ci = os.environ.get("CI", "").lower() == "true"
    print(f"{'FAIL' if ci else 'SKIP'}: {why}" + (" (CI=true: a missing dependency fails)" if ci else ""))
    return 1 if ci else SKIP


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mcore_twin.live", description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", required=True, help="the twin binary")
    p.add_argument("--cases", type=int, default=50, help="cases checked by a twin (default 50)")
    p.add_argument("--seed", type=int, help="run seed (default: $MEGATRON_LIVE_SEED, else the clock; printed)")
    p.add_argument("--replay", type=int, action="append", default=[], help="run only this case seed (repeatable)")
    p.add_argument("--kept", default="megatron-live-failures", help="directory for failing cases' files")
    p.add_argument("--max-attempts", type=int, help="give up drawing after this many (default 3 x --cases)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    a = p.parse_args(argv)
    t_start = time.time()

    if (missing := megatron_missing()) is not None:
        return missing
    import torch

    from . import bootstrap

    loc = bootstrap.find_megatron()
    if not os.path.isfile(a.twin) or not os.access(a.twin, os.X_OK):
        print(f"FAIL: twin binary {a.twin} is not an executable file")
        return 1

    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, a.threads))
    state = bootstrap.bootstrap()
    from .capture import NonFiniteError
    from .cli import capture_config

    if a.seed is None and os.environ.get("MEGATRON_LIVE_SEED"):
        a.seed = int(os.environ["MEGATRON_LIVE_SEED"])
    run_seed = a.seed if a.seed is not None else int(time.time() * 1000) % (1 << 31)
    commit = state["commit"] or "unknown"
    retro, sqrtsoftplus, qk_norm_needs_q_lora = _has_retro(), _has_sqrtsoftplus(), _mla_qk_norm_needs_q_lora()
    print(f"megatron-live: run seed {run_seed} (rerun: --seed {run_seed}); Megatron-Core {commit[:8]} from {loc[0]}"
          f" ({len(state['shims'])} shims{'' if retro else '; no Retro at this commit'}); "
          f"startup {time.time() - t_start:.1f}s")  # fmt: skip
    os.makedirs(a.kept, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="megatron-live.")
    rng = random.Random(run_seed)
    mla_rng = random.Random(f"mla {run_seed}")  # which cases are MLA; rng's case seeds stay as they were
    seeds = a.replay or None
    golden_problems = []
    if not seeds:
        n, golden_problems = golden_name_checks(workdir, commit)
        print(f"megatron-live: {n} goldens of {commit[:8]} recaptured from their configs: "
              + ("same tensor names, dtypes, config and metadata" if not golden_problems else "MISMATCH"))  # fmt: skip
        for line in golden_problems:
            print("    " + line)
    target = len(seeds) if seeds else a.cases
    max_attempts = len(seeds) if seeds else (a.max_attempts or 3 * a.cases)

    counts = {"pass": 0, "fail": 0}
    near_ties = cut_flips = 0
    skips = {}
    opt_unsupported = {}
    failures = []
    api_done = set()
    by_kind = {}
    mla_kinds = {}
    attempts = 0
    checked = 0
    # MLA at fixed positions too: at least one of the first two cases checked, MLA_MIN by the middle
    mla_due = [min(1, target - 1), max(1, target // 2)][: min(MLA_MIN, target)] if not seeds else []
    try:
        while checked < target and attempts < max_attempts:
            if seeds:
                case_seed = seeds[attempts]
            else:
                case_seed = rng.randrange(1 << 31)
                mla_count = sum(mla_kinds.values())
                if mla_rng.random() < MLA_SHARE or (mla_count < len(mla_due) and checked >= mla_due[mla_count]):
                    case_seed += MLA_SEEDS
            attempts += 1
            kind, cfg, opts = draw(case_seed, retro, sqrtsoftplus, qk_norm_needs_q_lora)
            mla = is_mla(case_seed)
            path = os.path.join(workdir, f"{kind}_{case_seed}.safetensors")
            tag = f"[{checked + 1}/{target}] case {case_seed} {kind}"
            try:
                capture_retrying(capture_config, cfg, kind, case_seed, path, case=f"live_{case_seed}", **opts)
            except NonFiniteError:
                skips.setdefault(f"Megatron output not finite in {NONFINITE_TRIES} runs", []).append(case_seed)
                continue
            except Exception as e:  # Megatron-Core rejected or failed the config: proves nothing
                skips.setdefault("Megatron: " + _first_line(e), []).append(case_seed)
                continue
            unsupported = optimized_unsupported(cfg) if kind == "dense_layer" else []
            results = run_twin(a.twin, path, both=kind in ("dense_layer", "moe_layer") and not unsupported)
            # A config the optimized twin refuses (an MLA one, or an MoE router feature it lacks): its
            # `unsupported` is taken and counted, the reference twin checking the case alone.
            refused = [res for res in results if res["twin"] == "optimized" and res["status"] == "unsupported"]
            results = [res for res in results if res not in refused]
            if refused and mla:
                unsupported = unsupported + ["multi_latent_attention"]
            elif refused:
                unsupported = unsupported + [refused[0]["message"].split("does not implement ", 1)[-1]]
            not_yet = next((res["message"] for res in results if res["status"] == "unsupported"
                            and "do not implement" in res.get("message", "")), None)  # fmt: skip
            if not_yet:  # a difference of this commit from the pin the twins do not implement yet
                skips.setdefault("twins: " + not_yet, []).append(case_seed)
                continue
            checked += 1
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if mla:
                mla_kinds[kind] = mla_kinds.get(kind, 0) + 1
            for f in unsupported:
                opt_unsupported[f] = opt_unsupported.get(f, 0) + 1
            case_ok, cut_flip = True, False
            lines = []
            held_to = {res.get("megatron") or "unknown" for res in results if res["status"] != "error"}
            if any(not m.startswith(commit[:8]) for m in held_to):
                case_ok = False
                lines.append(f"the twins held the golden to Megatron-Core {sorted(held_to)}, not {commit[:8]}")
            if any(res.get("routing") for res in results):
                near_ties += 1
                lines += [f"{res['twin']} twin: routing {res['routing']}" for res in results if res.get("routing")]
            for res in results:
                if res["status"] == "pass":
                    continue
                if capacity_cut_flip(cfg, res):
                    cut_flip = True
                else:
                    case_ok = False
                lines.append(describe_failure(res))
            if cut_flip and case_ok:
                cut_flips += 1
                kept = os.path.join(a.kept, "capacity-cut-flip", os.path.basename(path))
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                shutil.copyfile(path, kept)
                print(f"{tag}: capacity cut decided otherwise among close values, kept {kept}")
                for line in lines:
                    print("    " + line.replace("\n", "\n    "))
                continue
            api_kind = ("mla " if mla else "") + kind  # MLA layers' captures are checked apart
            if api_kind not in api_done and case_ok:
                api_done.add(api_kind)
                try:
                    problems = api_checks(kind, cfg, case_seed, opts, path, workdir)
                except NonFiniteError:
                    problems = []  # inconclusive: checked on the next case of this kind
                    api_done.discard(api_kind)
                except Exception as e:
                    problems = [f"the API capture raised {_first_line(e)}"]
                if problems:
                    case_ok = False
                    lines.append("capture API: " + "; ".join(problems[:5]))
            if case_ok:
                counts["pass"] += 1
                print(f"{tag}: pass")
                for line in lines:
                    print("    " + line)
                continue
            kept = os.path.join(a.kept, os.path.basename(path))
            shutil.copyfile(path, kept)
            counts["fail"] += 1
            failures.append(case_seed)
            print(f"{tag}: FAIL, kept {kept}")
            print(f"    config {json.dumps(cfg)} options {json.dumps(opts)}")
            for line in lines:
                print("    " + line.replace("\n", "\n    "))
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    elapsed = time.time() - t_start
    mla_note = f"; mla {sum(mla_kinds.values())}" + "".join(f", {k} {v}" for k, v in sorted(mla_kinds.items()))
    print(f"megatron-live: Megatron-Core {commit[:8]}: {checked} cases checked ({', '.join(f'{k} {v}' for k, v in sorted(by_kind.items()))}{mla_note}) "
          f"of {attempts} drawn in {elapsed:.0f}s: {counts['pass']} pass, {counts['fail']} fail, "
          f"{sum(map(len, skips.values()))} skipped; {near_ties} routed otherwise by a twin on near ties "
          f"(compared on Megatron's routing), {cut_flips} capacity cut decided otherwise among close values")  # fmt: skip
    for reason, case_seeds in sorted(skips.items(), key=lambda kv: -len(kv[1])):
        print(f"  skipped {len(case_seeds)}: {reason} (e.g. case {case_seeds[0]})")
    for reason, n in sorted(opt_unsupported.items(), key=lambda kv: -kv[1]):
        print(f"  checked by the reference twin alone ({n}): the optimized twin does not implement {reason}")
    if golden_problems:
        print("FAIL: a capture of a golden's config names other tensors than the golden (see above)")
        return 1
    if failures:
        print(f"FAIL: cases {' '.join(map(str, failures))} (replay: --replay SEED; files in {a.kept})")
        return 1
    if checked < target:
        print(f"FAIL: only {checked} of {target} cases were checked in {attempts} attempts (see the skips)")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
