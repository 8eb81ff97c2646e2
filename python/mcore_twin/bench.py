"""Benchmark history, the regression gate and the dashboard (standard library; scipy when present).

A results folder holds one folder per `ci/bench` run, named <UTC time>-<commit>:

    <results>/20261202T2300Z-0ba1ad8/
        meta.json                     commit, date, machine, build type, BLAS, threads
        bench_reference_layers.json   Google Benchmark JSON (--benchmark_out), repetitions kept
        bench_cost_model.json         the cost model's suite (model/<kernel>/<id>, not measured)
        check.json                    `twin check --json`

Benchmark names are <impl>/<op>/<case id> (bench/bench_util.h): reference/... pairs with
libtorch/... of the same op and id into the reference / LibTorch time ratio.

    python3 -m mcore_twin.bench compare BASE NEW [--threshold 0.10] [--alpha 0.05] [--metric real_time|cpu_time]
                                     [--history RESULTS [--window 5]] [--json]
        per benchmark the change of the median time against the base, with a two-sided
        Mann-Whitney U test over the repetitions (as Google Benchmark's tools/compare.py does);
        exit 1 when a benchmark is slower by more than the threshold with p < alpha (and, with a
        history, slower by more than the threshold than in each of the window's earlier runs), when
        one errored in NEW (a GPU benchmark's "no GPU: ..." skip aside), or when one of BASE is not
        in NEW, each failure one line naming the benchmark; else 0. 2 on bad input, and when a
        compared benchmark has a single repetition in a run (no U test without two).
        BASE / NEW: a run folder or one Google Benchmark JSON file.
    python3 -m mcore_twin.bench ratios RUN [--json]
        the reference / LibTorch eager time ratio per op and shape of one run, and each twin's time
        over Megatron-Core's own on the real-size layers (python -m mcore_twin.realsize).
    python3 -m mcore_twin.bench dashboard RESULTS [-o FILE] [--chartjs FILE]
        one self-contained HTML page (Chart.js inlined; opens offline): first each twin's time
        over Megatron-Core's on the real-size layers and the reference / LibTorch ratios over the
        runs, a chart per shape; the time over the runs, a chart per layer kind and op, and shape
        (time_charts: some forty for the ~150 benchmarks of the suites), short labels with the full
        id on hover; the accuracy per twin (each `twin check` row's share of its bound); then the
        latest run's comparison with the one before, its ratios and the cost model's roofline table.
"""

import argparse
import html
import json
import math
import os
import re
import statistics
import sys

CHARTJS_DEFAULT = "/usr/share/javascript/chart.js/chart.min.js"  # Debian libjs-chart.js (UMD build)
UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


class BenchError(Exception):
    """Bad input: a missing or malformed results file."""


# ---- reading results ------------------------------------------------------------------------------


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: {e}") from e


def gbench_files(path):
    """The Google Benchmark JSON files of a run folder (or the one file given)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise BenchError(f"{path}: no such run folder or file")
    names = sorted(n for n in os.listdir(path) if n.startswith("bench_") and n.endswith(".json"))
    if not names:
        raise BenchError(f"{path}: no bench_*.json in the run folder")
    return [os.path.join(path, n) for n in names]


def samples(path, metric="real_time"):
    """{benchmark name: [time in ns of each repetition]} of a run (iterations only, no aggregates);
    benchmarks that errored are left out. metric: real_time (wall clock, what a user waits) or
    cpu_time (steadier on a shared machine)."""
    out = {}
    for file in gbench_files(path):
        data = load_json(file)
        if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
            raise BenchError(f"{file}: not Google Benchmark JSON (no 'benchmarks' list)")
        for b in data["benchmarks"]:
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            name = b.get("run_name", b.get("name"))
            unit = b.get("time_unit", "ns")
            if name is None or unit not in UNIT_NS or metric not in b:
                raise BenchError(f"{file}: benchmark entry without name, {metric} or a known time_unit: {b}")
            out.setdefault(name, []).append(float(b[metric]) * UNIT_NS[unit])
    return out


def errors(path):
    """{benchmark name: error message} of the benchmarks that errored in a run (Google Benchmark's
    `error_occurred`: SkipWithError, which also skips a GPU benchmark without a GPU)."""
    out = {}
    for file in gbench_files(path):
        data = load_json(file)
        for b in data.get("benchmarks", []) if isinstance(data, dict) else []:
            if b.get("run_type", "iteration") == "iteration" and b.get("error_occurred"):
                out.setdefault(b.get("run_name", b.get("name")), " ".join(str(b.get("error_message", "")).split()))
    return out


def counters(path):
    """{benchmark name: the first repetition's entry} (counters, label) of a run."""
    out = {}
    for file in gbench_files(path):
        for b in load_json(file).get("benchmarks", []):
            if b.get("run_type", "iteration") == "iteration" and not b.get("error_occurred"):
                out.setdefault(b.get("run_name", b.get("name")), b)
    return out


# ---- the statistical test --------------------------------------------------------------------------


def _mwu_exact_two_sided(u, n1, n2):
    """Exact two-sided p-value of U (no ties): the count of rank arrangements by U, by recursion
    over the largest element (it belongs to sample 1, adding n2 to U, or to sample 2)."""
    # f[i][j][u]: arrangements of i + j elements with statistic u; built bottom-up over i, j.
    f = [[None] * (n2 + 1) for _ in range(n1 + 1)]
    for i in range(n1 + 1):
        for j in range(n2 + 1):
            if i == 0 or j == 0:
                f[i][j] = [1]
                continue
            a, b = f[i - 1][j], f[i][j - 1]  # largest in sample 1 (u += j) / in sample 2
            size = i * j + 1
            row = [0] * size
            for k, c in enumerate(a):
                row[k + j] += c
            for k, c in enumerate(b):
                row[k] += c
            f[i][j] = row
    dist = f[n1][n2]
    total = sum(dist)
    u_low = min(u, n1 * n2 - u)
    p = 2.0 * sum(dist[: int(math.floor(u_low)) + 1]) / total
    return min(1.0, p)


def mann_whitney_u(x, y):
    """Two-sided Mann-Whitney U test: (U of x, p). scipy.stats.mannwhitneyu when scipy is there;
    else exact without ties for small samples, the normal approximation with tie and continuity
    corrections otherwise (scipy's 'auto' method does the same)."""
    try:
        from scipy.stats import mannwhitneyu  # noqa: PLC0415

        r = mannwhitneyu(x, y, alternative="two-sided")
        return float(r.statistic), float(r.pvalue)
    except ImportError:
        return mann_whitney_u_builtin(x, y)


def mann_whitney_u_builtin(x, y):
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise BenchError("Mann-Whitney U test needs two non-empty samples")
    pooled = sorted((v, i) for i, v in enumerate(list(x) + list(y)))
    ranks = [0.0] * (n1 + n2)
    tie_sizes = []
    k = 0
    while k < len(pooled):
        j = k
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[k][0]:
            j += 1
        for m in range(k, j + 1):
            ranks[pooled[m][1]] = (k + j) / 2.0 + 1.0  # midrank
        tie_sizes.append(j - k + 1)
        k = j + 1
    r1 = sum(ranks[:n1])
    u1 = r1 - n1 * (n1 + 1) / 2.0
    has_ties = any(t > 1 for t in tie_sizes)
    if not has_ties and max(n1, n2) <= 8:
        return u1, _mwu_exact_two_sided(u1, n1, n2)
    n = n1 + n2
    mu = n1 * n2 / 2.0
    tie_term = sum(t**3 - t for t in tie_sizes) / (n * (n - 1)) if n > 1 else 0.0
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie_term))
    if sigma == 0:
        return u1, 1.0
    z = (abs(u1 - mu) - 0.5) / sigma
    p = math.erfc(max(z, 0.0) / math.sqrt(2.0))
    return u1, min(1.0, p)


# ---- compare ---------------------------------------------------------------------------------------


# What a user would run instead (libtorch/...): timed for the reference / LibTorch ratio, its time
# changes with the machine and with torch, never with this repository's code, so it is shown but
# not gated. (On this 2-core VM, unchanged reruns moved every libtorch/ benchmark by +11% to +14%
# together while the reference's moved less: a gate on them flags the machine, not a commit.)
NOT_GATED = ("libtorch/",)

# The error message of a benchmark skipped for want of a GPU (bench/bench_util.h skip_without_gpu:
# Google Benchmark 1.7 skips only with SkipWithError). Such a skip is no failure; any other error is.
SKIP_MESSAGE_PREFIXES = ("no GPU: ",)


def compare(base, new, threshold=0.10, alpha=0.05, ignore_prefixes=("model/",), metric="real_time",
            not_gated=NOT_GATED, history=(), min_repetitions=2, benchmark_filter=""):
    """Rows per benchmark in both runs: name, base / new median (ns), change (new / base - 1), p,
    gated, regression (gated, change > threshold and p < alpha). Benchmarks of a model (not
    measured) are left out; those under `not_gated` are compared but never a regression. Also the
    names only in one of the runs.

    failures: one line per benchmark that fails the gate other than by its time, each naming it:
    one that errored in NEW (a broken benchmark hides any regression; in BASE too or not), unless
    it was skipped for want of a GPU (SKIP_MESSAGE_PREFIXES); one of BASE that NEW lacks (removed,
    renamed, or its suite did not run: nothing measured is nothing gated). Under `not_gated` too:
    an error or a gap is this code's, not the machine's.

    benchmark_filter: the --benchmark_filter NEW ran with (a regex searched in the name; a leading
    '-' negates it, as Google Benchmark reads it): a BASE benchmark it leaves out is not missing.

    min_repetitions: a compared benchmark with fewer repetitions in a run is a BenchError: the U
    test needs two per run, and a p of nan would pass any slow-down (the dashboard passes 1 and
    shows p nan).

    history: earlier run folders (base among them or not). A benchmark is then a regression only if
    it is also slower than its slowest median in them by more than the threshold (vs_slowest): a
    benchmark whose time moves between unchanged runs (here a small oneDNN bf16 GEMM, 42 or 50 us
    by process) shows that spread in its history, and must leave it to count."""
    a, b = samples(base, metric), samples(new, metric)
    err_a, err_b = errors(base), errors(new)
    failures = []
    for name in sorted(err_b):
        if not name.startswith(ignore_prefixes) and not err_b[name].startswith(SKIP_MESSAGE_PREFIXES):
            failures.append(f"{name}: errored in NEW: {err_b[name] or '(no message)'}")
    negate = benchmark_filter.startswith("-")
    pattern = re.compile(benchmark_filter[1:] if negate else benchmark_filter)
    for name in sorted((set(a) | set(err_a)) - set(b) - set(err_b)):
        if not name.startswith(ignore_prefixes) and bool(pattern.search(name)) != negate:
            failures.append(f"{name}: in BASE, not in NEW (removed, renamed, or its suite did not run)")
    for name in sorted(set(a) & set(b)):
        if name.startswith(ignore_prefixes):
            continue
        for run, times in (("BASE", a[name]), ("NEW", b[name])):
            if len(times) < min_repetitions:
                raise BenchError(
                    f"{name}: only {len(times)} repetition(s) in {run}: refusing to compare, the U test needs "
                    f">= {min_repetitions} per run (ci/bench --repetitions N, N >= 2)"
                )
    slowest = {}
    for run in history:
        for name, times in samples(run, metric).items():
            slowest[name] = max(slowest.get(name, 0.0), statistics.median(times))
    rows = []
    for name in sorted(set(a) & set(b)):
        if name.startswith(ignore_prefixes):
            continue
        gated = not name.startswith(not_gated)
        ma, mb = statistics.median(a[name]), statistics.median(b[name])
        change = mb / ma - 1.0 if ma > 0 else float("inf")
        if len(a[name]) >= 2 and len(b[name]) >= 2:
            _, p = mann_whitney_u(a[name], b[name])
        else:
            p = float("nan")  # one repetition: no test, never a significant regression
        significant = not math.isnan(p) and p < alpha
        vs_slowest = mb / max(slowest.get(name, 0.0), ma) - 1.0 if ma > 0 else float("inf")
        rows.append(
            {
                "name": name,
                "base_ns": ma,
                "new_ns": mb,
                "change": change,
                "p": p,
                "reps": [len(a[name]), len(b[name])],
                "gated": gated,
                "vs_slowest": vs_slowest,  # against the slowest median of base and the history
                "regression": bool(gated and significant and change > threshold and vs_slowest > threshold),
                "improvement": bool(gated and significant and change < -threshold),
            }
        )
    return {
        "rows": rows,
        "only_base": sorted(set(a) - set(b)),
        "only_new": sorted(set(b) - set(a)),
        "failures": failures,
        "threshold": threshold,
        "alpha": alpha,
        "history": len(history),
    }


def format_compare(result):
    lines = [f"{'base':>11} {'new':>11} {'change':>8} {'p':>8}  {'verdict':<10}  benchmark"]
    for r in result["rows"]:
        verdict = "REGRESSION" if r["regression"] else "improved" if r["improvement"] else ""
        verdict = verdict or ("" if r["gated"] else "not gated")
        lines.append(
            f"{fmt_ns(r['base_ns']):>11} {fmt_ns(r['new_ns']):>11} {100 * r['change']:>+7.1f}% {r['p']:>8.4f}  "
            f"{verdict:<10}  {r['name']}"
        )
    n_reg = sum(r["regression"] for r in result["rows"])
    lines.append(
        f"{len(result['rows'])} compared, {n_reg} significant regressions beyond "
        f"{100 * result['threshold']:.0f}% (Mann-Whitney U, alpha {result['alpha']}; {', '.join(NOT_GATED)} not gated); "
        f"{len(result['only_base'])} only in base, {len(result['only_new'])} only in new"
        + (f"; a regression is also slower than the slowest of {result['history']} earlier runs" if result.get("history") else "")
    )
    lines += [f"FAIL: {f}" for f in result.get("failures", [])]
    return "\n".join(lines)


def fmt_ns(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


# ---- dashboard ---------------------------------------------------------------------------------------


def reference_ratios(run):
    """Per (op, case id) measured by both: the median reference time / the median LibTorch time;
    name: the reference benchmark's."""
    s = samples(run)
    ratios = []
    for name, times in sorted(s.items()):
        # reference_fast/... (the reference's fast mode) runs on manual time: Google Benchmark
        # appends /manual_time to its name.
        impl, op, case = split_name(name.removesuffix("/manual_time"))
        other = f"libtorch/{op}/{case}"
        if impl in ("reference", "reference_fast") and other in s:
            ref, lt = statistics.median(times), statistics.median(s[other])
            label = op if impl == "reference" else f"{op} (fast mode)"
            ratios.append({"op": label, "case": case, "reference_ns": ref, "libtorch_ns": lt, "ratio": ref / lt,
                           "name": name})  # fmt: skip
    return ratios


def megatron_ratios(run):
    """Per real-size case (python -m mcore_twin.realsize: <twin>/<op>/<case> beside
    megatron/<op>/<case>): each twin's median time over Megatron-Core's own, same threads;
    name: the twin's benchmark."""
    s = samples(run)
    ratios = []
    for name, times in sorted(s.items()):
        impl, op, case = split_name(name)
        base = f"megatron/{op}/{case}"
        if impl != "megatron" and base in s:
            twin, megatron = statistics.median(times), statistics.median(s[base])
            ratios.append({"twin": impl, "op": op, "case": case, "twin_ns": twin, "megatron_ns": megatron,
                           "ratio": twin / megatron, "name": name})  # fmt: skip
    return ratios


def run_folders(results):
    if not os.path.isdir(results):
        raise BenchError(f"{results}: no such results folder")
    runs = []
    for name in sorted(os.listdir(results)):
        path = os.path.join(results, name)
        meta_path = os.path.join(path, "meta.json")
        if os.path.isdir(path) and os.path.isfile(meta_path):
            meta = load_json(meta_path)
            runs.append((meta.get("date", name), name, path, meta))
    runs.sort()
    return [(name, path, meta) for _, name, path, meta in runs]


def split_name(name):
    """<impl>/<op>/<case id> -> (impl, op, id); other names -> (name, '', '')."""
    parts = name.split("/", 2)
    return tuple(parts) if len(parts) == 3 else (name, "", "")


# ---- dashboard: one chart per group and shape -----------------------------------------------------------

# Google Benchmark's own name parts (UseManualTime, Iterations(30), ...): how it ran, not what.
_GBENCH_PARTS = re.compile(
    r"manual_time|real_time|process_time|(iterations|repeats|threads|min_time|min_warmup_time):[\w.]+")
# The case id fields (parity's case ids: dense(...), moe(...)) that are the shape; the others
# (dtype, norm, act, seed, ...) tell the lines of a chart apart.
SHAPE_FIELDS = ("h", "a", "g", "d", "ffn", "E", "topk", "moe_ffn", "s", "b")
# Label fields shown as their bare value; the others as key=value.
_BARE_FIELDS = ("impl", "op", "args", "dtype", "twin", "case")
# `twin check`'s backend column names the twin a row checked.
TWIN_OF_BACKEND = {"cpu": "reference", "sim": "optimized (CUDA simulator)", "cuda": "optimized (GPU)"}


def parse_bench_name(name):
    """A benchmark name's parts for the charts: {impl, op, kind, shape, fields}.

    <impl>/<op>/<case id> (bench/bench_util.h): a case id kind(k=v,...) gives the layer kind, the
    shape (its SHAPE_FIELDS) and the other fields; a case id without fields (retro_block_6layers,
    llama3-8b:s1024) is its own shape and has no kind. BM_<Impl><Op>/<args> (the suites' own
    benchmarks): impl reference / optimized when the function is BM_Reference... / BM_Optimized...,
    the rest of the function name the op, the arguments (cpu0, gpu1, mode:0) a field. Google
    Benchmark's parts (manual_time, iterations:N) are dropped."""
    parts = [p for p in name.split("/") if not _GBENCH_PARTS.fullmatch(p)]
    if len(parts) < 3 or parts[0].startswith("BM_"):
        m = re.fullmatch(r"BM_(Reference|Optimized)?(\w+)", parts[0])
        impl, op = ((m.group(1) or "").lower(), m.group(2)) if m else ("", parts[0])
        return {"impl": impl, "op": op, "kind": "", "shape": "", "fields": {"args": "/".join(parts[1:])}}
    impl, op, case = parts[0], parts[1], "/".join(parts[2:])
    m = re.fullmatch(r"(\w+)\((.*)\)", case)
    if not m:
        return {"impl": impl, "op": op, "kind": "", "shape": case, "fields": {}}
    fields = dict(f.split("=", 1) if "=" in f else (f, "") for f in m.group(2).split(","))
    shape = " ".join(f"{k}={v}" for k, v in fields.items() if k in SHAPE_FIELDS)
    rest = {k: v for k, v in fields.items() if k not in SHAPE_FIELDS}
    return {"impl": impl, "op": op, "kind": m.group(1), "shape": shape, "fields": rest}


def _varying(fields_list):
    """The keys whose values differ between the lines, in first-seen order."""
    keys = dict.fromkeys(k for f in fields_list for k in f)
    return [k for k in keys if len({f.get(k) for f in fields_list}) > 1]


def short_labels(fields_list):
    """Per line of a chart, what tells it apart from the chart's other lines: the values of the
    fields that differ (impl, op, dtype, ... bare, the others k=v); a line alone, its first
    non-empty field. Labels repeated all the same get #n."""
    keys = _varying(fields_list)
    labels = []
    for f in fields_list:
        parts = [f.get(k, "") if k in _BARE_FIELDS else f"{k}={f.get(k, '')}" for k in keys]
        label = " ".join(p for p in parts if p) or next((v for v in f.values() if v), "median")
        labels.append(label if labels.count(label) == 0 else f"{label} #{labels.count(label) + 1}")
    return labels


def _line_styles(fields_list):
    """(colour, dash) index per line: the colour by the first differing field's value, the dash by
    the rest (dense: colour per impl, dash per dtype), so a chart of many lines stays legible."""
    keys = _varying(fields_list)
    head = [f.get(keys[0]) if keys else None for f in fields_list]
    tail = [tuple(f.get(k) for k in keys[1:]) for f in fields_list]
    colour, dash = list(dict.fromkeys(head)), list(dict.fromkeys(tail))
    return [(colour.index(h), dash.index(t)) for h, t in zip(head, tail)]


def charts_of(entries):
    """entries: (full id, group, shape, label fields, value per run). One chart per (group, shape),
    a line per entry labelled by short_labels, the full id kept for the tooltip; charts sorted by
    group ignoring case (BM_ functions beside the ops of their kind) then shape, lines by label."""
    by_chart = {}
    for full_id, group, shape, fields, values in entries:
        by_chart.setdefault((group, shape), []).append((full_id, fields, values))
    charts = []
    for (group, shape), lines in sorted(by_chart.items(), key=lambda kv: (kv[0][0].lower(), kv[0])):
        labelled = sorted(zip(short_labels([f for _, f, _ in lines]), lines))
        styles = _line_styles([f for _, (_, f, _) in labelled])
        charts.append({"group": group, "shape": shape, "title": f"{group} · {shape}" if shape else group,
                       "lines": [{"id": i, "label": lab, "data": v, "color": c, "dash": d}
                                 for (lab, (i, _, v)), (c, d) in zip(labelled, styles)]})  # fmt: skip
    return charts


def time_charts(series):
    """The time history: one chart per group and shape. The group is the layer kind and op
    (`dense mlp`, `moe router`; an op alone for a case id without fields, the function for a
    BM_ benchmark: `MoERouter`), the shape the case id's SHAPE_FIELDS; its lines are the
    implementations, dtypes and other fields of that op on that shape (reference / libtorch /
    reference_fast x bf16 / fp32), a BM_ benchmark's arguments. The real suites give some forty
    charts for ~150 benchmarks."""
    entries = []
    for name, values in series.items():
        p = parse_bench_name(name)
        group = f"{p['kind']} {p['op']}".strip()
        entries.append((name, group, p["shape"], {"impl": p["impl"], **p["fields"]}, values))
    charts = charts_of(entries)
    for chart in charts:
        _time_axis(chart)
    return charts


def _time_axis(chart):
    """The chart's unit (the largest time's) and a log axis when its times span over 30x."""
    top = max((v for line in chart["lines"] for v in line["data"] if v is not None), default=1.0)
    unit = next((u for u, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)) if top >= scale), "ns")
    chart.update(unit=unit, scale=UNIT_NS[unit], log=_spans(chart, 30))


def _spans(chart, factor):
    """Whether the chart's positive values span more than `factor` (a log axis then shows them all)."""
    values = [v for line in chart["lines"] for v in line["data"] if v is not None and v > 0]
    return bool(values) and max(values) / min(values) > factor


def ratio_charts(runs):
    """The ratios over the runs, one chart per shape: each twin / Megatron-Core on the real-size
    layers (the chart's lines: the twins), and reference / LibTorch per layer kind and shape (its
    lines: op, implementation and dtype). (realsize charts, libtorch charts)"""
    megatron, libtorch = [], []
    for i, (_, path, _) in enumerate(runs):
        if _has_gbench(path):
            megatron += [(i, r["name"], r["ratio"]) for r in megatron_ratios(path)]
            libtorch += [(i, r["name"], r["ratio"]) for r in reference_ratios(path)]
    return _ratio_entries(megatron, len(runs), True), _ratio_entries(libtorch, len(runs), False)


def _ratio_entries(points, n_runs, over_megatron):
    series = {}
    for i, name, ratio in points:
        series.setdefault(name, [None] * n_runs)[i] = ratio
    entries = []
    for name, values in series.items():
        p = parse_bench_name(name)
        fields = {"twin": p["impl"], "op": p["op"]}
        if not over_megatron:
            fields = {"op": p["op"], "impl": p["impl"], **p["fields"]}
        entries.append((name, p["kind"] or ("real-size" if over_megatron else p["op"]), p["shape"], fields, values))
    charts = charts_of(entries)
    for chart in charts:
        chart.update(unit="twin / Megatron-Core" if over_megatron else "reference / LibTorch", scale=1,
                     log=_spans(chart, 30))
    return charts


def accuracy_history(runs):
    """{row id: [share of the bound per run]} of each run's check.json (`twin check --json`), and
    {row id: (twin, layer kind, label fields)}. A row without a bound (an exact table, a kind a
    twin does not support, an error) has no share to plot."""
    history, keys = {}, {}
    for i, (_, path, _) in enumerate(runs):
        check = os.path.join(path, "check.json")
        rows = load_json(check).get("rows", []) if os.path.isfile(check) else []
        for row in rows:
            share, bound = row.get("share"), row.get("bound")
            if row.get("status", "pass") not in ("pass", "fail") or not isinstance(share, (int, float)) or not bound:
                continue
            key = f"{row.get('layer')} [{row.get('dtype')}, {row.get('backend')}, tp={row.get('tp')}]"
            history.setdefault(key, [None] * len(runs))[i] = share
            kind, _, case = str(row.get("layer")).partition(" ")
            twin = TWIN_OF_BACKEND.get(row.get("backend"), str(row.get("backend")))
            keys[key] = (twin, kind, {"case": case, "dtype": row.get("dtype"), "tp": row.get("tp")})
    return history, keys


def accuracy_charts(history, keys):
    """Accuracy per twin: one chart per twin (the group) and layer kind, a line per `twin check`
    row (case, dtype, tp)."""
    charts = charts_of([(k, *keys[k][:2], keys[k][2], v) for k, v in history.items()])
    for chart in charts:
        chart.update(unit="max error / bound", scale=1, log=False)
    return charts


def chart_counts(data):
    """{section id: {group: number of charts}}: what the page draws (the browser test counts it)."""
    counts = {}
    for section in data["sections"]:
        for chart in section["charts"]:
            group = counts.setdefault(section["id"], {})
            group[chart["group"]] = group.get(chart["group"], 0) + 1
    return counts


def dashboard_data(results):
    runs = run_folders(results)
    if not runs:
        raise BenchError(f"{results}: no run folders (each with a meta.json)")
    labels = [f"{meta.get('commit', '?')[:8]} {meta.get('date', name)[:16]}" for name, _, meta in runs]
    series = time_history(runs)
    accuracy, accuracy_keys = accuracy_history(runs)
    latest_name, latest_path, latest_meta = runs[-1]
    realsize_charts, libtorch_charts = ratio_charts(runs)
    comparison = None
    if len(runs) >= 2 and _has_gbench(runs[-2][1]) and _has_gbench(latest_path):
        comparison = compare(runs[-2][1], latest_path, min_repetitions=1)
        comparison["base"], comparison["new"] = runs[-2][0], latest_name
    return {
        "labels": labels,
        "series": series,
        "accuracy": accuracy,
        "ratios": reference_ratios(latest_path) if _has_gbench(latest_path) else [],
        "realsize": megatron_ratios(latest_path) if _has_gbench(latest_path) else [],
        "roofline": roofline_rows(latest_path),
        "comparison": comparison,
        "latest": {"name": latest_name, "meta": latest_meta},
        "sections": [
            {"id": "realsize", "charts": realsize_charts},
            {"id": "libtorch", "charts": libtorch_charts},
            {"id": "time", "charts": time_charts(series)},
            {"id": "accuracy", "charts": accuracy_charts(accuracy, accuracy_keys), "by_group": True},
        ],
    }


def time_history(runs):
    """{benchmark: [median time in ns per run]}, the cost model (not measured) left out."""
    series = {}
    for i, (_, path, _) in enumerate(runs):
        try:
            s = samples(path)
        except BenchError:
            s = {}
        for bench, times in s.items():
            if not bench.startswith("model/"):
                series.setdefault(bench, [None] * len(runs))[i] = statistics.median(times)
    return series


def roofline_rows(run):
    """The cost model's rows (bench_cost_model.json) of a run, by case then kernel."""
    cost_file = os.path.join(run, "bench_cost_model.json")
    if not os.path.isfile(cost_file):
        return []
    rows = []
    for bench, entry in counters(cost_file).items():
        _, kernel, case = split_name(bench)
        case = "/".join(p for p in case.split("/") if not _GBENCH_PARTS.fullmatch(p))
        rows.append({"kernel": kernel, "case": case, "bytes": entry.get("bytes"),
                     "flops": entry.get("flops"), "intensity": entry.get("FLOP/B"),
                     "roofline_us": entry.get("roofline_us"), "label": entry.get("label", "")})  # fmt: skip
    return sorted(rows, key=lambda r: (r["case"], r["kernel"]))


def _has_gbench(path):
    return any(n.startswith("bench_") and n.endswith(".json") for n in os.listdir(path))


PAGE_JS = r"""
(function () {
  const status = window.__dashboardStatus;
  function publish() { document.getElementById('render-status').textContent = JSON.stringify(status); }
  const palette = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd',
                   '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
  const dashes = [[], [6, 3], [2, 2], [10, 3, 2, 3], [14, 4]];
  // The full id in the tooltip, a line per ~90 characters, broken after its commas.
  function wrap(text) {
    const lines = [''];
    for (const piece of text.split(/(?<=,)/)) {
      if (lines[lines.length - 1].length + piece.length > 90) lines.push('');
      lines[lines.length - 1] += piece;
    }
    return lines;
  }
  // The legend in HTML under the chart: each short label with its full id as the title (hover);
  // a click hides or shows its line.
  function legend(spec, c) {
    const ul = document.createElement('ul');
    ul.className = 'legend';
    spec.lines.forEach((line, k) => {
      const li = document.createElement('li');
      li.title = line.id;
      const swatch = document.createElement('span');
      swatch.className = 'swatch';
      swatch.style.borderTop = `3px ${line.dash ? 'dashed' : 'solid'} ${c.data.datasets[k].borderColor}`;
      li.appendChild(swatch);
      li.appendChild(document.createTextNode(line.label));
      li.addEventListener('click', () => {
        c.setDatasetVisibility(k, !c.isDatasetVisible(k));
        li.classList.toggle('off', !c.isDatasetVisible(k));
        c.update();
      });
      ul.appendChild(li);
    });
    return ul;
  }
  function datasetsOf(spec) {
    return spec.lines.map(line => {
      const colour = palette[line.color % palette.length];
      return {label: line.label, fullId: line.id, data: line.data.map(v => v === null ? null : v / spec.scale),
              borderColor: colour, backgroundColor: colour, borderDash: dashes[line.dash % dashes.length],
              borderWidth: 1.5, pointRadius: 3};
    });
  }
  // A section drawn by group (accuracy: by twin) gets a heading and a row of charts per group.
  function groupBox(container, section, group) {
    if (!section.by_group) return container;
    const id = 'charts-' + section.id + '-' + group.replace(/[^A-Za-z0-9]+/g, '-');
    let box = document.getElementById(id);
    if (!box) {
      const h = document.createElement('h3');
      h.textContent = group;
      box = document.createElement('div');
      box.className = 'charts';
      box.id = id;
      container.appendChild(h);
      container.appendChild(box);
    }
    return box;
  }
  function chart(container, section, spec, labels) {
    const box = document.createElement('div');
    box.className = 'chart ' + section;
    box.dataset.section = section;
    box.dataset.group = spec.group;
    const h = document.createElement('h4');
    h.textContent = spec.title;
    h.title = spec.lines.map(l => l.id).join('\n');
    const canvas = document.createElement('canvas');
    const wide = section === 'realsize' || section === 'libtorch';
    canvas.width = wide ? 650 : 430;
    canvas.height = wide ? 260 : 210;
    const datasets = datasetsOf(spec);
    box.appendChild(h); box.appendChild(canvas); container.appendChild(box);
    const c = new Chart(canvas, {type: 'line', data: {labels: labels, datasets: datasets},
      options: {responsive: false, spanGaps: true,
                plugins: {legend: {display: false},
                          tooltip: {callbacks: {
                            label: ctx => `${ctx.dataset.label}: ${ctx.parsed.y.toPrecision(3)} ${spec.unit}`,
                            afterLabel: ctx => wrap(ctx.dataset.fullId)}}},
                scales: {y: {type: spec.log ? 'logarithmic' : 'linear', beginAtZero: !spec.log,
                             title: {display: true, text: spec.unit}}}}});
    box.appendChild(legend(spec, c));
    status.charts += 1;
    if (c.chartArea && c.chartArea.width > 0 && canvas.width > 0) status.rendered += 1;
    status.points[section + ': ' + spec.title] = datasets.map(
      (_, k) => c.getDatasetMeta(k).data.filter(p => !p.skip && Number.isFinite(p.y)).length);
  }
  try {
    const data = JSON.parse(document.getElementById('dashboard-data').textContent);
    Chart.defaults.animation = false;
    for (const section of data.sections) {
      const container = document.getElementById('charts-' + section.id);
      for (const spec of section.charts) chart(groupBox(container, section, spec.group), section.id, spec, data.labels);
    }
  } catch (e) {
    status.errors.push(String(e && e.stack || e));
  }
  publish();
})();
"""

# Runs before Chart.js: every uncaught error and console.error call lands in the status the page
# publishes in #render-status (read by the browser test).
STATUS_JS = r"""
window.__dashboardStatus = {errors: [], charts: 0, rendered: 0, points: {}};
window.addEventListener('error', e => window.__dashboardStatus.errors.push(String(e.message)));
(function () {
  const original = console.error;
  console.error = function () {
    window.__dashboardStatus.errors.push(Array.from(arguments).map(String).join(' '));
    return original.apply(console, arguments);
  };
})();
"""

# Tables: a long unbroken value may wrap anywhere rather than widen its table past the window;
# a header never wraps, so no column is narrower than its header; names (kernels, ops) and
# numbers never wrap either; case ids (.id) wrap, at their commas first (<wbr>).
PAGE_CSS = """
body { font-family: sans-serif; margin: 1em; }
table { border-collapse: collapse; font-size: 12px; overflow-wrap: anywhere; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; vertical-align: top; }
th { white-space: nowrap; }
td.name, td.num { white-space: nowrap; }
td.id, td.name, th.id, th.name { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; }
.chart { width: 430px; } .chart.realsize, .chart.libtorch { width: 650px; }
.chart h4 { font-size: 11px; margin: 0 0 2px 0; overflow-wrap: anywhere; }
.legend { list-style: none; padding: 0; margin: 2px 0; font-size: 11px; display: flex; flex-wrap: wrap; }
.legend li { margin-right: 10px; white-space: nowrap; cursor: pointer; } .legend li.off { opacity: 0.4; }
#charts-accuracy { display: block; } #charts-accuracy h3 { margin: 8px 0 4px 0; font-size: 14px; }
.swatch { display: inline-block; width: 18px; margin-right: 3px; vertical-align: middle; }
.regression { background: #fbb; } .model { color: #a60; font-weight: bold; } #render-status { display: none; }
"""

SECTION_TITLES = {
    "realsize": "Real-size layers: each twin's time / Megatron-Core's (same threads), per shape over the runs",
    "libtorch": "Reference / LibTorch eager (same thread count), per layer kind and shape over the runs",
    "time": "Time per benchmark: a chart per layer kind and op, and shape",
    "accuracy": "Accuracy per twin: each twin check row's max error / bound over the runs",
}


def _cell(value, kind):
    """A table cell; kind: name / num (never wraps), id (wraps after its commas, slashes and
    brackets; the whole id as its title)."""
    text = html.escape(str(value))
    if kind == "id":
        broken = re.sub(r"([,/(])", r"\1<wbr>", text)
        return f"<td class='id' title='{text}'>{broken}</td>"
    return f"<td class='{kind}'>{text}</td>"


def _table(header, rows, kinds, classes=None):
    """header: the column names; kinds: each column's cell kind (see _cell)."""
    out = ["<table><tr>" + "".join(f"<th class='{k}'>{html.escape(h)}</th>" for h, k in zip(header, kinds)) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f" class='{classes[i]}'" if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(_cell(c, k) for c, k in zip(row, kinds)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _section(section_id, title, *body):
    return "\n".join([f"<section id='{section_id}'><h2>{title}</h2>", *body, "</section>"])


def _charts(section_id):
    return f"<div class='charts' id='charts-{section_id}'></div>"


def _realsize_section(data):
    table = _table(
        ["twin", "op", "case", "twin time", "Megatron-Core", "ratio"],
        [[r["twin"], r["op"], r["case"], fmt_ns(r["twin_ns"]), fmt_ns(r["megatron_ns"]), f"{r['ratio']:.2f}x"]
         for r in data["realsize"]],
        ["name", "name", "id", "num", "num", "num"],
    ) if data["realsize"] else "<p>(no real-size run: python -m mcore_twin.realsize, run by ci/bench)</p>"
    return _section("realsize", html.escape(SECTION_TITLES["realsize"]), _charts("realsize"),
                    "<p>Latest run:</p>", table)


def _comparison_section(data):
    cmp_ = data["comparison"]
    if not cmp_:
        return _section("comparison", "Latest run against the one before", "<p>(one run only)</p>")
    # Regressions first, then improvements, then the unchanged.
    ordered = sorted(cmp_["rows"], key=lambda r: (not r["regression"], not r["improvement"], r["name"]))
    rows = [
        [r["name"], fmt_ns(r["base_ns"]), fmt_ns(r["new_ns"]), f"{100 * r['change']:+.1f}%", f"{r['p']:.4f}",
         "REGRESSION" if r["regression"] else "improved" if r["improvement"] else
         "" if r.get("gated", True) else "not gated"]
        for r in ordered
    ]
    classes = ["regression" if r["regression"] else "" for r in ordered]
    intro = (f"<p>{html.escape(cmp_['base'])} &rarr; {html.escape(cmp_['new'])}: Mann-Whitney U over the repetitions, "
             f"regression = slower by more than {100 * cmp_['threshold']:.0f}% with p &lt; {cmp_['alpha']}</p>")
    table = _table(["benchmark", "base", "new", "change", "p", "verdict"], rows,
                   ["id", "num", "num", "num", "num", "name"], classes)
    return _section("comparison", "Latest run against the one before", intro, f"<div id='regressions'>{table}</div>")


def _comparison_summary(data):
    cmp_ = data["comparison"]
    if not cmp_:
        return ""
    regressions = sum(r["regression"] for r in cmp_["rows"])
    improvements = sum(r["improvement"] for r in cmp_["rows"])
    cls = " class='regression'" if regressions else ""
    return (f"<p{cls}>Latest run against the one before: {regressions} regression(s), {improvements} improvement(s) "
            f"in {len(cmp_['rows'])} benchmarks (<a href='#comparison'>the table</a>)</p>")


def _libtorch_table_section(data):
    table = _table(
        ["op", "case", "reference", "LibTorch", "ratio"],
        [[r["op"], r["case"], fmt_ns(r["reference_ns"]), fmt_ns(r["libtorch_ns"]), f"{r['ratio']:.2f}x"]
         for r in data["ratios"]],
        ["name", "id", "num", "num", "num"],
    )
    return _section("libtorch-latest", "Reference / LibTorch eager, latest run", table)


def _cost_model_section(data):
    table = _table(
        ["kernel", "case", "bytes", "FLOPs", "FLOP/B", "roofline us", "note"],
        [[r["kernel"], r["case"], f"{r['bytes']:.4g}", f"{r['flops']:.4g}", f"{r['intensity']:.2f}",
          f"{r['roofline_us']:.3f}", r["label"]] for r in data["roofline"]],
        ["name", "id", "num", "num", "num", "num", "name"],
    )
    title = "Cost model of the optimized kernels <span class='model'>(MODEL, not measured)</span>"
    return _section("costmodel", title, table)


def _finite(value):
    """value with every NaN or infinite float None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def build_page(data, chartjs_source):
    """The page: a line on the latest comparison, the charts (the real-size ratios on top, then the
    reference / LibTorch ratios, the time per group, the accuracy per twin), then the long tables
    (the comparison, the latest reference / LibTorch ratios, the cost model)."""
    meta = data["latest"]["meta"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>mcore-twin dashboard</title>",
        f"<style>{PAGE_CSS}</style>",
        f"<script>{STATUS_JS}</script>",
        f"<script>{chartjs_source}</script></head><body>",
        "<h1>mcore-twin performance and accuracy</h1>",
        f"<p>{len(data['labels'])} runs; latest {html.escape(data['latest']['name'])}: "
        + html.escape(", ".join(f"{k}={v}" for k, v in sorted(meta.items())))
        + "</p>",
        _comparison_summary(data),
        _realsize_section(data),
        _section("libtorch", html.escape(SECTION_TITLES["libtorch"]), _charts("libtorch"),
                 "<p>(the latest run's ratios: <a href='#libtorch-latest'>the table</a>)</p>"),
        _section("time", html.escape(SECTION_TITLES["time"]), _charts("time")),
        _section("accuracy", html.escape(SECTION_TITLES["accuracy"]), _charts("accuracy")),
        _comparison_section(data),
        _libtorch_table_section(data),
        _cost_model_section(data),
    ]
    # What the charts draw; JSON has no NaN or infinity (a single repetition's p is NaN), so null.
    payload = json.dumps(_finite({"labels": data["labels"], "sections": data["sections"]})).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='dashboard-data'>{payload}</script>")
    parts.append("<pre id='render-status'></pre>")
    parts.append(f"<script>{PAGE_JS}</script></body></html>")
    return "\n".join(parts)


def build_dashboard(results, output, chartjs=CHARTJS_DEFAULT):
    if not os.path.isfile(chartjs):
        raise BenchError(f"{chartjs}: Chart.js not found (Debian package libjs-chart.js; or pass --chartjs FILE)")
    with open(chartjs) as f:
        source = f.read().replace("</script", "<\\/script")
    data = dashboard_data(results)
    with open(output, "w") as f:
        f.write(build_page(data, source))
    return data


# ---- command line -------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m mcore_twin.bench", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="compare a run with a baseline run; exit 1 on a significant regression")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--threshold", type=float, default=0.10, help="relative slow-down that counts (default 0.10)")
    c.add_argument("--alpha", type=float, default=0.05, help="significance level of the U test (default 0.05)")
    c.add_argument("--metric", choices=["real_time", "cpu_time"], default="real_time")
    c.add_argument("--json", action="store_true")
    c.add_argument("--history", help="a results folder: its runs before NEW (the last --window) are the history")
    c.add_argument("--window", type=int, default=5, help="how many earlier runs the history holds (default 5)")
    c.add_argument("--filter", default="", help="the --benchmark_filter NEW ran with: BASE benchmarks it leaves out are not missing")
    r = sub.add_parser("ratios", help="reference / LibTorch time ratio per op and shape of one run")
    r.add_argument("run")
    r.add_argument("--json", action="store_true")
    d = sub.add_parser("dashboard", help="build the static HTML dashboard from a results folder")
    d.add_argument("results")
    d.add_argument("-o", "--output", default="dashboard.html")
    d.add_argument("--chartjs", default=CHARTJS_DEFAULT)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "compare":
            if not (0 < args.alpha < 1) or args.threshold < 0:
                raise BenchError("--alpha must be in (0, 1) and --threshold >= 0")
            if args.window < 1:
                raise BenchError("--window must be >= 1")
            history = []
            if args.history:  # the runs before NEW in time order (all of them when NEW is elsewhere)
                paths = [path for _, path, _ in run_folders(args.history)]
                real = [os.path.realpath(path) for path in paths]
                end = real.index(os.path.realpath(args.new)) if os.path.realpath(args.new) in real else len(paths)
                history = paths[:end][-args.window:]
            result = compare(args.base, args.new, args.threshold, args.alpha, metric=args.metric, history=history,
                             benchmark_filter=args.filter)
            print(json.dumps(result) if args.json else format_compare(result))
            return 1 if result["failures"] or any(r["regression"] for r in result["rows"]) else 0
        if args.cmd == "ratios":
            ratios, realsize = reference_ratios(args.run), megatron_ratios(args.run)
            if args.json:
                print(json.dumps(ratios + realsize))
            else:
                for x in realsize:
                    print(f"{fmt_ns(x['twin_ns']):>11} {fmt_ns(x['megatron_ns']):>11} {x['ratio']:>7.2f}x  "
                          f"{x['twin']} / Megatron-Core: {x['op']} / {x['case']}")
                print(f"{'reference':>11} {'LibTorch':>11} {'ratio':>8}  op / case")
                for x in ratios:
                    print(f"{fmt_ns(x['reference_ns']):>11} {fmt_ns(x['libtorch_ns']):>11} {x['ratio']:>7.2f}x  "
                          f"{x['op']} / {x['case']}")
            return 0
        data = build_dashboard(args.results, args.output, args.chartjs)
        print(f"{args.output}: {len(data['labels'])} runs, {len(data['series'])} benchmarks, "
              f"{len(data['accuracy'])} accuracy rows")
        return 0
    except BenchError as e:
        print(f"mcore_twin.bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
