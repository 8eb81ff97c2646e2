"""Tests of python/mcore_twin/bench.py: the Mann-Whitney U test, the regression gate on synthetic
Google Benchmark results (a planted 20% regression is flagged, noise and an unchanged rerun are
not; --metric and the --history window each decide a verdict; a benchmark that errors or
disappears fails the gate, a single repetition is refused), bad input, the dashboard page built
from sample runs, its charts grouped by layer kind, op and shape (on the suites' names, and on the
built suites' own lists when build/bin has them), and (--browser) that page loaded in headless
Chromium at 1400 px: no errors, every chart rendered with one point per run, the charts per group
those dashboard_data gives, no table column narrower than a word of its header or cells, the
real-size section first, the planted regression in the comparison table.

    PYTHONPATH=python python3 tests/python/test_bench_tool.py [--browser]
A test whose optional dependency (scipy, libjs-chart.js, chromium) is missing skips, and fails
when CI=true; exit 77 (CTest's skip) when every test skipped.
"""

import contextlib
import glob
import html
import io
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from mcore_twin import bench

DENSE_ID = "dense(h=8,a=2,g=2,d=4,ffn=16,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=4,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=1)"
STEADY = f"reference/layer/{DENSE_ID}"
PLANTED = f"reference/mlp/{DENSE_ID}"  # 20% slower in the second run
TORCH = f"libtorch/layer/{DENSE_ID}"


def optional(test, what):
    """A missing optional dependency skips the test, and fails it when CI=true (as in the C++ tests)."""
    if os.environ.get("CI") == "true":
        test.fail(f"CI=true: a missing optional dependency is an error: {what}")
    test.skipTest(what)


def gbench_json(times_by_name, unit="us", cpu_times_by_name=None, errored=None):
    """Google Benchmark JSON (as --benchmark_out writes it with repetitions) of given times (cpu_time
    = real_time unless given); `errored`: {name: message} of benchmarks that called SkipWithError."""
    benchmarks = []
    for name, times in times_by_name.items():
        cpu = (cpu_times_by_name or {}).get(name, times)
        for i, t in enumerate(times):
            benchmarks.append({"name": name, "run_name": name, "run_type": "iteration", "repetitions": len(times),
                               "repetition_index": i, "threads": 1, "iterations": 10, "real_time": t,
                               "cpu_time": cpu[i], "time_unit": unit})
        benchmarks.append({"name": name + "_mean", "run_name": name, "run_type": "aggregate",
                           "aggregate_name": "mean", "real_time": sum(times) / len(times), "time_unit": unit})
    for name, message in (errored or {}).items():
        for i in range(3):
            benchmarks.append({"name": name, "run_name": name, "run_type": "iteration", "repetitions": 3,
                               "repetition_index": i, "threads": 1, "iterations": 0, "real_time": 0.0,
                               "cpu_time": 0.0, "time_unit": unit, "error_occurred": True, "error_message": message})
    return {"context": {"date": "2026-12-02", "num_cpus": 2}, "benchmarks": benchmarks}


def noisy(rng, centre, n=9, rel=0.02):
    return [centre * (1.0 + rng.gauss(0.0, rel)) for _ in range(n)]


def write_run(root, name, date, times_by_name, check_share=None, cpu_times_by_name=None, errored=None):
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"commit": name[-8:], "date": date, "machine": "test", "build_type": "RelWithDebInfo"}, f)
    with open(os.path.join(path, "bench_suite.json"), "w") as f:
        json.dump(gbench_json(times_by_name, cpu_times_by_name=cpu_times_by_name, errored=errored), f)
    with open(os.path.join(path, "bench_cost_model.json"), "w") as f:
        json.dump({"benchmarks": [{"name": f"model/gemm m=8,n=4,k=8/{DENSE_ID}", "run_type": "iteration",
                                   "real_time": 0.001, "cpu_time": 0.001, "time_unit": "us", "flops": 512.0,
                                   "bytes": 256.0, "FLOP/B": 2.0, "roofline_us": 0.001,
                                   "label": "MODEL H200 memory-bound"}]}, f)
    if check_share is not None:
        with open(os.path.join(path, "check.json"), "w") as f:
            json.dump({"command": "check", "status": "pass", "rows": [
                {"layer": "dense gpt", "dtype": "bf16", "backend": "sim", "tp": "1", "max_error": 0.1 * check_share,
                 "bound": 0.1, "share": check_share, "seconds": 0.1, "status": "pass", "detail": ""},
                {"layer": "fixture moe", "dtype": "bf16", "backend": "optimized", "tp": "-", "max_error": None,
                 "bound": None, "share": None, "seconds": 0.0, "status": "unsupported", "detail": ""}]}, f)
    return path


def sample_results(root):
    """Two runs: the second with PLANTED 20% slower, STEADY unchanged but re-measured."""
    rng = random.Random(20261202)
    first = {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 400.0), TORCH: noisy(rng, 100.0)}
    second = {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 480.0), TORCH: noisy(rng, 100.0)}
    a = write_run(root, "20261201T000000Z-aaaaaaaa", "2026-12-01T00:00:00Z", first, check_share=0.25)
    b = write_run(root, "20261202T000000Z-bbbbbbbb", "2026-12-02T00:00:00Z", second, check_share=0.5)
    return a, b


class MannWhitneyU(unittest.TestCase):
    def test_exact_p_of_separated_samples(self):
        # Every x below every y: U = 0, the most extreme of C(10, 5) = 252 equally likely rank
        # arrangements on each side, so the two-sided p is 2 / 252.
        u, p = bench.mann_whitney_u_builtin([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
        self.assertEqual(u, 0)
        self.assertAlmostEqual(p, 2 / 252, places=12)

    def test_exact_distribution_by_enumeration(self):
        # The exact p against a brute-force count over all C(7, 3) splits of the ranks.
        x, y = [0.3, 2.5, 4.0], [0.1, 1.0, 3.0, 5.0]
        u, p = bench.mann_whitney_u_builtin(x, y)
        pooled = sorted(x + y)
        rank = {v: i + 1 for i, v in enumerate(pooled)}
        u_obs = sum(rank[v] for v in x) - 3 * 4 / 2
        us = [sum(c) - 6 for c in itertools.combinations(range(1, 8), 3)]
        lo = min(u_obs, 12 - u_obs)
        expected = min(1.0, 2 * sum(1 for v in us if v <= lo) / len(us))
        self.assertEqual(u, u_obs)
        self.assertAlmostEqual(p, expected, places=12)

    def test_identical_samples_are_not_significant(self):
        _, p = bench.mann_whitney_u_builtin([5.0] * 6, [5.0] * 6)
        self.assertEqual(p, 1.0)

    def test_builtin_matches_scipy_when_present(self):
        try:
            from scipy.stats import mannwhitneyu
        except ImportError:
            optional(self, "scipy not installed (python3-scipy)")
        rng = random.Random(7)
        for n1, n2, ties in [(5, 5, False), (9, 9, False), (12, 15, False), (9, 9, True)]:
            x = [round(rng.gauss(0, 1), 1 if ties else 9) for _ in range(n1)]
            y = [round(rng.gauss(0.5, 1), 1 if ties else 9) for _ in range(n2)]
            u, p = bench.mann_whitney_u_builtin(x, y)
            ref = mannwhitneyu(x, y, alternative="two-sided")
            self.assertEqual(u, ref.statistic)
            self.assertAlmostEqual(p, ref.pvalue, places=9, msg=(n1, n2, ties))


class Compare(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.base, self.new = sample_results(self.dir)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_planted_regression_is_flagged_and_noise_is_not(self):
        result = bench.compare(self.base, self.new, threshold=0.10, alpha=0.05)
        rows = {r["name"]: r for r in result["rows"]}
        self.assertTrue(rows[PLANTED]["regression"])
        self.assertAlmostEqual(rows[PLANTED]["change"], 0.2, delta=0.03)
        self.assertFalse(rows[STEADY]["regression"])
        self.assertFalse(rows[TORCH]["regression"])
        self.assertNotIn(f"model/gemm m=8,n=4,k=8/{DENSE_ID}", rows)  # a model is not gated
        self.assertEqual(bench.main(["compare", self.base, self.new]), 1)

    def test_unchanged_rerun_passes(self):
        self.assertEqual(bench.main(["compare", self.base, self.base]), 0)
        # and a rerun with fresh noise of the same distribution
        rng = random.Random(99)
        rerun = write_run(self.dir, "20261203T000000Z-cccccccc", "2026-12-03T00:00:00Z",
                          {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 400.0), TORCH: noisy(rng, 100.0)})
        self.assertEqual(bench.main(["compare", self.base, rerun]), 0)

    def test_what_a_user_would_run_instead_is_shown_but_not_gated(self):
        # LibTorch's time moves with the machine, not with this code: 30% slower is no regression
        rng = random.Random(7)
        base = write_run(self.dir, "20261206T000000Z-ffffffff", "2026-12-06T00:00:00Z",
                         {TORCH: noisy(rng, 100.0), STEADY: noisy(rng, 1000.0)})
        slower = write_run(self.dir, "20261207T000000Z-99999999", "2026-12-07T00:00:00Z",
                           {TORCH: noisy(rng, 130.0), STEADY: noisy(rng, 1000.0)})
        rows = {r["name"]: r for r in bench.compare(base, slower)["rows"]}
        self.assertLess(rows[TORCH]["p"], 0.05)
        self.assertGreater(rows[TORCH]["change"], 0.2)
        self.assertFalse(rows[TORCH]["gated"])
        self.assertFalse(rows[TORCH]["regression"])
        self.assertTrue(rows[STEADY]["gated"])
        self.assertEqual(bench.main(["compare", base, slower]), 0)

    def test_a_change_within_the_history_spread_passes_and_one_beyond_it_is_flagged(self):
        # A benchmark at 400 or 480 by run (a bimodal one): base 400, new 480 is +20%, but an earlier
        # run was 480 too, so it passes with the history and is flagged without; 600 is flagged.
        rng = random.Random(13)
        runs = [write_run(self.dir, f"2026121{i}T000000Z-{i}{i}{i}{i}{i}{i}{i}{i}", f"2026-12-1{i}T00:00:00Z",
                          {PLANTED: noisy(rng, t)}) for i, t in enumerate((480.0, 400.0, 480.0, 600.0))]
        slow, base, new, planted = runs
        self.assertTrue(bench.compare(base, new)["rows"][0]["regression"])
        row = bench.compare(base, new, history=[slow, base])["rows"][0]
        self.assertLess(row["p"], 0.05)
        self.assertAlmostEqual(row["vs_slowest"], 0.0, delta=0.03)
        self.assertFalse(row["regression"])
        self.assertTrue(bench.compare(base, planted, history=[slow, base, new])["rows"][0]["regression"])
        # the command line takes the runs of a folder before NEW as the history
        self.assertEqual(bench.main(["compare", base, new, "--history", self.dir]), 0)
        self.assertEqual(bench.main(["compare", base, planted, "--history", self.dir]), 1)
        self.assertEqual(bench.main(["compare", base, new, "--history", self.dir, "--window", "0"]), 2)

    def test_a_significant_change_under_the_threshold_passes(self):
        rng = random.Random(5)
        slower = write_run(self.dir, "20261204T000000Z-dddddddd", "2026-12-04T00:00:00Z",
                           {PLANTED: [t * 1.05 for t in noisy(rng, 400.0, rel=0.001)]})
        base = write_run(self.dir, "20261205T000000Z-eeeeeeee", "2026-12-05T00:00:00Z",
                         {PLANTED: noisy(rng, 400.0, rel=0.001)})
        row = bench.compare(base, slower, threshold=0.10)["rows"][0]
        self.assertLess(row["p"], 0.05)
        self.assertFalse(row["regression"])
        self.assertTrue(bench.compare(base, slower, threshold=0.02)["rows"][0]["regression"])

    def run_main(self, *args):
        """(exit code, stdout lines, stderr lines) of `python3 -m mcore_twin.bench ARGS`."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = bench.main(list(args))
        return rc, out.getvalue().splitlines(), err.getvalue().splitlines()

    def test_metric_decides_the_verdict(self):
        # A slower wall clock with the same CPU time (a loaded machine) is a real_time regression
        # only; more CPU time in the same wall clock (work spread onto idle threads) a cpu_time one.
        rng = random.Random(17)
        t = {PLANTED: noisy(rng, 400.0)}
        base = write_run(self.dir, "20261208T000000Z-a0a0a0a0", "2026-12-08T00:00:00Z", t)
        wall = write_run(self.dir, "20261209T000000Z-b0b0b0b0", "2026-12-09T00:00:00Z", {PLANTED: noisy(rng, 480.0)},
                         cpu_times_by_name={PLANTED: noisy(rng, 400.0)})
        cpu = write_run(self.dir, "20261210T000000Z-c0c0c0c0", "2026-12-10T00:00:00Z", {PLANTED: noisy(rng, 400.0)},
                        cpu_times_by_name={PLANTED: noisy(rng, 480.0)})
        self.assertEqual(bench.main(["compare", base, wall]), 1)  # real_time by default
        self.assertEqual(bench.main(["compare", base, wall, "--metric", "real_time"]), 1)
        self.assertEqual(bench.main(["compare", base, wall, "--metric", "cpu_time"]), 0)
        self.assertEqual(bench.main(["compare", base, cpu, "--metric", "real_time"]), 0)
        self.assertEqual(bench.main(["compare", base, cpu, "--metric", "cpu_time"]), 1)
        row = bench.compare(base, cpu, metric="cpu_time")["rows"][0]
        self.assertAlmostEqual(row["change"], 0.2, delta=0.03)

    def test_history_window_decides_the_verdict(self):
        # A run at 480 six runs before NEW, then five at 400: NEW at 480 is within the spread of a
        # 6-run window, beyond that of the default 5. A run after NEW (at 480) is never history.
        rng = random.Random(23)
        results = os.path.join(self.dir, "history")
        times = (480.0, 400.0, 400.0, 400.0, 400.0, 400.0, 480.0, 480.0)
        runs = [write_run(results, f"2026120{i}T000000Z-{i}{i}{i}{i}{i}{i}{i}{i}", f"2026-12-0{i}T00:00:00Z",
                          {PLANTED: noisy(rng, t)}) for i, t in enumerate(times, start=1)]
        base, new = runs[5], runs[6]
        self.assertEqual(bench.main(["compare", base, new]), 1)
        self.assertEqual(bench.main(["compare", base, new, "--history", results]), 1)  # window 5: 400 only
        self.assertEqual(bench.main(["compare", base, new, "--history", results, "--window", "5"]), 1)
        self.assertEqual(bench.main(["compare", base, new, "--history", results, "--window", "6"]), 0)
        self.assertEqual(bench.main(["compare", base, new, "--history", results, "--window", "2"]), 1)
        row = bench.compare(base, new, history=runs[1:6])["rows"][0]
        self.assertTrue(row["regression"])
        self.assertFalse(bench.compare(base, new, history=runs[0:6])["rows"][0]["regression"])

    def test_errored_benchmark_fails_the_gate(self):
        # A benchmark that errors measures nothing: it would pass any regression, in NEW alone or in
        # both runs alike. A GPU benchmark's "no GPU: ..." skip (bench_util.h) is no error.
        rng = random.Random(29)
        gpu = f"optimized/layer/{DENSE_ID}"
        base = write_run(self.dir, "20261211T000000Z-d0d0d0d0", "2026-12-11T00:00:00Z",
                         {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 400.0)}, errored={gpu: "no GPU: none found"})
        broken = write_run(self.dir, "20261212T000000Z-e0e0e0e0", "2026-12-12T00:00:00Z", {STEADY: noisy(rng, 1000.0)},
                           errored={PLANTED: "layer result is wrong", gpu: "no GPU: driver too old"})
        rc, out, _ = self.run_main("compare", base, broken)
        self.assertEqual(rc, 1)
        self.assertEqual([line for line in out if line.startswith("FAIL")],
                         [f"FAIL: {PLANTED}: errored in NEW: layer result is wrong"])
        self.assertEqual(self.run_main("compare", broken, broken)[0], 1)  # broken in both: still broken
        rerun = write_run(self.dir, "20261213T000000Z-f0f0f0f0", "2026-12-13T00:00:00Z",
                          {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 400.0)}, errored={gpu: "no GPU: none found"})
        rc, out, _ = self.run_main("compare", base, rerun)
        self.assertEqual((rc, [line for line in out if line.startswith("FAIL")]), (0, []))
        self.assertEqual(bench.compare(base, rerun)["failures"], [])

    def test_disappeared_benchmark_fails_the_gate(self):
        rng = random.Random(31)
        gpu = f"optimized/layer/{DENSE_ID}"
        base = write_run(self.dir, "20261215T000000Z-b1b1b1b1", "2026-12-15T00:00:00Z",
                         {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 400.0), TORCH: noisy(rng, 100.0)},
                         errored={gpu: "no GPU: none found"})
        gone = write_run(self.dir, "20261216T000000Z-c1c1c1c1", "2026-12-16T00:00:00Z", {STEADY: noisy(rng, 1000.0)})
        rc, out, _ = self.run_main("compare", base, gone)
        self.assertEqual(rc, 1)
        failed = sorted(line.split(": ")[1] for line in out if line.startswith("FAIL"))
        self.assertEqual(failed, sorted([PLANTED, TORCH, gpu]))
        for line in out:
            if line.startswith("FAIL"):
                self.assertIn("in BASE, not in NEW", line)
        self.assertEqual(len(bench.compare(base, gone)["failures"]), 3)
        # a benchmark new in NEW is no failure (nor the GPU one, skipped there)
        self.assertEqual(self.run_main("compare", gone, base)[0], 0)
        # NEW ran with ci/bench --filter: what the filter leaves out is not missing, what it keeps is
        self.assertEqual(self.run_main("compare", base, gone, "--filter", "^reference/layer/")[0], 0)
        self.assertEqual(self.run_main("compare", base, gone, "--filter=-reference/mlp/")[0], 1)  # TORCH, gpu
        kept = bench.compare(base, gone, benchmark_filter="-(" + "|".join(map(re.escape, [PLANTED, TORCH, gpu])) + ")")
        self.assertEqual(kept["failures"], [])

    def test_single_repetition_is_refused(self):
        # p would be nan, and nan < alpha is false: one repetition would pass any slow-down
        rng = random.Random(37)
        one = write_run(self.dir, "20261217T000000Z-d1d1d1d1", "2026-12-17T00:00:00Z",
                        {STEADY: noisy(rng, 1000.0), PLANTED: [400.0]})
        slower = write_run(self.dir, "20261218T000000Z-e1e1e1e1", "2026-12-18T00:00:00Z",
                           {STEADY: noisy(rng, 1000.0), PLANTED: noisy(rng, 800.0)})
        for args in ((one, slower), (slower, one)):
            rc, out, err = self.run_main("compare", *args)
            self.assertEqual(rc, 2)
            self.assertEqual(out, [])
            self.assertEqual(len(err), 1, err)
            self.assertIn(PLANTED, err[0])
            self.assertIn("repetition", err[0])
        with self.assertRaises(bench.BenchError):
            bench.compare(one, slower)

    def test_units_are_normalised(self):
        ms = os.path.join(self.dir, "ms.json")
        with open(ms, "w") as f:
            json.dump(gbench_json({PLANTED: [0.4] * 3}, unit="ms"), f)
        us = os.path.join(self.dir, "us.json")
        with open(us, "w") as f:
            json.dump(gbench_json({PLANTED: [400.0] * 3}, unit="us"), f)
        self.assertAlmostEqual(bench.compare(ms, us)["rows"][0]["change"], 0.0, places=12)

    def test_bad_input_exits_2(self):
        self.assertEqual(bench.main(["compare", os.path.join(self.dir, "missing"), self.new]), 2)
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            f.write("{\"not\": \"gbench\"}")
        self.assertEqual(bench.main(["compare", bad, self.new]), 2)


class Dashboard(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        sample_results(self.dir)
        self.page = os.path.join(self.dir, "dashboard.html")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_page_builds_from_sample_runs(self):
        if not os.path.isfile(bench.CHARTJS_DEFAULT):
            optional(self, "libjs-chart.js not installed")
        data = bench.build_dashboard(self.dir, self.page)
        self.assertEqual(len(data["labels"]), 2)
        self.assertEqual(set(data["series"]), {STEADY, PLANTED, TORCH})
        self.assertEqual(list(data["accuracy"].values()), [[0.25, 0.5]])  # the unsupported row has no share
        ratio = [r for r in data["ratios"] if r["op"] == "layer"]
        self.assertEqual(len(ratio), 1)
        self.assertAlmostEqual(ratio[0]["ratio"], 10.0, delta=1.0)
        # reference and LibTorch of one op and shape: one chart, a line each
        layer = [c for c in bench.time_charts(data["series"]) if c["group"] == "dense layer"]
        self.assertEqual([[line["label"] for line in c["lines"]] for c in layer], [["libtorch", "reference"]])
        with open(self.page) as f:
            text = f.read()
        self.assertIn("Chart.js v3", text)  # inlined, no external script
        self.assertNotRegex(text, r"<script[^>]+src=")
        self.assertIn("REGRESSION", text)

    def test_missing_chartjs_is_a_clear_error(self):
        self.assertEqual(bench.main(["dashboard", self.dir, "-o", self.page, "--chartjs", "/nonexistent.js"]), 2)

    def test_every_kind_of_row_is_charted(self):
        root = os.path.join(self.dir, "every-kind")
        dashboard_results(root)
        data = bench.dashboard_data(root)
        self.assertEqual(bench.chart_counts(data), EXPECTED_CHARTS)
        # accuracy: tables (no bound) and unsupported rows have no share to plot
        self.assertEqual(sorted(data["accuracy"]), sorted(
            ["dense gpt [bf16, sim, tp=1]", "dense_layer dense_ln_mha_gelu_bias [fp32, cpu, tp=1]",
             "dense_layer dense_ln_mha_gelu_bias [fp32, sim, tp=1]",
             "dense_layer dense_ln_mha_gelu_bias [fp32, sim, tp=2]"]))
        realsize = data["sections"][0]
        self.assertEqual(realsize["id"], "realsize")
        lines = {line["label"]: line["data"] for line in realsize["charts"][0]["lines"]}
        self.assertEqual(set(lines), {"reference", "optimized_sim"})
        self.assertAlmostEqual(lines["optimized_sim"][1], 5.0, delta=0.5)  # each run's ratio
        # the cost model's case ids without Google Benchmark's suffixes
        self.assertEqual({r["case"] for r in data["roofline"]}, {DENSE_ID})


# The suites' case ids (bench_reference_layers) in two shapes, each in bf16 and fp32.
SUITE_DENSE = [
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask=causal,"
    "s=64,b=2,dtype={},tp=1,sp=0,drop=0,seed=1)",
    "dense(h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,"
    "s=64,b=2,dtype={},tp=1,sp=0,drop=0,seed=2)",
]
SUITE_MOE = "moe(h=256,a=8,E=8,topk=2,moe_ffn=512,act=silu,glu=1,dispatcher=alltoall,s=64,b=2,dtype=bf16,seed=1)"
SUITE_DENSE_OPS = ["input_layernorm", "linear_qkv", "core_attention", "linear_proj", "self_attn_bda",
                   "pre_mlp_layernorm", "mlp", "mlp_bda", "layer"]
SUITE_BM = [f"BM_ReferenceDenseLayer/cpu{i}" for i in (0, 1)] + [
    f"BM_OptimizedDenseLayer/gpu{i}/manual_time" for i in (0, 1, 2)] + [
    "BM_OptimizedMlaLayer/deepseek-v3/manual_time", "BM_ReferenceDenseLayerBackward/cpu0",
    "BM_ReferenceDenseLayerBackward/cpu1", "BM_ReferenceDenseLayerForwardBackward/cpu0",
    "BM_ReferenceDenseLayerForwardBackward/cpu1", "BM_OptimizedDenseLayerBackward/gpu0/manual_time",
    "BM_OptimizedDenseLayerBackward/gpu1/manual_time"] + [f"BM_MoE{op}" for op in (
        "Router", "Permute", "GroupedGemm", "Unpermute", "Layer", "RouterBackward", "LayerBackward")] + [
    "BM_RetroFirstLayer", "BM_RetroBlock6", "BM_RetroFirstLayerForwardBackward", "BM_RetroBlock6ForwardBackward"] + [
    f"BM_ExpertGemmGpu/mode:{i}/manual_time" for i in (0, 1, 2)] + [
    "BM_RmsNormSimLaunch/1/real_time", "BM_RmsNormSimLaunch/0/real_time", "BM_TwinHelp/iterations:30/manual_time",
    "BM_TwinFixture/iterations:10/manual_time", "BM_TwinHelpVendorLibsPreloaded/iterations:30/manual_time"]


def suite_names():
    """The names the suites (bench/) give their benchmarks, as --benchmark_list_tests lists them."""
    names = [f"{impl}/{op}/{case.format(dtype)}{suffix}" for case in SUITE_DENSE for dtype in ("bf16", "fp32")
             for op in SUITE_DENSE_OPS
             for impl, suffix in (("reference", ""), ("reference_fast", "/manual_time"), ("libtorch", ""))]
    names += [f"reference/{op}/{SUITE_MOE}" for op in ("router", "dispatch", "experts", "combine", "moe_layer")]
    names += ["reference/retro_first_layer/retro_first_layer_divisible",
              "reference/retro_later_layer/retro_later_layer_divisible",
              "reference/retro_block/retro_block_6layers_nondivisible"]
    return names + SUITE_BM


class Grouping(unittest.TestCase):
    """The time charts: one per layer kind and op, and shape; lines labelled by what differs."""

    def check_charts(self, charts, names):
        """Every benchmark a line of one chart; labels short and distinct within a chart."""
        ids = [line["id"] for c in charts for line in c["lines"]]
        self.assertEqual(sorted(ids), sorted(names))
        for c in charts:
            labels = [line["label"] for line in c["lines"]]
            self.assertEqual(len(set(labels)), len(labels), c["title"])
            self.assertLessEqual(max(map(len, labels)), 40, labels)
            self.assertLessEqual(len(c["title"]), 80, c["title"])

    def test_names_parse_into_kind_op_shape_and_fields(self):
        p = bench.parse_bench_name(f"reference_fast/mlp/{DENSE_ID}/manual_time")
        self.assertEqual((p["impl"], p["op"], p["kind"], p["shape"]),
                         ("reference_fast", "mlp", "dense", "h=8 a=2 g=2 d=4 ffn=16 s=4 b=1"))
        self.assertEqual((p["fields"]["dtype"], p["fields"]["norm"]), ("bf16", "ln"))
        p = bench.parse_bench_name("BM_OptimizedDenseLayer/gpu1/manual_time")
        self.assertEqual((p["impl"], p["op"], p["kind"], p["shape"], p["fields"]),
                         ("optimized", "DenseLayer", "", "", {"args": "gpu1"}))
        p = bench.parse_bench_name("BM_TwinHelp/iterations:30/manual_time")
        self.assertEqual((p["impl"], p["op"], p["fields"]), ("", "TwinHelp", {"args": ""}))
        p = bench.parse_bench_name("megatron/layer_fwd_bwd/llama3-8b:s1024")
        self.assertEqual((p["impl"], p["op"], p["kind"], p["shape"]),
                         ("megatron", "layer_fwd_bwd", "", "llama3-8b:s1024"))

    def test_suite_names_make_tens_of_charts(self):
        names = suite_names()
        charts = bench.time_charts({n: [1e5, 1.1e5] for n in names})
        self.check_charts(charts, names)
        counts = {}
        for c in charts:
            counts[c["group"]] = counts.get(c["group"], 0) + 1
        for op in SUITE_DENSE_OPS:
            self.assertEqual(counts[f"dense {op}"], 2)  # two shapes
        self.assertEqual(counts["moe router"], 1)
        self.assertEqual(counts["DenseLayer"], 1)  # reference cpu0, cpu1 and optimized gpu0-2
        self.assertEqual(len(charts), 2 * 9 + 5 + 3 + 20)
        self.assertGreater(len(names), 140)
        mlp = [c for c in charts if c["group"] == "dense mlp" and "ffn=704" in c["shape"]][0]
        self.assertEqual(mlp["title"], "dense mlp · h=256 a=8 g=2 d=32 ffn=704 s=64 b=2")
        self.assertEqual([line["label"] for line in mlp["lines"]], [
            "libtorch bf16", "libtorch fp32", "reference bf16", "reference fp32", "reference_fast bf16",
            "reference_fast fp32"])
        # colour per implementation, dash per dtype
        self.assertEqual([(line["color"], line["dash"]) for line in mlp["lines"]],
                         [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])

    def test_live_suite_names(self):
        """The names the built suites list (bench_cost_model aside: its model/ rows are no chart, and
        listing them runs the model, minutes on a loaded machine)."""
        bin_dir = os.environ.get("TWIN_BENCH_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))
        suites = sorted(f for f in glob.glob(os.path.join(bin_dir, "bench_*")) if not f.endswith("bench_cost_model"))
        if not suites:
            self.skipTest(f"no built suites in {bin_dir}")
        names = []
        for suite in suites:
            out = subprocess.run([suite, "--benchmark_list_tests"], capture_output=True, text=True, timeout=120)
            self.assertEqual(out.returncode, 0, f"{suite}: {out.stderr}")
            names += out.stdout.split()
        charts = bench.time_charts({n: [1e5] for n in names})
        self.check_charts(charts, names)
        self.assertGreater(len(names), 100)
        self.assertLessEqual(len(charts), 60)

    def test_labels_say_what_differs(self):
        fields = [{"impl": "reference", "dtype": "bf16", "norm": "ln"},
                  {"impl": "reference", "dtype": "fp32", "norm": "rms"}]
        self.assertEqual(bench.short_labels(fields), ["bf16 norm=ln", "fp32 norm=rms"])
        self.assertEqual(bench.short_labels([{"impl": "reference", "dtype": "bf16"}]), ["reference"])
        self.assertEqual(bench.short_labels([{"impl": "", "args": ""}]), ["median"])


class RealSize(unittest.TestCase):
    """python -m mcore_twin.realsize's rows (megatron/, reference/, optimized_sim/ of one op and case)
    become each twin's time over Megatron-Core's, listed first on the page."""

    def test_ratios_over_megatron_lead_the_page(self):
        root = tempfile.mkdtemp()
        try:
            case = "layer_fwd_bwd/llama3-8b:s1024"
            run = write_run(root, "20261203T000000Z-cccccccc", "2026-12-03T00:00:00Z", {STEADY: [1000.0, 1010.0]})
            with open(os.path.join(run, "bench_realsize.json"), "w") as f:
                json.dump(gbench_json({f"megatron/{case}": [8.0, 8.4], f"reference/{case}": [24.0, 25.2],
                                       f"optimized_sim/{case}": [40.0, 42.0]}, unit="s"), f)
            rows = {r["twin"]: r for r in bench.megatron_ratios(run)}
            self.assertEqual(set(rows), {"reference", "optimized_sim"})
            self.assertAlmostEqual(rows["reference"]["ratio"], 3.0)
            self.assertAlmostEqual(rows["optimized_sim"]["ratio"], 5.0)
            page = bench.build_page(bench.dashboard_data(root), "")
            self.assertIn("5.00x", page)
            self.assertLess(page.index("Real-size layers"), page.index("Latest run against the one before"))
        finally:
            shutil.rmtree(root)


LLAMA_ID = ("dense(h=8,a=2,g=1,d=4,ffn=12,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,"
            "s=4,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=2)")
MOE_ID = "moe(h=8,a=2,E=4,topk=2,moe_ffn=8,act=silu,glu=1,dispatcher=alltoall,s=4,b=1,dtype=bf16,seed=1)"

# What the page must draw from dashboard_results: {section: {group: number of charts}}.
EXPECTED_CHARTS = {
    "realsize": {"real-size": 1},
    "libtorch": {"dense": 2},  # DENSE_ID's shape (bf16 and fp32) and LLAMA_ID's
    "time": {"dense layer": 2, "dense mlp": 2, "DenseLayer": 1, "MoERouter": 1, "TwinHelp": 1, "moe router": 1,
             "retro_block": 1, "layer_fwd_bwd": 1},
    "accuracy": {"reference": 1, "optimized (CUDA simulator)": 2},
}


def layer_names():
    """The suites' kinds of names (<impl>/<op>/<case id>, BM_ functions, Google Benchmark's
    suffixes) beside sample_results' three."""
    dense = (DENSE_ID, DENSE_ID.replace("dtype=bf16", "dtype=fp32"), LLAMA_ID)
    names = [f"{impl}/{op}/{case}{suffix}" for case in dense for op in ("layer", "mlp")
             for impl, suffix in (("reference", ""), ("libtorch", ""), ("reference_fast", "/manual_time"))]
    names += [f"reference/router/{MOE_ID}", "reference/retro_block/retro_block_6layers_nondivisible",
              "BM_ReferenceDenseLayer/cpu0", "BM_ReferenceDenseLayer/cpu1", "BM_MoERouter",
              "BM_TwinHelp/iterations:30/manual_time"]
    return [n for n in names if n not in (STEADY, PLANTED, TORCH)]


def check_row(layer, backend, tp, share, bound=0.01, dtype="fp32", status="pass"):
    return {"layer": layer, "dtype": dtype, "backend": backend, "tp": tp, "max_error": share * bound, "bound": bound,
            "share": share, "seconds": 0.1, "status": status, "detail": ""}


def dashboard_results(root):
    """sample_results' two runs with every kind of row the page shows: the suites' other names, a
    real-size run, the cost model's long kernel names and case ids, `twin check` rows of both twins
    (and a table and an unsupported row, which have no share)."""
    rng = random.Random(20261203)
    for i, run in enumerate(sample_results(root)):
        with open(os.path.join(run, "bench_layers.json"), "w") as f:
            # one repetition each (ci/bench --repetitions 1): the comparison's p is NaN
            json.dump(gbench_json({n: noisy(rng, 50.0 + 10 * k, n=1) for k, n in enumerate(layer_names())}), f)
        with open(os.path.join(run, "bench_realsize.json"), "w") as f:
            json.dump(gbench_json({f"{impl}/layer_fwd_bwd/tiny:s64": noisy(rng, t, n=3) for impl, t in
                                   (("megatron", 8.0), ("reference", 24.0), ("optimized_sim", 40.0))}, unit="s"), f)
        kernels = ("dot_product_attention_backward_dkv", "gemm m=1024,n=128,k=256", "total")
        with open(os.path.join(run, "bench_cost_model.json"), "w") as f:
            json.dump({"benchmarks": [{"name": f"model/{k}/{DENSE_ID}/iterations:1/manual_time", "run_type": "iteration",
                                       "real_time": 0.001, "cpu_time": 0.001, "time_unit": "us", "flops": 512.0,
                                       "bytes": 256.0, "FLOP/B": 2.0, "roofline_us": 0.001,
                                       "label": "MODEL H200 memory-bound"} for k in kernels]}, f)
        check = os.path.join(run, "check.json")
        with open(check) as f:
            data = json.load(f)
        data["rows"] += [check_row("dense_layer dense_ln_mha_gelu_bias", backend, tp, 0.1 * (i + 1))
                         for backend, tp in (("cpu", "1"), ("sim", "1"), ("sim", "2"))]
        data["rows"] += [check_row("layer_offset_table layer_offset_table", "cpu", "1", 0.0, bound=0.0, dtype="-"),
                         check_row("moe_layer live_1", "sim", "ep4", 0.0, bound=0.0, dtype="", status="unsupported")]
        with open(check, "w") as f:
            json.dump(data, f)


# Appended to the page after its own script: the layout as rendered, into <pre id="layout-probe">.
# Per table column its content width beside the widest word of its header and of its cells (in
# their fonts; a case id's words end at its commas, slashes and brackets, where it may wrap); the
# charts per section and group; the sections' order on the page; the legend's labels and titles.
LAYOUT_PROBE = r"""<script>
(function () {
  const probe = document.createElement('span');
  probe.style.cssText = 'position: absolute; visibility: hidden; white-space: nowrap';
  document.body.appendChild(probe);
  function widestWord(cell) {
    probe.style.font = getComputedStyle(cell).font;
    const words = cell.textContent.split(cell.classList.contains('id') ? /\s+|(?<=[,\/(])/ : /\s+/);
    let best = ['', 0];
    for (const word of words.filter(Boolean)) {
      probe.textContent = word;
      const width = probe.getBoundingClientRect().width;
      if (width > best[1]) best = [word, width];
    }
    return best;
  }
  function column(table, j) {
    const th = table.rows[0].cells[j], style = getComputedStyle(th);
    const [word, wordPx] = widestWord(th);
    let cell = ['', 0];
    for (const row of [...table.rows].slice(1)) {
      const w = widestWord(row.cells[j]);
      if (w[1] > cell[1]) cell = w;
    }
    return {header: th.textContent, word: word, word_px: wordPx, cell_word: cell[0], cell_word_px: cell[1],
            column_px: th.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)};
  }
  const tables = [...document.querySelectorAll('table')].map(table => ({
    section: table.closest('section').id,
    right: table.getBoundingClientRect().right,
    columns: [...table.rows[0].cells].map((_, j) => column(table, j))}));
  const charts = {};
  for (const box of document.querySelectorAll('.chart')) {
    const section = charts[box.dataset.section] = charts[box.dataset.section] || {};
    section[box.dataset.group] = (section[box.dataset.group] || 0) + 1;
  }
  const sections = [...document.querySelectorAll('body > section')].map(s => [s.id, s.getBoundingClientRect().top]);
  const legends = [...document.querySelectorAll('.legend li')].map(li => [li.textContent, li.title]);
  const out = document.createElement('pre');
  out.id = 'layout-probe';
  out.textContent = JSON.stringify({viewport: window.innerWidth, tables, charts, sections, legends});
  document.body.appendChild(out);
})();
</script>"""


def render(chromium, page, root, width=1400):
    """The DOM of the page after its scripts, in headless Chromium at `width` px."""
    profile = os.path.join(root, "profile")
    return subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}",
         f"--window-size={width},4000", "--virtual-time-budget=10000", "--dump-dom", "file://" + page],
        capture_output=True, text=True, timeout=120).stdout


def pre_json(dom, pre_id):
    m = re.search(rf'<pre id="{pre_id}">([^<]*)</pre>', dom)
    return json.loads(html.unescape(m.group(1))) if m else None


class Browser(unittest.TestCase):
    """The dashboard in headless Chromium (Debian `chromium`) at 1400 px, built from
    dashboard_results: it renders without errors, and its layout keeps the rules."""

    @classmethod
    def setUpClass(cls):
        cls.chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        cls.missing = not cls.chromium or not os.path.isfile(bench.CHARTJS_DEFAULT)
        if cls.missing:
            return
        cls.root = tempfile.mkdtemp()
        dashboard_results(cls.root)
        page = os.path.join(cls.root, "dashboard.html")
        cls.data = bench.build_dashboard(cls.root, page)
        with open(page) as f:
            text = f.read()
        with open(page, "w") as f:
            f.write(text.replace("</body></html>", LAYOUT_PROBE + "</body></html>"))
        cls.dom = render(cls.chromium, page, cls.root)
        cls.status, cls.layout = pre_json(cls.dom, "render-status"), pre_json(cls.dom, "layout-probe")

    @classmethod
    def tearDownClass(cls):
        if not cls.missing:
            shutil.rmtree(cls.root)

    def setUp(self):
        if self.missing:
            optional(self, "chromium or libjs-chart.js not installed")
        self.assertIsNotNone(self.status, "no render status in the DOM: the page script did not run")
        self.assertIsNotNone(self.layout, "no layout probe in the DOM")

    def test_renders_without_errors(self):
        self.assertEqual(self.status["errors"], [])
        charts = [(s["id"], c) for s in self.data["sections"] for c in s["charts"]]
        self.assertEqual(self.status["charts"], len(charts))
        self.assertEqual(self.status["rendered"], len(charts))
        for section, chart in charts:
            points = self.status["points"][f"{section}: {chart['title']}"]
            self.assertEqual(points, [2] * len(chart["lines"]))  # one per run
        regressions = re.search(r"<div id=\"regressions\">(.*?)</div>", self.dom, re.S).group(1)
        planted_row = [r for r in regressions.split("<tr") if PLANTED.replace(",", ",<wbr>").replace("/", "/<wbr>")
                       .replace("(", "(<wbr>") in r]
        self.assertEqual(len(planted_row), 1)
        self.assertIn("REGRESSION", planted_row[0])
        self.assertEqual(regressions.count("REGRESSION"), 1)

    def test_charts_by_group(self):
        """A chart per group and shape, not per benchmark: the page draws what dashboard_data says,
        and that is the fixture's groups."""
        self.assertEqual(self.layout["charts"], bench.chart_counts(self.data))
        self.assertEqual(self.layout["charts"], EXPECTED_CHARTS)

    def test_short_labels_with_the_full_id_on_hover(self):
        ids = {line["id"] for s in self.data["sections"] for c in s["charts"] for line in c["lines"]}
        for label, title in self.layout["legends"]:
            self.assertIn(title, ids)
            self.assertLessEqual(len(label), 40, label)
        self.assertIn(f"libtorch/mlp/{DENSE_ID}", [title for _, title in self.layout["legends"]])

    def test_no_column_narrower_than_its_header(self):
        """Nor than a word of its cells: no header, kernel name or number wraps inside a word (a
        case id only at its commas, slashes and brackets), and every table fits in the window."""
        self.assertEqual(self.layout["viewport"], 1400)
        self.assertEqual(len(self.layout["tables"]), 4)  # real-size, comparison, LibTorch, cost model
        for table in self.layout["tables"]:
            self.assertLessEqual(table["right"], self.layout["viewport"], f"{table['section']}: wider than the window")
            for col in table["columns"]:
                where = f"{table['section']}: column '{col['header']}' is {col['column_px']:.0f} px"
                header = f"its header word '{col['word']}' ({col['word_px']:.0f} px)"
                self.assertGreaterEqual(col["column_px"] + 1, col["word_px"], f"{where}, narrower than {header}")
                cell = f"its cell's word '{col['cell_word']}' ({col['cell_word_px']:.0f} px)"
                self.assertGreaterEqual(col["column_px"] + 1, col["cell_word_px"], f"{where}, narrower than {cell}")

    def test_real_size_section_first(self):
        ids = [section for section, _ in self.layout["sections"]]
        self.assertEqual(ids, ["realsize", "libtorch", "time", "accuracy", "comparison", "libtorch-latest",
                               "costmodel"])
        tops = [top for _, top in self.layout["sections"]]
        self.assertEqual(tops, sorted(tops))


if __name__ == "__main__":
    browser = "--browser" in sys.argv
    if browser:
        sys.argv.remove("--browser")
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for case in ([Browser] if browser else [MannWhitneyU, Compare, Dashboard, Grouping, RealSize]):
        suite.addTests(loader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    if not result.wasSuccessful():
        sys.exit(1)
    if result.skipped and result.testsRun == len(result.skipped):
        if os.environ.get("CI") == "true":
            print("CI=true: a missing optional dependency is an error", file=sys.stderr)
            sys.exit(1)
        sys.exit(77)
    sys.exit(0)
