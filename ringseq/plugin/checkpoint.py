"""Full (unsharded) checkpoints of replicated training state.

Under the ring plugin every rank holds the whole model and the whole optimizer state (only
activations are sharded), so a checkpoint is the plain ``state_dict`` written once by global
rank 0: it loads into the same model built without ringseq (``model.load_state_dict``) and a
plain ``torch.optim`` optimizer. Paths must be on a file system every rank can read when
loading.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import tempfile
import warnings

import torch
import torch.distributed as dist

from .._dist import agree_or_raise, with_message
from ..engine.integrity import ANY
from ..engine.ring import get_ring
from .checkpoint_call import checkpoint_call, current_call
from .digest import differing_digests, state_digest
from .precision import settle_scaler

__all__ = ["ReplicatedCheckpointIO"]


def _unwrap(obj):
    return obj.unwrap() if hasattr(obj, "unwrap") else obj


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _to_cpu(obj, empty: bool = False):
    """``obj`` with its tensors on the CPU (``empty``: as empty tensors of their dtypes, what
    :func:`refuse_unloadable` tries to read back without copying any data); dicts as plain
    dicts, lists and tuples of their type (a namedtuple by its fields)."""
    if torch.is_tensor(obj):
        return torch.empty(0, dtype=obj.dtype) if empty else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v, empty) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = (_to_cpu(v, empty) for v in obj)
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _write(obj, path: str) -> None:
    """torch.save to an exclusively created temporary file next to ``path``, then an atomic
    rename: a crash mid-write never leaves a truncated checkpoint, and a planted
    ``<path>.tmp`` (say, a symlink) is never written through. A ``str`` is written as text
    (a shard index)."""
    _write_all([(obj, path)])


def _write_all(files) -> None:
    """Writes each ``(obj, path)`` of ``files`` as :func:`_write` does (``obj`` None: removes
    ``path``), every temporary file before any rename, so that a write failing (a full disk)
    leaves all of them as they were: before, an optimizer state written beside the grad
    scaler's old one loaded together with it."""
    temporary = []  # (temporary file, path), not renamed yet
    try:
        for obj, path in files:
            if obj is not None:
                temporary.append((_temporary_file(obj, path), path))
        for obj, path in files:
            if obj is None:
                _remove_stale(path)
        while temporary:
            os.replace(*temporary[0])
            temporary.pop(0)
    except BaseException:
        for tmp, _ in temporary:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def _temporary_file(obj, path: str) -> str:
    """``obj`` written to an exclusively created temporary file next to ``path`` (see
    :func:`_write`); returns its name. Removes it when the write fails."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600, which os.replace would keep: give it the mode
        # torch.save's open() leaves, an existing file's own or 0666 less the umask (other
        # jobs read checkpoints); a file system that refuses chmod keeps mkstemp's
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode) if os.path.isfile(path)
                      else 0o666 & ~_umask())
        with os.fdopen(fd, "w" if isinstance(obj, str) else "wb") as f:
            if isinstance(obj, str):
                f.write(obj)
            else:
                torch.save(_to_cpu(obj), f)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _umask() -> int:
    """The process's umask: from /proc on Linux (reading it through os.umask means setting it,
    for a moment, for every thread), else set and set straight back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _save_state_of(owner, path: str) -> None:
    """``owner.state_dict()`` taken inside the writing rank's write (the others need none): an
    error there is agreed on, where one raised before the agreement left the others waiting.
    An entry the loads cannot read back is refused (:func:`refuse_unloadable`), nothing
    written (before: written, and the load failed)."""
    def write():
        state = owner.state_dict()
        refuse_unloadable(state)
        _write(state, path)
    on_writer(path, write)


def refuse_unloadable(state: dict) -> None:
    """TypeError naming the entry of the state dict ``state`` whose value (not a tensor), as
    :func:`_write` writes it, ``torch.load(weights_only=True)`` (what every load here reads
    with) cannot read back: a module's extra state or a scheduler's lambda holding an object
    of a class of its own, an IntEnum, a slice. Tried by a round trip through memory, so
    exactly what the loads accept passes (dtypes, devices, sets, dict subclasses, which the
    write makes plain dicts, classes registered with
    ``torch.serialization.add_safe_globals``). Run by the writing rank inside its write, whose
    error names the call (:func:`on_writer`)."""
    for key, value in state.items():
        if torch.is_tensor(value):
            continue
        buffer = io.BytesIO()
        try:
            torch.save(_to_cpu(value, empty=True), buffer)
            buffer.seek(0)
            torch.load(buffer, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised as the TypeError below
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            reason = f"it holds a {found.group(1)}" if found else f"{type(exc).__name__}: {exc}"
            raise TypeError(
                f"the state entry {key!r} ({type(value).__name__}) cannot be read back by "
                f"torch.load(weights_only=True), which the loads read with ({reason}): keep "
                f"it to tensors, Python's numbers and strings, dtypes, devices and "
                f"containers of them (a module's extra state: what get_extra_state returns), "
                f"or register its classes with torch.serialization.add_safe_globals") from exc


def wrong_kind(path: str, directory: bool):
    """A ValueError naming the call when ``path`` is an existing directory where the
    checkpoint is a file (``directory`` False) or the other way round, else None. (Before:
    FileExistsError / IsADirectoryError naming a temporary file the user never passed.) A
    file's path that ends in a separator is refused too: it names a directory (before:
    NotADirectoryError naming a temporary file '..XXXX.tmp')."""
    if not directory and isinstance(path, str) and path.endswith(("/", os.sep)):
        return ValueError(f"{current_call()}: {path!r} ends in {path[-1]!r}, a directory's "
                          f"path; this checkpoint is a file: pass the path of a file")
    if not (os.path.isfile(path) if directory else os.path.isdir(path)):
        return None
    kind, other = ("a directory", "a file") if directory else ("a file", "a directory")
    return ValueError(f"{current_call()}: {path!r} is {other}; this checkpoint is {kind}: pass "
                      f"the path of {kind}, or remove what is there")


def on_writer(path: str, write, directory: bool = False) -> None:
    """Runs ``write()`` on the writing rank (rank 0) for the checkpoint ``path``, then agrees:
    doubles as the barrier (nobody reads the file before it exists) and makes a failed write
    raise on every rank, not only on rank 0 while the others train on (rank 0's own error
    names the checkpoint, as a load's does). ``directory``: the checkpoint is a directory
    (else a file); a path of the other kind is refused (:func:`wrong_kind`), nothing written."""
    error = None
    if _is_writer():
        error = wrong_kind(path, directory)
        try:
            if error is None:
                write()
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank after agreeing
            error = saving_failed(exc, path)
    if dist.is_initialized():
        agree_or_raise(error is None, f"saving {path!r} failed: {error!r}", error=error,
                       peer_message=f"{current_call()}: rank 0 failed to write the checkpoint "
                                    f"{path!r} (see its error)")
    elif error is not None:
        raise error


def saving_failed(error: BaseException, path: str) -> BaseException:
    """``error`` (its type where it takes a message; an OSError keeps its errno and filename)
    saying which checkpoint failed to save, the original chained."""
    text = f"{current_call()}: rank 0: saving the checkpoint {path!r} failed"
    if isinstance(error, OSError) and error.errno is not None:
        wrapped = type(error)(error.errno, f"{text}: {error.strerror}", error.filename)
        wrapped.__cause__ = error
        return wrapped
    return with_message(error, f"{text}: {type(error).__name__}: {error}")


def read_file(path: str):
    """One checkpoint file as CPU tensors; ``weights_only=True``: a checkpoint cannot run code.
    ValueError for an empty file (torch.load's EOFError says nothing)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"{path!r} is empty (0 bytes): not a checkpoint file a save wrote")
    return torch.load(path, map_location="cpu", weights_only=True)


def _load(path: str, check, apply, read=read_file, replicated: bool = False):
    """Collective load of ``path``: every rank ``read``s it (default: ``read_file``) into new
    objects and ``check``s it against its own state WITHOUT changing anything; the ranks vote;
    then every rank ``apply``s it, or -- when any rank could not read or check it -- none does
    and every rank raises (the failing rank its own error type with the rank and path in the
    message, the original chained; the others a ValueError naming the path and the failed
    ranks). Every rank's state is unchanged on failure. A collective ``read`` must raise on
    every rank when it fails on one (torch.distributed.checkpoint's loader does).
    ``replicated``: every rank read the whole state, so the ranks also compare its digest
    (:func:`ringseq.plugin.digest.state_digest`) and raise ValueError on every rank, nothing
    applied, when they read different contents (one rank given another step's file)."""
    error, state = None, None
    try:
        state = read(path)
        check(state)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank after agreeing
        error = exc
    rank = dist.get_rank() if dist.is_initialized() else 0
    if error is not None:
        message = (f"{current_call()}: rank {rank}: loading the checkpoint {path!r} failed "
                   f"(nothing was loaded on any rank): {type(error).__name__}: {error}")
        error = with_message(error, message)
    if dist.is_initialized():
        agree_or_raise(error is None, str(error), error=error,
                       peer_message=f"{current_call()}: loading the checkpoint {path!r} "
                                    f"failed on another rank (see its error); no rank loaded "
                                    f"it, this rank's state is unchanged")
    elif error is not None:
        raise error
    if replicated:
        _check_same_state(path, state)
    return apply(state)


def _check_same_state(path: str, state) -> None:
    ring = get_ring(None)
    if not ring.checks_on or ring.broken is not None:
        # nothing to compare with; or a broken ring (a failed step's vote timed out), which
        # must not keep the checkpoint that repairs the step from loading
        return
    # The digest reads every tensor the file held: whatever fails there (a kind of tensor it
    # cannot read, out of memory) is voted on, as the read and the check were, so the peers of
    # a rank failing alone raise at once instead of waiting the ring timeout in this agreement
    error, digest = None, 0
    try:
        digest = state_digest(state)
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank by the agreement
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = with_message(exc, f"{current_call()}: rank {rank}: loading the checkpoint "
                                  f"{path!r} failed (nothing was loaded on any rank): comparing "
                                  f"what the ranks read failed: {type(exc).__name__}: {exc}")
    rows = ring.agree(error is None, str(error or ""), error=error, about="checkpoint load",
                      fields=(("checkpoint digest", digest, ANY),))
    split = differing_digests([(0, digest) for (digest,) in rows or ()])
    if split:
        raise ValueError(f"{current_call()}: loading the checkpoint {path!r}: the ranks read "
                         f"different contents "
                         f"(digests {split[0]}); every rank must load the same checkpoint. "
                         f"Nothing was loaded on any rank")


def _check_model_state(model, state, strict: bool) -> None:
    """What ``load_state_dict`` would refuse, found before anything is copied (it copies the
    entries that fit before raising about the others)."""
    if not isinstance(state, dict):
        raise ValueError(f"a model checkpoint is a state dict, got a {type(state).__name__}")
    own = model.state_dict()
    problems = []
    if strict:
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing:
            problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected[:5]}"
                            f"{' ...' if len(unexpected) > 5 else ''}")
    for key, value in state.items():
        mine = own.get(key)
        if torch.is_tensor(mine) and torch.is_tensor(value) and mine.shape != value.shape:
            problems.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, "
                            f"{tuple(mine.shape)} in the model")
        elif torch.is_tensor(mine) and torch.is_tensor(value):
            uncopyable = _uncopyable(value, mine)
            if uncopyable:
                problems.append(f"{key}: {uncopyable}")
        elif mine is not None and torch.is_tensor(mine) != torch.is_tensor(value):
            problems.append(f"{key}: a {type(value).__name__} in the checkpoint")
    if problems:
        raise ValueError("the checkpoint does not fit the model: " + "; ".join(problems))


def _tensor_kind(t: torch.Tensor) -> str:
    """What a tensor is, as the refusals name it: ``"sparse_coo float32"``, ``"meta float32"``,
    ``"qint8"`` (a quantized dtype), ``"float32"``."""
    layout = "" if t.layout == torch.strided else f"{str(t.layout).replace('torch.', '')} "
    device = "meta " if t.is_meta else ""
    return f"{device}{layout}{str(t.dtype).replace('torch.', '')}"


def _uncopyable(value: torch.Tensor, mine: torch.Tensor):
    """Why ``load_state_dict`` could not copy the checkpoint's tensor ``value`` into the
    model's ``mine`` of the same shape (it raises at that entry after copying the ones before
    it), or would copy it wrongly; None where it copies. Kinds, not values: a meta tensor has
    no data to copy; sparse and strided layouts do not copy into each other; a quantized
    tensor does not copy into an unquantized one; a complex tensor into a real one would lose
    its imaginary part (torch only warns). Other dtypes convert, as ``load_state_dict``
    converts them."""
    found, expected = _tensor_kind(value), _tensor_kind(mine)
    if value.is_meta and not mine.is_meta:
        reason = "a meta tensor holds no data (saved from a model on the meta device?)"
    elif value.layout != mine.layout:
        reason = "load_state_dict cannot copy one layout into the other"
    elif value.is_quantized and not mine.is_quantized:  # (a float one quantizes as it copies)
        reason = "load_state_dict cannot copy a quantized tensor into an unquantized one"
    elif value.is_complex() and not mine.is_complex():
        reason = "copying it would discard the imaginary part"
    else:
        return None
    return f"a {found} tensor in the checkpoint, a {expected} one in the model: {reason}"


def _check_optimizer_state(optimizer, state) -> None:
    """What the optimizer would refuse (or, worse, accept and fail on at its next step):
    another number of groups or of parameters per group, settings of another class, state
    for no parameter, a parameter with only part of its state or state tensors of another
    shape (:func:`_check_state_layout`)."""
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        raise ValueError("an optimizer checkpoint is a state dict with 'state' and "
                         "'param_groups'")
    groups = optimizer.param_groups
    saved = state["param_groups"]
    if len(saved) != len(groups) or any(len(a["params"]) != len(b["params"])
                                        for a, b in zip(saved, groups)):
        raise ValueError(f"the checkpoint has {[len(g['params']) for g in saved]} parameters "
                         f"per group, the optimizer {[len(g['params']) for g in groups]}")
    _check_group_settings(optimizer, saved)
    params = {i: p for a, b in zip(saved, groups) for i, p in zip(a["params"], b["params"])}
    for i in state["state"]:
        if i not in params:
            raise ValueError(f"the checkpoint has state for parameter {i}, which no group holds")
    _check_state_layout(optimizer, saved, params, state["state"])


def _check_state_layout(optimizer, saved_groups, params, saved_state) -> None:
    """Each saved parameter's state against the entries and tensor shapes one step of this
    optimizer's class, with the saved groups' settings, gives it (:func:`_stepped_layout`);
    for a class that is not torch's or cannot step on the meta device, against the entries of
    the saved parameters of its group with the same shape (Adafactor keeps other entries for
    matrices than for vectors; a Muon hybrid for an embedding than for hidden matrices). A
    parameter saved with part of its state (``exp_avg`` without ``exp_avg_sq``) would load and
    fail at the next step with a KeyError: ValueError naming it and what it lacks, and, where
    the class stepped, for a state tensor of another shape. A parameter with no state at all
    had none when saved (it never got a gradient) and loads stateless."""
    stepped = _stepped_layout(optimizer, saved_groups)
    for g, group in enumerate(saved_groups):
        alike: dict = {}  # parameter shape -> the entries its stated parameters carry
        for i in group["params"]:
            if saved_state.get(i):
                alike.setdefault(tuple(params[i].shape), set()).update(saved_state[i])
        for i in group["params"]:
            entries = saved_state.get(i)
            if not entries:
                continue
            p = params[i]
            expected = (stepped[p] if stepped is not None else
                        dict.fromkeys(alike[tuple(p.shape)]))
            lacking = sorted(set(expected) - set(entries), key=str)
            if lacking:
                whose = (f"{type(optimizer).__name__}'s step with the saved settings needs"
                         if stepped is not None else
                         f"other parameters of shape {tuple(p.shape)} in its group have")
                raise ValueError(f"the checkpoint holds only part of the optimizer state of "
                                 f"parameter {i} (group {g}): it lacks {lacking}, which {whose}")
            for name, shape in _shapes(entries).items():
                if expected.get(name) is not None and shape != expected[name]:
                    raise ValueError(f"state {name!r} of parameter {i} has shape {shape}, "
                                     f"{type(optimizer).__name__} gives it {expected[name]} "
                                     f"for a parameter of shape {tuple(p.shape)}")


def _shapes(entries) -> dict:
    """The shapes of the tensors among one parameter's state entries (name -> tuple)."""
    return {name: tuple(value.shape) for name, value in entries.items() if torch.is_tensor(value)}


def _stepped_layout(optimizer, saved_groups):
    """The state one step of ``optimizer``'s class gives each of its parameters (parameter ->
    {entry name: tensor shape, or None for a non-tensor}) under the settings of
    ``saved_groups`` (those the load installs: amsgrad, centered, momentum decide the
    entries): a new optimizer of the class over meta-device stand-ins with meta gradients
    steps once (no memory, no values). Only torch's own classes (another class may keep
    settings outside its groups, or communicate in its step, before the ranks' vote); None
    for the others and where the step fails (Adafactor and ASGD read values with
    ``.item()``)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    groups, stand_ins = [], []
    for group, saved in zip(optimizer.param_groups, saved_groups):
        metas = []
        for p in group["params"]:
            meta = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
            meta.grad = torch.empty_like(p, device="meta")  # (p's shape), no storage
            metas.append(meta)
            stand_ins.append((p, meta))
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": metas})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = type(optimizer)(groups)
            probe.step()
    except Exception:  # noqa: BLE001 - not laid out this way: the caller's other comparison
        return None
    layout = {}
    for p, meta in stand_ins:
        entries = probe.state.get(meta, {})
        layout[p] = dict.fromkeys(entries)
        layout[p].update(_shapes(entries))
    return layout


def _check_group_settings(optimizer, saved_groups) -> None:
    """The settings each saved group lacks that this optimizer's class needs: its
    ``load_state_dict`` takes the saved groups as they are, after the class's
    ``__setstate__`` filled in the settings newer versions added, so a group saved by another
    optimizer class (Adam's into SGD: no ``momentum``) loads and fails at the next step. Run on
    copies of the groups in a bare object of the class."""
    groups = [dict(g) for g in saved_groups]
    # (the keys as saved: __setstate__ below fills the class's newer settings into the copies,
    # which the message must not list as the checkpoint's -- before, an Adam file into SGD
    # "had" nesterov)
    saved_keys = [sorted(str(k) for k in g if k != "params") for g in saved_groups]
    try:
        probe = object.__new__(type(optimizer))
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {},
                            "param_groups": groups})
    except Exception:  # noqa: BLE001 - a class whose __setstate__ needs more: not checked
        return
    for i, group in enumerate(groups):
        missing = sorted(set(optimizer.defaults) - set(group))
        if missing:
            raise ValueError(f"group {i} of the checkpoint lacks the settings {missing} of "
                             f"{type(optimizer).__name__} (a state dict of another optimizer "
                             f"class? it has {saved_keys[i]})")


def _check_scheduler_state(lr_scheduler, state) -> None:
    """A learning-rate scheduler's state dict of this scheduler's class and optimizer: the
    same public keys as its own (another class, an optimizer's or a model's state dict
    differ; private ones and ``verbose`` come and go between torch versions) and a base
    learning rate per parameter group. ``load_state_dict`` checks nothing: it sets every entry
    as an attribute."""
    if not isinstance(state, dict):
        raise ValueError(f"a learning-rate scheduler checkpoint is a state dict, got a "
                         f"{type(state).__name__}")

    def public(keys):
        return {k for k in keys if not (isinstance(k, str) and k.startswith("_"))} - {"verbose"}
    own = lr_scheduler.state_dict()
    missing = sorted(public(own) - public(state), key=str)
    extra = sorted(public(state) - public(own), key=str)
    if missing or extra:
        raise ValueError(f"the checkpoint is not a state dict of this "
                         f"{type(lr_scheduler).__name__}: it lacks {missing[:6]} and has "
                         f"{extra[:6]} besides (another scheduler class, or the optimizer's or "
                         f"the model's checkpoint?)")
    if "base_lrs" in own and len(state["base_lrs"]) != len(own["base_lrs"]):
        raise ValueError(f"the checkpoint's scheduler has {len(state['base_lrs'])} parameter "
                         f"group(s), this one {len(own['base_lrs'])}")
    # A chain (SequentialLR, ChainedScheduler) holds its schedulers' states in a private list,
    # which its load_state_dict sets one by one after its own attributes: checked here, else
    # other schedulers' states loaded silently into these, or failed half-way (IndexError).
    subs = getattr(lr_scheduler, "_schedulers", None)
    if isinstance(subs, (list, tuple)):
        saved = state.get("_schedulers")
        if not isinstance(saved, list) or len(saved) != len(subs):
            count = len(saved) if isinstance(saved, list) else "no list of"
            raise ValueError(f"the checkpoint's {type(lr_scheduler).__name__} chains {count} "
                             f"scheduler(s), this one {len(subs)}")
        for i, (sub, sub_state) in enumerate(zip(subs, saved)):
            try:
                _check_scheduler_state(sub, sub_state)
            except ValueError as exc:
                raise ValueError(f"its scheduler {i} ({type(sub).__name__}): {exc}") from None


def scaler_state(optimizer):
    """The fp16 grad scaler's state of ``optimizer``, or None without a scaler (a save then
    removes the file an earlier save left, which a load would otherwise restore beside this
    optimizer state: another run's loss scale)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return None
    # the scale after the update the steps so far left due, on a copy: the live scaler is
    # updated once per iteration, before the next loss, on every rank alike (a save between
    # two optimizers' steps, or on the writing rank alone, would update it again)
    if not getattr(scaler, "_ringseq_update_due", False):
        return scaler.state_dict()
    copy = torch.amp.GradScaler(scaler._device)
    copy.load_state_dict(scaler.state_dict())
    copy._lazy_init_scale_growth_tracker(scaler._scale.device)  # (a step ran: it has one)
    # (copies of the records: GradScaler.update sums every optimizer's inf flag into the first
    # record in place, which, shared, made that optimizer's step skip on the writing rank
    # alone)
    copy._per_optimizer_states = {
        key: {**state, "found_inf_per_device": {
            device: found.clone() for device, found in state["found_inf_per_device"].items()}}
        for key, state in scaler._per_optimizer_states.items()}
    copy._ringseq_update_due = True
    copy._ringseq_overflow = getattr(scaler, "_ringseq_overflow", False)
    settle_scaler(copy)
    return copy.state_dict()


def save_scaler(state, scaler_file: str) -> None:
    """Writes ``state`` (:func:`scaler_state`) to ``scaler_file`` (removes the file where it
    is None: no scaler)."""
    on_writer(scaler_file, lambda: _write_all([(state, scaler_file)]))


def _remove_stale(path: str) -> None:
    # (a path inside a file holds nothing to remove: the caller's own write says what is wrong)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.remove(path)


# A plain optimizer file and its grad scaler's file name one save (an id; the optimizer's also
# whether a scaler was saved with it): two renames cannot be one atomic step, and a save that
# failed between them, or left an older run's scaler file, must not load as one checkpoint.
_SAVE_KEY = "ringseq_save"


def marked_pair(optimizer_state: dict, scaler_state):
    """``(optimizer state, scaler state or None)`` of one save, each marked with its id."""
    save = {"id": os.urandom(8).hex(), "scaler": scaler_state is not None}
    if scaler_state is not None:
        scaler_state = {**scaler_state, _SAVE_KEY: save["id"]}
    return {**optimizer_state, _SAVE_KEY: save}, scaler_state


def _with_scaler_state(optimizer, scaler_file: str, read_optimizer):
    """``(read, apply_scaler)`` for loading an optimizer together with the fp16 grad scaler's
    state saved beside it (when the optimizer has a scaler and ``scaler_file`` exists): ``read``
    returns ``(optimizer state, scaler state or None)``, both read before either is applied, so
    a scaler file that cannot be read leaves the optimizer unchanged too. A pair written by
    :func:`marked_pair` must match: a scaler file of another save is refused (ValueError), one
    the save did not write is ignored, and one it wrote must be there. ``read_optimizer`` of a
    directory gives its record the same way, without an id (``{"scaler": bool}``); a state
    without a record (a directory saved before ringseq kept one) loads a scaler file where
    there is one."""
    scaler = getattr(optimizer, "scaler", None)

    def read(path):
        state = read_optimizer(path)
        save = state.pop(_SAVE_KEY, None) if isinstance(state, dict) else None
        if scaler is None or (save is not None and not save.get("scaler")):
            return state, None  # (no scaler here, or none saved with this state)
        if not os.path.exists(scaler_file):
            if save is not None:
                raise ValueError(f"{scaler_file!r} is missing, but the optimizer state in "
                                 f"{path!r} was saved with the grad scaler's (a save that "
                                 f"failed part way, or the file removed after it?): load a "
                                 f"complete checkpoint")
            return state, None
        scaler_state = read_file(scaler_file)
        if not isinstance(scaler_state, dict) or not scaler_state:
            raise ValueError(f"{scaler_file!r} holds no grad scaler state")
        scaler_save = scaler_state.pop(_SAVE_KEY, None)
        # (a directory records no id: its metadata, written last, is what marks a save whole)
        if save is not None and "id" in save and scaler_save != save["id"]:
            raise ValueError(f"{scaler_file!r} holds the grad scaler's state of another save "
                             f"than the optimizer state in {path!r} (a save that failed part "
                             f"way?): load a complete checkpoint")
        return state, scaler_state

    def apply_scaler(scaler_state) -> None:
        if scaler_state is not None:
            scaler.load_state_dict(scaler_state)
            # (the loaded scale is settled: no update of the steps before the load is due,
            # and no optimizer's step or unscale of them is recorded)
            scaler._ringseq_update_due = scaler._ringseq_overflow = False
            scaler._per_optimizer_states.clear()

    return read, apply_scaler


class ReplicatedCheckpointIO:
    """``save_model/load_model/save_optimizer/load_optimizer/save_lr_scheduler/
    load_lr_scheduler`` for replicated state. Saving is collective: rank 0 writes, then the
    ranks agree on its success, so a failed write raises on every rank (rank 0 its own error,
    the others a ValueError). Loading reads the file on every rank (tensors to CPU, then the
    model's / the optimizer's own device placement). The fp16 grad scaler's state goes next to
    the optimizer checkpoint as ``<path>.grad_scaler`` and is restored from there when present
    (read and checked together with the optimizer's, applied only when both are good).

    Loading is collective too: every rank reads the file with ``weights_only=True`` (a
    checkpoint cannot run code) and checks it against its own state without changing it, the
    ranks agree, and only then every rank applies it: a file one rank cannot read (missing,
    truncated, garbage) or a state dict that does not fit (keys, shapes, groups) raises on every
    rank and no rank's state changes -- the failing rank its own exception type with the rank and
    path in the message (the original chained), the others a ValueError naming the path and the
    failed ranks. Writes go to an
    exclusively created temporary file in the target directory, then ``os.replace``.
    """

    @checkpoint_call
    def save_model(self, model, checkpoint: str) -> None:
        _save_state_of(_unwrap(model), checkpoint)

    @checkpoint_call
    def load_model(self, model, checkpoint: str, strict: bool = True):
        model = _unwrap(model)
        return _load(checkpoint, lambda state: _check_model_state(model, state, strict),
                     lambda state: model.load_state_dict(state, strict=strict),
                     replicated=True)

    @checkpoint_call
    def save_optimizer(self, optimizer, checkpoint: str) -> None:
        # The two files written together: a failed write leaves both as they were; a failed
        # rename between them leaves files of two saves, which their ids tell apart at load.
        # (The stale scaler file of a save without one goes first: failing after that, the
        # old optimizer state is refused, its scaler's file gone, never loaded beside
        # another save's.)
        def write():
            state, scaler = marked_pair(_unwrap(optimizer).state_dict(), scaler_state(optimizer))
            _write_all([(state, checkpoint), (scaler, checkpoint + ".grad_scaler")])
        on_writer(checkpoint, write)

    @checkpoint_call
    def load_optimizer(self, optimizer, checkpoint: str) -> None:
        optim = _unwrap(optimizer)
        read, apply_scaler = _with_scaler_state(optimizer, checkpoint + ".grad_scaler", read_file)

        def apply(states) -> None:
            optim.load_state_dict(states[0])
            apply_scaler(states[1])

        _load(checkpoint, lambda states: _check_optimizer_state(optim, states[0]), apply, read,
              replicated=True)

    @checkpoint_call
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        _save_state_of(lr_scheduler, checkpoint)

    @checkpoint_call
    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        _load(checkpoint, lambda state: _check_scheduler_state(lr_scheduler, state),
              lr_scheduler.load_state_dict, replicated=True)
