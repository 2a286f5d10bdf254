"""Layer files that a conversion leaves as they are are copies of the source's files.

A layer_NN-model_TT file holds layer NN's shards of TP rank TT whatever the PP and DP sizes, so
a DP- or PP-only change writes each one as a copy of the source's (which a file system with
reflinks clones): the output file is the source file byte for byte, torch.load reads it, and
`verify` finds the same model. Where the file would change it is written: a TP change's
split tensors; and
TP rank 1's file when its replicated tensors (norms, biases) differ from rank 0's, which the
writer takes. A damaged record in a file that would be copied still refuses the run.

Run: /usr/bin/python3 tests/interop/test_layer_file_copy.py --reshard build/reshard
"""
import filecmp
import glob
import os
import struct
import tempfile
import unittest
import zipfile

import interop_support as support
from interop_support import reshard


def layer_files(tag_dir):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(tag_dir, 'layer_*-model_states.pt')))


class LayerFileCopyTest(unittest.TestCase):

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def fixture(self, name, style='ms_gpt2', **kw):
        return support.make_fixture(os.path.join(self.tmp, name), style=style, tp=2, pp=2, dp=2,
                                    optimizer='bf16_zero', **kw)

    def convert(self, src, name, *layout, expect_ok=True):
        out = os.path.join(self.tmp, name, 'global_step10')
        p = reshard('convert', src, out, *layout, '-q')
        if expect_ok:
            self.assertEqual(p.returncode, 0, p.stderr)
        return out, p

    def same_as_source(self, src, out):
        names = layer_files(out)
        self.assertEqual(names, layer_files(src))
        return [n for n in names if filecmp.cmp(os.path.join(src, n), os.path.join(out, n), shallow=False)]

    def test_dp_and_pp_changes_copy_every_layer_file(self):
        """Also where a weight is planned as several boxes: the SwiGLU [gate; up] weight of a
        Llama-style block, one box per half."""
        for style in ('ms_gpt2', 'ms_llama'):
            src = self.fixture(style, style=style)
            for name, layout in (('dp4', ('--tp', 2, '--pp', 2, '--dp', 4)),
                                 ('pp1', ('--tp', 2, '--pp', 1, '--dp', 4))):
                with self.subTest(style=style, layout=name):
                    dry = reshard('convert', src, os.path.join(self.tmp, 'dry'), *layout, '--dry-run')
                    self.assertIn('copied from ' + support.layer_file(src, 3, 1), dry.stdout)
                    out, _ = self.convert(src, style + name, *layout)
                    self.assertEqual(self.same_as_source(src, out), layer_files(src))
                    support.load(support.layer_file(out, 3, 1))  # torch reads it
                    self.assertIn('same model', reshard('verify', src, out).stdout)
                    self.assertEqual(reshard('verify', out).returncode, 0)  # the manifest has the copies' CRCs

    def test_a_tp_change_writes_the_files_it_splits(self):
        """TP 2 -> 1 merges the blocks' split tensors: their files are written. A file of
        replicated tensors only (the final norm's, TP rank 0's) is the same file, so a copy."""
        src = self.fixture('src')
        out, _ = self.convert(src, 'tp1', '--tp', 1, '--pp', 2, '--dp', 4)
        copied = [n for n in layer_files(out) if os.path.exists(os.path.join(src, n))
                  and filecmp.cmp(os.path.join(src, n), os.path.join(out, n), shallow=False)]
        self.assertNotIn(os.path.basename(support.layer_file(src, 3, 0)), copied)
        for name in copied:
            self.assertTrue(all(t.dim() == 1 for t in support.load(os.path.join(out, name)).values()), name)
        self.assertIn('same model', reshard('verify', src, out).stdout)

    def test_rank_1_with_other_replicas_is_written_from_rank_0s(self):
        """With drifted replicas (--replicated first takes TP rank 0's), rank 1's block files are
        not its source files, whose norms differ: they are written; rank 0's are still copies."""
        src = self.fixture('src', tp_drift_eps=1e-2)
        out, _ = self.convert(src, 'dp4', '--tp', 2, '--pp', 2, '--dp', 4, '--replicated', 'first')
        copied = self.same_as_source(src, out)
        self.assertIn(os.path.basename(support.layer_file(src, 3, 0)), copied)
        self.assertNotIn(os.path.basename(support.layer_file(src, 3, 1)), copied)
        want, got = support.load(support.layer_file(src, 3, 0)), support.load(support.layer_file(out, 3, 1))
        norm = next(k for k in want if 'layernorm' in k)
        self.assertTrue(want[norm].equal(got[norm]))

    def test_a_damaged_record_of_a_copied_file_refuses_the_run(self):
        src = self.fixture('src')
        path = support.layer_file(src, 3, 1)
        with zipfile.ZipFile(path) as z:  # the biggest storage record
            record = max((i for i in z.infolist() if '/data/' in i.filename), key=lambda i: i.file_size)
        with open(path, 'r+b') as f:
            f.seek(record.header_offset + 26)
            name_len, extra_len = struct.unpack('<HH', f.read(4))
            at = record.header_offset + 30 + name_len + extra_len + record.file_size // 2
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xff]))
        out, p = self.convert(src, 'dp4', '--tp', 2, '--pp', 2, '--dp', 4, expect_ok=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn('does not have the CRC-32 its zip directory records', p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == '__main__':
    support.main()
