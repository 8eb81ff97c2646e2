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
        one self-contained HTML page (Chart.js inlined; opens offline): time series per benchmark
        over the runs, the latest reference / LibTorch ratios, the cost model's roofline table,
        the accuracy history (each `twin check` row's share of its bound) and the latest run's
        comparison with the one before.
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
    """Per (op, case id) measured by both: the median reference time / the median LibTorch time."""
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
            ratios.append({"op": label, "case": case, "reference_ns": ref, "libtorch_ns": lt, "ratio": ref / lt})
    return ratios


def megatron_ratios(run):
    """Per real-size case (python -m mcore_twin.realsize: <twin>/<op>/<case> beside
    megatron/<op>/<case>): each twin's median time over Megatron-Core's own, same threads."""
    s = samples(run)
    ratios = []
    for name, times in sorted(s.items()):
        impl, op, case = split_name(name)
        base = f"megatron/{op}/{case}"
        if impl != "megatron" and base in s:
            twin, megatron = statistics.median(times), statistics.median(s[base])
            ratios.append({"twin": impl, "op": op, "case": case, "twin_ns": twin, "megatron_ns": megatron,
                           "ratio": twin / megatron})  # fmt: skip
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


def dashboard_data(results):
    runs = run_folders(results)
    if not runs:
        raise BenchError(f"{results}: no run folders (each with a meta.json)")
    labels, series, accuracy = [], {}, {}
    for i, (name, path, meta) in enumerate(runs):
        labels.append(f"{meta.get('commit', '?')[:8]} {meta.get('date', name)[:16]}")
        try:
            s = samples(path)
        except BenchError:
            s = {}
        for bench, times in s.items():
            if bench.startswith("model/"):
                continue
            series.setdefault(bench, [None] * len(runs))[i] = statistics.median(times)
        check = os.path.join(path, "check.json")
        if os.path.isfile(check):
            for row in load_json(check).get("rows", []):
                key = f"{row.get('layer')} [{row.get('dtype')}, {row.get('backend')}, tp={row.get('tp')}]"
                share = row.get("share")
                accuracy.setdefault(key, [None] * len(runs))[i] = share if isinstance(share, (int, float)) else None
    # Rows that never had a share (a kind a twin does not support) have nothing to plot.
    accuracy = {k: v for k, v in accuracy.items() if any(x is not None for x in v)}
    latest_name, latest_path, latest_meta = runs[-1]
    ratios = reference_ratios(latest_path) if _has_gbench(latest_path) else []
    realsize = megatron_ratios(latest_path) if _has_gbench(latest_path) else []
    roofline = []
    cost_file = os.path.join(latest_path, "bench_cost_model.json")
    if os.path.isfile(cost_file):
        for bench, entry in counters(cost_file).items():
            _, kernel, case = split_name(bench)
            roofline.append(
                {
                    "kernel": kernel,
                    "case": case,
                    "bytes": entry.get("bytes"),
                    "flops": entry.get("flops"),
                    "intensity": entry.get("FLOP/B"),
                    "roofline_us": entry.get("roofline_us"),
                    "label": entry.get("label", ""),
                }
            )
    comparison = None
    if len(runs) >= 2 and _has_gbench(runs[-2][1]) and _has_gbench(latest_path):
        comparison = compare(runs[-2][1], latest_path, min_repetitions=1)
        comparison["base"], comparison["new"] = runs[-2][0], latest_name
    return {
        "labels": labels,
        "series": series,
        "accuracy": accuracy,
        "ratios": ratios,
        "realsize": realsize,
        "roofline": roofline,
        "comparison": comparison,
        "latest": {"name": latest_name, "meta": latest_meta},
    }


def _has_gbench(path):
    return any(n.startswith("bench_") and n.endswith(".json") for n in os.listdir(path))


PAGE_JS = r"""
(function () {
  const status = window.__dashboardStatus;
  function publish() { document.getElementById('render-status').textContent = JSON.stringify(status); }
  try {
    const data = JSON.parse(document.getElementById('dashboard-data').textContent);
    Chart.defaults.animation = false;
    function chart(container, title, datasets, unit) {
      const box = document.createElement('div');
      box.className = 'chart';
      const h = document.createElement('h4');
      h.textContent = title;
      const canvas = document.createElement('canvas');
      box.appendChild(h); box.appendChild(canvas); container.appendChild(box);
      const c = new Chart(canvas, {type: 'line', data: {labels: data.labels, datasets: datasets},
        options: {responsive: false, spanGaps: true, plugins: {legend: {display: datasets.length > 1}},
                  scales: {y: {title: {display: true, text: unit}}}}});
      status.charts += 1;
      if (c.chartArea && c.chartArea.width > 0 && canvas.width > 0) status.rendered += 1;
      status.points[title] = c.getDatasetMeta(0).data.filter(p => !p.skip && Number.isFinite(p.y)).length;
    }
    const perf = document.getElementById('perf-charts');
    for (const name of Object.keys(data.series).sort()) {
      chart(perf, name, [{label: 'median time (us)', data: data.series[name].map(v => v === null ? null : v / 1e3)}], 'us');
    }
    const acc = document.getElementById('accuracy-charts');
    for (const name of Object.keys(data.accuracy).sort()) {
      chart(acc, name, [{label: 'share of bound', data: data.accuracy[name]}], 'max error / bound');
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

PAGE_CSS = """
body { font-family: sans-serif; margin: 1em; } table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; white-space: nowrap; }
td.l, th.l { text-align: left; white-space: normal; word-break: break-all; max-width: 760px; }
.chart { display: inline-block; margin: 4px; vertical-align: top; } .chart h4 { font-size: 11px; width: 420px;
word-break: break-all; margin: 0; } canvas { width: 420px; height: 200px; } .regression { background: #fbb; }
.model { color: #a60; font-weight: bold; } #render-status { display: none; }
"""


def _table(header, rows, classes=None):
    out = ["<table><tr>" + "".join(f"<th class='{'l' if i == 0 else ''}'>{html.escape(h)}</th>" for i, h in enumerate(header)) + "</tr>"]
    for k, row in enumerate(rows):
        cls = f" class='{classes[k]}'" if classes and classes[k] else ""
        cells = "".join(f"<td class='{'l' if i == 0 else ''}'>{html.escape(str(c))}</td>" for i, c in enumerate(row))
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def build_page(data, chartjs_source):
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
    ]
    parts.append("<h2>Real-size layers: each twin / Megatron-Core (latest run, same threads)</h2>")
    parts.append(
        _table(
            ["twin", "op", "case", "twin time", "Megatron-Core", "ratio"],
            [[r["twin"], r["op"], r["case"], fmt_ns(r["twin_ns"]), fmt_ns(r["megatron_ns"]), f"{r['ratio']:.2f}x"]
             for r in data.get("realsize", [])],
        )
        if data.get("realsize")
        else "<p>(no real-size run: python -m mcore_twin.realsize, run by ci/bench)</p>"
    )
    parts.append("<h2>Latest run against the one before</h2>")
    cmp_ = data["comparison"]
    if cmp_:
        # Regressions first, then improvements, then the unchanged.
        ordered = sorted(cmp_["rows"], key=lambda r: (not r["regression"], not r["improvement"], r["name"]))
        rows = [
            [r["name"], fmt_ns(r["base_ns"]), fmt_ns(r["new_ns"]), f"{100 * r['change']:+.1f}%", f"{r['p']:.4f}",
             "REGRESSION" if r["regression"] else "improved" if r["improvement"] else
             "" if r.get("gated", True) else "not gated"]
            for r in ordered
        ]
        classes = ["regression" if r["regression"] else "" for r in ordered]
        parts.append(
            f"<p>{html.escape(cmp_['base'])} &rarr; {html.escape(cmp_['new'])}: Mann-Whitney U over the repetitions, "
            f"regression = slower by more than {100 * cmp_['threshold']:.0f}% with p &lt; {cmp_['alpha']}</p>"
        )
        parts.append("<div id='regressions'>" + _table(["benchmark", "base", "new", "change", "p", "verdict"], rows, classes) + "</div>")
    else:
        parts.append("<p>(one run only)</p>")
    parts.append("<h2>Reference / LibTorch eager (latest run, same thread count)</h2>")
    parts.append(
        _table(
            ["op", "case", "reference", "LibTorch", "ratio"],
            [[r["op"], r["case"], fmt_ns(r["reference_ns"]), fmt_ns(r["libtorch_ns"]), f"{r['ratio']:.2f}x"] for r in data["ratios"]],
        )
    )
    parts.append("<h2>Cost model of the optimized kernels <span class='model'>(MODEL, not measured)</span></h2>")
    parts.append(
        _table(
            ["kernel", "case", "bytes", "FLOPs", "FLOP/B", "roofline us", "note"],
            [[r["kernel"], r["case"], f"{r['bytes']:.4g}", f"{r['flops']:.4g}", f"{r['intensity']:.2f}",
              f"{r['roofline_us']:.3f}", r["label"]] for r in data["roofline"]],
        )
    )
    parts.append("<h2>Time per benchmark over the runs</h2><div id='perf-charts'></div>")
    parts.append("<h2>Accuracy: each twin check row's max error / bound over the runs</h2><div id='accuracy-charts'></div>")
    payload = json.dumps(data).replace("</", "<\\/")
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
