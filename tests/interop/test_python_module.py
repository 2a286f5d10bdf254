"""The Python module (`import reshard`), checked against what the CLI writes, with real PyTorch.

* `state_dict(tp, pp, tp_rank, pp_rank)` for every rank of many layouts (TP and PP growing and
  shrinking, uneven stages) is, key for key and bit for bit, the layer files `reshard convert`
  writes for that rank (the stage's files by the plan's stage bounds, keys `layer_NN.<key>`);
  for Megatron-DeepSpeed sources with bf16 ZeRO and fp32 ZeRO-1 optimizers, an HF folder, a
  DeepSpeed universal checkpoint and a Megatron-Core torch_dist checkpoint.
* `optimizer_state(tp, pp, dp, ...)` is the tree of the ZeRO shard file convert writes for the rank.
* For DeepSpeed MoE saves (TP, PP, EP and DP changed, ZeRO and not), `state_dict(..., ep, ep_rank)`
  is convert's mp_rank module and that EP rank's expert files, and `optimizer_state` the DP rank's
  shard (without ZeRO, its EP rank's expp_rank file's torch state); a ZeRO-3 rank's
  `optimizer_state` is its partition file.
* `tensor(name)` is `export --to consolidated --from weights`'s tensor; `export(to="hf")` in memory
  is `export --to hf`'s files, and the HF model's logits from it are the export's.
* A tensor stored contiguously comes back mapped copy-on-write, not copied: writing to it leaves
  the source file unchanged.
* Several threads read at once and get what one thread gets; a call runs without the GIL (the
  main thread keeps running while another thread reads); reading one rank's state dict holds that
  rank's tensors, not the checkpoint's.
* The commands return their reports as dicts, `progress` gets lines, and failures raise
  reshard.Error with the CLI's one line.

Run: /usr/bin/python3 tests/interop/test_python_module.py --reshard build/reshard  (PYTHONPATH=tests)
The module is looked for in python/ beside the binary (the build tree's).
"""
import concurrent.futures
import enum
import hashlib
import os
import re
import sys
import threading
import time
import unittest

import numpy
import torch

import interop_support as support
from interop_support import FAMILIES, differences, load, make_fixture

reshard = None  # the module under test, imported by main()


def file_digest(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def folder_digests(folder):
    return {os.path.join(d, n): file_digest(os.path.join(d, n))
            for d, _, names in os.walk(folder) for n in names}


def convert(src, out, *args):
    p = support.reshard('convert', src, out, '-q', *args)
    assert p.returncode == 0, p.stderr
    return os.path.join(out)


def stage_bounds(src, tp, pp, *args):
    """The target's stage bounds (spec ids) as the plan prints them."""
    p = support.reshard('convert', src, '/nonexistent-out', '--to', 'deepspeed', '--tp', tp, '--pp', pp, '--dry-run',
                        *args)
    assert p.returncode == 0, p.stderr
    return [int(b) for b in re.search(r'stage bounds \(spec ids\)((?: \d+)+)', p.stdout).group(1).split()]


LAYER_RE = re.compile(r'^layer_(\d+)-model_(\d+)-model_states\.pt$')


def rank_layer_files(tag, bounds, tp_rank, pp_rank):
    """{'layer_NN.key': tensor} of the layer files convert wrote for the rank."""
    out = {}
    for name in sorted(os.listdir(tag)):
        m = LAYER_RE.match(name)
        if not m or int(m.group(2)) != tp_rank:
            continue
        layer = int(m.group(1))
        stage = max(p for p in range(len(bounds) - 1) if layer >= bounds[p] or p == 0)
        if stage != pp_rank:
            continue
        for key, t in load(os.path.join(tag, name)).items():
            out[f'layer_{layer:02d}.{key}'] = t
    return out


def same_tree(ours, theirs, where=''):
    """Differences between reshard's tree (PickledObject for objects it keeps as data) and
    torch.load's (the fixture's stand-in classes)."""
    if isinstance(ours, reshard.PickledObject):
        if isinstance(theirs, enum.Enum):  # Enum(value), or getattr(Enum, name)
            kind = f'{type(theirs).__module__}.{type(theirs).__name__}'
            named = ours.cls == 'builtins.getattr' and ours.args[0].cls == kind and ours.args[1] == theirs.name
            called = ours.cls == kind and ours.args == [theirs.value]
            return [] if named or called else [f'{where}: {ours!r} vs {theirs!r}']
        if ours.args is None:
            return [] if ours.cls == f'{theirs.__module__}.{theirs.__name__}' else [f'{where}: {ours.cls}']
        if ours.state:
            return same_tree(ours.state, vars(theirs), where)
        return same_tree(ours.args, list(theirs), where)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if list(ours) != list(theirs):
            return [f'{where}: keys {list(ours)} vs {list(theirs)}']
        return [d for k in ours for d in same_tree(ours[k], theirs[k], f'{where}.{k}')]
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        if len(ours) != len(theirs):
            return [f'{where}: lengths {len(ours)} vs {len(theirs)}']
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in same_tree(a, b, f'{where}[{i}]')]
    return differences(ours, theirs, where)


class StateDictTest(support.FixtureTestCase):
    """state_dict / optimizer_state against convert's files."""

    LAYOUTS = [(1, 1, 1), (2, 2, 2), (4, 3, 3), (3, 1, 2), (1, 4, 1)]

    def check_source(self, src, layouts, *convert_args, optimizer=True):
        ckpt = reshard.open(src)
        for tp, pp, dp in layouts:
            with self.subTest(src=src, tp=tp, pp=pp, dp=dp):
                out = self.path('converted', os.path.basename(src), f'{tp}_{pp}_{dp}')
                # The layouts of one source sit side by side: none of them is the root's `latest`.
                convert(src, out, '--to', 'deepspeed', '--tp', tp, '--pp', pp, '--dp', dp, '--no-update-latest', *convert_args)
                tag = os.path.join(out, sorted(d for d in os.listdir(out) if d.startswith('global_step'))[0]) \
                    if not os.path.exists(os.path.join(out, 'mp_rank_00_model_states.pt')) else out
                bounds = stage_bounds(src, tp, pp, *convert_args)
                seen = 0
                for t in range(tp):
                    for p in range(pp):
                        ours = ckpt.state_dict(tp=tp, pp=pp, tp_rank=t, pp_rank=p)
                        theirs = rank_layer_files(tag, bounds, t, p)
                        self.assertTrue(theirs)
                        self.assertEqual(differences(ours, theirs, f'rank {t},{p}'), [])
                        seen += len(ours)
                self.assertEqual(seen, sum(len(load(os.path.join(tag, n))) for n in os.listdir(tag)
                                           if LAYER_RE.match(n)))
                if not optimizer:
                    continue
                for t, p, d in {(0, 0, 0), (tp - 1, pp - 1, dp - 1), (tp // 2, pp // 2, dp // 2)}:
                    mp = p * tp + t
                    files = [n for n in os.listdir(tag) if re.fullmatch(
                        rf'(bf16_)?zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states\.pt', n)]
                    self.assertEqual(len(files), 1, os.listdir(tag))
                    ours = ckpt.optimizer_state(tp=tp, pp=pp, dp=dp, tp_rank=t, pp_rank=p, dp_rank=d)
                    self.assertEqual(same_tree(ours, load(os.path.join(tag, files[0])), files[0]), [])

    def test_megatron_deepspeed_bf16_zero(self):
        src = make_fixture(self.path('bloom'), tp=2, pp=2, dp=2, optimizer='bf16_zero', **FAMILIES['bs_bloom'])
        self.check_source(src, self.LAYOUTS)

    def test_megatron_deepspeed_zero1_llama(self):
        src = make_fixture(self.path('llama'), tp=2, pp=2, dp=2, optimizer='zero1', **FAMILIES['ms_llama'])
        self.check_source(src, [(1, 1, 1), (3, 2, 2), (6, 1, 3)])

    def test_hf_universal_and_torch_dist_sources(self):
        src = make_fixture(self.path('gpt2'), tp=2, pp=2, dp=2, optimizer='bf16_zero', **FAMILIES['ms_gpt2'])
        hf = self.path('hf')
        self.assertEqual(support.reshard('export', src, hf, '--to', 'hf', '-q').returncode, 0)
        self.check_source(hf, [(2, 2, 1), (1, 3, 1)], optimizer=False)
        universal = self.path('universal')
        p = support.reshard('export', src, universal, '--to', 'universal', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.check_source(universal, [(1, 2, 2), (4, 1, 1)])
        torch_dist = self.path('torch_dist')
        p = support.reshard('export', src, torch_dist, '--to', 'torch_dist', '--tp', 2, '--pp', 1, '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        self.check_source(torch_dist, [(1, 2, 2), (2, 1, 1)])

    def test_non_pipeline(self):
        from fixtures import deepspeed_nonpipe as dn
        src = self.path('nonpipe')
        dn.write_nonpipe(src, dn.NonPipeConfig(zero_stage=2, dtype='bf16', dp=2))
        out = self.path('converted')
        convert(src, out, '--tp', 1, '--pp', 1, '--dp', 3)
        tag = os.path.join(out, 'global_step10')
        ckpt = reshard.open(src)
        module = load(os.path.join(tag, 'mp_rank_00_model_states.pt'))['module']
        self.assertEqual(differences(ckpt.state_dict(), dict(module)), [])
        for d in range(3):
            ours = ckpt.optimizer_state(dp=3, dp_rank=d)
            theirs = load(os.path.join(tag, f'bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt'))
            self.assertEqual(same_tree(ours, theirs, f'DP rank {d}'), [])

    def test_zero3(self):
        """A ZeRO-3 rank's optimizer state is its partition file; its weights are partitions too,
        which state_dict refuses (tensor() reads them whole)."""
        from fixtures import deepspeed_nonpipe as dn
        src = self.path('zero3')
        dn.write_nonpipe(src, dn.NonPipeConfig(zero_stage=3, dtype='bf16', dp=2, sub_group_size=40))
        tag = os.path.join(convert(src, self.path('converted'), '--tp', 1, '--pp', 1, '--dp', 3), 'global_step10')
        ckpt = reshard.open(src)
        for d in range(3):
            ours = ckpt.optimizer_state(dp=3, dp_rank=d)
            theirs = load(os.path.join(tag, f'bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt'))
            self.assertEqual(same_tree(ours, theirs, f'DP rank {d}'), [])
        with self.assertRaisesRegex(reshard.Error, 'has no layer files for rank .*tensor\\(\\)'):
            ckpt.state_dict()
        self.assertTrue(ckpt.keys())

    # DeepSpeed MoE saves: (source, target TP, PP, EP, DP): bf16 ZeRO-1 of the pipeline engine at
    # PP 2 -> 1 and EP 2 -> 4; fp32 ZeRO-2 at TP 2 -> 1 and EP 2 -> 1; fp32 without ZeRO (each EP
    # rank's torch state in its expp_rank file) at EP 2 -> 4, DP 4 -> 8.
    MOE_CASES = [
        (dict(engine='pipe', pp=2, dp=4, ep=2, dtype='bf16'), 1, 1, 4, 4),
        (dict(engine='module', tp=2, dp=4, ep=2, zero_stage=2), 1, 1, 1, 2),
        (dict(engine='module', dp=4, ep=2, zero_stage=0), 1, 1, 4, 8),
    ]

    def test_moe(self):
        from fixtures import deepspeed_moe as dm
        for i, (source, tp, pp, ep, dp) in enumerate(self.MOE_CASES):
            cfg = dm.MoeConfig(**source)
            with self.subTest(source=source, tp=tp, pp=pp, ep=ep, dp=dp):
                src = self.path(f'moe{i}')
                dm.write_moe(src, cfg)
                rules = dm.TOY_RULES[cfg.engine]
                out = convert(src, self.path(f'moe{i}-converted'), '--tp', tp, '--pp', pp, '--ep', ep, '--dp', dp,
                              '--rules', rules)
                tag = dm.resolve_tag_dir(out)
                dm.install_pickle_shims()
                ckpt = reshard.open(src, rules=rules)
                local = cfg.num_experts // ep
                seen = 0
                for t in range(tp):
                    for p in range(pp):
                        mp = p * tp + t
                        module = dict(load(os.path.join(tag, f'mp_rank_{mp:02d}_model_states.pt'))['module'])
                        for e in range(ep):
                            theirs = dict(module)
                            for n in sorted(os.listdir(tag)):
                                m = re.fullmatch(rf'layer_\d+_expert_(\d+)_mp_rank_{mp:02d}_model_states\.pt', n)
                                if m and int(m.group(1)) // local == e:
                                    theirs.update(load(os.path.join(tag, n)))
                            ours = ckpt.state_dict(tp=tp, pp=pp, tp_rank=t, pp_rank=p, ep=ep, ep_rank=e)
                            self.assertGreater(len(theirs), len(module))
                            self.assertEqual(differences(ours, theirs, f'rank {t},{p}, EP rank {e}'), [])
                            seen += len(ours) - len(module)
                        seen += len(module)
                        for d in range(dp):
                            ours = ckpt.optimizer_state(tp=tp, pp=pp, dp=dp, ep=ep, tp_rank=t, pp_rank=p, dp_rank=d)
                            if cfg.zero_stage == 0:
                                name = f'expp_rank_{d % ep}_mp_rank_{mp:02d}_optim_states.pt'
                                theirs = load(os.path.join(tag, name))['optimizer']
                            else:
                                name = [n for n in os.listdir(tag) if re.fullmatch(
                                    rf'(bf16_)?zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states\.pt', n)][0]
                                theirs = load(os.path.join(tag, name))
                            self.assertEqual(same_tree(ours, theirs, name), [])
                # Every tensor of the target's model files, once.
                self.assertEqual(seen, sum(len(load(os.path.join(tag, n)).get('module', {}))
                                           if n.startswith('mp_rank') else len(load(os.path.join(tag, n)))
                                           for n in os.listdir(tag) if n.endswith('_model_states.pt')))
                with self.assertRaisesRegex(reshard.Error, 'DP rank 1 holds the experts of EP rank 1 .*ep_rank 1'):
                    ckpt.optimizer_state(dp=4, ep=2, dp_rank=1, ep_rank=0)
                with self.assertRaisesRegex(reshard.Error, r'\(tp_rank 0, pp_rank 0, dp_rank 0, ep_rank 2\) is '
                                            r'outside the layout TP 1 x PP 1 x DP 1 \(EP 2\)'):
                    ckpt.state_dict(ep=2, ep_rank=2)
        dense = reshard.open(make_fixture(self.path('dense'), tp=1, pp=1, dp=1, **FAMILIES['ms_gpt2']))
        with self.assertRaisesRegex(reshard.Error, 'has no experts; leave ep at 1'):
            dense.state_dict(ep=2)

    def test_expert_parallel_size_of_a_target(self):
        """ep= reaches the targets that declare it (their "layout"), as --ep does: a Megatron-Core MoE save
        written at EP 2 by export and by convert is the CLI's output byte for byte; another target refuses it."""
        sizes = {t['name']: t['layout'] for t in reshard.target_formats()}
        self.assertEqual(sorted(n for n, layout in sizes.items() if 'ep' in layout), ['deepspeed', 'torch_dist'])
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'megatron-core', '0.19-moe',
                           'w2_ep2')
        given = dict(set={'num_attention_heads': 4, 'num_key_value_heads': 2, 'make_vocab_size_divisible_by': 16},
                     vocab_size=64)
        cli = self.path('cli')
        p = support.reshard('convert', src, cli, '--ep', '2', '--set', 'num_attention_heads=4', '--set',
                            'num_key_value_heads=2', '--set', 'make_vocab_size_divisible_by=16', '--vocab-size', 64,
                            '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        exported, converted = self.path('exported'), self.path('converted')
        reshard.export(src, exported, to='torch_dist', tp=1, pp=1, dp=2, ep=2, **given)
        reshard.convert(src, converted, ep=2, **given)
        def digests(out):
            folder = os.path.join(out, 'iter_0000000')
            return {n: file_digest(os.path.join(folder, n)) for n in os.listdir(folder)}
        for out in (exported, converted):
            self.assertEqual(digests(out), digests(cli))
        with self.assertRaisesRegex(reshard.Error, '--ep sets the layout of --to deepspeed, torch_dist; --to hf has no such size'):
            reshard.export(src, self.path('hf'), to='hf', ep=2, **given)

    def test_a_flag_option_of_a_target(self):
        """A target's flag option is a keyword taking True (its kind "flag"), as the CLI's flag: the torch_dist
        export with the embedding counted in the pipeline split is the CLI's output byte for byte."""
        options = {o['name']: o['kind'] for t in reshard.target_formats() for o in t['options']}
        self.assertEqual(options['account_for_embedding_in_pipeline_split'], 'flag')
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'megatron-core', '0.19', 'w2_tp2')
        sets = ['num_attention_heads=4', 'num_key_value_heads=2', 'make_vocab_size_divisible_by=16']
        cli = self.path('cli')
        p = support.reshard('convert', src, cli, '--pp', 3, '--account-for-embedding-in-pipeline-split',
                            *[a for s in sets for a in ('--set', s)], '--vocab-size', 64, '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        ours = self.path('python')
        reshard.convert(src, ours, pp=3, account_for_embedding_in_pipeline_split=True,
                        set=dict(s.split('=') for s in sets), vocab_size=64)
        def digests(out):
            folder = os.path.join(out, 'iter_0000000')
            return {n: file_digest(os.path.join(folder, n)) for n in os.listdir(folder)}
        self.assertEqual(digests(ours), digests(cli))
        # False leaves it out: with the embedding counted, 2 layers would not split into 2 stages.
        reshard.convert(src, self.path('even'), pp=2, account_for_embedding_in_pipeline_split=False,
                        set=dict(s.split('=') for s in sets), vocab_size=64)
        with self.assertRaisesRegex(reshard.Error, 'counted as 3 do not divide into 2 stages'):
            reshard.convert(src, self.path('counted'), pp=2, account_for_embedding_in_pipeline_split=True,
                            set=dict(s.split('=') for s in sets), vocab_size=64)

    def test_deepspeed_options_as_keywords(self):
        """The deepspeed target's options are keywords as every target's: a list is the CLI's comma-separated
        value, a flag takes True; the output is the CLI's, byte for byte, and a value the option cannot read is
        refused in the CLI's words."""
        src = make_fixture(self.path('src'), tp=2, pp=2, optimizer='bf16_zero', **FAMILIES['ms_gpt2'])
        tag = os.path.basename(src)
        cli = self.path('cli', tag)
        p = support.reshard('convert', src, cli, '--tp', 1, '--pp', 3, '--layers-per-stage', '2,3,1',
                            '--no-update-latest', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        ours = self.path('python', tag)
        reshard.convert(src, ours, tp=1, pp=3, layers_per_stage=[2, 3, 1], no_update_latest=True)
        self.assertEqual(os.listdir(self.path('python')), [tag])  # no latest beside it
        def digests(out):  # but the manifest, which records the command
            return {n: file_digest(os.path.join(out, n)) for n in os.listdir(out) if n != 'reshard-manifest.json'}
        self.assertEqual(digests(ours), digests(cli))
        with self.assertRaisesRegex(reshard.Error, "--layers-per-stage takes the blocks of each stage, "
                                                   "comma-separated \\(e.g. 5,6,6,5\\), not '1,x'"):
            reshard.convert(src, self.path('refused'), tp=1, pp=2, layers_per_stage='1,x')
        self.assertFalse(os.path.exists(self.path('refused')))

    def test_tensor_and_exports_in_memory(self):
        src = make_fixture(self.path('gpt2'), tp=2, pp=2, dp=2, optimizer='bf16_zero', **FAMILIES['ms_gpt2'])
        ckpt = reshard.open(src)
        consolidated = self.path('consolidated')
        p = support.reshard('export', src, consolidated, '--to', 'consolidated', '--from', 'weights', '-q')
        self.assertEqual(p.returncode, 0, p.stderr)
        files, _ = support.read_safetensors(os.path.join(consolidated, 'model.safetensors'))
        weights = [k for k in ckpt.keys() if ckpt.meta(k)['section'] == 'weights']
        self.assertEqual(sorted(weights), sorted(files))
        for name in weights:
            got = ckpt.tensor(name)
            meta = ckpt.meta(name)
            self.assertEqual((meta['dtype'], meta['shape']), (str(got.dtype)[6:], tuple(got.shape)))
            if meta['vocab']:  # stored with the padding rows, which the export leaves out
                self.assertEqual(meta['vocab_size'], len(files[name]))
                self.assertGreater(len(got), len(files[name]))
                got = got[:meta['vocab_size']]
            self.assertEqual(differences(got, files[name], name), [])
        self.assertTrue(any(ckpt.meta(k)['rule'] for k in weights))
        self.assertTrue(any(ckpt.meta(k)['state'] == 'exp_avg' for k in ckpt.keys()))
        memory = ckpt.export(to='consolidated', from_='weights')
        self.assertEqual(differences(dict(sorted(memory['state_dict'].items())), dict(sorted(files.items()))), [])

        import test_export_hf as hf_test
        hf = self.path('hf')
        self.assertEqual(support.reshard('export', src, hf, '--to', 'hf', '-q').returncode, 0)
        tensors, config = hf_test.read_folder(hf)
        memory = ckpt.export(to='hf')
        self.assertEqual(sorted(memory['state_dict']), sorted(tensors))
        self.assertEqual(differences({k: memory['state_dict'][k] for k in sorted(tensors)},
                                     {k: tensors[k] for k in sorted(tensors)}), [])
        with open(os.path.join(hf, 'config.json')) as f:
            self.assertEqual(memory['texts']['config.json'], f.read())
        ids = torch.tensor([3, 14, 15, 92, 65, 35, 8])
        logits = hf_test.hf_gpt2_logits(memory['state_dict'], config, ids)
        self.assertTrue(torch.equal(logits, hf_test.hf_gpt2_logits(tensors, config, ids)))
        refused = support.reshard('export', src, self.path('td'), '--to', 'torch_dist', '--tp', 1, '--pp', 1,
                                  '--dry-run')
        self.assertEqual(refused.returncode, 0, refused.stderr)
        with self.assertRaisesRegex(reshard.Error, 'Distributed Checkpoint'):
            ckpt.export(to='torch_dist', tp=1, pp=1)

    def test_in_place_tensors_are_private(self):
        src = make_fixture(self.path('bloom'), tp=1, pp=2, **FAMILIES['bs_bloom'])
        before = folder_digests(src)
        ckpt = reshard.open(src)
        weights = ckpt.state_dict(tp=1, pp=2, tp_rank=0, pp_rank=1)
        key = next(k for k, t in weights.items() if t.dim() == 2)
        t = weights[key]
        kept = t.clone()
        t.add_(1)  # a private mapping: the write stays in this process
        self.assertFalse(torch.equal(t, kept))
        self.assertEqual(folder_digests(src), before)
        self.assertTrue(torch.equal(reshard.open(src).state_dict(tp=1, pp=2, tp_rank=0, pp_rank=1)[key], kept))

    def test_numpy_and_bf16(self):
        src = make_fixture(self.path('bloom'), tp=2, pp=1, optimizer='bf16_zero', **FAMILIES['bs_bloom'])
        ckpt = reshard.open(src)
        masters = [k for k in ckpt.keys() if ckpt.meta(k)['state'] == 'fp32']
        array = ckpt.tensor(masters[0], as_numpy=True)
        self.assertIsInstance(array, numpy.ndarray)
        self.assertTrue(numpy.array_equal(array, ckpt.tensor(masters[0]).numpy()))
        bf16 = next(k for k in ckpt.keys() if ckpt.meta(k)['dtype'] == 'bfloat16')
        self.assertEqual(ckpt.tensor(bf16).dtype, torch.bfloat16)
        with self.assertRaisesRegex(reshard.Error, 'numpy has no bfloat16'):
            ckpt.tensor(bf16, as_numpy=True)


class ThreadsAndMemoryTest(support.FixtureTestCase):

    def test_threads_read_what_one_thread_reads(self):
        src = make_fixture(self.path('bloom'), tp=2, pp=2, **FAMILIES['bs_bloom'])
        ckpt = reshard.open(src)
        ranks = [(t, p) for t in range(3) for p in range(2)] * 3
        alone = {r: ckpt.state_dict(tp=3, pp=2, tp_rank=r[0], pp_rank=r[1]) for r in set(ranks)}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda r: (r, ckpt.state_dict(tp=3, pp=2, tp_rank=r[0], pp_rank=r[1])),
                                     ranks))
        for r, got in together:
            self.assertEqual(differences(got, alone[r], str(r)), [])

    def big(self):
        """A ms_gpt2 of about 120 MB of bf16 weights at TP 2."""
        return make_fixture(self.path('big'), style='ms_gpt2', tp=2, pp=1, L=4, h=1024, n=16, hd=64,
                            ffn=4096, V=16384, mvsdb=8)

    def test_calls_release_the_gil(self):
        ckpt = reshard.open(self.big())
        start = time.perf_counter()
        ckpt.state_dict(tp=1, pp=1)  # TP merges: copied, not mapped
        alone = time.perf_counter() - start
        gaps, done = [], threading.Event()
        worker = threading.Thread(target=lambda: (ckpt.state_dict(tp=1, pp=1), done.set()))
        last = time.perf_counter()
        worker.start()
        while not done.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        worker.join()
        # Holding the GIL through the read would stop this loop for all of it.
        self.assertGreater(alone, 0.05)
        self.assertLess(max(gaps), alone / 2, f'the main thread stopped for {max(gaps):.3f} s of a '
                                               f'{alone:.3f} s read')

    MEASURE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, reshard
def resident():
    with open('/proc/self/status') as f:
        fields = dict(line.split(':', 1) for line in f)
    return sum(int(fields[k].split()[0]) * 1024 for k in ('RssAnon', 'RssFile'))
ckpt = reshard.open(sys.argv[2])
before = resident()
weights = ckpt.state_dict(tp=int(sys.argv[3]), pp=1, tp_rank=int(sys.argv[3]) - 1)
print(sum(t.numel() * t.element_size() for t in weights.values()), resident() - before)
"""

    def resident_growth(self, src, tp):
        """(tensor bytes, resident memory growth) of one process reading TP rank tp-1 of tp."""
        import subprocess
        p = subprocess.run([sys.executable, '-c', self.MEASURE, reshard.__path__[0] + '/..', src, str(tp)],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        return [int(x) for x in p.stdout.split()]

    def test_one_rank_holds_its_tensors(self):
        src = self.big()
        rank_bytes, rank_grown = self.resident_growth(src, 4)
        whole_bytes, whole_grown = self.resident_growth(src, 1)
        print(f'resident memory: one TP rank of 4 grew {rank_grown / 2**20:.1f} MiB for '
              f'{rank_bytes / 2**20:.1f} MiB of tensors; the whole model (TP 1) {whole_grown / 2**20:.1f} '
              f'MiB for {whole_bytes / 2**20:.1f} MiB')
        self.assertGreater(rank_bytes, whole_bytes / 5)
        self.assertLess(rank_grown, rank_bytes * 1.25 + 8 * 2**20)
        self.assertLess(rank_grown, whole_grown / 2)


class CommandsTest(support.FixtureTestCase):

    def test_reports_progress_and_errors(self):
        src = self.bloom(optimizer='bf16_zero', dp=2)
        report = reshard.lint(src, tp=4, pp=1)
        self.assertTrue(report['ok'], report)
        self.assertEqual(report['rule_set'], 'bigscience-bloom')
        self.assertIn('TP 2', reshard.inspect(src))
        lines = []
        out = self.path('out')
        report = reshard.convert(src, out, tp=4, pp=1, dp=1, progress=lines.append, max_memory='2GiB')
        self.assertGreater(report['bytes_written'], 0)
        self.assertTrue(lines)
        self.assertTrue(reshard.verify(src, out)['same'])
        self.assertTrue(reshard.verify(out)['ok'])
        self.assertIn('bigscience-bloom', [r['name'] for r in reshard.rule_sets()])

        def fail(line):
            raise KeyboardInterrupt('stop')
        with self.assertRaises(KeyboardInterrupt):
            reshard.convert(src, self.path('stopped'), tp=1, pp=1, progress=fail)

        with self.assertRaises(reshard.Error) as e:
            reshard.convert(src, self.path('x'), tp=-1, pp=1)
        self.assertEqual(len(str(e.exception).splitlines()), 1)
        self.assertIn('--tp', str(e.exception))
        self.assertFalse(os.path.exists(self.path('x')))
        with self.assertRaisesRegex(reshard.Error, "^unknown target format 'HF'; did you mean 'hf'\\? \\(the formats: "):
            reshard.convert(src, self.path('x'), to='HF')
        self.assertFalse(os.path.exists(self.path('x')))
        with self.assertRaisesRegex(reshard.Error, 'no-such'):
            reshard.open(self.path('no-such'))
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'tpp'"):
            reshard.lint(src, tpp=2)
        ckpt = reshard.open(src)
        with self.assertRaisesRegex(reshard.Error, 'outside the layout TP 2'):
            ckpt.state_dict(tp=2, pp=1, tp_rank=2)
        with self.assertRaisesRegex(reshard.Error, 'keys\\(\\) lists'):
            ckpt.tensor('no.such.tensor')
        with self.assertRaisesRegex(reshard.Error, 'replicated must be'):
            reshard.open(src, replicated='mean')

    def test_drifted_replicas_refused_as_convert_refuses(self):
        src = self.bloom(tp_drift_eps=0.01)
        with self.assertRaisesRegex(reshard.Error, 'replicated'):
            reshard.open(src)
        ckpt = reshard.open(src, replicated='average')
        self.assertTrue(ckpt.state_dict(tp=1, pp=1))


def main():
    global reshard
    binary = next((a.split('=', 1)[1] if '=' in a else sys.argv[i + 2]
                   for i, a in enumerate(sys.argv[1:]) if a.startswith('--reshard')), os.environ.get('RESHARD'))
    module_dir = os.path.join(os.path.dirname(os.path.abspath(binary or '.')), 'python')
    if not os.path.isdir(os.path.join(module_dir, 'reshard')):
        print(f'SKIP: no Python module in {module_dir} (built with Debian\'s pybind11-dev and python3-dev)')
        sys.exit(0)
    sys.path.insert(0, module_dir)
    import reshard as module
    reshard = module
    support.main()


if __name__ == '__main__':
    main()
