"""The virtual pipeline (VPP): Megatron-LM's `torch` format's model0, model1, ... chunks, and torch_dist's args.

With --num-virtual-stages-per-pipeline-rank V, each pipeline stage builds V model chunks, and the
chunks take the layers in turn: every stage's chunk 0, then every stage's chunk 1, ... (Megatron-
Core's get_transformer_layer_offset). A `torch` rank file holds `model0`, `model1`, ..., each chunk's
layers numbered from 0; torch_dist keys are global, and only the args (and the dp_reshardable
optimizer buckets, one grad buffer per chunk) know the chunks.

Checked without the framework, on a Megatron-DeepSpeed fixture (ms_llama, 6 layers, bf16 ZeRO state):
* `export --to megatron --pp 3 --vpp 2` writes model0 and model1 in every rank file, each chunk's
  layers the global layers LAYOUT gives (compared with the same export at PP 1), the args recording
  VPP 2, and distrib_optim.pt one grad buffer per chunk;
* it reads back (verify: the same model; converted to DeepSpeed at PP 1: every weight and optimizer
  state equal), and converts to PP 2 with 3 chunks and back; a tied embedding (ms_gpt2) has its
  replica in the last stage's last chunk, and reads back; `torch_dist --vpp 2` with dp_reshardable
  buckets reads back the same;
* layer counts VPP cannot split, VPP at PP 1, and rank files with differing chunks are refused in one
  line, nothing written.
With real Megatron-Core 0.19.1 (megatron_core_pypi.py, in the torch 2.6 chroot): LAYOUT (even, and
uneven with the first stage's layers given) is what its get_transformer_layer_offset and
get_num_layers_to_build give for every (stage, chunk). Skipped with one line without the chroot.

Run: /usr/bin/python3 tests/interop/test_megatron_vpp.py --reshard build/reshard
"""
import glob
import json
import os
import re
import sys

import torch

import interop_support as support
from interop_support import FAMILIES, FixtureTestCase, make_fixture
import megatron_core_pypi
import torch2_chroot

run = support.reshard
FIRST = '--decoder-first-pipeline-num-layers'

# (layers, PP, VPP, first stage's layers) -> each stage's chunks as (first global layer, layers), as
# Megatron-Core numbers them.
LAYOUT = {
    (6, 3, 2, None): [[(0, 1), (3, 1)], [(1, 1), (4, 1)], [(2, 1), (5, 1)]],
    (8, 2, 2, None): [[(0, 2), (4, 2)], [(2, 2), (6, 2)]],
    (8, 2, 4, None): [[(0, 1), (2, 1), (4, 1), (6, 1)], [(1, 1), (3, 1), (5, 1), (7, 1)]],
    (8, 3, 2, 4): [[(0, 2), (4, 2)], [(2, 1), (6, 1)], [(3, 1), (7, 1)]],
}

# Megatron-Core's own numbering of every case, printed as JSON.
OFFSETS = r'''
import json
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_block import get_num_layers_to_build
out = {}
for layers, pp, vpp, first in json.loads(%r):
    config = TransformerConfig(num_layers=layers, hidden_size=16, num_attention_heads=4, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    out[json.dumps([layers, pp, vpp, first])] = [
        [[get_transformer_layer_offset(config, vp_stage=v, pp_rank=p), get_num_layers_to_build(config, vp_stage=v, pp_rank=p)]
         for v in range(vpp)] for p in range(pp)]
print('OFFSETS', json.dumps(out))
'''


def rank_files(folder):
    return {os.path.basename(os.path.dirname(p)): torch.load(p, weights_only=False)
            for p in sorted(glob.glob(os.path.join(folder, 'iter_*', 'mp_rank_*', 'model_optim_rng.pt')))}


def layer_keys(model, layer):
    prefix = f'decoder.layers.{layer}.'
    return {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}


class VppTorchFormatTest(FixtureTestCase):

    def source(self, layers=6):
        if os.path.exists(self.path(f'ms{layers}')):
            return self.path(f'ms{layers}', 'global_step10')
        return make_fixture(self.path(f'ms{layers}'), **dict(FAMILIES['ms_llama'], L=layers, tp=1, pp=1, dp=1,
                                                           optimizer='bf16_zero'))

    def export(self, src, name, *flags, tp=1):
        out = self.path(name)
        p = run('export', src, out, '--to', 'megatron', '--tp', tp, *flags)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return out, p

    def assertChunksAre(self, chunked, flat, layout):
        """Every rank file of `chunked` holds model0.. with the global layers `layout` gives, equal to
        those layers of the PP 1 export `flat`."""
        whole = rank_files(flat)['mp_rank_00']['model']
        files = rank_files(chunked)
        self.assertEqual(len(files), len(layout))
        compared = 0
        for p, chunks in enumerate(layout):
            f = files[f'mp_rank_00_{p:03d}']
            self.assertNotIn('model', f)
            self.assertEqual(sorted(k for k in f if k.startswith('model')), [f'model{c}' for c in range(len(chunks))])
            self.assertEqual(f['args'].virtual_pipeline_model_parallel_size, len(chunks))
            for c, (first, count) in enumerate(chunks):
                model = f[f'model{c}']
                self.assertEqual(layer_keys(model, count), {}, f'stage {p} chunk {c} holds more than {count} layers')
                for local in range(count):
                    got, want = layer_keys(model, local), layer_keys(whole, first + local)
                    self.assertEqual(sorted(got), sorted(want))
                    for key in want:
                        self.assertTrue(torch.equal(got[key], want[key]), f'stage {p} chunk {c} layer {local}: {key}')
                        compared += 1
            self.assertEqual('embedding.word_embeddings.weight' in f['model0'], p == 0)
            self.assertEqual('output_layer.weight' in f[f'model{len(chunks) - 1}'], p == len(layout) - 1)
        return compared

    def assertSameAsSource(self, src, folder):
        back = self.path(os.path.basename(folder) + '_ds', 'global_step10')
        p = run('convert', '--to', 'deepspeed', folder, back, '--tp', 1, '--pp', 1, '--dp', 1, '--vocab-size',
                FAMILIES['ms_llama']['V'], '--no-update-latest')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('verify', src, back)
        # Megatron's formats carry the learning-rate scheduler, not the sample counter.
        self.assertEqual(re.findall(r'differs: (.*)', p.stdout), ['global_samples differs'], p.stdout)
        self.assertNotIn('elements differ', p.stdout)
        self.assertEqual(re.findall(r'verify: (\d+) tensors', p.stdout),
                         re.findall(r'verify: (\d+) tensors', run('verify', src, src).stdout))

    def test_chunks_hold_the_interleaved_layers(self):
        compared = 0
        for (layers, pp, vpp, first), layout in LAYOUT.items():
            with self.subTest(layers=layers, pp=pp, vpp=vpp, first=first):
                src = self.source(layers)
                flat = self.path(f'flat{layers}')
                if not os.path.exists(flat):
                    self.export(src, f'flat{layers}', '--pp', 1)
                flags = ['--pp', pp, '--vpp', vpp] + ([FIRST, first] if first else [])
                chunked, p = self.export(src, f'vpp{layers}_{pp}_{vpp}_{first}', *flags)
                self.assertIn(f'--num-virtual-stages-per-pipeline-rank {vpp}', p.stdout)
                compared += self.assertChunksAre(chunked, flat, layout)
                self.assertSameAsSource(src, chunked)
        print(f'compared {compared} layer tensors', file=sys.stderr)

    def test_distrib_optim_has_a_grad_buffer_per_chunk(self):
        src = self.source()
        mlm, _ = self.export(src, 'mlm', '--pp', 3, '--vpp', 2)
        for p in range(3):
            state = torch.load(glob.glob(os.path.join(mlm, 'iter_*', f'mp_rank_00_{p:03d}', 'distrib_optim.pt'))[0],
                               weights_only=False)
            self.assertEqual(sorted(k for k in state if k != 'buckets_coalesced'), [0, 1])
            f = rank_files(mlm)[f'mp_rank_00_{p:03d}']
            for c in (0, 1):
                (dtypes, buffer), = state[c].items()
                numel = sum(v.numel() for k, v in f[f'model{c}'].items() if isinstance(v, torch.Tensor) and v.numel())
                # Each parameter starts at a multiple of 64 elements: the buffer holds the chunk's and no more.
                self.assertGreaterEqual(buffer['numel_unpadded'], numel)
                self.assertLess(buffer['numel_unpadded'], numel + 64 * len(f[f'model{c}']))

    def test_chunks_convert_to_other_layouts_and_back(self):
        src = self.source()
        mlm, _ = self.export(src, 'mlm', '--pp', 3, '--vpp', 2)
        # PP 3 x VPP 2 -> PP 2 x VPP 3 (one layer per chunk) -> torch_dist at PP 3 x VPP 2.
        other = self.path('pp2_vpp3')
        p = run('convert', mlm, other, '--pp', 2, '--vpp', 3, '--vocab-size', FAMILIES['ms_llama']['V'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(sorted(k for k in rank_files(other)['mp_rank_00_001'] if k.startswith('model')),
                         ['model0', 'model1', 'model2'])
        self.assertSameAsSource(src, other)
        td = self.path('td')
        p = run('export', other, td, '--to', 'torch_dist', '--tp', 1, '--pp', 3, '--vpp', 2, '--optimizer-layout',
                'dp_reshardable', '--dp', 2, '--vocab-size', FAMILIES['ms_llama']['V'])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        p = run('inspect', td)
        self.assertIn('layout dp_reshardable', p.stdout)
        self.assertSameAsSource(src, td)
        # Its own PP: the virtual pipeline kept; another: said and dropped.
        p = run('convert', td, self.path('td_own'), '--to', 'megatron', '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('(even, 2 virtual stages each)', p.stdout)
        self.assertIn('model1', rank_files(self.path('td_own'))['mp_rank_00_002'])
        p = run('convert', td, self.path('td_pp2'), '--to', 'megatron', '--pp', 2, '--weights-only')
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("the source's virtual pipeline (2 model chunks per stage) is its PP 3's", p.stdout)
        self.assertIsNone(rank_files(self.path('td_pp2'))['mp_rank_00_000']['args'].virtual_pipeline_model_parallel_size)

    def test_a_tied_embeddings_replica_is_in_the_last_chunk(self):
        src = make_fixture(self.path('gpt2'), **dict(FAMILIES['ms_gpt2'], tp=1, pp=1, dp=1, optimizer='bf16_zero'))
        mlm, _ = self.export(src, 'gpt2_mlm', '--pp', 2, '--vpp', 3, tp=2)
        files = rank_files(mlm)
        for p, f in ((0, files['mp_rank_01_000']), (1, files['mp_rank_01_001'])):
            for c in range(3):
                self.assertEqual('embedding.word_embeddings.weight' in f[f'model{c}'], (p, c) == (0, 0))
                self.assertEqual('output_layer.weight' in f[f'model{c}'], (p, c) == (1, 2))
        self.assertTrue(torch.equal(files['mp_rank_01_000']['model0']['embedding.word_embeddings.weight'],
                                    files['mp_rank_01_001']['model2']['output_layer.weight']))
        self.assertSameAsSource(src, mlm)

    def test_what_vpp_cannot_split_is_refused(self):
        src = self.source()
        out = self.path('bad')
        p = run('export', src, out, '--to', 'megatron', '--tp', 1, '--pp', 3, '--vpp', 4)
        self.assertRefused(p, "pipeline stage 0's 2 layers do not divide into 4 virtual stages", out)
        p = run('export', src, out, '--to', 'torch_dist', '--tp', 1, '--pp', 1, '--vpp', 2)
        self.assertRefused(p, 'a virtual pipeline (--vpp 2) interleaves the model chunks of several pipeline stages, '
                              'and PP is 1', out)

    def test_rank_files_with_other_chunks_are_refused(self):
        src = self.source()
        mlm, _ = self.export(src, 'mlm', '--pp', 3, '--vpp', 2, '--weights-only')
        path = glob.glob(os.path.join(mlm, 'iter_*', 'mp_rank_00_001', 'model_optim_rng.pt'))[0]
        f = torch.load(path, weights_only=False)
        del f['model1']
        torch.save(f, path)
        out = self.path('out')
        p = run('convert', mlm, out, '--pp', 1)
        self.assertRefused(p, 'holds 1 model chunk where the first rank file holds 2', out)


class MegatronCoreNumberingTest(FixtureTestCase):
    """LAYOUT is Megatron-Core 0.19.1's own numbering of the layers of every (stage, chunk)."""

    def test_layout_is_megatron_cores(self):
        root = torch2_chroot.root_or_skip()
        site = megatron_core_pypi.site_or_skip(root)
        cases = [list(k) for k in LAYOUT]
        p = megatron_core_pypi.run(root, site, OFFSETS % json.dumps(cases), {}, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        got = json.loads(re.search(r'^OFFSETS (.*)$', p.stdout, re.M).group(1))
        for case, layout in LAYOUT.items():
            self.assertEqual(got[json.dumps(list(case))], [[list(c) for c in stage] for stage in layout], case)
        print(f'Megatron-Core numbers {len(LAYOUT)} layouts as reshard writes them', file=sys.stderr)


MODEL = dict(hidden=16, heads=4, groups=2, ffn=32, layers=4, vocab=64, max_seq=32)
SIZES = ['--set', f"num_attention_heads={MODEL['heads']}", '--set', f"num_key_value_heads={MODEL['groups']}",
         '--set', 'make_vocab_size_divisible_by=16', '--vocab-size', MODEL['vocab']]

# Run by every script: the GPTModel's chunks at PP `pp`, VPP `vpp` (None: one chunk), after the process
# group; `worlds` runs each case in its own world.
BUILD = r'''
import argparse, contextlib, datetime, json, os, socket
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

M = json.loads(%r)

def build(pp, vpp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    config = TransformerConfig(
        num_layers=M['layers'], hidden_size=M['hidden'], num_attention_heads=M['heads'],
        num_query_groups=M['groups'], ffn_hidden_size=M['ffn'], pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        activation_func=F.gelu, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    torch.manual_seed(1234)
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        chunks.append(GPTModel(config, get_gpt_layer_local_spec(), vocab_size=M['vocab'],
                               max_sequence_length=M['max_seq'],
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                               share_embeddings_and_output_weights=False, position_embedding_type='rope',
                               vp_stage=vp))
    return chunks

def keys(chunks):
    return ['model'] if len(chunks) == 1 else [f'model{v}' for v in range(len(chunks))]

''' % json.dumps(MODEL) + megatron_core_pypi.RANKS

# The source: PP 2 x VPP 2, each chunk's sharded state under model0 / model1 beside args that record the
# virtual pipeline, as Megatron-LM's torch_dist save writes them.
SAVE = r'''
def save(r, port, world):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    start(r, port, world)
    chunks = build(2, 2)
    # The norms start at 1 and the biases at 0: values a misplaced copy would show.
    g = torch.Generator().manual_seed(7 + ps.get_pipeline_model_parallel_rank())
    for chunk in chunks:
        for p in chunk.parameters():
            if p.dim() == 1:
                p.data.add_(torch.randn(p.shape, generator=g))
    args = argparse.Namespace(num_layers=M['layers'], tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              data_parallel_size=1, virtual_pipeline_model_parallel_size=2,
                              num_virtual_stages_per_pipeline_rank=2, num_layers_per_virtual_pipeline_stage=None)
    state = {k: c.sharded_state_dict() for k, c in zip(keys(chunks), chunks)}
    os.makedirs('/data/src', exist_ok=True)
    dist_checkpointing.save({**state, 'args': args, 'checkpoint_version': 3.0}, '/data/src')
    end_rank(dist)

worlds(save, [(2,)])
print('megatron-core', __import__('megatron.core.package_info').core.package_info.__version__)
'''

# Loads, at each case's PP x VPP, Megatron-Core's own save and reshard's output into the chunks (every
# parameter zeroed first), both strictly, and saves what each rank holds after each; at PP 1 the loss on
# fixed tokens, before and after one SGD step.
LOAD = megatron_core_pypi.LOSSES + r'''
def load(r, port, world, name, out, form, pp, vpp):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    start(r, port, world)
    chunks = build(pp, vpp)
    held, loss = {}, {}
    for who, folder, kind in (('megatron', '/data/src', 'torch_dist'), ('reshard', out, form)):
        for chunk in chunks:
            for p in chunk.parameters():
                p.data.zero_()
        if kind == 'torch_dist':
            state = dist_checkpointing.load({k: c.sharded_state_dict() for k, c in zip(keys(chunks), chunks)},
                                            folder, strict=StrictHandling.RAISE_ALL)
        else:
            rank = 'mp_rank_00' if pp == 1 else f'mp_rank_00_{ps.get_pipeline_model_parallel_rank():03d}'
            state = torch.load(f'{folder}/{rank}/model_optim_rng.pt', weights_only=False)
        for k, c in zip(keys(chunks), chunks):
            c.load_state_dict(state[k], strict=True)
        held[who] = {f'{k}.{n}': v.clone() for k, c in zip(keys(chunks), chunks)
                     for n, v in c.state_dict().items() if isinstance(v, torch.Tensor)}
        if pp == 1:
            loss[who] = losses(chunks[0])
    torch.save({'held': held, 'loss': loss}, f'/data/{name}_loaded_rank{r}.pt')
    end_rank(dist)

worlds(load, CASES)
'''


class MegatronCoreVppSaveTest(megatron_core_pypi.MegatronCoreTestCase):
    """Real Megatron-Core 0.19.1 saves a 4-layer GPT (local spec, untied, rule set megatron-core-gpt) at
    PP 2 x VPP 2 as torch_dist, model0 / model1 beside args recording VPP 2. reshard converts it to
    torch_dist at PP 1, PP 4, PP 2 x VPP 2 (its own), and to the torch format at PP 2 x VPP 2 (model0,
    model1 in each rank file), and back; Megatron-Core loads every output at its layout strictly, every
    parameter equal to its own load of its save at that layout, and at PP 1 with the same loss before and
    after an SGD step."""

    SAVE = torch2_chroot.END_RANK + BUILD + SAVE

    def test_the_source_is_read_with_its_virtual_pipeline(self):
        p = run('inspect', self.saved('src'), *SIZES[:-2])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('rule set megatron-core-gpt;', p.stdout)
        self.assertIn('saved at: TP 1 (args), PP 2 (args), DP 1 (args), VPP 2 (args)', p.stdout)

    def test_megatron_core_loads_every_layout_strictly(self):
        # name: (form, PP, VPP, conversion flags, source)
        outputs = {
            'pp1': ('torch_dist', 1, None, ['--pp', 1], 'src'),
            'pp4': ('torch_dist', 4, None, ['--pp', 4], 'src'),
            'own': ('torch_dist', 2, 2, ['--pp', 2], 'src'),
            'torch_own': ('torch', 2, 2, ['--to', 'megatron'], 'src'),
            'pp1_back': ('torch_dist', 2, 2, ['--pp', 2, '--vpp', 2], 'pp1'),
            'pp4_torch': ('torch', 2, 2, ['--to', 'megatron', '--pp', 2, '--vpp', 2], 'pp4'),
            'torch_back': ('torch_dist', 2, 2, ['--to', 'torch_dist'], 'torch_own'),
        }
        cases = []
        for name, (form, pp, vpp, flags, source) in outputs.items():
            p = run('convert', self.saved(source), self.saved(name), *flags, *SIZES)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            p = run('verify', self.saved('src'), self.saved(name), *SIZES[:-2])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('same model', p.stdout)
            cases.append([pp, name, f'/data/{name}/iter_0000000', form, pp, vpp])
        p = self.megatron(torch2_chroot.END_RANK + BUILD + 'CASES = json.loads(%r)\n' % json.dumps(cases) + LOAD)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr[-4000:])
        for _, name, _, form, pp, vpp in cases:
            with self.subTest(output=name, pp=pp, vpp=vpp):
                compared, got = self.assertLoadedAsItsOwn(name, pp)
                print(f'{name} ({form}) at PP {pp}, VPP {vpp}: {compared} tensors loaded strictly, equal' +
                      (f"; loss {got['loss']['reshard']}" if pp == 1 else ''), file=sys.stderr)


if __name__ == '__main__':
    support.main()
