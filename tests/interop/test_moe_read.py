"""`reshard lint`, `inspect` and `verify` on real DeepSpeed MoE saves (tests/data/deepspeed_moe/).

The expected layout of each save is read from its files here with torch (num_experts, the expp_rank
files, the expert files' keys, the MoE optimizer groups' partition_count), not written into the
test, and compared with what reshard reports. Then copies of the saves are damaged one way each
(an expert file missing, misnamed, duplicated; an expp_rank file missing; num_experts edited; every
expert file removed) and every command must refuse with one line naming the problem (exit 2), the
input left unchanged. The old file form (`expert_{e}_mp_rank_XX`, every MoE layer of expert e in
one file) reads as the same model.

Run by ctest as ``/usr/bin/python3 tests/interop/test_moe_read.py --reshard BIN`` with
PYTHONPATH=tests.
"""

import collections
import glob
import hashlib
import os
import re
import shutil

import torch

import interop_support as support
from interop_support import FixtureTestCase

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data', 'deepspeed_moe')
SAVES = {  # folder -> rule file describing its toy model
    'zero1_fp32_ep2_dp4': os.path.join(DATA, 'toy-moe-nonpipe.yaml'),
    'pipe_pp2_ep2_dp2': os.path.join(DATA, 'toy-moe-pipe.yaml'),
}
EXPERT_FILE = re.compile(r'layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt')
EXPERT_KEY = re.compile(r'(?:(\d+)\.|.*layers\.(\d+)\.)mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.')

run = support.reshard


def tag_dir(root):
    with open(os.path.join(root, 'latest')) as f:
        return os.path.join(root, f.read().strip())


def folder_digest(path):
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode())
        with open(os.path.join(path, name), 'rb') as f:
            h.update(f.read())
    return h.hexdigest()


def expected_layout(root):
    """The layout read with torch: EP, expert-DP, experts per MoE layer, MoE blocks."""
    tag = tag_dir(root)
    mp_files = sorted(glob.glob(os.path.join(tag, 'mp_rank_*_model_states.pt')))
    num_experts = [torch.load(f)['num_experts'] for f in mp_files]
    ep = len(glob.glob(os.path.join(tag, 'expp_rank_*_mp_rank_00_optim_states.pt')))
    shards = glob.glob(os.path.join(tag, '*zero_pp_rank_*_mp_rank_00_optim_states.pt'))
    osd = torch.load(shards[0])['optimizer_state_dict']
    moe_counts = {pc for pc, g in zip(osd['partition_count'], osd['base_optimizer_state']['param_groups'])
                  if g.get('moe')}
    # The spec (pipeline names) or block (module paths) of each MoE layer, from the expert keys.
    places = set()
    for f in glob.glob(os.path.join(tag, 'layer_*_expert_*_model_states.pt')):
        for key in torch.load(f):
            spec, block, _ = EXPERT_KEY.match(key).groups()
            places.add(int(spec) - 1 if spec else int(block))  # the toy pipeline's spec 0 is the embedding
    return {'ep': ep, 'edp': len(shards) // ep, 'moe_counts': moe_counts,
            'experts': sorted({e for per_stage in num_experts for e in per_stage}),
            'moe_layers': sum(len(n) for n in num_experts), 'blocks': sorted(places)}


class MoeReadTestCase(FixtureTestCase):

    def copy(self, name):
        dst = self.path(name)
        shutil.copytree(os.path.join(DATA, name), dst)
        return dst

    def refuse(self, root, rules, pattern):
        """Every reading command exits 2 with one line matching `pattern`; the input is unchanged."""
        before = folder_digest(tag_dir(root))
        for cmd in (('lint', root), ('inspect', root), ('convert', root, self.path('out'), '--tp', '1', '--pp', '1')):
            p = run(*cmd, '--rules', rules)
            self.assertEqual(p.returncode, 2, f'{cmd}\n{p.stdout}\n{p.stderr}')
            self.assertEqual(len(p.stderr.splitlines()), 1, p.stderr)
            self.assertRegex(p.stderr, pattern)
        self.assertFalse(os.path.exists(self.path('out')))
        self.assertEqual(folder_digest(tag_dir(root)), before)


class RealSaveTests(MoeReadTestCase):

    def test_lint_reports_the_layout_the_files_show(self):
        for name, rules in SAVES.items():
            with self.subTest(save=name):
                want = expected_layout(os.path.join(DATA, name))
                self.assertEqual(want['moe_counts'], {want['edp']})  # the data set agrees with itself
                p = run('lint', os.path.join(DATA, name), '--rules', rules)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                blocks = ', '.join(map(str, want['blocks']))
                experts = '/'.join(map(str, want['experts']))
                self.assertIn(f"info: MoE: EP {want['ep']} x expert-DP {want['edp']}; {want['moe_layers']} "
                              f"MoE layers of {experts} experts (blocks {blocks}", p.stdout)
                self.assertIn(f"expert groups over expert-DP {want['edp']}, states fp32, exp_avg, exp_avg_sq", p.stdout)
                self.assertEqual([line for line in p.stdout.splitlines() if line.startswith('error:')], [])
                self.assertEqual(p.stdout.splitlines()[-1],
                                 f"lint: ok, the checkpoint can be converted with rule set "
                                 f"'{os.path.basename(rules)[:-5]}'")

    def test_inspect_names_every_expert_by_its_global_id(self):
        for name, rules in SAVES.items():
            with self.subTest(save=name):
                tag = tag_dir(os.path.join(DATA, name))
                p = run('inspect', os.path.join(DATA, name), '--rules', rules)
                self.assertEqual(p.returncode, 0, p.stderr)
                names = set(re.findall(r'  name (\S+)', p.stdout))
                for f in glob.glob(os.path.join(tag, 'layer_*_expert_*_model_states.pt')):
                    m, e, mp = map(int, EXPERT_FILE.match(os.path.basename(f)).groups())
                    for key, t in torch.load(f).items():
                        spec, block, expert = EXPERT_KEY.match(key).groups()
                        self.assertEqual(int(expert), e, f)  # the file's global id is the key's
                        b = int(spec) - 1 if spec else int(block)
                        suffix = key.split('deepspeed_experts.', 1)[1]
                        self.assertIn(f'layers.{b}.mlp.deepspeed_moe.experts.deepspeed_experts.{suffix}', names)
                self.assertEqual(len(re.findall(r'^  block \d+ \(layer \d+, stage \d+, MoE layer \d+\): ', p.stdout,
                                                re.M)), expected_layout(os.path.join(DATA, name))['moe_layers'])

    def test_verify_compares_expert_weights(self):
        name, rules = 'zero1_fp32_ep2_dp4', SAVES['zero1_fp32_ep2_dp4']
        src = os.path.join(DATA, name)
        p = run('verify', src, src, '--rules', rules)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)
        changed = self.copy(name)
        f = os.path.join(tag_dir(changed), 'layer_1_expert_2_mp_rank_00_model_states.pt')
        sd = torch.load(f)
        key = next(k for k in sd if k.endswith('dense_4h_to_h.weight'))
        sd[key][3, 5] += 1.0
        torch.save(sd, f)
        p = run('verify', src, changed, '--rules', rules)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn('layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.2.dense_4h_to_h.weight', p.stdout)

    def test_builtin_rules_detect_the_moe_family_and_name_what_the_toy_model_lacks(self):
        p = run('lint', os.path.join(DATA, 'zero1_fp32_ep2_dp4'))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertEqual(p.stdout.splitlines()[-1],
                         "lint: the checkpoint cannot be converted with rule set 'megatron-gpt2-moe'")
        self.assertRegex(p.stdout, r'missing key: language_model\.encoder\.layers\.0 .*query_key_value')

    def test_old_expert_file_form_reads_as_the_same_model(self):
        name, rules = 'zero1_fp32_ep2_dp4', SAVES['zero1_fp32_ep2_dp4']
        old = self.copy(name)
        tag = tag_dir(old)
        merged = collections.defaultdict(dict)
        for f in sorted(glob.glob(os.path.join(tag, 'layer_*_expert_*_model_states.pt'))):
            m, e, mp = map(int, EXPERT_FILE.match(os.path.basename(f)).groups())
            merged[(e, mp)].update(torch.load(f))
            os.remove(f)
        for (e, mp), sd in merged.items():
            torch.save(sd, os.path.join(tag, f'expert_{e}_mp_rank_{mp:02d}_model_states.pt'))
        p = run('inspect', old, '--rules', rules)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('expert files: old form expert_{e}_mp_rank_*', p.stdout)
        p = run('verify', os.path.join(DATA, name), old, '--rules', rules)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)


class RefusalTests(MoeReadTestCase):
    NAME = 'zero1_fp32_ep2_dp4'
    RULES = SAVES['zero1_fp32_ep2_dp4']

    def test_missing_expert_file(self):
        root = self.copy(self.NAME)
        os.remove(os.path.join(tag_dir(root), 'layer_1_expert_2_mp_rank_00_model_states.pt'))
        self.refuse(root, self.RULES, r'^reshard: error: layer_1_expert_2_mp_rank_00_model_states\.pt is missing '
                                      r'\(mp_rank_00_model_states\.pt records num_experts \[4, 4\]\)')

    def test_swapped_expert_files(self):
        root = self.copy(self.NAME)
        tag = tag_dir(root)
        a, b = (os.path.join(tag, f'layer_0_expert_{e}_mp_rank_00_model_states.pt') for e in (2, 3))
        os.rename(a, a + '.tmp')
        os.rename(b, a)
        os.rename(a + '.tmp', b)
        self.refuse(root, self.RULES, r'^reshard: error: layer_0_expert_\d_mp_rank_00_model_states\.pt holds '
                                      r'.*expert \d of MoE layer 0; the file is misnamed')

    def test_duplicated_expert_file(self):
        root = self.copy(self.NAME)
        tag = tag_dir(root)
        shutil.copy(os.path.join(tag, 'layer_0_expert_3_mp_rank_00_model_states.pt'),
                    os.path.join(tag, 'layer_0_expert_4_mp_rank_00_model_states.pt'))
        self.refuse(root, self.RULES, r'layer_0_expert_4_mp_rank_00_model_states\.pt and '
                                      r'layer_0_expert_3_mp_rank_00_model_states\.pt both hold')

    def test_missing_expp_rank_file_contradicts_the_moe_groups(self):
        root = self.copy(self.NAME)
        os.remove(os.path.join(tag_dir(root), 'expp_rank_1_mp_rank_00_optim_states.pt'))
        self.refuse(root, self.RULES, r'expp_rank_1_mp_rank_00_optim_states\.pt is missing: the MoE optimizer '
                                      r'groups of mp_rank_00 are partitioned over 2 ranks, so DP 4 has EP 2')

    def test_edited_num_experts(self):
        root = self.copy(self.NAME)
        f = os.path.join(tag_dir(root), 'mp_rank_00_model_states.pt')
        sd = torch.load(f)
        sd['num_experts'] = [4, 8]
        torch.save(sd, f)
        self.refuse(root, self.RULES, r'layer_1_expert_4_mp_rank_00_model_states\.pt is missing '
                                      r'\(mp_rank_00_model_states\.pt records num_experts \[4, 8\]\)')

    def test_expert_files_removed_by_hand(self):
        root = self.copy(self.NAME)
        for f in glob.glob(os.path.join(tag_dir(root), 'layer_*_expert_*')) + \
                glob.glob(os.path.join(tag_dir(root), 'expp_rank_*')):
            os.remove(f)
        self.refuse(root, self.RULES, r'records num_experts \[4, 4\] but .* has no layer_\*_expert_\*_model_states'
                                      r'\.pt files; put the expert files back')

    def test_stages_that_do_not_follow_each_other(self):
        root = self.copy('pipe_pp2_ep2_dp2')
        tag = tag_dir(root)
        shutil.copy(os.path.join(tag, 'mp_rank_00_model_states.pt'), os.path.join(tag, 'mp_rank_01_model_states.pt'))
        self.refuse(root, SAVES['pipe_pp2_ep2_dp2'], r"^reshard: error: mp_rank_01 starts at spec 0, not after the "
                                                     r"previous stage's last spec 2; the checkpoint mixes saves")

if __name__ == '__main__':
    support.main()
