"""Tests of python/mcore_twin/bench.py: the Mann-Whitney U test, the regression gate on synthetic
Google Benchmark results (a planted 20% regression is flagged, noise and an unchanged rerun are
not; --metric and the --history window each decide a verdict; a benchmark that errors or
disappears fails the gate, a single repetition is refused), bad input, the dashboard page built
from sample runs, and (--browser) that page loaded in headless Chromium: no errors, every chart
rendered with one point per run, the planted regression in the comparison table.

    PYTHONPATH=python python3 tests/python/test_bench_tool.py [--browser]
A test whose optional dependency (scipy, libjs-chart.js, chromium) is missing skips, and fails
when CI=true; exit 77 (CTest's skip) when every test skipped.
"""

import contextlib
import io
import itertools
import json
import math
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
        with open(self.page) as f:
            text = f.read()
        self.assertIn("Chart.js v3", text)  # inlined, no external script
        self.assertNotRegex(text, r"<script[^>]+src=")
        self.assertIn("REGRESSION", text)

    def test_missing_chartjs_is_a_clear_error(self):
        self.assertEqual(bench.main(["dashboard", self.dir, "-o", self.page, "--chartjs", "/nonexistent.js"]), 2)


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


class Browser(unittest.TestCase):
    """The dashboard in headless Chromium (Debian `chromium`)."""

    def test_renders_without_errors(self):
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if not chromium or not os.path.isfile(bench.CHARTJS_DEFAULT):
            optional(self, "chromium or libjs-chart.js not installed")
        root = tempfile.mkdtemp()
        try:
            sample_results(root)
            page = os.path.join(root, "dashboard.html")
            data = bench.build_dashboard(root, page)
            profile = os.path.join(root, "profile")
            out = subprocess.run(
                [chromium, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}",
                 "--virtual-time-budget=10000", "--dump-dom", "file://" + page],
                capture_output=True, text=True, timeout=120).stdout
            m = re.search(r'<pre id="render-status">([^<]*)</pre>', out)
            self.assertIsNotNone(m, "no render status in the DOM: the page script did not run")
            status = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
            self.assertEqual(status["errors"], [])
            n_charts = len(data["series"]) + len(data["accuracy"])
            self.assertEqual(status["charts"], n_charts)
            self.assertEqual(status["rendered"], n_charts)
            for name in list(data["series"]) + list(data["accuracy"]):
                self.assertEqual(status["points"][name], 2, name)  # one point per run
            regressions = re.search(r"<div id=\"regressions\">(.*?)</div>", out, re.S).group(1)
            planted_row = [r for r in regressions.split("<tr") if PLANTED.replace("&", "&amp;") in r]
            self.assertEqual(len(planted_row), 1)
            self.assertIn("REGRESSION", planted_row[0])
            self.assertEqual(regressions.count("REGRESSION"), 1)
        finally:
            shutil.rmtree(root)


if __name__ == "__main__":
    browser = "--browser" in sys.argv
    if browser:
        sys.argv.remove("--browser")
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for case in ([Browser] if browser else [MannWhitneyU, Compare, Dashboard]):
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
