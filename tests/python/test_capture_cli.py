"""Tests of the capture tool's errors (python/mcore_twin/cli.py), run as a user runs it:
`python -m mcore_twin.capture` in a subprocess on small JSON configs. Each bad input exits 2 with
exactly one line on stderr, `error: ...` naming the config field or option, and no traceback,
before Megatron-Core builds anything; an exception Megatron-Core raises is one line with exit 3; a
golden's own config still captures (exit 0), and every golden's config passes the check.

    PYTHONPATH=python /usr/bin/python3 tests/python/test_capture_cli.py
Needs torch for this Python (the CLI imports it); the cases that run Megatron-Core also need
it (../shared/megatron-core or $MCORE_SRC). Without them the cases skip and the run exits 77
(CTest's skip), unless CI=true: then a missing one fails.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

CI = os.environ.get("CI") == "true"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDENS = os.path.join(ROOT, "fixtures", "megatron-core")
SMALL_DENSE = os.path.join(GOLDENS, "dense_ln_mha_gelu_nobias.safetensors")  # h 64, s 16, b 2, fp32
SMALL_MOE = os.path.join(GOLDENS, "moe_top2_aux_allgather.safetensors")

try:
    import torch  # noqa: F401  (the CLI's import; checked here for a clear skip)
except ImportError:
    print("torch is not installed for this Python: the capture tool cannot run", file=sys.stderr)
    sys.exit(1 if CI else 77)

from mcore_twin import bootstrap, cli, st_io  # noqa: E402


def golden_config(path):
    _, meta = st_io.read(path)
    return json.loads(meta["config"])


def megatron_missing():
    """Why Megatron-Core cannot be found, or None."""
    try:
        bootstrap.find_megatron()
        return None
    except bootstrap.MegatronNotFound as e:
        return str(e)


class CaptureCli(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.dense = golden_config(SMALL_DENSE)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def need_megatron(self):
        why = megatron_missing()
        if why is None:
            return
        if CI:
            self.fail(f"CI=true: Megatron-Core is required: {why}")
        self.skipTest(why)

    def run_cli(self, cfg=None, *args, text=None, megatron=True, commit=None):
        """(exit code, stdout, stderr) of the CLI on `cfg` (a dict, or `text` as the file);
        megatron=False points MCORE_SRC at nothing, so only a check before Megatron-Core names the field;
        `commit` sets MCORE_COMMIT (which Megatron-Core runs)."""
        path = os.path.join(self.dir, "cfg.json")
        with open(path, "w") as f:
            f.write(text if text is not None else json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), PYTHONDONTWRITEBYTECODE="1")
        env.pop("MCORE_COMMIT", None)
        if commit:
            env["MCORE_COMMIT"] = commit
        env.pop("PYTHONWARNINGS", None)  # the CLI's own default: Megatron's import chatter kept off stderr
        if not megatron:
            env["MCORE_SRC"] = os.path.join(self.dir, "no-megatron-here")
        out = os.path.join(self.dir, "out.safetensors")
        p = subprocess.run([sys.executable, "-m", "mcore_twin.capture", "--config", path, "--seed", "3", "--out", out,
                            *args], capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
        return p.returncode, p.stdout, p.stderr

    def assert_bad_input(self, cfg, *names, args=(), text=None, megatron=False, commit=None):
        """Exit 2, one stderr line `error: ...` holding every one of `names`, nothing written. By
        default without Megatron-Core: the input is rejected before Megatron-Core is looked for (its
        own later errors, such as build.py's on an unknown field, do not count)."""
        rc, out, err = self.run_cli(cfg, *args, text=text, megatron=megatron, commit=commit)
        self.assertEqual(rc, 2, f"stdout {out!r}, stderr {err!r}")
        lines = err.splitlines()
        self.assertEqual(len(lines), 1, f"stderr is not one line: {err!r}")
        self.assertTrue(lines[0].startswith("error: "), lines[0])
        self.assertNotIn("Traceback", err)
        for name in names:
            self.assertIn(name, lines[0])
        self.assertFalse(os.path.exists(os.path.join(self.dir, "out.safetensors")))
        return lines[0]

    # ---- bad config: exit 2, one line naming the field

    def test_params_dtype_bf16_names_the_field_the_value_and_the_spellings(self):
        # the golden format spells the torch dtype's name; "bf16" was a KeyError from build.py
        line = self.assert_bad_input(dict(self.dense, params_dtype="bf16"), "params_dtype", '"bf16"')
        self.assertIn("float32, bfloat16, float16", line)

    def test_missing_num_layers(self):
        # Megatron divided by it: ZeroDivisionError in TransformerConfig's init
        cfg = dict(self.dense)
        del cfg["num_layers"]
        self.assert_bad_input(cfg, "num_layers", "missing")

    def test_unknown_field_name(self):
        self.assert_bad_input(dict(self.dense, hidden_sise=64), "hidden_sise", "unknown")

    def test_unknown_field_name_with_megatron(self):
        # neither a golden's config field nor one of TransformerConfig's (which config_full writes)
        self.need_megatron()
        line = self.assert_bad_input(dict(self.dense, hidden_sise=64), "hidden_sise", megatron=True)
        self.assertIn("nor a TransformerConfig field", line)
        rc, _, err = self.run_cli(dict(self.dense, fp8=None))  # a TransformerConfig field is taken
        self.assertEqual(rc, 0, err)

    def test_hidden_size_must_be_a_positive_integer(self):
        self.assert_bad_input(dict(self.dense, hidden_size=-64), "hidden_size", "-64", "positive integer")
        self.assert_bad_input(dict(self.dense, hidden_size=64.5), "hidden_size", "64.5", "positive integer")

    def test_query_groups_must_divide_the_heads(self):
        self.assert_bad_input(dict(self.dense, num_query_groups=3), "num_query_groups", "num_attention_heads")

    def test_moe_router_dtype_as_megatron_spells_it(self):
        # "float32" here would route in params_dtype without a word (the router casts for fp32 / fp64 only)
        cfg = dict(golden_config(SMALL_MOE), moe_router_dtype="float32")
        line = self.assert_bad_input(cfg, "moe_router_dtype", '"float32"')
        self.assertIn("fp32, fp64", line)

    def test_normalization_spelling(self):
        # Megatron builds a LayerNorm for anything but "RMSNorm"
        self.assert_bad_input(dict(self.dense, normalization="rmsnorm"), "normalization", "RMSNorm")

    def test_kind_and_config_disagree(self):
        self.assert_bad_input(self.dense, "num_moe_experts", "moe_layer", args=("--kind", "moe_layer"))
        dense = ("--kind", "dense_layer")
        self.assert_bad_input(golden_config(SMALL_MOE), "num_moe_experts", "dense_layer", args=dense)
        self.assert_bad_input(dict(self.dense, retro_chunk_length=4), "retro_chunk_length", args=dense)

    def test_option_the_kind_ignores(self):
        self.assert_bad_input(self.dense, "--padding-mask", "dense_layer", args=("--padding-mask",))

    def test_config_file_not_json(self):
        self.assert_bad_input(None, "--config", "cfg.json", "not JSON", text="{'hidden_size': 64,}")

    def test_config_not_an_object(self):
        self.assert_bad_input([self.dense], "--config", "JSON object")

    def test_bad_argument_is_one_line(self):
        self.assert_bad_input(self.dense, "--kind", "dense", args=("--kind", "dense"))

    # ---- good configs, and Megatron-Core's own errors

    def test_every_golden_config_passes_the_check(self):
        # without Megatron-Core: a golden's config holds only the fields the capture writes
        files = sorted(glob.glob(os.path.join(GOLDENS, "**", "*.safetensors"), recursive=True))
        shared = os.path.join(ROOT, "..", "shared", "fixtures")
        files += sorted(glob.glob(os.path.join(shared, "**", "*.safetensors"), recursive=True))
        self.assertGreater(len(files), 20)
        for path in files:
            cfg, kind, _ = cli.load_config(path)
            with self.subTest(golden=os.path.relpath(path, ROOT)):
                cli.check_config(cfg, kind)

    def test_small_golden_config_captures(self):
        self.need_megatron()
        rc, out, err = self.run_cli(self.dense)
        self.assertEqual(rc, 0, err)
        self.assertEqual(err, "")  # Megatron's import warnings stay off stderr
        self.assertIn("dense_layer", out)
        _, meta = st_io.read(os.path.join(self.dir, "out.safetensors"))
        self.assertEqual(meta["kind"], "dense_layer")
        written = json.loads(meta["config"])
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
            self.assertEqual(written[name], self.dense[name], name)

    # ---- which Megatron-Core: MCORE_COMMIT

    def test_unknown_megatron_commit_names_the_known_ones(self):
        self.assert_bad_input(self.dense, "abcdef0", "93ddc247, d98e8a64", megatron=True, commit="abcdef0")

    def test_current_commit_captures_what_it_has_and_names_what_it_lacks(self):
        self.need_megatron()
        current = os.path.join(ROOT, "..", "shared", "megatron-core-d98e8a64")
        if not os.path.isdir(current):
            self.fail(f"{current} is missing") if CI else self.skipTest(f"{current} is missing")
        moe = golden_config(SMALL_MOE)
        self.assertIs(moe["moe_use_legacy_grouped_gemm"], False)  # a January config: no longer a field
        rc, out, err = self.run_cli(moe, commit="d98e8a64")
        self.assertEqual(rc, 0, err)
        tensors, meta = st_io.read(os.path.join(self.dir, "out.safetensors"))
        self.assertEqual(meta["megatron_commit"], "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
        self.assertIn("aux.load_balancing_loss", tensors)  # the tracker moved into moe_logging there
        os.remove(os.path.join(self.dir, "out.safetensors"))
        self.assert_bad_input(dict(moe, moe_use_legacy_grouped_gemm=True), "moe_use_legacy_grouped_gemm", "d98e8a64",
                              megatron=True, commit="d98e8a64")  # fmt: skip
        retro, kind, _ = cli.load_config(os.path.join(GOLDENS, "retro_first_layer_divisible.safetensors"))
        self.assert_bad_input(retro, "Retro", "d98e8a64", "MCORE_COMMIT=93ddc247", args=("--kind", kind),
                              megatron=True, commit="d98e8a64")  # fmt: skip

    def test_megatron_error_is_one_line_exit_3(self):
        # top-1 softmax routing after top-k: TransformerConfig's own check, which the CLI leaves to it
        self.need_megatron()
        cfg = dict(golden_config(SMALL_MOE), moe_router_topk=1, moe_router_pre_softmax=False)
        rc, out, err = self.run_cli(cfg)
        self.assertEqual(rc, 3, f"stdout {out!r}, stderr {err!r}")
        lines = err.splitlines()
        self.assertEqual(len(lines), 1, f"stderr is not one line: {err!r}")
        prefix = "error: Megatron-Core failed on config field moe_router_pre_softmax: "
        self.assertTrue(lines[0].startswith(prefix), lines[0])
        self.assertIn("ValueError", lines[0])
        self.assertIn("transformer_config.py", lines[0])  # where it raised
        self.assertNotIn("Traceback", err)


if __name__ == "__main__":
    result = unittest.TextTestRunner(verbosity=2).run(unittest.TestLoader().loadTestsFromTestCase(CaptureCli))
    if not result.wasSuccessful():
        sys.exit(1)
    sys.exit(77 if result.skipped else 0)  # a case that did not run is not a pass
