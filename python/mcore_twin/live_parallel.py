"""Live parallel tests: Megatron-Core's own tensor- and sequence-parallel layers, run as processes
over gloo on the CPU, against the twins and against the same layer on one rank.

    /usr/bin/python3 -m mcore_twin.live_parallel --twin build/bin/twin [--cases 12] [--seed S]

Each case draws a dense layer (live.draw_dense, with heads, query groups and the FFN divisible by
the tensor-parallel size, and under sequence parallelism the sequence) and a layout in turn: TP 2,
TP 2 + SP, TP 4, in fp32 and bf16 alternately. It is captured twice from one seed, so with the same
weights, inputs and upstream gradient: on one rank, and on the layout's ranks (parallel.py, the
shards gathered into one golden). Then:

- `twin fixture --twin both` on the gathered golden: the reference unsharded, the optimized twin at
  the golden's own layout; both must pass, gradients included;
- `twin diff` of the one-rank capture against the gathered one: every forward tensor and gradient
  within its counted bound (exit 0).

Last, one planted tensor-parallel bug must be found: a TP 2 capture whose column-parallel input
gradient all-reduce drops rank 1's partial sum (in Megatron's backward only); `twin diff` against
the one-rank capture must exit 1 and name a gradient as the first divergence.

Exit codes: 0 pass; 1 a failure; 77 Megatron-Core or torch not found (a failure when CI=true).
"""

import argparse
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

LAYOUTS = (Layout(tp=2), Layout(tp=2, sp=True), Layout(tp=4))


def draw(case_seed, layout, bf16):
    """A dense case Megatron can shard at `layout`: live.draw_dense's, resized."""
    r = random.Random(case_seed)
    kind, cfg, opts = live.draw_dense(r)
    tp = layout.tp
    heads = tp * r.choice([1, 2])
    cfg["num_attention_heads"] = heads
    cfg["num_query_groups"] = r.choice([g for g in live._divisors(heads) if g % tp == 0])
    cfg["ffn_hidden_size"] = 16 * tp * r.randint(1, 4)
    if layout.sp:
        cfg["seq_length"] = tp * r.randint(2, 6)
    if "window_size" in cfg:
        cfg["window_size"] = [min(cfg["window_size"][0], cfg["seq_length"] - 1) or 1, 0]
    cfg.pop("bf16", None)
    cfg["params_dtype"] = "bfloat16" if bf16 else "float32"
    if bf16:
        cfg["bf16"] = True
    return kind, dict(sorted(cfg.items())), opts


def at_layout(cfg, layout):
    c = dict(cfg)
    c["tensor_model_parallel_size"] = layout.tp
    c["sequence_parallel"] = layout.sp
    return c


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


def capture_cases(rank, cases, plant):
    """One rank's part of every case of one layout; a case Megatron refuses is written as
    <out>.error by rank 0 (every rank raises alike, so the ranks stay in step)."""
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
                                 attn_mask_type=cfg.get("attn_mask_type"), **kw)  # fmt: skip
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


def twin_json(twin, args):
    p = subprocess.run([twin] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    objs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p.returncode, objs, p.stderr.strip()


def check_case(twin, tp1, tpn, cfg):
    """Problems of one case ([] when it passes). A config with a feature the optimized twin does not
    implement is checked by the reference twin alone (live.optimized_unsupported)."""
    problems = []
    both = not live.optimized_unsupported(cfg)
    code, results, err = twin_json(twin, ["fixture", "--json", "--twin", "both" if both else "reference", tpn])
    if not results:
        return [f"twin fixture printed no JSON (exit {code}): {err[:300]}"]
    for res in results:
        if res["status"] != "pass":
            problems.append(f"twin fixture ({res['twin']} twin, tp {res['tp']}{'+sp' if res['sp'] else ''}): "
                            f"{res['status']}: {res['message']}; gradients {res.get('grads')}")  # fmt: skip
    code, diffs, err = twin_json(twin, ["diff", "--json", tp1, tpn])
    if code != 0 or not diffs:
        d = diffs[0] if diffs else {}
        problems.append(f"twin diff one-rank vs gathered: exit {code}: {d.get('message', err[:300])}")
    grads = diffs[0].get("grads", "") if diffs else ""
    return problems, grads


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mcore_twin.live_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", required=True, help="the twin binary")
    p.add_argument("--cases", type=int, default=12, help="cases, spread over the layouts (default 12)")
    p.add_argument("--seed", type=int, help="run seed (default: $MEGATRON_LIVE_SEED, else the clock; printed)")
    p.add_argument("--kept", default="megatron-parallel-failures", help="directory for failing cases' files")
    a = p.parse_args(argv)
    t0 = time.time()
    from . import bootstrap

    try:
        import torch
    except ImportError:
        return live.missing_dependency(f"{sys.executable} cannot import torch (install python3-torch: ci/setup does)")
    try:
        bootstrap.find_megatron()
    except bootstrap.MegatronNotFound as e:
        return live.missing_dependency(str(e))
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
          + ", ".join(f"tp {l.tp}{' + sp' if l.sp else ''}" for l in LAYOUTS))  # fmt: skip
    rng = random.Random(run_seed)
    work = tempfile.mkdtemp(prefix="megatron-parallel.")
    cases, skipped = [], []
    try:
        by_layout = {layout: [] for layout in LAYOUTS}
        for i in range(a.cases + 1):  # the last: the planted bug
            planted = i == a.cases
            layout = LAYOUTS[0] if planted else LAYOUTS[i % len(LAYOUTS)]
            seed = rng.randrange(1 << 31)
            kind, cfg, opts = draw(seed, layout, bf16=i % 2 == 1 and not planted)
            tag = f"{'planted' if planted else 'case'}_{seed}_tp{layout.tp}{'sp' if layout.sp else ''}"
            tp1, tpn = os.path.join(work, tag + "_tp1.safetensors"), os.path.join(work, tag + ".safetensors")
            try:
                live.capture_retrying(capture_config, cfg, kind, seed, tp1, case=tag + "_tp1", **opts)
            except Exception as e:
                skipped.append(f"{tag}: one rank: {live._first_line(e)}")
                continue
            case = (kind, at_layout(cfg, layout), seed, tpn, opts)
            if planted:
                planted_case = (layout, case, tp1)
            else:
                by_layout[layout].append(case)
                cases.append((tag, layout, cfg, tp1, tpn))
        t_capture = time.time()
        for layout, layout_cases in by_layout.items():
            if layout_cases:
                run_ranks(layout.tp, capture_cases, layout_cases, False)
        run_ranks(planted_case[0].tp, capture_cases, [planted_case[1]], True)
        print(f"megatron-parallel: {len(cases) + 1} cases captured on one rank and at their layout in "
              f"{time.time() - t0:.0f}s ({time.time() - t_capture:.0f}s on the ranks)")  # fmt: skip

        failures = checked = with_grads = 0
        for tag, layout, cfg, tp1, tpn in cases:
            if os.path.exists(tpn + ".error"):
                skipped.append(f"{tag}: at its layout: {open(tpn + '.error').read()}")
                continue
            checked += 1
            problems, grads = check_case(a.twin, tp1, tpn, cfg)
            with_grads += grads == "compared"
            if not problems:
                print(f"[{checked}] {tag}: pass" + ("" if grads == "compared" else f" (gradients {grads})"))
                continue
            failures += 1
            os.makedirs(a.kept, exist_ok=True)
            for f in (tp1, tpn):
                shutil.copyfile(f, os.path.join(a.kept, os.path.basename(f)))
            print(f"[{checked}] {tag}: FAIL (kept in {a.kept})\n    config {json.dumps(cfg)}")
            for line in problems:
                print("    " + line)

        # The planted bug: found, as a gradient.
        _, (_, _, _, planted_tpn, _), planted_tp1 = planted_case
        code, diffs, err = twin_json(a.twin, ["diff", "--json", planted_tp1, planted_tpn])
        first = diffs[0].get("first_divergence") if diffs else None
        found = code == 1 and isinstance(first, str) and first.startswith("grad.")
        print(f"megatron-parallel: planted bug (rank 1's input-gradient partial sum dropped at tp 2): "
              f"{'found' if found else 'NOT FOUND'}: twin diff exit {code}, first divergence {first}")  # fmt: skip
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
