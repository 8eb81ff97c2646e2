"""Megatron-Core on the GPU for ci/gpu-check (steps 4 and 5).

    python3 ci/gpu-megatron.py baseline --cases IDS.txt --out 4-megatron.json [--twin-bench 3-bench.json]
                                        [--iters N] [--device cuda|cpu]
    python3 ci/gpu-megatron.py capture  --golden G.safetensors --out capture.safetensors [--seed S]
                                        [--device cuda|cpu]

baseline (step 4): for each dense-layer case id (the `dense(h=...,...)` ids of parity/dense_case.h, one per
  line), builds Megatron-Core's local-spec TransformerLayer (the pinned source, no fusions, as the goldens
  were made) on the device's PyTorch, runs the forward in inference (no_grad, eval) and times it with CUDA
  events: warm-up, then the mean of --iters forwards between two events on the stream. With --twin-bench
  (step 3's Google Benchmark JSON, whose optimized-layer rows carry the case id as their label) it writes
  the optimized twin's time over Megatron's for each case both ran.
capture (step 5): builds the layer of a golden's config and seed with python/mcore_twin (same
  parameters and inputs as the CPU capture tool), moves it to the device and captures it there (the
  capture tool's forward + backward, taps), so `twin fixture --twin reference` can hold Megatron's GPU
  numerics against the reference's bounds.

--device cpu runs the same code on the CPU (torch 1.13 + the shims of ../shared/megatron-core) with
wall-clock timing instead of CUDA events: a smoke test of this script on a machine without a GPU.
With --device cuda and no usable GPU the script prints "no GPU: <reason>" and exits 77.

On the GPU, Megatron-Core is imported WITHOUT mcore_shims.py: the shims redirect every CUDA call to the
CPU (they exist for torch 1.13 CPU-only). The tarball is unpacked into a folder of its own, without the
shims beside it, and MCORE_SRC points there (python/mcore_twin/bootstrap.py imports the shims only when
they sit beside the source).
"""

import argparse
import glob
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

NO_GPU = 77


def log(msg):
    print(msg, flush=True)


def parse_case_id(case_id):
    """The fields of a `dense(k=v,...)` id as a dict of strings."""
    m = re.fullmatch(r"\s*dense\((.*)\)\s*", case_id)
    if not m:
        raise ValueError(f"not a dense case id: {case_id!r}")
    fields = {}
    for part in m.group(1).split(","):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"{case_id!r}: field {part!r} has no value")
        fields[k.strip()] = v.strip()
    return fields


def case_config(case_id):
    """A golden-style config (python/mcore_twin/build.py) of a dense case id; the field names are
    Megatron's, the mapping that of parity/dense_case.cpp `to_config`."""
    f = parse_case_id(case_id)
    need = ("h", "a", "g", "d", "ffn", "norm", "act", "glu", "bias", "s", "b", "dtype")
    missing = [k for k in need if k not in f]
    if missing:
        raise ValueError(f"{case_id!r}: missing {', '.join(missing)}")
    if int(f.get("tp", "1")) != 1:
        raise ValueError(f"{case_id!r}: the baseline runs tp=1 (one GPU)")
    dtype = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}[f["dtype"]]
    rope = f.get("rope", "none")
    cfg = dict(
        num_layers=1,
        hidden_size=int(f["h"]),
        num_attention_heads=int(f["a"]),
        num_query_groups=int(f["g"]),
        kv_channels=int(f["d"]),
        ffn_hidden_size=int(f["ffn"]),
        normalization="RMSNorm" if f["norm"] == "rms" else "LayerNorm",
        activation_func=f["act"],
        gated_linear_unit=f["glu"] == "1",
        add_bias_linear=f["bias"] == "1",
        add_qkv_bias=f.get("qkv_bias", "0") == "1",
        qk_layernorm=f.get("qkln", "0") == "1",
        rotary_interleaved=rope == "interleaved",
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=dtype,
        seq_length=int(f["s"]),
        micro_batch_size=int(f["b"]),
        attn_mask_type={"causal": "causal", "none": "no_mask", "no_mask": "no_mask"}.get(f.get("mask", "causal"), "causal"),
        position_embedding_type="none" if rope == "none" else "rope",
        rotary_percent=float(f.get("rot", "1")),
    )
    if f.get("mask", "causal") not in ("causal", "none", "no_mask"):
        raise ValueError(f"{case_id!r}: the baseline times causal / unmasked layers only")
    return cfg, int(f.get("seed", "1"))


def layer_flops(cfg):
    """Forward FLOPs, counted as bench/bench_transformer_layer.cpp counts them (2 m n k per GEMM,
    attention 4 b a s^2 d, halved when causal)."""
    s, b, h, d = cfg["seq_length"], cfg["micro_batch_size"], cfg["hidden_size"], cfg["kv_channels"]
    a, g, ffn = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["ffn_hidden_size"]
    tok = float(s) * b
    qkv = (a + 2.0 * g) * d
    fc1 = (2.0 if cfg["gated_linear_unit"] else 1.0) * ffn
    gemm = 2.0 * tok * h * (qkv + a * d + fc1) + 2.0 * tok * ffn * h
    attn = 4.0 * b * a * float(s) * s * d
    if cfg["attn_mask_type"] == "causal":
        attn /= 2.0
    return gemm + attn


def gpu_reason(torch, device):
    """None when `device` is usable, else why not."""
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def setup_megatron(device):
    """Points python/mcore_twin/bootstrap.py at the pinned source: on the CPU the shared folder (with the
    shims); on the GPU the tarball unpacked without them."""
    from mcore_twin import bootstrap

    if device != "cpu":
        loc = os.environ.get("MCORE_SRC") or bootstrap.default_location()
        if loc and not os.path.isdir(os.path.join(loc, "megatron", "core")):
            tarballs = sorted(glob.glob(os.path.join(loc, "megatron-core-*.tar.xz")))
            if not tarballs:
                raise SystemExit(f"error: no megatron-core-*.tar.xz in {loc}")
            loc = bootstrap.unpack(tarballs[-1])  # the cache folder holds no mcore_shims.py
        if not loc:
            raise SystemExit("error: Megatron-Core not found (set MCORE_SRC to .gpu-bundle/megatron-core)")
        os.environ["MCORE_SRC"] = loc
    state = bootstrap.bootstrap()
    if device != "cpu" and state["shims"]:
        raise SystemExit("error: the CPU shims were imported on the GPU path (they move every tensor to the CPU)")
    return state


def build_layer(cfg, seed, device, layer_number=None):
    import torch
    from mcore_twin.build import build

    module, kw = build("dense_layer", cfg, seed, layer_number=layer_number)
    if device != "cpu":
        module = module.to(device)
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return module, kw


def build_layer_on_device(cfg, seed, device):
    """The baseline's layer, built and initialised on the GPU: the capture tool's CPU initialisation of a
    Llama-70B layer (0.86 G parameters drawn in fp32 on the CPU) would take longer than the timing. The
    same distributions (python/mcore_twin/build.py `_init_params`), drawn by the device's generator: the
    time does not depend on which draws they are."""
    import torch
    from megatron.core.transformer.spec_utils import build_module
    from mcore_twin.build import _spec, make_config

    config = make_config(cfg, "dense_layer")
    config.use_cpu_initialization = False  # parameters allocated on torch.cuda.current_device()
    config.perform_initialization = False  # drawn below, on the device
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    module = build_module(_spec(config, "dense_layer", cfg.get("attn_mask_type")), config=config, layer_number=1)
    module = module.to(device)
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            if "norm" in owner and leaf == "weight":
                t.normal_(1.0, 0.1)
            elif leaf == "bias":
                t.normal_(0.0, 0.02)
            else:
                t.normal_(0.0, 0.05)
    dtype = torch.float32
    if config.bf16:
        module, dtype = module.bfloat16(), torch.bfloat16
    elif config.fp16:
        module, dtype = module.half(), torch.float16
    s, b = int(cfg["seq_length"]), int(cfg.get("micro_batch_size", 1))
    kw = {"hidden_states": torch.randn(s, b, config.hidden_size, device=device).to(dtype)}
    if cfg.get("position_embedding_type", "none") == "rope":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=float(cfg.get("rotary_percent", 1.0)),
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=cfg.get("rotary_base", 10000),
            use_cpu_initialization=False,
        )
        kw["rotary_pos_emb"] = rope(s).to(device)
    return module, kw


def cmd_baseline(a):
    import torch

    why = gpu_reason(torch, a.device)
    if why:
        log(f"no GPU: {why}")
        json.dump({"status": "no GPU", "reason": why}, open(a.out, "w"), indent=1)
        return NO_GPU
    ids = [line.strip() for line in open(a.cases) if line.strip() and not line.startswith("#")]
    if not ids:
        raise SystemExit(f"error: {a.cases} lists no case id")
    state = setup_megatron(a.device)
    rows = []
    for case_id in ids:
        row = {"case": case_id}
        try:
            cfg, seed = case_config(case_id)
            t0 = time.perf_counter()
            if (a.init or ("capture" if a.device == "cpu" else "device")) == "capture":
                layer, kw = build_layer(cfg, seed, a.device)
            else:
                layer, kw = build_layer_on_device(cfg, seed, a.device)
            layer.eval()
            args = {k: kw[k] for k in ("hidden_states", "attention_mask", "rotary_pos_emb") if k in kw}
            args.setdefault("attention_mask", None)
            row["build_s"] = round(time.perf_counter() - t0, 3)
            with torch.no_grad():
                for _ in range(a.warmup):
                    layer(**args)
                if a.device == "cpu":
                    t = time.perf_counter()
                    for _ in range(a.iters):
                        layer(**args)
                    ms = (time.perf_counter() - t) * 1e3 / a.iters
                    row["timer"] = "wall clock (cpu)"
                else:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(a.iters):
                        layer(**args)
                    end.record()
                    end.synchronize()
                    ms = start.elapsed_time(end) / a.iters
                    row["timer"] = "cuda events"
                    row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            row.update(status="ok", megatron_ms=ms, iters=a.iters, tflops=layer_flops(cfg) / (ms * 1e-3) / 1e12)
            log(f"megatron {case_id}: {ms:.3f} ms/forward, {row['tflops']:.1f} TFLOP/s")
            del layer, kw, args
            if a.device != "cpu":
                torch.cuda.empty_cache()
        except Exception as e:  # one case failing must not hide the others
            row.update(status="error", error=f"{type(e).__name__}: {e}")
            log(f"megatron {case_id}: {row['error']}")
        rows.append(row)
    if a.twin_bench and os.path.exists(a.twin_bench):
        twin = {}
        for bm in json.load(open(a.twin_bench)).get("benchmarks", []):
            if bm.get("name", "").startswith("BM_OptimizedDenseLayer") and not bm.get("error_occurred"):
                unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[bm.get("time_unit", "ns")]
                twin[bm.get("label", "")] = bm["real_time"] * unit
        for row in rows:
            if row.get("status") == "ok" and row["case"] in twin:
                row["twin_ms"] = twin[row["case"]]
                row["twin_over_megatron"] = twin[row["case"]] / row["megatron_ms"]
                log(f"ratio {row['case']}: twin {row['twin_ms']:.3f} ms / megatron {row['megatron_ms']:.3f} ms = "
                    f"{row['twin_over_megatron']:.3f}")  # fmt: skip
    info = {"device": a.device, "torch": torch.__version__, "megatron_src": state["src"], "shims": state["shims"]}
    if a.device != "cpu":
        info["gpu"] = torch.cuda.get_device_name(0)
    ok = all(r.get("status") == "ok" for r in rows)
    json.dump({"status": "ok" if ok else "error", "info": info, "cases": rows}, open(a.out, "w"), indent=1)
    return 0 if ok else 1


def cmd_capture(a):
    import torch

    why = gpu_reason(torch, a.device)
    if why:
        log(f"no GPU: {why}")
        return NO_GPU
    state = setup_megatron(a.device)
    from mcore_twin import cli

    cfg, kind, layer_number = cli.load_config(a.golden)
    if kind != "dense_layer":
        raise SystemExit(f"error: {a.golden} is a {kind} golden; the GPU capture takes dense_layer goldens")
    module, kw = build_layer(cfg, a.seed, a.device, layer_number)
    from mcore_twin.capture import capture_layer

    t0 = time.perf_counter()
    r = capture_layer(
        module,
        a.out,
        kind=kind,
        grad_seed=a.seed,
        case=f"gpu-capture {os.path.basename(a.golden)} seed {a.seed} on {a.device}",
        group="gpu-check",
        attn_mask_type=cfg.get("attn_mask_type"),
        megatron_commit="93ddc24720bb8d62ae68ced044ad59e1a95ead0f",
        notes=f"captured on {torch.cuda.get_device_name(0) if a.device != 'cpu' else 'cpu'}, torch {torch.__version__}",
        **kw,
    )
    n = sum(1 for k in r.tensors if k.startswith(("tap.", "output.")))
    log(f"{r.path}: {r.kind} on {a.device} in {time.perf_counter() - t0:.2f} s, {len(r.tensors)} tensors ({n} compared); "
        f"megatron from {state['src']}, shims {'on' if state['shims'] else 'off'}")  # fmt: skip
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("baseline", help="step 4: Megatron-Core's layer timed with CUDA events")
    b.add_argument("--cases", required=True, help="a file of dense case ids, one per line")
    b.add_argument("--out", required=True, help="JSON file to write")
    b.add_argument("--twin-bench", help="step 3's Google Benchmark JSON: adds the twin / Megatron time ratio")
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    b.add_argument("--init", choices=("capture", "device"),
                   help="parameters drawn as the capture tool draws them (on the CPU; default with --device cpu) "
                   "or on the device (default with --device cuda)")  # fmt: skip
    c = sub.add_parser("capture", help="step 5: a golden's layer captured on the GPU")
    c.add_argument("--golden", required=True, help="a dense_layer golden: its config, kind and layer number")
    c.add_argument("--out", required=True, help=".safetensors file to write")
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    if a.cmd == "baseline" and (a.iters < 1 or a.warmup < 0):
        p.error("--iters must be >= 1 and --warmup >= 0")
    return cmd_baseline(a) if a.cmd == "baseline" else cmd_capture(a)


if __name__ == "__main__":
    sys.exit(main())
