"""Real-size layers, timed: Megatron-Core's own forward + backward of a production-shaped layer on
the CPU (torch, N threads) beside `twin fixture` on the golden captured from it, the reference (N
threads) and the optimized twin on the simulator (N workers), each a whole command as a user runs
it (loading the golden included).

    /usr/bin/python3 -m mcore_twin.realsize --twin build/bin/twin --out RUN/bench_realsize.json
        [--shape llama3-8b] [--seq 1024] [--threads N] [--repetitions 3] [--twin-repetitions 1] [--golden FILE]

Shapes (SHAPES): llama3-8b (the default: hidden 4096, ffn 14336, 32 heads, 8 query groups, RMSNorm,
SwiGLU, RoPE, bf16, b 1), llama3-70b (hidden 8192, ffn 28672, 64 heads; a machine with the memory),
and tiny (hidden 128, for the tool's own test). The layer is built by the capture tool's builder
(build.py, its seed), captured to a golden in a temporary folder, and each twin must pass it.

Writes Google Benchmark JSON, so `ci/bench` stores it with the suites and the dashboard shows it:
megatron/layer_fwd_bwd/<shape>:s<seq>, reference/..., reference_fast/... (`--fast`: its GEMMs in
fp32 through a BLAS) and optimized_sim/..., real_time in ns per repetition, each twin's peak
resident memory as counters. `python -m mcore_twin.bench ratios RUN` and the dashboard give each twin's time over
Megatron's.

Exit codes: 0 measured; 1 a twin did not pass the golden; 2 bad arguments; 77 Megatron-Core or
torch not found.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Llama-3-shaped dense layers (the local GPT spec's TransformerLayer), bf16, causal.
_LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func="silu", add_bias_linear=False,
              add_qkv_bias=False, position_embedding_type="rope", rotary_base=500000.0, rotary_percent=1.0,
              layernorm_epsilon=1e-5, bf16=True, params_dtype="bfloat16", attn_mask_type="causal",
              attention_softmax_in_fp32=True, hidden_dropout=0.0, attention_dropout=0.0, num_layers=1,
              micro_batch_size=1)  # fmt: skip
SHAPES = {
    "llama3-8b": dict(_LLAMA, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                      kv_channels=128),
    "llama3-70b": dict(_LLAMA, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
                       kv_channels=128),
    "tiny": dict(_LLAMA, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 kv_channels=32),
}  # fmt: skip
SEED = 1234


def config(shape, seq):
    c = dict(SHAPES[shape])
    c["seq_length"] = seq
    return c


def time_megatron(cfg, threads, repetitions):
    """Wall seconds of each repetition of Megatron-Core's forward + backward (the capture tool's
    layer and inputs, a ones upstream gradient) on `threads` torch threads; one untimed warm-up."""
    import torch

    from .build import build

    torch.set_num_threads(threads)
    module, kw = build("dense_layer", cfg, SEED)
    hidden = kw.pop("hidden_states").requires_grad_(True)
    # The layer's own inputs; the rest of kw describes the RoPE table for the golden's metadata.
    kw = {k: v for k, v in kw.items() if k in ("attention_mask", "rotary_pos_emb")}
    kw.setdefault("attention_mask", None)

    def once():
        out = module(hidden, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        module.zero_grad(set_to_none=True)
        hidden.grad = None

    once()
    times = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return times


def vm_hwm(pid):
    """The process's peak resident memory in bytes so far (/proc's VmHWM, of its own address space
    since its exec; wait4's ru_maxrss would also count the Python parent it was forked from), or 0."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def time_twin(twin, golden, which, threads, repetitions, extra=()):
    """Wall seconds of each `twin fixture --twin WHICH --json` on the golden (the reference on
    `threads` threads, the simulator on as many workers), its largest peak resident memory in bytes
    (VmHWM read every 0.1 s while it runs), and its status line."""
    env = dict(os.environ, CUDASIM_WORKERS=str(threads))
    cmd = [twin, "fixture", "--twin", which, "--threads", str(threads), "--json", *extra, golden]
    times, peak, result = [], 0, None
    for _ in range(repetitions):
        with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
            while p.poll() is None:
                peak = max(peak, vm_hwm(p.pid))
                time.sleep(0.1)
            times.append(time.perf_counter() - t0)
            out.seek(0)
            err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith("{")]
            result = json.loads(lines[0]) if lines else {"status": "error", "message": err.read().strip()[-300:]}
    return times, peak, result


def gbench_entries(name, seconds, counters):
    return [dict({"name": name, "run_name": name, "run_type": "iteration", "repetitions": len(seconds),
                  "repetition_index": i, "threads": 1, "iterations": 1, "real_time": s * 1e9, "cpu_time": s * 1e9,
                  "time_unit": "ns"}, **counters) for i, s in enumerate(seconds)]  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mcore_twin.realsize", description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", required=True, help="the twin binary")
    p.add_argument("--out", required=True, help="the Google Benchmark JSON to write (bench_realsize.json)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each (default: every core)")
    p.add_argument("--repetitions", type=int, default=3, help="Megatron's timed repetitions (default 3)")
    p.add_argument("--twin-repetitions", type=int, default=1, help="each twin's (default 1: minutes each)")
    p.add_argument("--golden", help="time the twins on this golden, captured before from the same --shape and --seq "
                                    "(a real-size capture takes minutes; default: capture one, then delete it)")
    a = p.parse_args(argv)
    if a.seq < 1 or a.threads < 1 or a.repetitions < 1 or a.twin_repetitions < 1:
        print("error: --seq, --threads, --repetitions and --twin-repetitions must be >= 1", file=sys.stderr)
        return 2
    if a.golden and not os.path.isfile(a.golden):
        print(f"error: --golden {a.golden}: no such file", file=sys.stderr)
        return 2
    if not os.access(a.twin, os.X_OK):
        print(f"error: --twin {a.twin}: not an executable", file=sys.stderr)
        return 2
    from . import bootstrap, live

    if (missing := live.megatron_missing()) is not None:
        return missing
    import warnings

    warnings.filterwarnings("ignore")
    bootstrap.bootstrap()
    from .cli import capture_config

    cfg, case = config(a.shape, a.seq), f"{a.shape}:s{a.seq}"
    work = tempfile.mkdtemp(prefix="realsize.")
    try:
        golden = a.golden or os.path.join(work, f"{a.shape}.safetensors")
        if not a.golden:
            t0 = time.perf_counter()
            capture_config(cfg, "dense_layer", SEED, golden)
            print(f"realsize: {case}: captured in {time.perf_counter() - t0:.1f} s "
                  f"({os.path.getsize(golden) / 1e9:.2f} GB)", file=sys.stderr)  # fmt: skip
        golden_bytes = os.path.getsize(golden)
        rows, counters = {"megatron": time_megatron(cfg, a.threads, a.repetitions)}, {"megatron": {}}
        failed = []
        for which, impl, extra in (("reference", "reference", ()), ("reference", "reference_fast", ("--fast",)),
                                   ("optimized", "optimized_sim", ())):  # fmt: skip
            rows[impl], peak, result = time_twin(a.twin, golden, which, a.threads, a.twin_repetitions, extra)
            counters[impl] = {"peak_rss_bytes": peak, "peak_rss_per_golden_byte": peak / golden_bytes}
            if result.get("status") != "pass":
                failed.append(f"{which}: {result.get('status')}: {result.get('message')}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    benchmarks = []
    for impl, seconds in rows.items():
        benchmarks += gbench_entries(f"{impl}/layer_fwd_bwd/{case}", seconds, counters[impl])
    context = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_name": platform.node(),
               "num_cpus": os.cpu_count(), "threads": a.threads, "shape": a.shape, "seq_length": a.seq}  # fmt: skip
    with open(a.out, "w") as f:
        json.dump({"context": context, "benchmarks": benchmarks}, f, indent=1)
    megatron = statistics.median(rows["megatron"])
    for impl, seconds in rows.items():
        m = statistics.median(seconds)
        peak = counters[impl].get("peak_rss_bytes")
        print(f"realsize: {case} {impl:>13}: {m:8.2f} s" + ("" if impl == "megatron" else f"  ({m / megatron:.1f}x Megatron)")
              + (f", peak memory {peak / 1e9:.2f} GB ({counters[impl]['peak_rss_per_golden_byte']:.1f}x the golden)" if peak else ""))
    for f in failed:
        print(f"realsize: FAIL: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
