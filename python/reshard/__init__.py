"""reshard: reshape large-model training checkpoints between parallel layouts and formats.

The commands of the ``reshard`` binary, as functions whose keyword arguments are
the CLI's options (``--weights-only`` is ``weights_only=True``); each returns its
report as a dict and raises :class:`Error`, whose message is the CLI's one line::

    import reshard
    report = reshard.lint("ckpts/global_step20", tp=4, pp=2)
    reshard.convert("ckpts/global_step20", "out/global_step20", tp=4, pp=2,
                    progress=print)

and a checkpoint read in place, without writing a converted copy::

    ckpt = reshard.open("ckpts/global_step20")
    ckpt.keys()                              # canonical names
    ckpt.tensor("final_layernorm.weight")
    ckpt.state_dict(tp=2, pp=1, tp_rank=0)   # what that rank's layer files hold
    ckpt.optimizer_state(tp=2, pp=1, dp=4, tp_rank=0, dp_rank=3)

Tensors come back as ``torch.Tensor`` (``as_numpy=True``: numpy arrays), made
from the memory-mapped source files; a tensor stored contiguously is mapped
copy-on-write rather than copied. Calls release the GIL while they read or
write, so several threads may use the module at once.
"""

import argparse
import re

from ._reshard import Error
from . import _reshard

__all__ = ["Error", "PickledObject", "Checkpoint", "open", "lint", "inspect", "convert",
           "export", "verify", "target_formats", "rule_sets"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def _bytes(value, name):
    """An int, or a size such as "4GiB" or "512MB", as the CLI reads them."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise Error(f"{name} takes a number of bytes or a size such as 4GiB, not {value!r}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def _sizes(kwargs):
    for name in ("max_memory", "buffer_size", "max_shard_size"):
        if name in kwargs:
            kwargs[name] = _bytes(kwargs[name], name)
    return kwargs


class PickledObject:
    """An object of a pickled tree that reshard keeps as plain data: its class
    ("module.name"), the arguments it was built with and its state; args and state
    are None for a reference to a class or function that the tree names but never calls."""

    def __init__(self, cls, args, state):
        self.cls, self.args, self.state = cls, args, state

    def __repr__(self):
        return f"PickledObject({self.cls!r}, args={self.args!r}, state={self.state!r})"


def _make_object(cls, args, state):
    if args is None:  # a global: torch's dtypes are the ones optimizer states name
        module, _, name = cls.rpartition(".")
        if module == "torch":
            import torch
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        return PickledObject(cls, None, None)
    if cls == "argparse.Namespace" and not args:
        return argparse.Namespace(**{str(k): v for k, v in state.items()})
    return PickledObject(cls, list(args), dict(state))


_NUMPY_DTYPES = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
                 "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?", "complex64": "<c8",
                 "complex128": "<c16"}


def _torch_tensor(data, dtype, shape):
    import torch
    torch_dtype = getattr(torch, dtype)
    if len(memoryview(data)) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(data, dtype=torch_dtype).reshape(shape)


def _numpy_array(data, dtype, shape):
    import numpy
    if dtype not in _NUMPY_DTYPES:
        raise Error(f"numpy has no {dtype}; read this tensor as a torch tensor (as_numpy=False)")
    return numpy.frombuffer(data, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)


def _factories(as_numpy):
    return _reshard.Factories(_numpy_array if as_numpy else _torch_tensor, _make_object)


class Checkpoint:
    """A checkpoint opened in place (see :func:`open`)."""

    def __init__(self, path, **options):
        self._c = _reshard.Checkpoint(str(path), **options)

    @property
    def summary(self):
        """One line: its kind, layout, iteration and counts."""
        return self._c.summary()

    def keys(self):
        """The canonical names of every tensor, weights first, then optimizer states."""
        return self._c.keys()

    def meta(self, name):
        """A dict: name, section ("weights" or "optimizer"), param, state, dtype, shape, rule."""
        return self._c.meta(name)

    def tensor(self, name, as_numpy=False):
        """The tensor ``name`` whole, TP replicas merged as the open's ``replicated`` says."""
        return self._c.tensor(name, _factories(as_numpy))

    def state_dict(self, tp=1, pp=1, tp_rank=0, pp_rank=0, ep=1, ep_rank=0, as_numpy=False):
        """The weights rank (tp_rank, pp_rank) of TP ``tp`` x PP ``pp`` loads: every tensor of
        its layer files as ``convert`` would write them, keyed ``layer_NN.<key in the file>``
        (a non-pipeline checkpoint: its mp_rank file's module, keyed as there). A DeepSpeed MoE
        checkpoint's rank at EP ``ep`` loads that module and the expert files of EP rank
        ``ep_rank``, keyed as there."""
        return self._c.state_dict(_factories(as_numpy), tp, pp, ep, tp_rank, pp_rank, ep_rank)

    def optimizer_state(self, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, ep=1, ep_rank=None,
                        as_numpy=False):
        """The optimizer state that rank loads: the tree of the ZeRO shard file ``convert``
        would write for it at DP ``dp`` (and EP ``ep``: DP rank d is EP rank d % ep, the
        default ``ep_rank``), as torch.load would give it."""
        if ep_rank is None:
            ep_rank = dp_rank % ep if ep > 0 else 0
        return self._c.optimizer_state(_factories(as_numpy), tp, pp, dp, ep, tp_rank, pp_rank, dp_rank, ep_rank)

    def export(self, to, as_numpy=False, **options):
        """What ``reshard.export(..., to=to)`` would write, made in memory: a dict with
        "state_dict" (its tensors by their keys in its files: the HF model's names for
        ``to="hf"``), "texts" (config.json, ...) and "copies" (a tokenizer's files, as bytes).
        Options as export's (dtype, from_, tokenizer, ...)."""
        return self._c.export(_factories(as_numpy), to=to, **_sizes(options))


def open(path, rules=None, set=None, **options):  # noqa: A001 (reshard.open, as the issue names it)
    """Opens the checkpoint at ``path`` (a tag folder or a root holding ``latest``), any format
    reshard reads, without writing anything. ``rules``: a rule file or built-in name; ``set``:
    values the rules need that the checkpoint does not record ({"num_attention_heads": 16});
    also replicated, weights_only, vocab_size, allow_class, state_dict_prefixes ("model,optim": a DCP
    recipe save's prefixes where they are ambiguous), threads, check_crc."""
    if set is not None:
        options["set"] = {str(k): str(v) for k, v in set.items()}
    return Checkpoint(path, rules=rules, **options)


def _stringify_set(options):
    if options.get("set") is not None:
        options["set"] = {str(k): str(v) for k, v in options["set"].items()}
    return options


def lint(checkpoint, **options):
    """Dry run: can the checkpoint be reshaped (tp=, pp=, dp= for a target)? A dict with ok,
    rule_set, summary, findings [{severity, message}] and notes."""
    return _reshard.lint(str(checkpoint), **_stringify_set(options))


def inspect(checkpoint, **options):
    """A description of the checkpoint, as ``reshard inspect`` prints it."""
    return _reshard.inspect(str(checkpoint), **_stringify_set(options))


def convert(input, output, **options):  # noqa: A002
    """Writes the checkpoint at another layout (tp=, pp=, dp=, ep=; each kept from the source when
    not given), in its own format or the one ``to=`` names ("deepspeed", or any of
    ``target_formats()``, with that format's options as for ``export``); returns the report
    (files, bytes, memory, phases, notes). ``progress``: a callable taking each line."""
    return _reshard.convert(str(input), str(output), **_sizes(_stringify_set(options)))


def export(input, output, **options):  # noqa: A002
    """Writes the checkpoint in another format (``to=``, one of ``target_formats()``) at the layout
    sizes it takes (tp=, pp=, dp=, ep=: its "layout"), with the options that format declares as keyword arguments (the CLI's --layer-spec is layer_spec=,
    --from is from_=)."""
    return _reshard.export(str(input), str(output), **_sizes(_stringify_set(options)))


def verify(a, b=None, **options):
    """Compares two checkpoints tensor by tensor (a dict with same, differences, ...), or with
    ``b`` left out checks ``a`` against the manifest reshard wrote into it."""
    return _reshard.verify(str(a), None if b is None else str(b), **_sizes(_stringify_set(options)))


def target_formats():
    """The formats convert and export write: name, help, output, the layout sizes (tp, pp, dp)
    each takes, and its options (name, kind, help, choices, default)."""
    return _reshard.target_formats()


def rule_sets():
    """The built-in rule sets: name, description and origin of each."""
    return _reshard.rule_sets()
