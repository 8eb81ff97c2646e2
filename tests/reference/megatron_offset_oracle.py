# Differential oracle for the layer_offset_table kind, without PyTorch: executes Megatron's own
# Python text (read from a Megatron-LM checkout at the pinned commit 93ddc247) for
# get_transformer_layer_offset, get_num_layers_to_build, is_vp_first/last_stage and the pipeline
# part of TransformerConfig.__post_init__ (plus its pp > 0 assert and the num_layers init-method
# division) on plain namespaces, over a grid, and writes a table in layer_offset_table.json's
# format for `twin fixture --twin reference`. It reproduces the golden table exactly.
#
#   python3 megatron_offset_oracle.py MEGATRON_DIR NUM_LAYERS PP VP FIRST_LAST OUT.json
#   e.g. ... ~/Megatron-LM -1,0,1,2,3,4,5,6,7,8,9,10,12,16 0,1,2,3,4,5 None,0,1,2,3 None,-1,0,1,2,3,4 wide.json
import itertools, json, math, os, sys, textwrap, types

MEG = sys.argv.pop(1)
def meg(p): return os.path.join(MEG, p)

def extract_def(path, name):
    src = open(path).read().split('\n')
    start = next(i for i, l in enumerate(src) if l.startswith('def ' + name + '('))
    end = next(i for i in range(start + 1, len(src)) if src[i] and not src[i][0].isspace() and not src[i].startswith(')'))
    return '\n'.join(src[start:end])

class LayerType: decoder = 'decoder'
ns = {'Optional': __import__('typing').Optional, 'LayerType': LayerType,
      'parallel_state': types.SimpleNamespace(get_pipeline_model_parallel_rank=lambda: 0)}
exec(extract_def(meg('megatron/core/pipeline_parallel/utils.py'), 'is_vp_first_stage'), ns)
exec(extract_def(meg('megatron/core/pipeline_parallel/utils.py'), 'is_vp_last_stage'), ns)
utils_mod = types.ModuleType('megatron.core.pipeline_parallel.utils')
utils_mod.is_vp_first_stage = ns['is_vp_first_stage']
for m in ['megatron', 'megatron.core', 'megatron.core.pipeline_parallel']:
    sys.modules.setdefault(m, types.ModuleType(m))
sys.modules['megatron.core.pipeline_parallel.utils'] = utils_mod
ns['TransformerConfig'] = object
exec(extract_def(meg('megatron/core/transformer/transformer_layer.py'), 'get_transformer_layer_offset'), ns)
exec(extract_def(meg('megatron/core/transformer/transformer_block.py'), 'get_num_layers_to_build'), ns)

tc = open(meg('megatron/core/transformer/transformer_config.py')).read().split('\n')
# From the uneven-PP / embedding-loss conflict check up to the next
# 'if self.apply_query_key_layer_scaling:' (the pipeline checks).
start = next(i for i, l in enumerate(tc) if 'cannot be' in l and 'num_layers_in_first_pipeline_stage and' in l) - 7
assert tc[start].strip() == 'if (', tc[start]
end = next(i for i in range(start, len(tc)) if tc[i].strip() == 'if self.apply_query_key_layer_scaling:')
body = textwrap.dedent('\n'.join(tc[start:end]))
post = 'def pipeline_post_init(self):\n' + textwrap.indent(body, '    ') + '''
    assert (
        self.pipeline_model_parallel_size > 0
    ), "Pipeline model parallel size must be larger than 0"
    std = 0.02 / math.sqrt(2.0 * self.num_layers)
'''
ns['math'] = math
exec(post, ns)

def err(e): return {'error': type(e).__name__ + ': ' + str(e)}
def run(fn, *a):
    try: return fn(*a)
    except Exception as e: return err(e)

NL = [int(x) for x in sys.argv[1].split(',')]
PP = [int(x) for x in sys.argv[2].split(',')]
VP = [None if x == 'None' else int(x) for x in sys.argv[3].split(',')]
FL = [None if x == 'None' else int(x) for x in sys.argv[4].split(',')]
entries = []
for nl, pp, vp, first, last, emb, loss in itertools.product(NL, PP, VP, FL, FL, [False, True], [False, True]):
    cfg = dict(num_layers=nl, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
               account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    c = types.SimpleNamespace(pipeline_model_parallel_layout=None, **cfg)
    try:
        ns['pipeline_post_init'](c); config_error = None
    except Exception as e:
        config_error = type(e).__name__ + ': ' + str(e)
    results = []
    for pp_rank in range(max(pp, 1)):
        for vp_stage in [None] + (list(range(vp)) if vp else []):
            r = {'pp_rank': pp_rank, 'vp_stage': vp_stage}
            if config_error is None:
                r['offset'] = run(ns['get_transformer_layer_offset'], c, vp_stage, pp_rank)
                r['num_layers_to_build'] = run(ns['get_num_layers_to_build'], c, vp_stage, pp_rank)
            r['raw_offset'] = run(ns['get_transformer_layer_offset'], c, vp_stage, pp_rank)
            results.append(r)
    entries.append({'config': cfg, 'config_error': config_error, 'results': results})
json.dump({'kind': 'layer_offset_table', 'case': 'oracle', 'entries': entries}, open(sys.argv[5], 'w'))
print(len(entries), 'entries', sum(e['config_error'] is not None for e in entries), 'rejected')
