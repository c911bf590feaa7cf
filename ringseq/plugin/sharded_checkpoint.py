"""Checkpoints of sharded (FSDP / tensor-parallel) and replicated training state.

Model: always the FULL state dict, the same keys and tensors as the plain model built without
ringseq, from any mesh. The state dict of this rank's shards, under the plain model's names
(``torch.distributed.checkpoint.state_dict.get_model_state_dict``), is gathered tensor by
tensor (``DTensor.full_tensor``, collective; only rank 0 keeps a CPU copy), the ranks agreeing
after each copy that every rank succeeded (:func:`full_model_state_dict`), and written by rank
0, either as one ``torch.save`` file or, with ``max_shard_size``, as transformers-style shards
in a directory (``pytorch_model-00001-of-0000N.bin`` + ``pytorch_model.bin.index.json``: a
``weight_map`` from key to file), which transformers' ``load_sharded_checkpoint``
(``transformers.trainer_utils`` in transformers 5, ``modeling_utils`` in 4.x) or plain
``torch.load`` of each shard reads. Loading reads the full state dict on every rank and cuts
this rank's shards from it locally (``distribute_tensor(src_data_rank=None)``), so a
checkpoint of any mesh loads into any other.

Optimizer: sharded training writes its state with ``torch.distributed.checkpoint`` (a
directory; every rank writes its own shards, keyed by parameter name through
``get_optimizer_state_dict``), which ``dcp.load`` reshards into any other mesh (dp, sp, tp or
zero_stage changed, replicated included). Replicated training writes the plain
``torch.optim`` state dict file as before (``sharded=True`` writes the directory format
instead); loading takes either format on any mesh.

Loading is all or nothing (as ReplicatedCheckpointIO's): the model's full state dict, or the
optimizer's state read by ``dcp.load`` into new tensors laid out as this rank's, is checked
on every rank, the ranks vote, and only then is anything applied.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from .._dist import agree_on_fields, agree_or_raise
from ..parallel.fsdp import reshard_gathered
from .checkpoint import (_SAVE_KEY, ReplicatedCheckpointIO, _check_model_state,
                         _check_optimizer_state, _load, _unwrap, _with_scaler_state, _write,
                         on_writer, read_file, refuse_unloadable, save_scaler, scaler_state,
                         wrong_kind)
from .checkpoint_call import checkpoint_call, current_call, shard_bytes

# The fp16 grad scaler's state inside a sharded optimizer checkpoint's directory.
_SCALER_FILE = "grad_scaler.pt"
# Whether the save wrote the grad scaler's file, recorded in the directory's metadata (the
# entry "ringseq_save.grad_scaler", beside the optimizer's) as the plain file records it in its
# save id: without it a directory whose grad_scaler.pt is gone loaded and kept the live loss
# scale. (A bool alike on every rank: dcp keeps one rank's copy of a non-tensor entry.)
_SCALER_RECORD = f"{_SAVE_KEY}.grad_scaler"

__all__ = ["DistributedCheckpointIO", "INDEX_NAME"]

INDEX_NAME = "pytorch_model.bin.index.json"


def _is_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


def _holds_dtensors(optimizer) -> bool:
    """Whether an optimizer (boosted or the user's own object) holds sharded parameters."""
    from torch.distributed.tensor import DTensor
    inner = _unwrap(optimizer)
    return any(isinstance(p, DTensor) for g in getattr(inner, "param_groups", ())
               for p in g["params"])


def full_model_state_dict(model) -> dict:
    """The full state dict of ``model`` (any sharding) on rank 0, as CPU tensors; ``{}`` on
    the other ranks of a sharded model.

    Collective when the model is sharded: the ranks gather it tensor by tensor and agree after
    laying out their shards and after each tensor's copy on rank 0 that every rank succeeded
    (torch's full-state gather has no such point: a rank that failed alone, out of memory for
    its copy, left the others in the next gather until the process group's timeout). Raises
    the failing rank's error there and ValueError on the other ranks. A failure inside a
    gather itself (one rank out of memory for the full tensor) is the process group's: the
    others wait in it until that rank's process ends or the group's timeout. What the load
    could not read back is refused by the writer (:func:`refuse_unloadable`)."""
    reshard_gathered(model)
    if not _is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor
    state, error = None, None
    try:  # (local: this rank's shards under the model's names)
        state = get_model_state_dict(model)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error = exc
    fn = current_call()
    agree_or_raise(error is None, f"{fn}: collecting the model's state failed: {error!r}",
                   error=error,
                   peer_message=f"{fn}: collecting the model's state failed on another rank")
    full, keep = {}, dist.get_rank() == 0
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # (collective)
        try:
            if keep:
                full[key] = _host_copy(key, value)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = exc
        agree_or_raise(error is None, f"{fn}: copying {key!r} of the model's state to the host "
                       f"failed: {error!r}", error=error,
                       peer_message=f"{fn}: copying {key!r} of the model's state failed on "
                                    f"another rank")
    return full


def _host_copy(key: str, value):
    """A state dict entry as rank 0 keeps it: a tensor on the CPU, anything else (a module's
    extra state) as it is; the write refuses what the load cannot read back
    (:func:`refuse_unloadable`). ``key``: the entry's name, for a test's failing copy."""
    return value.detach().cpu() if torch.is_tensor(value) else value


def _write_shards(state: dict, directory: str, max_bytes: int) -> None:
    shards, current, size = [], {}, 0
    for key, t in state.items():
        n = t.numel() * t.element_size() if torch.is_tensor(t) else 0
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += n
    shards.append(current)
    os.makedirs(directory, exist_ok=True)
    # The old index goes first: a save that fails part way leaves a directory without an
    # index (refused at load), never an index over a mix of old and new shards.
    _remove_if_there(os.path.join(directory, INDEX_NAME))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        _write(shard, os.path.join(directory, name))
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size() if torch.is_tensor(t) else 0
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    _write(index, os.path.join(directory, INDEX_NAME))  # (last, atomically)


def _remove_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.remove(path)


def read_full_state_dict(path: str) -> dict:
    """A full state dict from one file or a directory of transformers-style shards."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if not os.path.isfile(index):
            other = (": it holds torch.distributed.checkpoint's .metadata, an optimizer "
                     "checkpoint (for load_optimizer)"
                     if os.path.isfile(os.path.join(path, ".metadata")) else "")
            if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
                other = (": it holds model.safetensors.index.json, transformers' "
                         "save_pretrained format (load it with from_pretrained)")
            raise ValueError(f"{path!r} is a directory without {INDEX_NAME}: not a model "
                             f"checkpoint save_model wrote, or one whose save failed part way "
                             f"(the index is written last){other}")
        try:
            with open(index) as f:
                meta = json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:  # (JSONDecodeError is a ValueError)
            # (before: the decoder's words alone, naming no file)
            raise ValueError(f"{index!r} is not the JSON index save_model writes ({exc}): "
                             f"damaged or cut short after the save") from None
        weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{index!r} has no weight_map (parameter name -> shard file): not "
                             f"an index save_model wrote")
        files = sorted(set(weight_map.values()))
        state = {}
        for name in files:
            shard = read_file(os.path.join(path, name))
            if not isinstance(shard, dict):
                # (before: dict.update's TypeError, naming no file)
                raise ValueError(f"{os.path.join(path, name)!r}, a shard {INDEX_NAME} names, "
                                 f"holds a {type(shard).__name__}, not the dict of tensors "
                                 f"(parameter name -> tensor) save_model writes")
            state.update(shard)
        return state
    return read_file(path)


def _cut_like(value: torch.Tensor, like, dtype=None):
    """This rank's shard of the whole tensor ``value`` laid out as the DTensor ``like`` (its
    mesh and placements), cut locally (``distribute_tensor(src_data_rank=None)``: no
    communication, every rank holds the whole tensor)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.detach().to(like.device, dtype or value.dtype),
                             like.device_mesh, like.placements, src_data_rank=None)


def _local_shards(model, state: dict) -> dict:
    """``state`` (a full state dict) with every entry that is a DTensor in ``model``'s own
    state dict cut to this rank's shard (:func:`_cut_like`); other entries as they are."""
    from torch.distributed.tensor import DTensor
    own = model.state_dict()
    return {key: _cut_like(value, own[key], own[key].dtype)
            if isinstance(own.get(key), DTensor) and torch.is_tensor(value) else value
            for key, value in state.items()}


def _local_optimizer_shards(own: dict, full: dict, params: dict) -> dict:
    """``full`` (an optimizer state dict by parameter name, every tensor whole) with each
    entry that is a DTensor in ``own`` (this optimizer's layout) cut to this rank's shard
    (:func:`_cut_like`), as :func:`_local_shards` does for a model. A parameter ``own`` has no
    state for (it got no gradient in the steps taken here) is laid out as its parameter in
    ``params`` (name -> parameter): its entries of the parameter's shape are cut alike."""
    from torch.distributed.tensor import DTensor

    def layout(name, key, value):
        mine = own["state"].get(name, {}).get(key)
        if isinstance(mine, DTensor):
            return mine
        p = params.get(name)
        if mine is None and isinstance(p, DTensor) and tuple(value.shape) == tuple(p.shape):
            return p
        return None
    state = {}
    for name, entries in full["state"].items():
        state[name] = {}
        for key, value in entries.items():
            like = layout(name, key, value) if torch.is_tensor(value) else None
            state[name][key] = value if like is None else _cut_like(value, like)
    return {"state": state, "param_groups": full["param_groups"]}


def _empty_like_state(state):
    """The same nested state dict with every tensor replaced by an uninitialized one of the
    same shape, dtype, device and (for a DTensor) placement: where torch.distributed.checkpoint
    loads, so that the live state is untouched until every rank has read everything."""
    from torch.utils._pytree import tree_map_only
    return tree_map_only(torch.Tensor, torch.empty_like, state)


def _dcp_read(state: dict, path: str) -> dict:
    """``dcp.load`` into ``state`` (collective: it raises on every rank when a rank fails), its
    failure as a ValueError naming the path and each failed rank's error (the loader raises a
    CheckpointException, a BaseException carrying the tracebacks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as exc:
        damaged = _damaged_files(path)
        raise ValueError(_checkpoint_exception_text(exc, path, "load")
                         + (f"; {damaged} (truncated or removed after the save)" if damaged
                            else "")) from None
    return state


def _dcp_metadata(path: str):
    """The metadata of the ``torch.distributed.checkpoint`` directory ``path``; ValueError
    naming its ``.metadata`` file when that cannot be read (before: the unpickler's words
    alone, "pickle data was truncated", naming no file)."""
    import torch.distributed.checkpoint as dcp
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise ValueError(f"{os.path.join(path, '.metadata')!r} could not be read "
                         f"({type(exc).__name__}: {exc}): the directory's metadata is damaged "
                         f"or not torch.distributed.checkpoint's") from None


def _damaged_files(path: str) -> str:
    """The data files of the directory ``path`` that are missing or shorter than its metadata
    says, as text ('' when none, or when the metadata cannot be read): what a failed load
    names (before: "rank 0: EOFError: " for a truncated file, naming none)."""
    try:
        ends: dict = {}
        for info in (_dcp_metadata(path).storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
    except (ValueError, AttributeError, TypeError):
        return ""
    damaged = []
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            damaged.append(f"{name} is missing")
        elif os.path.getsize(file) < end:
            damaged.append(f"{name} holds {os.path.getsize(file)} bytes, its metadata places "
                           f"data up to byte {end}")
    return "; ".join(damaged)


def _fqn_optimizer_state(optimizer, plain: dict) -> dict:
    """A plain ``torch.optim`` state dict (parameters numbered in param-group order) keyed by
    parameter name instead (every tensor whole: :func:`_local_optimizer_shards` cuts them)."""
    names = {id(p): n for n, p in optimizer.model.named_parameters()}
    order = [names[id(p)] for g in _unwrap(optimizer).param_groups for p in g["params"]]
    groups = plain["param_groups"]
    numbered = [i for g in groups for i in g["params"]]
    if len(numbered) != len(order):
        raise ValueError(f"the optimizer checkpoint holds {len(numbered)} parameters, the "
                         f"optimizer {len(order)}")
    by_index = dict(zip(numbered, order))
    return {"state": {by_index[i]: s for i, s in plain["state"].items()},
            "param_groups": [dict(g, params=[by_index[i] for i in g["params"]])
                             for g in groups]}


def _checkpoint_exception_text(exc, path: str, what: str) -> str:
    # (torch gives each failed rank's (exception, traceback))
    failures = {r: f[0] if isinstance(f, tuple) else f for r, f in exc.failures.items()}
    causes = "; ".join(f"rank {r}: {type(f).__name__}: {f}" if str(f) else
                       f"rank {r}: {type(f).__name__} (no message)"
                       for r, f in sorted(failures.items()))
    return f"{current_call()}: torch.distributed.checkpoint could not {what} {path!r}: {causes}"


def _dcp_state_names(path: str) -> set:
    """The parameter names a ``torch.distributed.checkpoint`` optimizer directory holds state
    for (from its metadata: keys ``optimizer.state.<parameter name>.<entry>``)."""
    prefix = "optimizer.state."
    return {k[len(prefix):].rpartition(".")[0] for k in _dcp_keys(path) if k.startswith(prefix)}


def _dcp_keys(path: str) -> list:
    """The state dict keys in the metadata of the optimizer checkpoint directory ``path``.
    ValueError when it has no metadata (another kind of directory, or a save that failed part
    way: the metadata is written last) or no optimizer state."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        other = (f": it holds {INDEX_NAME}, a model checkpoint (for load_model)"
                 if os.path.isfile(os.path.join(path, INDEX_NAME)) else "")
        raise ValueError(f"{path!r} has no .metadata: not an optimizer checkpoint directory "
                         f"save_optimizer wrote, or one whose save failed part way (the "
                         f"metadata is written last){other}")
    keys = list(_dcp_metadata(path).state_dict_metadata)
    if not any(k.startswith("optimizer.") for k in keys):
        raise ValueError(f"{path!r} holds no optimizer state (its metadata names "
                         f"{keys[:3]}...): not an optimizer checkpoint save_optimizer wrote")
    return keys


def _check_dcp_optimizer_layout(path: str, own: dict, cls: str = "optimizer") -> None:
    """What ``dcp.load`` does not check, from the directory's metadata (the same on every
    rank) against this optimizer's own state dict ``own`` (parameter names; ``cls``: the
    optimizer's class name, which the messages name; the directory records none): the number of
    parameter groups and the settings each needs, and state for exactly this optimizer's
    parameters and with the entries this class keeps (``dcp.load`` reads only the entries it is
    asked for: a checkpoint of a larger model, or with more groups, loaded without a word).
    ValueError naming what differs.
    A parameter with no state at all in the checkpoint had none when it was saved (it never
    got a gradient: an embedding under ``inputs_embeds``): it is taken out of ``own``, so it
    is neither read nor given state; part of a parameter's state missing is an error.
    ``initial_lr``, which a learning-rate scheduler attached here adds to each group, is not
    asked of a checkpoint saved without one (taken out of ``own``'s groups; the load keeps
    the live value), as the single-file format loads it."""
    keys = _dcp_keys(path)
    group_prefix, state_prefix = "optimizer.param_groups.", "optimizer.state."
    settings: dict = {}
    for key in keys:
        if key.startswith(group_prefix):
            index, _, name = key[len(group_prefix):].partition(".")
            settings.setdefault(int(index), set()).add(name)
    groups = own["param_groups"]
    if len(settings) != len(groups):
        raise ValueError(f"the checkpoint has {len(settings)} parameter group(s), the optimizer "
                         f"{len(groups)}: build the optimizer with the parameter groups of the "
                         f"run that saved it")
    for i, group in enumerate(groups):
        lacking = sorted(set(group) - settings.get(i, set()) - {"initial_lr"})
        if lacking:
            raise ValueError(f"group {i} of the checkpoint lacks the settings {lacking} of this "
                             f"optimizer (a checkpoint of another optimizer class, or written "
                             f"by another torch version?)")
        if "initial_lr" not in settings.get(i, set()):
            group.pop("initial_lr", None)
    saved: dict = {}  # parameter name -> its state entries in the checkpoint
    for key in keys:  # ("optimizer.state.<parameter name>.<state entry>")
        if key.startswith(state_prefix):
            name, _, entry = key[len(state_prefix):].rpartition(".")
            saved.setdefault(name, set()).add(entry)
    wanted = {name: set(entries) for name, entries in own["state"].items()}
    names = {name for group in groups for name in group["params"]}  # this optimizer's

    def listed(items):
        items = sorted(items)
        return f"{items[:4]}{' ...' if len(items) > 4 else ''}"
    for name in set(wanted) - set(saved):  # (no state when saved: none loaded)
        del own["state"][name]
    foreign = set(saved) - names
    if foreign:
        raise ValueError(f"the checkpoint holds optimizer state for {len(foreign)} parameter(s) "
                         f"this optimizer does not ({listed(foreign)}): a checkpoint of "
                         f"another model or of more parameters")
    # this optimizer's parameters whose entries differ from the ones its class keeps (before:
    # named "parameters this optimizer does not" have, "a checkpoint of another model")
    other = {name: entries for name, entries in saved.items()
             if name in wanted and entries - wanted[name]}
    if other:
        name = min(other)
        raise ValueError(f"the checkpoint holds other optimizer state entries for "
                         f"{len(other)} parameter(s) of this optimizer ({listed(other)}): "
                         f"{name!r} has {sorted(saved[name])} there, this "
                         f"{cls} keeps {sorted(wanted[name])}: a checkpoint of "
                         f"another optimizer class, or of other settings")
    unkept = set(saved) - set(wanted)
    if unkept:
        raise ValueError(f"the checkpoint holds optimizer state for {len(unkept)} parameter(s) "
                         f"({listed(unkept)}) that this {cls} keeps none for: a "
                         f"checkpoint of another optimizer class, or of other settings")
    lacking = {name for name, entries in saved.items() if wanted[name] - entries}
    if lacking:
        name = min(lacking)
        raise ValueError(f"the checkpoint holds only part of the optimizer state for "
                         f"{len(lacking)} parameter(s) of this optimizer ({listed(lacking)}): "
                         f"{name!r} lacks {sorted(wanted[name] - saved[name])}")


@contextlib.contextmanager
def _frozen_counted(model, opt, names=()):
    """torch.distributed.checkpoint's optimizer state dicts keep the state of parameters that
    require a gradient only: the state of a parameter frozen after it trained (Adam's moments,
    its step count) was dropped without a word loading a plain file into sharded parameters,
    and a directory holding it was refused as "another model". The optimizer's frozen
    floating-point parameters that hold state, or that ``names`` (the parameter names a
    checkpoint holds state for) name, count as trainable meanwhile: only those, since torch
    lays out a fresh optimizer's state with a zero gradient and a step at lr 0 for every
    parameter that requires one (a frozen base would get both)."""
    named = {id(p): n for n, p in model.named_parameters()}
    frozen = [p for g in opt.param_groups for p in g["params"]
              if not p.requires_grad and (p.is_floating_point() or p.is_complex())
              and (opt.state.get(p) or named.get(id(p)) in names)]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _own_optimizer_state(model, opt, names=()) -> dict:
    """``get_optimizer_state_dict(model, opt)``: this optimizer's state by parameter name, laid
    out for every parameter that trains (and the frozen ones ``names`` names: those a
    checkpoint holds state for). torch lays out the state of an optimizer that has none yet (a
    step at lr 0) only while no parameter holds a gradient, so the gradients are set aside
    meanwhile (a resume after a backward would otherwise load no state at all)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    held = {}
    if not opt.state:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    held[p], p.grad = p.grad, None
    try:
        with _frozen_counted(model, opt, names):
            return get_optimizer_state_dict(model, opt)
    finally:
        for p, grad in held.items():
            p.grad = grad


def _check_group_members(loaded: dict, own_groups) -> None:
    """Each group of the checkpoint (its parameter names, which ``dcp.load`` put into the
    staged state) holds the parameters of this optimizer's group: the settings of group i
    apply to its own parameters."""
    for i, (theirs, mine) in enumerate(zip(loaded["param_groups"], own_groups)):
        only_theirs = sorted(set(theirs["params"]) - set(mine))
        only_mine = sorted(set(mine) - set(theirs["params"]))
        if only_theirs or only_mine:
            raise ValueError(f"group {i} holds other parameters in the checkpoint: "
                             f"{only_theirs[:3]} there and not here, {only_mine[:3]} here and "
                             f"not there: build the optimizer's groups as the run that saved it "
                             f"did")


class DistributedCheckpointIO(ReplicatedCheckpointIO):
    """The plugin's checkpoint I/O for every mesh (see the module doc). Saving and loading
    are collective; a failed write or read raises on every rank (as ReplicatedCheckpointIO)."""

    @checkpoint_call
    def save_model(self, model, checkpoint: str, max_shard_size=None) -> None:
        """Writes the full state dict to the file ``checkpoint``, or with ``max_shard_size``
        (bytes, or e.g. ``"2GB"``) as transformers-style shards into the directory
        ``checkpoint``."""
        limit = None if max_shard_size is None else shard_bytes(max_shard_size)
        state = full_model_state_dict(_unwrap(model))  # ({} off rank 0 when sharded)

        def write():
            refuse_unloadable(state)
            if limit is None:
                _write(state, checkpoint)
            else:
                _write_shards(state, checkpoint, limit)
        on_writer(checkpoint, write, directory=limit is not None)

    @checkpoint_call
    def load_model(self, model, checkpoint: str, strict: bool = True):
        """Loads a full state dict (a file, or a directory of shards from ``save_model``) into
        ``model`` on any mesh, all or nothing: every rank reads the whole checkpoint and checks
        its keys and (global) shapes against the model before any rank changes a parameter."""
        inner = _unwrap(model)
        reshard_gathered(inner)
        if not _is_sharded(inner) and not os.path.isdir(checkpoint):
            return super().load_model(model, checkpoint, strict=strict)
        placed = {}
        if _is_sharded(inner):
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_model_state_dict)

            def check(state):
                _check_model_state(inner, state, strict)
                # Every rank holds the whole state dict: each cuts its own shards from it
                # before the vote (torch's full-state load scatters them from rank 0 after
                # it: a rank failing there, out of memory, left the others in the scatter)
                placed.update(_local_shards(inner, state))

            def apply(state):  # (local copies only)
                # torch's result lists no keys under strict=False (it fills the missing ones
                # into the dict from the model's own): the keys as load_state_dict reports them
                own, given = set(inner.state_dict()), set(state)
                set_model_state_dict(inner, placed, options=StateDictOptions(strict=strict))
                return _IncompatibleKeys(sorted(own - given), sorted(given - own))
        else:
            def check(state):
                _check_model_state(inner, state, strict)

            def apply(state):
                return inner.load_state_dict(state, strict=strict)
        return _load(checkpoint, check, apply, read_full_state_dict, replicated=True)

    @checkpoint_call
    def save_optimizer(self, optimizer, checkpoint: str, sharded=None) -> None:
        """Sharded models (or ``sharded=True``): a ``torch.distributed.checkpoint`` directory,
        with the fp16 grad scaler's state in it as ``grad_scaler.pt``; otherwise the plain
        ``torch.optim`` state dict file (and ``<path>.grad_scaler``)."""
        model = getattr(optimizer, "model", None)
        if model is not None:
            reshard_gathered(model)
        # (the user's own optimizer object after boost holds the sharded parameters too)
        params_sharded = _holds_dtensors(optimizer) or (model is not None and _is_sharded(model))
        if sharded is None:
            sharded = params_sharded
        elif not sharded and params_sharded:
            # a plain file would hold rank 0's shards only, which every rank would then load
            raise ValueError("save_optimizer(sharded=False): this model's parameters are sharded "
                             "(FSDP / tensor parallelism), so its optimizer state is too; save "
                             "it with sharded=True or None (a torch.distributed.checkpoint "
                             "directory)")
        if not sharded:
            return super().save_optimizer(optimizer, checkpoint)
        if model is None:
            raise ValueError("save_optimizer: a sharded optimizer checkpoint needs the boosted "
                             "optimizer booster.boost returned (it names the state by the "
                             "model's parameter names), got the optimizer itself")
        # (every rank writes its shards there; before dcp.save, which failed on every rank
        # with FileExistsError, naming no call)
        refused = wrong_kind(checkpoint, directory=True)
        agree_or_raise(refused is None, str(refused), error=refused,
                       peer_message=f"save_optimizer: {checkpoint!r} is a file on another rank")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        opt = _unwrap(optimizer)
        # torch lays out the state of an optimizer that has none (and no gradients) with a
        # real step at lr 0: step counts of 1, Adam's weight decay in exp_avg. Saved that way,
        # and kept, it changes the training that follows; an optimizer without state is saved
        # and left without state (a load restores every parameter stateless).
        fresh = not opt.state and not any(p.grad is not None for g in opt.param_groups
                                          for p in g["params"])
        state, error = None, None
        try:  # (local: this rank's shards; out of memory, say, on one rank)
            with _frozen_counted(model, opt):
                state = get_optimizer_state_dict(model, opt)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = exc
        finally:
            if fresh:  # (torch's layout step gave it state)
                opt.state.clear()
        # dcp.save is collective: a rank that could not lay out its state must not leave the
        # others waiting in it
        agree_or_raise(error is None, f"laying out the optimizer state failed: {error!r}",
                       error=error, peer_message="laying out the optimizer state failed on "
                                                 "another rank")
        if fresh:
            state["state"] = {}
        # torch.distributed.checkpoint rewrites the ranks' files in place and the metadata
        # last: the old metadata goes first (every rank past it before any writes), so a save
        # that fails part way leaves a directory that is refused at load, never an old index
        # over a mix of two steps' files.
        on_writer(checkpoint, lambda: _remove_if_there(os.path.join(checkpoint, ".metadata")),
                  directory=True)
        # The grad scaler's state goes in before the metadata, which dcp writes last: a save
        # failing at either leaves no metadata, refused at load (before, a scaler write that
        # failed after dcp's left the new optimizer state beside the old loss scale).
        scaler = scaler_state(optimizer)
        save_scaler(scaler, os.path.join(checkpoint, _SCALER_FILE))
        try:  # collective: raises on every rank when one fails
            dcp.save({"optimizer": state, _SAVE_KEY: {"grad_scaler": scaler is not None}},
                     checkpoint_id=checkpoint)
        except CheckpointException as exc:  # a BaseException: `except Exception` misses it
            raise ValueError(_checkpoint_exception_text(exc, checkpoint, "save to")) from None

    @checkpoint_call
    def load_optimizer(self, optimizer, checkpoint: str) -> None:
        """Loads either format into this mesh's optimizer (resharding as needed), all or
        nothing: the checkpoint (and the grad scaler's state) is read into new tensors and
        checked on every rank before any rank's optimizer changes. A directory is read by
        ``dcp.load`` into uninitialized tensors laid out as this rank's optimizer state, so the
        load holds a second copy of this rank's optimizer state until it is applied."""
        model = getattr(optimizer, "model", None)
        # Which format is read is decided from what this rank sees: a rank whose file system
        # does not show the directory (yet) took the other branch and its collectives, and
        # the others waited in theirs until its process ended. Agreed first, on every rank.
        is_dir = os.path.isdir(checkpoint)
        if dist.is_initialized():
            agree_on_fields(True, "", ((f"load_optimizer: whether {checkpoint!r} is a "
                                        f"directory", int(is_dir),
                                        lambda v: "a directory" if v else "not a directory"),))
        if model is not None:
            reshard_gathered(model)
        if model is None and (is_dir or _holds_dtensors(optimizer)):
            raise ValueError(f"load_optimizer: {checkpoint!r} is a sharded optimizer checkpoint "
                             f"or the parameters are sharded: pass the boosted optimizer "
                             f"booster.boost returned (it maps the state to the model's "
                             f"parameter names), got the optimizer itself")
        if model is None or (not is_dir and not _is_sharded(model)):
            return super().load_optimizer(optimizer, checkpoint)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)
        opt = _unwrap(optimizer)
        if is_dir:
            own_groups = []  # this optimizer's groups by parameter name (dcp.load overwrites
                             # the staged copy's with the checkpoint's)

            def read_optimizer(path):  # this mesh's layout, filled in from the checkpoint
                staged, error, record = None, None, False
                try:
                    # the save's record of the grad scaler's file, where the directory has one
                    # (the same metadata on every rank: every rank asks dcp for it or none)
                    record = _SCALER_RECORD in _dcp_keys(path)
                    own = _own_optimizer_state(model, opt, _dcp_state_names(path))
                    _check_dcp_optimizer_layout(path, own, type(opt).__name__)
                    own_groups[:] = [list(g["params"]) for g in own["param_groups"]]
                    staged = _empty_like_state(own)
                except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                    error = exc
                # dcp.load is collective: a rank that could not stage (out of memory) must not
                # leave the others waiting in it
                agree_or_raise(error is None, f"staging the optimizer state failed: {error!r}",
                               error=error, peer_message="staging the optimizer state failed "
                                                         "on another rank")
                wanted = {"optimizer": staged}
                if record:
                    wanted[_SAVE_KEY] = {"grad_scaler": False}  # (filled in by dcp.load)
                read = _dcp_read(wanted, path)
                if not record:  # (saved before the record: a scaler file there is loaded)
                    return read["optimizer"]
                # (as the plain file's save id, which _with_scaler_state's read takes out)
                return {**read["optimizer"],
                        _SAVE_KEY: {"scaler": bool(read[_SAVE_KEY]["grad_scaler"])}}

            def check(states):  # (dcp.load matched every key it was asked for and its shape)
                _check_group_members(states[0], own_groups)

            def apply_optimizer(state):
                # strict=False: a parameter without state in the checkpoint had none when it was
                # saved (it never got a gradient: an embedding under inputs_embeds, say); the
                # layout check took it out of what is read, and the loaded state dict replaces
                # this optimizer's, so it keeps none. The checks matched groups and members.
                scheduled = [g.get("initial_lr") for g in opt.param_groups]
                with _frozen_counted(model, opt, set(state["state"])):
                    set_optimizer_state_dict(model, opt, state,
                                             options=StateDictOptions(strict=False))
                for group, initial_lr in zip(opt.param_groups, scheduled):
                    if initial_lr is not None:  # (a scheduler's, saved without it)
                        group.setdefault("initial_lr", initial_lr)
            scaler_file = os.path.join(checkpoint, _SCALER_FILE)
        else:
            placed = {}  # this rank's shards of the file's state, cut before the vote

            def read_optimizer(path):
                return read_file(path)

            def check(states):
                _check_optimizer_state(opt, states[0])
                # torch's state dict load fills a parameter the file has no state for from this
                # optimizer's state (or the zero state it lays out for a fresh one), so it would
                # not come back stateless: refused here, before any rank applies anything
                stateless = sorted({i for g in states[0]["param_groups"] for i in g["params"]}
                                   - set(states[0]["state"]))
                if stateless:
                    raise ValueError(
                        f"the optimizer file holds no state for {len(stateless)} parameter(s) "
                        f"(numbers {stateless[:4]}{' ...' if len(stateless) > 4 else ''}: they "
                        f"had none when it was saved), which loading a file into sharded "
                        f"parameters cannot restore; save and load the directory format "
                        f"(save_optimizer(..., sharded=True))")
                # (torch's full-state load scatters them from rank 0 after the vote: a rank
                # failing there, out of memory, left the others in the scatter)
                full = _fqn_optimizer_state(optimizer, states[0])
                placed.update(_local_optimizer_shards(
                    _own_optimizer_state(model, opt, set(full["state"])), full,
                    dict(model.named_parameters())))

            def apply_optimizer(plain):  # (local copies only)
                with _frozen_counted(model, opt, set(placed["state"])):
                    set_optimizer_state_dict(model, opt, placed)
            scaler_file = checkpoint + ".grad_scaler"
        read, apply_scaler = _with_scaler_state(optimizer, scaler_file, read_optimizer)

        def apply(states) -> None:
            apply_optimizer(states[0])
            apply_scaler(states[1])

        # torch's get_optimizer_state_dict gives an optimizer without state one (a step with
        # zero gradients at lr 0); a failed load takes it back, so that nothing has changed
        fresh = not opt.state
        try:
            # (a file, or a directory into unsharded parameters: every rank read the whole
            # state, so the ranks compare its digest: one rank given another step's is refused)
            _load(checkpoint, check, apply, read,
                  replicated=not _is_sharded(model) or not os.path.isdir(checkpoint))
        except BaseException:
            if fresh:
                opt.state.clear()
            raise
        return None
