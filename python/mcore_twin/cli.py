"""`python -m mcore_twin.capture`: build a layer from a config and a seed, capture it as a golden.

    /usr/bin/python3 -m mcore_twin.capture --config cfg.json --seed 3 --out case.safetensors \\
        [--kind dense_layer|moe_layer|retro_decoder_layer_first|retro_decoder_layer|retro_block]

`--config` is a JSON object in the form of a golden's `__metadata__.config` (or a golden
`.safetensors` file, whose config, kind and layer number are taken). Exit codes: 0 written;
2 bad arguments or config; 3 Megatron-Core raised (its message is printed); 4 Megatron-Core's own
output is not finite (nothing written; a golden with a NaN proves nothing).
"""

import argparse
import json
import sys
import traceback

from . import bootstrap, st_io
from .capture import KINDS, CaptureError, NonFiniteError, capture_layer


def infer_kind(cfg):
    if cfg.get("num_moe_experts"):
        return "moe_layer"
    if cfg.get("retro_chunk_length"):
        raise CaptureError("a Retro config needs --kind (retro_decoder_layer_first, retro_decoder_layer, retro_block)")
    return "dense_layer"


def load_config(path):
    """(config dict, kind or None, layer_number or None) from a JSON file or a golden."""
    if path.endswith(".safetensors"):
        _, meta = st_io.read(path)
        if "config" not in meta:
            raise CaptureError(f"{path}: no __metadata__.config")
        ln = meta.get("layer_number")
        return json.loads(meta["config"]), meta.get("kind"), int(ln) if ln else None
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise CaptureError(f"{path}: the config must be a JSON object")
    return cfg, None, None


def capture_config(cfg, kind, seed, out, *, layer_number=None, grad_seed=None, case=None, padding_mask=False,
                   context_mask=False, explicit_mask=False, require_finite=True):  # fmt: skip
    """Builds `kind` from `cfg` and `seed` and captures it to `out` (the CLI and the live tests)."""
    state = bootstrap.bootstrap()
    from .build import build

    module, kw = build(kind, cfg, seed, layer_number=layer_number, padding_mask=padding_mask,
                       context_mask=context_mask, explicit_mask=explicit_mask)  # fmt: skip
    commit = state.get("commit")
    if commit and len(commit) < 40 and "93ddc24720bb8d62ae68ced044ad59e1a95ead0f".startswith(commit):
        commit = "93ddc24720bb8d62ae68ced044ad59e1a95ead0f"
    return capture_layer(
        module,
        out,
        kind=kind,
        grad_seed=seed if grad_seed is None else grad_seed,
        case=case,
        group="capture-cli",
        attn_mask_type=cfg.get("attn_mask_type"),
        megatron_commit=commit,
        require_finite=require_finite,
        **kw,
    )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mcore_twin.capture", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="config JSON (a golden's __metadata__.config) or a golden file")
    p.add_argument("--seed", type=int, required=True, help="seed of parameters, inputs and the upstream gradient")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--kind", choices=KINDS, help="default: from the golden, else moe_layer / dense_layer by config")
    p.add_argument("--layer-number", type=int, help="default: 1; Retro layers where the block spec puts them")
    p.add_argument("--grad-seed", type=int, help="seed of grad_in.output (default: --seed)")
    p.add_argument("--case", help="__metadata__.case (default: the file name)")
    p.add_argument("--padding-mask", action="store_true", help="MoE: a random padded tail per sequence")
    p.add_argument("--context-mask", action="store_true", help="Retro first layer / block: a random encoder mask")
    p.add_argument("--explicit-mask", action="store_true", help="dense / MoE causal: pass a causal + padding mask")
    p.add_argument("--allow-nonfinite", action="store_true", help="write the file even when Megatron's output is not finite")
    a = p.parse_args(argv)
    try:
        cfg, golden_kind, golden_layer = load_config(a.config)
        kind = a.kind or golden_kind or infer_kind(cfg)
        if "seq_length" not in cfg:
            raise CaptureError("the config needs seq_length (and micro_batch_size)")
    except (OSError, ValueError, CaptureError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        r = capture_config(cfg, kind, a.seed, a.out, layer_number=a.layer_number or golden_layer,
                           grad_seed=a.grad_seed, case=a.case, padding_mask=a.padding_mask,
                           context_mask=a.context_mask, explicit_mask=a.explicit_mask,
                           require_finite=not a.allow_nonfinite)  # fmt: skip
    except bootstrap.MegatronNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"not written: {e}", file=sys.stderr)
        return 4
    except CaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # Megatron-Core rejected the config or failed running it
        traceback.print_exc(limit=-3)
        print(f"Megatron-Core failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    n = sum(1 for k in r.tensors if k.startswith(("tap.", "tap_in.", "output.", "aux.", "state.")))
    print(f"{r.path}: {r.kind}, {len(r.tensors)} tensors ({n} compared)")
    return 0
