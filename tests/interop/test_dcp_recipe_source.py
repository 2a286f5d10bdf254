"""Saves made with PyTorch's Distributed Checkpoint recipe, read by reshard as a model with its AdamW
state (the dcp_recipe format).

Real torch 2.6 (the Debian trixie chroot of torch2_chroot.py; skipped with one line when it cannot
be had) trains a small Llama-style model one AdamW step and saves it as torch's recipe does:
`get_state_dict(model, optimizer)` and `dcp.save` of the two dicts under top-level prefixes. The
model is an nn.Module with HF transformers' LlamaForCausalLM parameter names (transformers is not
in the chroot): GQA (4 query heads, 2 KV heads), an FFN width of 27 and a vocabulary of 100, so
FSDP2's Shard(0) cuts them unevenly.

* `recipe_w2`: FSDP2 (`fully_shard`) at world 2 on gloo, saved as `{"model": ..., "optim": ...}`;
* `appstate_w3`: FSDP2 at world 3 (uneven shares: 100 vocabulary rows as 34 + 33 + 33), saved as the tutorial's
  `{"app": AppState(model, optimizer)}` (keys `app.model.` / `app.optim.`);
* `flat_w1`: one process, the optimizer's state dict flattened (`flatten_optimizer_state_dict=True`:
  `optim.param_groups.<fqn>.lr`, as torchtitan saves it);
* `sgd_w1`: one process, SGD with momentum (no Adam moments): refused in one line;
* `qknorm_w1`: one process, a parameter no built-in family's HF names have: refused in one line
  naming the rule-file sections to add;
* `ambiguous_w1`: one process, the model under both `model` and `ema` beside `optim`: refused in
  one line naming --state-dict-prefixes, read once the option names the pair.

Each save's tensors are loaded back by torch (`dcp.load` into zeros, one process) and kept as
NAME_full.pt. On the host: inspect shows the format and its optimizer; convert to
Megatron-DeepSpeed, export --to torch_dist and --to hf; verify says the same model with its
optimizer state; and the weights, exp_avg and exp_avg_sq that the outputs hold equal the save's.

Run: PYTHONPATH=tests:tests/interop /usr/bin/python3 tests/interop/test_dcp_recipe_source.py
     --reshard build/reshard
"""
import glob
import os
import shutil
import sys
import tempfile

import torch

import interop_support as support
from interop_support import FixtureTestCase
import torch2_chroot
from test_torchtitan_source import assert_universal_states, canonical

run = support.reshard

CFG = dict(n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, tied=False)
HEADS = ('--set', 'num_attention_heads=4')
# verify compares the 15 canonical weights, and their fp32 masters, exp_avg and exp_avg_sq
COMPARED = 'verify: 60 tensors'
PREFIXES = {'recipe_w2': ('model.', 'optim.'), 'appstate_w3': ('app.model.', 'app.optim.'),
            'flat_w1': ('model.', 'optim.')}

# The model, its AdamW and a training step, as torch 2.6 in the chroot runs them (also
# test_dcp_recipe_target's).
MODEL = r'''
import datetime, socket
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 27, 100, 2

# torch 2.6's FSDP2 on CPU waits on stream events that torch.cpu.Stream lacks; CPU work runs in
# order on one stream, so events that do nothing are exact.
if not hasattr(torch.cpu.Stream, 'record_event'):
    torch.cpu.Stream.record_event = lambda self, event=None: event if event is not None else torch.cpu.Event()
    torch.cpu.Stream.wait_event = lambda self, event: None

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 2).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.mlp = Mlp()

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))

class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)

class LlamaForCausalLM(nn.Module):
    """HF's parameter names: model.embed_tokens, model.layers.N.{...}, model.norm, lm_head."""
    def __init__(self):
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():  # non-unit norms, so that a reader mixing them up is seen
            for name, p in self.named_parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if 'norm' in name
                        else 0.2 * torch.randn(p.shape, generator=g))

    def forward(self, tokens):
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))

class AppState(Stateful):
    """The DCP tutorial's wrapper: the model's and optimizer's state dicts under model / optim."""
    def __init__(self, model, optimizer, options=None):
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {'model': model_sd, 'optim': optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict['model'],
                       optim_state_dict=state_dict['optim'], options=self.options)

def batch_loss(model, seed):
    """The loss of the fixed batch `seed` (every rank the same batch)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

def step(model, optimizer, seed=99):
    """One AdamW step on batch `seed`; its loss."""
    loss = batch_loss(model, seed)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()

def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

def load_back(name):
    """Every tensor of the save, by key, as dcp.load gives it back in one process."""
    metadata = dcp.FileSystemReader('/data/' + name).read_metadata()
    got = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
           if hasattr(m, 'chunks')}
    dcp.load(got, checkpoint_id='/data/' + name)
    torch.save(got, f'/data/{name}_full.pt')
'''

# Run by torch 2.6 in the chroot, the test's temporary folder at /data. Ranks are forked before this
# process starts any thread (dcp.save writes through a thread pool).
GENERATE = MODEL + r'''
def rank(r, world, port, name):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh('cpu', (world,))
    torch.manual_seed(0)
    model = LlamaForCausalLM()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model)
    step(model, optimizer)
    if name == 'appstate_w3':
        dcp.save({'app': AppState(model, optimizer)}, checkpoint_id='/data/' + name)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({'model': model_sd, 'optim': optim_sd}, checkpoint_id='/data/' + name)
    end_rank(dist)

def single(name):
    model = LlamaForCausalLM()
    if name == 'qknorm_w1':  # a Qwen3-style norm of the queries, which no built-in family has
        model.model.layers[0].self_attn.q_norm = nn.RMSNorm(HEAD_DIM)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if name == 'sgd_w1' else adamw(model)
    step(model, optimizer)
    flat = StateDictOptions(flatten_optimizer_state_dict=(name == 'flat_w1'))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=flat)
    state = {'model': model_sd, 'optim': optim_sd}
    if name == 'ambiguous_w1':  # an EMA copy of the model beside it
        state['ema'] = {k: v.clone() for k, v in model_sd.items()}
    dcp.save(state, checkpoint_id='/data/' + name)

for name, world in (('recipe_w2', 2), ('appstate_w3', 3)):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(rank, args=(world, port, name), nprocs=world, start_method='fork')
for name in ('flat_w1', 'sgd_w1', 'ambiguous_w1', 'qknorm_w1'):
    single(name)
for name in ('recipe_w2', 'appstate_w3', 'flat_w1', 'sgd_w1', 'ambiguous_w1'):
    load_back(name)
print('torch', torch.__version__)
'''


def hf_of(full, prefix, state=None):
    """The save's HF-named tensors under `prefix`: the weights, or optimizer state `state`."""
    if state is None:
        return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    head = prefix + 'state.'
    return {k[len(head):-len(state) - 1]: v for k, v in full.items()
            if k.startswith(head) and k.endswith('.' + state)}


class DcpRecipeSourceTest(FixtureTestCase):

    @classmethod
    def setUpClass(cls):
        root = torch2_chroot.root_or_skip()
        cls.work = tempfile.mkdtemp(prefix='reshard-recipe-')
        cls.addClassCleanup(shutil.rmtree, cls.work)
        p = torch2_chroot.run(root, torch2_chroot.END_RANK + GENERATE, {cls.work: '/data'}, timeout=600)
        if p.returncode:
            raise AssertionError('torch 2 could not write the saves:\n' + p.stdout + p.stderr)
        print(p.stdout.strip(), file=sys.stderr)

    def saved(self, name):
        return os.path.join(self.work, name)

    def full(self, name):
        return torch.load(self.saved(name + '_full.pt'))

    def test_inspect_shows_the_recipe_with_its_optimizer(self):
        for name, (model, optim) in PREFIXES.items():
            with self.subTest(save=name):
                p = run('inspect', self.saved(name), *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('format: dcp_recipe', p.stdout)
                self.assertIn(f"HF's names (the model under {model}, the optimizer under {optim})", p.stdout)
                self.assertIn("dcp_recipe's AdamW state (exp_avg, exp_avg_sq", p.stdout)
                world = int(name[-1])
                self.assertIn(f'dp_shard {world}', p.stdout)

    def test_convert_to_megatron_deepspeed_carries_the_adamw_state(self):
        for name, (model, optim) in PREFIXES.items():
            with self.subTest(save=name):
                ms = self.path('ms_' + name, 'global_step1')
                p = run('convert', '--to', 'deepspeed', self.saved(name), ms, '--tp', 1, '--pp', 2, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', self.saved(name), ms, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                self.assertIn(COMPARED, p.stdout)
                uni = self.path('uni_' + name)
                p = run('export', ms, uni, '--to', 'universal')
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                full = self.full(name)
                want = {'fp32': canonical(hf_of(full, model), CFG)}
                for state in ('exp_avg', 'exp_avg_sq'):
                    want[state] = canonical(hf_of(full, optim, state), CFG)
                compared = assert_universal_states(self, uni, want, CFG['n_layers'])
                self.assertEqual(compared, 3 * 15)  # 15 canonical weights
                shard = torch.load(sorted(glob.glob(os.path.join(ms, '*optim_states.pt')))[0])
                inner = shard['optimizer_state_dict']['base_optimizer_state']
                self.assertEqual([(g['lr'], g['weight_decay'], tuple(g['betas'])) for g in inner['param_groups']],
                                 [(1e-3, 0.1, (0.9, 0.95))] * 2)
                self.assertEqual({int(s['step']) for s in inner['state'].values()}, {1})

    def test_export_to_torch_dist_and_hf(self):
        for name, (model, optim) in PREFIXES.items():
            with self.subTest(save=name):
                td = self.path('td_' + name)
                p = run('export', self.saved(name), td, '--to', 'torch_dist', '--tp', 1, '--pp', 1, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                p = run('verify', self.saved(name), td, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)
                self.assertIn(COMPARED, p.stdout)
                hf = self.path('hf_' + name)
                p = run('export', self.saved(name), hf, '--to', 'hf', '--format', 'pt', *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                got = torch.load(os.path.join(hf, 'pytorch_model.bin'))
                want = hf_of(self.full(name), model)
                self.assertEqual(sorted(got), sorted(want))
                for key in want:
                    self.assertTrue(torch.equal(got[key], want[key]), key)
                p = run('verify', self.saved(name), hf, *HEADS)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn('same model', p.stdout)

    def test_another_optimizer_is_refused_in_one_line(self):
        out = self.path('ms_sgd')
        p = run('convert', '--to', 'deepspeed', self.saved('sgd_w1'), out, '--tp', 1, '--pp', 1, *HEADS)
        self.assertRefused(p, 'holds momentum_buffer per parameter, not Adam', out)
        self.assertIn('--weights-only', p.stderr)
        p = run('convert', '--to', 'deepspeed', self.saved('sgd_w1'), out, '--tp', 1, '--pp', 1, '--weights-only',
                *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_a_model_no_family_maps_is_refused_in_one_line(self):
        out = self.path('ms_qknorm')
        p = run('convert', '--to', 'deepspeed', self.saved('qknorm_w1'), out, '--tp', 1, '--pp', 1, *HEADS)
        self.assertRefused(p, 'model.layers.0.self_attn.q_norm.weight is no HF name', out)
        self.assertIn("needs a rule file whose hf section names its HF model and whose torchtitan section", p.stderr)

    def test_two_model_prefixes_are_refused_until_named(self):
        out = self.path('ms_ambiguous')
        p = run('convert', '--to', 'deepspeed', self.saved('ambiguous_w1'), out, '--tp', 1, '--pp', 1, *HEADS)
        self.assertRefused(p, 'more than one pair of prefixes (ema,optim; model,optim)', out)
        self.assertIn('--state-dict-prefixes MODEL,OPTIM', p.stderr)
        p = run('convert', '--to', 'deepspeed', self.saved('ambiguous_w1'), out, '--tp', 1, '--pp', 1,
                '--state-dict-prefixes', 'model,optim', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('ema not carried', p.stdout + p.stderr)
        p = run('verify', self.saved('ambiguous_w1'), out, '--state-dict-prefixes', 'model,optim', *HEADS)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn('same model', p.stdout)


if __name__ == '__main__':
    support.main()
