# The Retro decoder layout for num_layers 1..96 as Megatron-Core itself builds it: runs the real
# megatron.core.models.retro.decoder_spec.get_retro_decoder_block_spec (pinned commit 93ddc247,
# unpacked from ../shared/megatron-core, imported through its mcore_shims.py) and reads each layer's
# spec: a RetroDecoderCrossAttention whose encoder_block_spec is set owns the encoder
# ('retro_with_encoder'), one without it is 'retro', an IdentityOp cross attention is 'gpt'. Writes a
# table in retro_decoder_layout_table.json's format (kind retro_layout_table), so the golden's
# handler reads it; tests/reference/retro/retro_decoder_layout_table_1_96.json is its output.
#
#   /usr/bin/python3 megatron_retro_layout_oracle.py SHIMS_DIR MEGATRON_DIR OUT.json
#   (SHIMS_DIR holds mcore_shims.py; MEGATRON_DIR holds megatron/core)
import json, os, sys

shims_dir, megatron_dir, out_path = sys.argv[1:4]
sys.path[:0] = [shims_dir, megatron_dir]
import mcore_shims  # noqa: E402  (first, before any megatron module)
import torch.distributed as dist  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29571")
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps  # noqa: E402

ps.initialize_model_parallel(1, 1)
mcore_shims.post_import_patches()
from megatron.core.models.retro import decoder_spec  # noqa: E402
from megatron.core.models.retro.config import RetroConfig  # noqa: E402
from megatron.core.models.retro.decoder_attention import RetroDecoderCrossAttention  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402


def kind(layer_spec):
    ca = layer_spec.submodules.cross_attention
    module = getattr(ca, "module", ca)
    if module is IdentityOp:
        return "gpt"
    assert module is RetroDecoderCrossAttention, module
    return "retro_with_encoder" if ca.params.get("encoder_block_spec") is not None else "retro"


entries = []
for n in range(1, 97):
    config = RetroConfig(num_layers=n, hidden_size=64, num_attention_heads=4, retro_chunk_length=4,
                         retro_split_preprocessing="98,2,0", use_cpu_initialization=True)
    try:
        spec = decoder_spec.get_retro_decoder_block_spec(config, use_transformer_engine=False)
    except Exception as e:  # Megatron's own error for too few layers
        entries.append({"num_layers": n, "error": f"{type(e).__name__}: {e}"})
        continue
    layers = [kind(s) for s in spec.layer_specs]
    retro = [i + 1 for i, k in enumerate(layers) if k != "gpt"]
    encoder = [i + 1 for i, k in enumerate(layers) if k == "retro_with_encoder"]
    assert len(encoder) == 1, (n, layers)
    entries.append({"num_layers": n, "layers": layers, "retro_layer_numbers": retro,
                    "encoder_layer_number": encoder[0]})

table = {
    "megatron_commit": "93ddc24720bb8d62ae68ced044ad59e1a95ead0f",
    "function": "megatron.core.models.retro.decoder_spec.get_retro_decoder_block_spec(config, "
                "use_transformer_engine=False)",
    "notes": "Written by tests/reference/retro/megatron_retro_layout_oracle.py. layers[i] is layer_number i+1: "
             "'gpt', 'retro', 'retro_with_encoder' (the first retro layer, which owns the retro encoder block). "
             "RetroConfig(hidden_size=64, heads=4, chunk_length=4, pp=1).",
    "kind": "retro_layout_table",
    "case": "retro_decoder_layout_table_1_96",
    "entries": entries,
}
with open(out_path, "w") as f:
    json.dump(table, f, indent=1)
    f.write("\n")
