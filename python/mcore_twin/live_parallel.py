"""Live parallel tests: Megatron-Core's own tensor-, sequence- and expert-parallel layers, run as
processes over gloo on the CPU, against the twins and against the same layer on one rank.

    /usr/bin/python3 -m mcore_twin.live_parallel --twin build/bin/twin [--cases 40] [--seed S]

Cases take the layouts in turn (LAYOUTS): a dense layer (live.draw_dense, with heads, query groups
and the FFN divisible by the tensor-parallel size, and under sequence parallelism the sequence) at
TP 2, TP 2 + SP and TP 4; a dense layer with multi-latent attention (draw_mla: MLASelfAttention,
mla.py) at TP 2 and TP 2 + SP; an MoE layer (live.draw_moe, its experts a multiple of ep) at EP 2
and EP 4 with the alltoall and the allgather dispatcher, at TP 2 + SP (Megatron's experts sharded
over the tensor-parallel ranks; the optimized twin runs each rank's tokens through whole experts) and
at TP 2 + SP x EP 2; fp32 and bf16 in turn. `--layout` runs the named layouts alone. Each is captured twice
from one seed, so with the same weights, inputs and upstream gradient: on one rank, and on the
layout's ranks (parallel.py, gathered into one golden). Then:

- `twin fixture --twin both` on the gathered golden: the reference on the whole layer, the
  optimized twin at the golden's own layout (MLA's at TP 2 and TP 2 + SP too); both pass (the
  optimized twin may refuse a feature it does not implement: unsupported, which the case's line
  names);
- `twin diff` of the one-rank capture (less the taps the gathered golden leaves out) against the
  gathered one: every forward tensor and gradient within its counted bound (exit 0).

MLA at TP is captured with Megatron-LM #1699 mended (parallel.mend_k_pos_emb_grad: Megatron leaves
k_pos_emb's gradient partial on each rank, so its gathered gradients would not be the one-rank
layer's; the golden's notes say so).

Last, two bugs must be found, each on a case of its own (BUGS: fp32, its gradients compared): a
planted one, a TP 2 capture whose column-parallel input gradient all-reduce drops rank 1's partial
sum (in Megatron's backward only); and Megatron's own (Megatron-LM #1699, where this Megatron-Core
has it), an MLA case at TP 2 captured as Megatron computes it, without the mend. `twin diff` of each
against its one-rank capture must exit 1 and name a gradient as the first divergence.

Exit codes: 0 pass; 1 a failure; 2 bad arguments; 77 Megatron-Core or torch not found (a failure when
CI=true).
"""

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from . import live
from .parallel import Layout

# (layout, variant): dense layers at tensor parallelism (variant None), MLA dense layers at tensor
# parallelism ("mla"), MoE layers at expert parallelism with each dispatcher (variant the MoE token
# dispatcher). Cases of one layout run in one set of rank processes, whatever their variant.
MLA = "mla"
LAYOUTS = (
    (Layout(tp=2), None), (Layout(tp=2, sp=True), None), (Layout(tp=4), None),
    (Layout(tp=2), MLA), (Layout(tp=2, sp=True), MLA),
    (Layout(ep=2), "alltoall"), (Layout(ep=2), "allgather"), (Layout(ep=4), "alltoall"), (Layout(ep=4), "allgather"),
    (Layout(tp=2, sp=True), "alltoall"), (Layout(tp=2, sp=True, ep=2), "alltoall"),
)  # fmt: skip

# The bugs a run must find, each on a case of its own (fp32, without the features whose gradients
# twin diff does not compare: with_reference_backward), captured on one rank and at its layout:
# plant, the tensor-parallel bug planted in Megatron's backward (_drop_rank1_input_grad); mend
# False, Megatron's own MLA bug left as Megatron computes it (Megatron-LM #1699).
Bug = collections.namedtuple("Bug", "name layout variant plant mend what")
BUGS = (
    Bug("planted", Layout(tp=2), None, True, True, "planted bug (rank 1's input-gradient partial sum dropped at tp 2)"),
    Bug("megatron", Layout(tp=2), MLA, False, False,
        "Megatron's own MLA bug at tp 2 (Megatron-LM #1699, k_pos_emb's gradient not summed across the ranks)"),
)  # fmt: skip


def layout_name(layout, variant=None):
    parts = [f"tp {layout.tp}"] if layout.tp > 1 else []
    parts += ["sp"] if layout.sp else []
    parts += [f"ep {layout.ep}"] if layout.ep > 1 else []
    return " + ".join(parts) + (f" {variant}" if variant else "")


def draw_moe(case_seed, layout, dispatcher, bf16):
    """An MoE case Megatron can run at `layout`: live.draw_moe's, with the experts a multiple of ep,
    no group-limited routing, no global aux loss (its statistics span the data-parallel ranks,
    which every expert-parallel rank is), and under sequence parallelism no capacity."""
    r = random.Random(case_seed)
    kind, cfg, opts = live.draw_moe(r)
    e = layout.ep * r.choice([1, 2])
    cfg["num_moe_experts"] = max(e, 2 * layout.ep if e < 2 else e)
    cfg["moe_router_topk"] = min(cfg["moe_router_topk"], cfg["num_moe_experts"])
    if cfg["moe_router_topk"] == 1:
        cfg["moe_router_pre_softmax"] = True
    cfg.pop("moe_router_num_groups", None)
    cfg.pop("moe_router_group_topk", None)
    if cfg["moe_router_load_balancing_type"] == "global_aux_loss":
        cfg["moe_router_load_balancing_type"] = "aux_loss"
    cfg["moe_token_dispatcher_type"] = dispatcher
    if layout.sp:  # capacity and sinkhorn act on each rank's slice of the tokens (parallel.py refuses them)
        for k in ("moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity"):
            cfg.pop(k, None)
        if cfg["moe_router_load_balancing_type"] == "sinkhorn":
            cfg["moe_router_load_balancing_type"] = "aux_loss"
            cfg["moe_aux_loss_coeff"] = 0.01
        opts["padding_mask"] = False  # a [b, s] mask of the whole sequence beside a slice of it
    _resize_for_tensor_parallel(r, cfg, layout)
    _set_dtype(cfg, bf16)
    return kind, dict(sorted(cfg.items())), opts


def _resize_for_tensor_parallel(r, cfg, layout):
    """Heads, query groups and the FFN divisible by tp, and under sequence parallelism the sequence."""
    tp = layout.tp
    if tp == 1:
        return
    heads = tp * r.choice([1, 2])
    cfg["num_attention_heads"] = heads
    cfg["num_query_groups"] = r.choice([g for g in live._divisors(heads) if g % tp == 0])
    cfg["ffn_hidden_size"] = 16 * tp * r.randint(1, 4)
    if layout.sp:
        cfg["seq_length"] = tp * r.randint(2, 6)
    if "window_size" in cfg:
        cfg["window_size"] = [min(cfg["window_size"][0], cfg["seq_length"] - 1) or 1, 0]


def _set_dtype(cfg, bf16):
    cfg.pop("bf16", None)
    cfg["params_dtype"] = "bfloat16" if bf16 else "float32"
    if bf16:
        cfg["bf16"] = True


# MLA draws (small heads and latent ranks, as the MLA goldens'): what MLA does not take of a dense
# draw (cli._check_mla refuses it, or MLA computes it otherwise).
MLA_DROPPED = ("kv_channels", "rotary_interleaved", "rotary_percent", "rotary_base", "softmax_scale", "qk_l2_norm",
               "attention_output_gate", "apply_rope_fusion")  # fmt: skip
MLA_DIMS = [8, 12, 16, 24, 32]


def draw_mla(case_seed, layout, bf16):
    """A dense MLA case Megatron can run at `layout` (tensor parallelism, with or without SP):
    live.draw_dense's layer (norms, MLP, masks, rare features) resized for tp, with multi-latent
    attention: tp or 2 tp heads; q_lora_rank (a multiple of tp) or none (linear_q_proj), 40%;
    kv_lora_rank + qk_pos_emb_head_dim a multiple of tp, linear_kv_down_proj's rows split across the
    ranks anywhere (inside the latent part or the RoPE part); qk_head_dim and v_head_dim apart or
    equal; qk_layernorm half the time; rope_type "rope" (40%) or "yarn" (original length below or
    above the sequence, mscale / mscale_all_dim varied)."""
    r = random.Random(case_seed)
    kind, cfg, opts = live.draw_dense(r)
    _resize_for_tensor_parallel(r, cfg, layout)
    for k in MLA_DROPPED:
        cfg.pop(k, None)
    tp = layout.tp
    cfg["num_query_groups"] = cfg["num_attention_heads"]  # MLA: a key / value head per query head
    cfg["hidden_size"] = r.choice([16, 24, 32, 48, 64])
    if not layout.sp:
        cfg["seq_length"] = r.randint(4, 16)
    if "window_size" in cfg:
        cfg["window_size"] = [min(cfg["window_size"][0], cfg["seq_length"] - 1) or 1, 0]
    cfg["multi_latent_attention"] = True
    cfg["q_lora_rank"] = None if r.random() < 0.4 else tp * r.choice(MLA_DIMS) // 2
    cfg["qk_pos_emb_head_dim"] = r.choice([4, 6, 8, 12, 16])
    cfg["kv_lora_rank"] = r.choice([d for d in MLA_DIMS if (d + cfg["qk_pos_emb_head_dim"]) % tp == 0])
    cfg["qk_head_dim"] = r.choice(MLA_DIMS)
    cfg["v_head_dim"] = cfg["qk_head_dim"] if r.random() < 0.3 else r.choice(MLA_DIMS)
    cfg["qk_layernorm"] = r.random() < 0.5
    cfg["position_embedding_type"] = "rope"
    cfg["rotary_base"] = r.choice([100, 500, 10000])
    cfg["rotary_percent"] = 1.0
    cfg["beta_fast"], cfg["beta_slow"] = 32.0, 1.0
    if r.random() < 0.4:
        cfg["rope_type"] = "rope"
        if cfg["qk_pos_emb_head_dim"] % 4 == 0 and r.random() < 0.3:
            cfg["rotary_percent"] = 0.5  # half the rotated width stays even
        cfg["rotary_scaling_factor"], cfg["mscale_all_dim"] = r.choice([(40.0, 0.0), (1.0, 1.0), (4.0, 0.707)])
        cfg["original_max_position_embeddings"], cfg["mscale"] = 4096, 1.0
    else:
        cfg["rope_type"] = "yarn"
        cfg["rotary_scaling_factor"] = r.choice([2.0, 4.0, 40.0])
        s = cfg["seq_length"]
        cfg["original_max_position_embeddings"] = r.randint(1, s - 1) if r.random() < 0.5 else r.choice([s + 4, 4096])
        cfg["mscale"] = r.choice([0.5, 0.707, 1.0])
        cfg["mscale_all_dim"] = cfg["mscale"] if r.random() < 0.3 else r.choice([0.0, 0.707, 1.0])
    _set_dtype(cfg, bf16)
    return kind, dict(sorted(cfg.items())), opts


def draw(case_seed, layout, bf16, variant=None):
    """A case Megatron can run at `layout` (a LAYOUTS entry with its variant): a dense layer
    (live.draw_dense's, resized) at tensor parallelism, an MLA dense layer (draw_mla) where
    `variant` is MLA, an MoE layer at expert parallelism (`variant` its dispatcher)."""
    if layout.ep > 1:
        return draw_moe(case_seed, layout, variant, bf16)
    if variant == MLA:
        return draw_mla(case_seed, layout, bf16)
    r = random.Random(case_seed)
    kind, cfg, opts = live.draw_dense(r)
    _resize_for_tensor_parallel(r, cfg, layout)
    _set_dtype(cfg, bf16)
    return kind, dict(sorted(cfg.items())), opts


def with_reference_backward(cfg):
    """The planted case's config: without the features the reference's backward does not cover yet
    (twin diff compares gradients only where it does, and the planted bug is a gradient's)."""
    c = dict(cfg)
    for flag in ("attention_output_gate", "bias_activation_fusion"):
        if c.get(flag):
            c[flag] = False
    if c.get("softmax_type") == "learnable":
        c["softmax_type"] = "vanilla"
    return c


def at_layout(cfg, layout):
    c = dict(cfg)
    c["tensor_model_parallel_size"] = layout.tp
    c["sequence_parallel"] = layout.sp
    c["expert_model_parallel_size"] = layout.ep
    return c


def without_what_the_layout_leaves_out(one_rank, gathered, out):
    """The one-rank capture without the tensors a gathered golden leaves out (an expert-parallel
    golden has no per-expert taps: they depend on the layout), for `twin diff`."""
    from . import st_io

    keep = set(st_io.read(gathered)[0])
    tensors, meta = st_io.read(one_rank)
    meta["tap_order"] = json.dumps([n for n in json.loads(meta.get("tap_order", "[]")) if n in keep])
    st_io.write(out, {k: v for k, v in tensors.items() if k in keep}, meta)
    return out


def _drop_rank1_input_grad():
    """The planted bug: the all-reduce of a column-parallel linear's input gradient (the one
    collective Megatron's LinearWithGradAccumulationAndAsyncCommunication.backward issues with
    async_op=True) keeps rank 0's partial sum alone, rank 1's dropped, on every rank alike: the
    forward is untouched."""
    import torch.distributed as dist

    all_reduce = dist.all_reduce

    def dropping(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op and dist.get_rank(group) != 0:
            tensor.zero_()
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = dropping


def capture_cases(rank, cases, plant, mend=True):
    """One rank's part of every case of one layout; a case Megatron refuses is written as
    <out>.error by rank 0 (every rank raises alike, so the ranks stay in step). mend: MLA's
    k_pos_emb gradient summed across the ranks (Megatron-LM #1699), as Megatron should."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from .build import build
    from .parallel import capture_parallel

    if plant:
        _drop_rank1_input_grad()
    for kind, cfg, seed, out, opts in cases:
        for attempt in range(live.NONFINITE_TRIES):
            try:
                module, kw = build(kind, cfg, seed, **opts)
                capture_parallel(module, out, kind=kind, grad_seed=seed, case=os.path.basename(out)[:-12],
                                 attn_mask_type=cfg.get("attn_mask_type"), mend_mla_k_pos_emb=mend, **kw)  # fmt: skip
                break
            except Exception as e:
                # Every rank gets the same error (capture_parallel shares the first one), so every
                # rank retries a non-finite run alike (live.NONFINITE_TRIES: torch 1.13's baddbmm).
                if "NonFiniteError" in str(e) and attempt + 1 < live.NONFINITE_TRIES:
                    continue
                if rank == 0:
                    with open(out + ".error", "w") as f:
                        f.write(live._first_line(e))
                break


def bug_found(twin, bug, case, tp1):
    """`twin diff` of the one-rank capture against the bug's capture at its layout must exit 1 and
    name a gradient as the first divergence. A Megatron bug this Megatron-Core does not have (its
    capture says which it mended: "megatron_tp_bug") has nothing to find."""
    from . import st_io

    tpn = case[3]
    if os.path.exists(tpn + ".error"):
        print(f"megatron-parallel: {bug.what}: NOT FOUND: its capture failed: {open(tpn + '.error').read()}")
        return False
    if not bug.plant and "megatron_tp_bug" not in st_io.read(tpn)[1]:
        print(f"megatron-parallel: {bug.what}: not present at this Megatron-Core (nothing to find)")
        return True
    code, diffs, _ = twin_json(twin, ["diff", "--json", tp1, tpn])
    first = diffs[0].get("first_divergence") if diffs else None
    found = code == 1 and isinstance(first, str) and first.startswith("grad.")
    print(f"megatron-parallel: {bug.what}: {'found' if found else 'NOT FOUND'}: twin diff exit {code}, "
          f"first divergence {first}")  # fmt: skip
    return found


def twin_json(twin, args):
    p = subprocess.run([twin] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    objs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p.returncode, objs, p.stderr.strip()


def check_case(twin, tp1, tpn, kind, cfg):
    """(problems ([] when the case passes), what happened to the gradients, notes). A config with a
    feature the optimized twin does not implement is checked by the reference twin alone
    (live.optimized_unsupported)."""

    problems, notes = [], []
    # Decided before running: a dense feature the optimized twin lacks; the reference alone checks
    # those. (An MoE golden whose capacity cut Megatron decided among ties runs through both: each
    # twin routes with the top-k choice the recorded post-drop map shows, then drops.)
    both = not (kind == "dense_layer" and live.optimized_unsupported(cfg))
    tp1 = without_what_the_layout_leaves_out(tp1, tpn, tp1[: -len(".safetensors")] + "_same_names.safetensors")
    code, results, err = twin_json(twin, ["fixture", "--json", "--twin", "both" if both else "reference", tpn])
    if not results:
        return [f"twin fixture printed no JSON (exit {code}): {err[:300]}"], "", []
    for res in results:
        # The optimized twin refuses, before it runs, a feature it does not implement (unsupported);
        # a capacity cut decided otherwise among close values is reported apart (live.capacity_cut_flip).
        if res["status"] == "pass":
            continue
        if res["status"] == "unsupported" and res["twin"] == "optimized":
            notes.append(f"optimized twin unsupported: {res['message']}")
            continue
        if live.capacity_cut_flip(cfg, res):
            notes.append(f"{res['twin']} twin: capacity cut decided otherwise among close values")
            continue
        problems.append(f"twin fixture ({res['twin']} twin, tp {res['tp']}{'+sp' if res['sp'] else ''}, ep {res['ep']}): "
                        f"{res['status']}: {res['message']}; gradients {res.get('grads')}")  # fmt: skip
    code, diffs, err = twin_json(twin, ["diff", "--json", tp1, tpn])
    first = (diffs[0].get("first_divergence") or "") if diffs else ""
    if code == 1 and cfg.get("moe_expert_capacity_factor") and first.startswith("tap.mlp.router."):
        notes.append("twin diff: capacity cut decided otherwise among close values")
    elif code != 0 or not diffs:
        d = diffs[0] if diffs else {}
        problems.append(f"twin diff one-rank vs gathered: exit {code}: {d.get('message', err[:300])}")
    grads = diffs[0].get("grads", "") if diffs else ""
    return problems, grads, notes


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mcore_twin.live_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", required=True, help="the twin binary")
    p.add_argument("--cases", type=int, default=40, help="cases, spread over the layouts (default 40)")
    p.add_argument("--seed", type=int, help="run seed (default: $MEGATRON_LIVE_SEED, else the clock; printed)")
    p.add_argument("--kept", default="megatron-parallel-failures", help="directory for failing cases' files")
    p.add_argument("--layout", action="append", default=[], help="only these layouts (as printed, e.g. 'ep 2 alltoall')")
    a = p.parse_args(argv)
    t0 = time.time()
    if (missing := live.megatron_missing()) is not None:
        return missing
    import torch

    from . import bootstrap

    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    bootstrap.bootstrap()
    from .cli import capture_config
    from .parallel import run_ranks

    if a.seed is None and os.environ.get("MEGATRON_LIVE_SEED"):
        a.seed = int(os.environ["MEGATRON_LIVE_SEED"])
    run_seed = a.seed if a.seed is not None else int(time.time() * 1000) % (1 << 31)
    print(f"megatron-parallel: run seed {run_seed} (rerun: --seed {run_seed}); layouts "
          + ", ".join(layout_name(layout, d) for layout, d in LAYOUTS))  # fmt: skip
    layouts = [(l, d) for l, d in LAYOUTS if not a.layout or layout_name(l, d) in a.layout]
    if not layouts:
        print(f"error: --layout names none of: {', '.join(layout_name(l, d) for l, d in LAYOUTS)}")
        return 2
    rng = random.Random(run_seed)
    work = tempfile.mkdtemp(prefix="megatron-parallel.")
    cases, skipped, bugs = [], [], []
    found = False
    try:
        by_layout = {layout: [] for layout, _ in layouts}
        for i in range(a.cases + len(BUGS)):  # the last: the bugs that must be found
            bug = BUGS[i - a.cases] if i >= a.cases else None
            layout, variant = (bug.layout, bug.variant) if bug else layouts[i % len(layouts)]
            seed = rng.randrange(1 << 31)
            kind, cfg, opts = draw(seed, layout, bf16=(i // len(layouts)) % 2 == 1 and not bug, variant=variant)
            if bug:
                cfg = with_reference_backward(cfg)
            tag = f"{bug.name if bug else 'case'}_{seed}_{layout_name(layout, variant).replace(' + ', '_').replace(' ', '')}"
            tp1, tpn = os.path.join(work, tag + "_tp1.safetensors"), os.path.join(work, tag + ".safetensors")
            try:
                live.capture_retrying(capture_config, cfg, kind, seed, tp1, case=tag + "_tp1", **opts)
            except Exception as e:
                skipped.append(f"{tag}: one rank: {live._first_line(e)}")
                continue
            case = (kind, at_layout(cfg, layout), seed, tpn, opts)
            if bug:
                bugs.append((bug, case, tp1))
            else:
                by_layout[layout].append(case)
                cases.append((tag, kind, cfg, tp1, tpn))
        t_capture = time.time()
        for layout, layout_cases in by_layout.items():
            if layout_cases:
                run_ranks(layout, capture_cases, layout_cases, False)
        for bug, case, _ in bugs:
            run_ranks(bug.layout, capture_cases, [case], bug.plant, bug.mend)
        print(f"megatron-parallel: {len(cases) + len(bugs)} cases captured on one rank and at their layout in "
              f"{time.time() - t0:.0f}s ({time.time() - t_capture:.0f}s on the ranks)")  # fmt: skip

        failures = checked = with_grads = 0
        for tag, kind, cfg, tp1, tpn in cases:
            if os.path.exists(tpn + ".error"):
                skipped.append(f"{tag}: at its layout: {open(tpn + '.error').read()}")
                continue
            checked += 1
            problems, grads, notes = check_case(a.twin, tp1, tpn, kind, cfg)
            with_grads += grads == "compared"
            if not problems:
                said = ([] if grads == "compared" else [f"gradients {grads}"]) + notes
                print(f"[{checked}] {tag}: pass" + (f" ({'; '.join(said)})" if said else ""))
                continue
            failures += 1
            os.makedirs(a.kept, exist_ok=True)
            for f in (tp1, tpn):
                shutil.copyfile(f, os.path.join(a.kept, os.path.basename(f)))
            print(f"[{checked}] {tag}: FAIL (kept in {a.kept})\n    config {json.dumps(cfg)}")
            for line in problems:
                print("    " + line)

        found = all([bug_found(a.twin, *b) for b in bugs])
        for bug in (b for b in BUGS if b not in [c[0] for c in bugs]):
            found = False
            print(f"megatron-parallel: {bug.what}: NOT FOUND: its one-rank capture failed (see the skips)")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"megatron-parallel: {checked} cases checked in {time.time() - t0:.0f}s ({with_grads} with their gradients): "
          f"{checked - failures} pass, {failures} fail, {len(skipped)} skipped")  # fmt: skip
    for s in skipped:
        print("  skipped: " + s)
    if failures or not found:
        return 1
    if checked and not with_grads:
        print("FAIL: no case compared its gradients")
        return 1
    if checked < max(1, a.cases // 2):
        print(f"FAIL: only {checked} of {a.cases} cases were checked (see the skips)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
