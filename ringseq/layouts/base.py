"""How a global sequence is split over the ranks of a ring, as data.

A layout answers two questions and nothing else:

* which global token positions rank ``r`` of ``W`` holds, in local order (``positions``), and
* for ring step ``i`` -- when rank ``r`` holds the K/V shard of rank ``src = (r - i) mod W`` --
  which block tasks ``(q rows, kv rows, causal)`` of local-shard rows must be computed
  (``tasks``). An empty list means the step has nothing to compute.

The ring engine (:mod:`ringseq.engine.loops`) executes any such schedule with one forward and one
backward loop, so a new layout is a new subclass of :class:`Layout`, never a new loop: define
``name``, ``_positions`` and ``_tasks`` (and ``multiple`` if needed), pass the instance as
``layout=`` anywhere (or ``register_layout`` it to use its name). Moving tokens
(``shard``/``scatter``) then works by index; override them only for speed.

The package: :mod:`.base` (the ``Layout`` contract, generic schedules under masks, the name
registry), :mod:`.builtin` (contiguous, zigzag, stripe), :mod:`.documents` (packed documents and
their balancer), :mod:`.sharding` (moving tokens to and from ranks).

Built-in layouts (``W`` = world size, ``s`` = global sequence length):

``contiguous``  rank ``r`` holds tokens ``[r*s/W, (r+1)*s/W)``. Causal work is unbalanced
                (rank ``W-1`` does ``W`` blocks, rank 0 one). Needs ``s % W == 0``.
``zigzag``      the sequence is cut into ``2W`` chunks; rank ``r`` holds chunks ``r`` and
                ``2W-1-r``, which balances causal work. Needs ``s % (2W) == 0``.
``stripe``      token ``t`` lives on rank ``t mod W`` (striped attention); causal work is
                balanced to within one diagonal. Needs ``s % W == 0``.

Full (non-causal) attention is permutation invariant, so every layout is valid for it: each
step is one non-causal task over all local rows. ``contiguous`` is the natural choice there
(zigzag and stripe only pay off for causal masks).
"""
from __future__ import annotations

import numbers
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

from .._args import as_int, given, is_bool
from .._hash import stable_code
from ..masks import AttnMask, Run, span_tasks

__all__ = ["BlockTask", "LAYOUTS", "Layout", "check_rank", "get_layout", "layout_field",
           "layout_name_of_code", "masked_tasks", "merge_intervals", "register_layout",
           "span_keys"]


@dataclass(frozen=True)
class BlockTask:
    """One attention block: local query rows ``q`` against rows ``kv`` of the K/V shard held.

    ``causal`` uses the kernel's bottom-right alignment: key ``j`` is visible to query ``i``
    iff ``j <= i + len(kv) - len(q)``. With ``spans`` (windows, packed documents: see
    :mod:`ringseq.masks`) the block is a kernel call with those spans, relative to the ``q``
    and ``kv`` rows, and ``causal`` is False.
    """
    q: slice
    kv: slice
    causal: bool
    spans: Optional[tuple] = None




# Schedules, hops and travelling rows are cached per layout object and per mask. A packed-
# documents batch brings a new mask (its cu_seqlens) at almost every step, and built-in layouts
# live as long as the process: the cache keeps the most recently used entries only.
SCHEDULE_CACHE_ENTRIES = 256


def layout_cached(obj, key, compute):
    """``compute()`` cached under ``key`` on ``obj`` (a layout), least recently used entries
    dropped past :data:`SCHEDULE_CACHE_ENTRIES`. A user's layout is cached under its values
    too (:func:`values_key`)."""
    values = values_key(obj)
    if values is not None:
        key = (values, key)
    cache = obj.__dict__.get("_schedules")
    if cache is None:
        cache = obj.__dict__.setdefault("_schedules", OrderedDict())
    try:
        value = cache[key]
        cache.move_to_end(key)
        return value
    except KeyError:
        pass
    value = compute()
    cache[key] = value
    while len(cache) > SCHEDULE_CACHE_ENTRIES:
        cache.popitem(last=False)
    return value


def values_key(layout) -> Optional[tuple]:
    """What a user's layout is cached under beside the object (schedules, plans): its
    parameters' text and, where it overrides :attr:`Layout.code`, its code. One edited after a
    call, or a ``copy.copy`` of it (which shares the instance's cache) edited, so gets the
    schedules of its new values (before: those of its first call's, and a wrong output without
    a word). None for a built-in layout, whose values never change (nothing to compute on the
    hot path: a documents layout's code hashes all its boundaries)."""
    cls = type(layout)
    if _built_in(cls):
        return None
    return (_parameters_text(layout), None if cls.code is Layout.code else layout.code)


_PLAIN = (bool, int, float, str, type(None))


def _scalar_text(value, depth: int = 0) -> Optional[str]:
    """``value`` as text that is the same on every rank for equal values when it is a number
    (NumPy's too, a 0-d array included, shown as the Python number it equals), a string, a
    bool, None, or a tuple / list of them (nested at most 4 deep); None for anything else
    (tensors, dicts, devices, objects: not compared)."""
    # (a NumPy scalar or 0-d array, read from an array, a config or np.load: before, left out
    # of the comparison and of the cache key, so ranks given np.int64(2) and np.int64(4)
    # paired silently; compared as the Python value it holds)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()
    if type(value) in _PLAIN:
        return repr(value)
    # (a subclass of int, float or str, another library's number: as the value it equals)
    if not isinstance(value, torch.Tensor):
        for kind in (numbers.Integral, numbers.Real, str):
            if isinstance(value, kind):
                return repr({numbers.Integral: int, numbers.Real: float}.get(kind, str)(value))
    if isinstance(value, (tuple, list)) and depth < 4:
        if all(type(v) in _PLAIN for v in value):  # (a long flat list: one join, not a call
            return "(" + ", ".join(map(repr, value)) + ")"  # per entry)
        parts = [_scalar_text(v, depth + 1) for v in value]
        return None if None in parts else "(" + ", ".join(parts) + ")"
    return None


def _parameters_text(layout) -> str:
    """The public scalar attributes of a user's layout instance (``self.k = k`` in
    ``__init__``, a dataclass's fields) as text that is the same on every rank for equal
    values. Computed at every call: a few attributes, and a copied or edited layout shows its
    own values."""
    state = dict(vars(layout)) if hasattr(layout, "__dict__") else {}
    for name in getattr(type(layout), "__slots__", ()):
        if hasattr(layout, name):
            state[name] = getattr(layout, name)
    parts = []
    for name in sorted(k for k in state if not k.startswith("_")):  # (not the caches)
        text = _scalar_text(state[name])
        if text is not None:
            parts.append(f"{name}={text}")
    return ", ".join(parts)


def _built_in(obj) -> bool:
    """Whether a class or function is ringseq's own, not a user's (a user's layout gets the
    checks and the code a built-in one needs none of)."""
    return obj.__module__.startswith("ringseq.")


class Layout:
    """Base class. Subclasses define ``name``, ``_positions`` and ``_tasks`` (and ``multiple``
    when the length must be a multiple of more than ``W``). Everything else -- checks,
    schedules, ``shard`` / ``scatter`` by index -- is generic; built-in layouts override
    ``shard`` / ``scatter`` only to copy slices instead of gathering by index."""

    name: str = "?"
    #: the GLOBAL document boundaries this layout was built for (``Documents``), else None
    documents = None

    @property
    def code(self) -> int:
        """A small integer naming this layout in cross-rank checks (stable across ranks): of
        its name and, for a layout defined outside ringseq, its class (two classes that kept
        one name are told apart) and its scalar parameters: the instance's public attributes
        that are numbers, strings, bools, None or tuples / lists of them (a shift ``self.k``,
        a dataclass's fields), by value, so ranks given different ones raise
        ``RingMismatchError`` instead of pairing silently (before: ``Rotated(0)`` on one rank
        and ``Rotated(1)`` on another computed wrong outputs without a word). Other
        attributes (tensors, dicts, objects) are not compared: a layout whose placement
        depends on one overrides this to include it, as :class:`ringseq.layouts.Documents`
        does with its boundaries. An attribute that differs between the ranks by design (a
        device name) starts with ``_``, or the layout overrides this."""
        cls = type(self)
        if _built_in(cls):
            return stable_code(self.name)
        params = _parameters_text(self)
        return self._class_code() if not params else stable_code(
            f"{self._class_text()}({params})")

    def _class_text(self) -> str:
        cls = type(self)
        # (a script's classes live in __main__ on the launching process and in __mp_main__
        # on the ranks multiprocessing spawns from it: one module)
        module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
        return f"{self.name}@{module}.{cls.__qualname__}"

    def _class_code(self) -> int:
        """:attr:`code` without the parameters: the name (and a user's class) only."""
        return (stable_code(self.name) if _built_in(type(self)) else
                stable_code(self._class_text()))

    @property
    def signature_code(self) -> int:
        """:attr:`code` as a ring call's signature compares it, beside the call's documents
        (cu_seqlens): a layout whose parameters are those documents leaves them out there, so
        that a mismatch names the layout and the documents each once."""
        return self.code

    def signature_text(self, code: Optional[int] = None) -> str:
        """How a mismatch shows this layout on every rank (the ranks exchange these texts
        then; each rank knows only its own layout): a built-in layout's name; a user's
        layout's name, class and the scalar parameters its :attr:`code` compares (before:
        ``layout #<hash>`` per rank). ``code``: the code compared (default
        :attr:`signature_code`); a user's own ``code`` override is shown by its value."""
        code = self.signature_code if code is None else code
        if _built_in(type(self)):
            if code == stable_code(self.name):
                return repr(self.name)
            # (a built-in layout's code holding its boundaries, as the plugin compares it:
            # shown by its code too, where boundaries cut short could look alike)
            docs = tuple(self.documents or ())
            shown = ", ".join(map(str, docs[:16])) + (", ..." if len(docs) > 16 else "")
            return f"{self.name!r} of documents ({shown}) (code {code})"
        if code == self._class_code():
            return self._class_text()
        params = _parameters_text(self)
        text = self._class_text() + (f"({params})" if params else "")
        if len(text) > 200:  # (cut: the code tells cut texts apart)
            return f"{text[:200]}...) (code {code})"
        return text if type(self).code is Layout.code and params else f"{text} (code {code})"

    def multiple(self, world_size: int) -> int:
        """The global sequence length must be a multiple of this."""
        return world_size

    def _checked_multiple(self, world_size: int) -> int:
        """:meth:`multiple`, a positive int multiple of the world size (every rank holds as
        many tokens); ValueError naming the layout otherwise (one of the user's)."""
        given = self.multiple(world_size)
        multiple = as_int(given)
        if multiple is None or multiple < 1 or multiple % world_size:
            raise ValueError(f"layout {self.name!r}: multiple({world_size}) must be a positive "
                             f"int multiple of the world size, got {given!r}")
        return multiple

    def check_seqlen(self, seqlen: int, world_size: int) -> int:
        """Returns the local length; raises ValueError if ``seqlen`` cannot be split."""
        m = self._checked_multiple(world_size)
        if seqlen <= 0 or seqlen % m != 0:
            raise ValueError(
                f"layout {self.name!r} with world size {world_size} needs a sequence length that "
                f"is a positive multiple of {m}; got {seqlen} (pad it to "
                f"{max(m, -(-seqlen // m) * m)})")
        return seqlen // world_size

    def check_local_seqlen(self, s_local: int, world_size: int) -> None:
        """Checks a local shard length (what one rank can see before any communication)."""
        m = self._checked_multiple(world_size) // world_size
        if s_local <= 0 or s_local % m != 0:
            raise ValueError(
                f"layout {self.name!r} needs local shards whose length is a positive multiple of "
                f"{m} (global length a multiple of {m * world_size}); got a local length of "
                f"{s_local}")

    def positions(self, seqlen: int, world_size: int, rank: int) -> torch.Tensor:
        """Global position ids (int64, shape ``(seqlen // world_size,)``) of rank's tokens.
        TypeError for a ``seqlen`` that is not an integer; ValueError for one the layout
        cannot split, when a layout's ``_positions`` returns another shape or dtype, and when
        a layout of your own gives positions that over the ranks are not a permutation of
        ``range(seqlen)`` (checked once per length and world size)."""
        seqlen = self._checked_placement(seqlen, world_size, rank)
        pos = self._checked_positions(seqlen, world_size, rank)
        if not _built_in(type(self)._positions):
            # a layout of the user's: its ranks' positions together must be a permutation,
            # else shard drops tokens and unshard returns uninitialized memory (checked once
            # per length and world size)
            layout_cached(self, ("permutation", seqlen, world_size),
                          lambda: self._check_permutation(seqlen, world_size))
        return pos

    def _checked_placement(self, seqlen, world_size, rank) -> int:
        """``seqlen`` as an int once it, ``world_size`` and ``rank`` name a placement of this
        layout; TypeError / ValueError naming what does not (as :meth:`positions` raises)."""
        try:
            seqlen = operator.index(seqlen)
        except TypeError:
            raise TypeError(f"layout {self.name!r}: seqlen must be an int, got {seqlen!r} "
                            f"({type(seqlen).__name__})") from None
        check_rank(rank, world_size)
        self.check_seqlen(seqlen, world_size)
        return seqlen

    def check_positions(self, seqlen: int, world_size: int) -> None:
        """ValueError unless the ranks' positions at ``seqlen`` are a permutation (a layout of
        the user's, checked once per length and world size; a built-in one needs nothing)."""
        if not _built_in(type(self)._positions):
            self.positions(seqlen, world_size, 0)

    def _checked_positions(self, seqlen: int, world_size: int, rank: int) -> torch.Tensor:
        pos = self._positions(seqlen, world_size, rank)
        want = (seqlen // world_size,)
        if not torch.is_tensor(pos) or tuple(pos.shape) != want or pos.dtype != torch.int64:
            got = (f"{pos.dtype} of shape {tuple(pos.shape)}" if torch.is_tensor(pos)
                   else type(pos).__name__)
            raise ValueError(f"layout {self.name!r}: _positions({seqlen}, {world_size}, {rank}) "
                             f"must return an int64 tensor of shape {want}, got {got}")
        return pos

    def _check_permutation(self, seqlen: int, world_size: int) -> bool:
        every = torch.cat([self._checked_positions(seqlen, world_size, r).cpu()
                           for r in range(world_size)])  # (seqlen,)
        outside = every[(every < 0) | (every >= seqlen)]
        if outside.numel():
            raise ValueError(f"layout {self.name!r}: _positions({seqlen}, {world_size}, rank) "
                             f"must give positions in [0, {seqlen}), got {outside[0].item()}")
        counts = torch.bincount(every, minlength=seqlen)
        if (counts != 1).any():
            p = int((counts != 1).nonzero()[0])
            raise ValueError(f"layout {self.name!r}: _positions({seqlen}, {world_size}, rank) "
                             f"over the ranks must list every position of [0, {seqlen}) exactly "
                             f"once (a permutation), but position {p} is listed "
                             f"{int(counts[p])} times")
        return True

    def check_tasks(self, world_size: int, s_local: int) -> None:
        """ValueError unless the causal block tasks of a layout of the user's (``_tasks``)
        are, for every rank and source, BlockTasks without spans whose rows lie inside the
        shard and which together give every query row the keys it sees (those at positions up
        to its own) exactly once (checked once per world size and local length, the same on
        every rank; a built-in layout needs nothing). Before, a task naming rows past the
        shard was cut short by slicing, and tasks that missed keys, repeated them or gave
        later ones computed wrong outputs, all without a word."""
        tasks = type(self)._tasks
        # (a user's class with the base's: one left undefined; ringseq's own layouts without
        # _tasks make their schedules themselves; a built-in class's tasks under a user's
        # positions hold for the built-in's positions only)
        if (not _built_in(tasks) or not _built_in(type(self)._positions)
                or tasks is Layout._tasks and not _built_in(type(self))):
            layout_cached(self, ("tasks", world_size, s_local),
                          lambda: self._check_tasks(world_size, s_local))

    def _check_tasks(self, world_size: int, s_local: int) -> bool:
        def refuse(rank, src, what, got):
            raise ValueError(f"layout {self.name!r}: _tasks({rank}, {src}, {world_size}, "
                             f"{s_local}) must return {what}, got {got}")
        positions = [self._checked_positions(s_local * world_size, world_size, r).cpu()
                     for r in range(world_size)]  # W x (s_local,)
        keys = _KeyWeights(positions, s_local)
        for rank in range(world_size):
            for src in range(world_size):
                tasks = self._tasks(rank, src, world_size, s_local)
                if not isinstance(tasks, (list, tuple)):
                    refuse(rank, src, "a list of BlockTask", type(tasks).__name__)
                for task in tasks:
                    if not isinstance(task, BlockTask):
                        refuse(rank, src, "a list of BlockTask", f"a {type(task).__name__}")
                    for rows in (task.q, task.kv):
                        if not _rows_inside(rows, s_local):
                            refuse(rank, src, f"tasks whose q and kv rows are slices of ints "
                                   f"inside the shard, [0, {s_local})", repr(rows))
                    if not is_bool(task.causal):
                        refuse(rank, src, "tasks whose causal is a bool", repr(task.causal))
                    if task.spans is not None:  # (the kernel's spans are made from masks)
                        refuse(rank, src, "tasks without spans (windows and documents are "
                               "masks: pass window_size or the documents)",
                               f"spans {_cut(repr(task.spans), 80)}")
                miss = keys.coverage_miss(positions[rank], src, tasks)
                if miss is not None:
                    row, seen, given_keys = miss
                    refuse(rank, src, f"tasks that give each query row the keys of rank "
                           f"{src}'s shard at positions up to its own (causal attention) "
                           f"exactly once", f"tasks that give local row {row} (position "
                           f"{int(positions[rank][row])}) {given_keys} keys where it sees "
                           f"{seen}" + (" (not those it sees)" if seen == given_keys else ""))
        return True

    def identity_on_one_rank(self, seqlen: int) -> bool:
        """Whether one rank holds the ``seqlen`` tokens in their own order (every built-in
        layout does: ``shard`` / ``unshard`` are then copies / no-ops at world size 1)."""
        if _built_in(type(self)._positions):
            return True
        return layout_cached(self, ("identity", seqlen), lambda: bool(torch.equal(
            self.positions(seqlen, 1, 0), torch.arange(seqlen))))

    def tasks(self, rank: int, src: int, world_size: int, s_local: int,
              causal: bool) -> List[BlockTask]:
        """Block tasks for ``rank`` holding the K/V shard of rank ``src``."""
        if not causal:
            # Full attention is permutation invariant: every pair is visible.
            return [BlockTask(slice(0, s_local), slice(0, s_local), False)]
        return self._tasks(rank, src, world_size, s_local)

    def schedule(self, rank: int, world_size: int, s_local: int,
                 causal) -> Tuple[Tuple[BlockTask, ...], ...]:
        """Tasks of every ring step ``i`` (K/V of rank ``(rank - i) % world_size``), cached:
        a layout is data, so the same arguments always give the same (immutable) schedule.
        ``causal`` is a bool or a :class:`ringseq.masks.AttnMask` (windows, documents)."""
        mask = causal if isinstance(causal, AttnMask) else AttnMask(causal=bool(causal))

        def compute():
            if mask.plain:
                return tuple(tuple(self.tasks(rank, (rank - i) % world_size, world_size,
                                              s_local, mask.causal)) for i in range(world_size))
            q_runs = self.runs(s_local * world_size, world_size, rank)
            return tuple(tuple(masked_tasks(q_runs, self.runs(
                s_local * world_size, world_size, (rank - i) % world_size), mask, s_local))
                for i in range(world_size))
        return layout_cached(self, (rank, world_size, s_local, mask), compute)

    def hops(self, world_size: int, s_local: int, causal) -> int:
        """How far K/V must travel: the last ring step with a task on ANY rank (the same on
        every rank). W - 1 for plain causal or full attention; fewer for short windows."""
        def compute():
            last = 0
            for r in range(world_size):
                sched = self.schedule(r, world_size, s_local, causal)
                last = max([last] + [i for i, tasks in enumerate(sched) if tasks])
            return last
        return layout_cached(self, ("hops", world_size, s_local, causal), compute)

    def kv_rows(self, world_size: int, s_local: int, causal):
        """What each rank's K/V block must carry around the ring, under a window or document
        mask: per source rank, the merged ``(start, end)`` intervals of its local rows that a
        task of a later step on another rank reads; None when nothing would be saved (plain
        causal / full attention, or some source is needed whole). Cached; the same on every
        rank. The engine then sends every block compacted to ``max`` of these lengths."""
        mask = causal if isinstance(causal, AttnMask) else AttnMask(causal=bool(causal))

        def compute():
            rows = None
            if not mask.plain and world_size > 1:
                need = [[] for _ in range(world_size)]
                for r in range(world_size):
                    sched = self.schedule(r, world_size, s_local, mask)
                    for i in range(1, world_size):
                        src = (r - i) % world_size
                        for t in sched[i]:
                            if t.spans is None:
                                need[src].append((t.kv.start, t.kv.stop))
                            else:
                                for sp in t.spans:
                                    a, b = span_keys(sp)
                                    need[src].append((t.kv.start + sp[2] + a, t.kv.start + sp[2] + b))
                merged = tuple(merge_intervals(n) for n in need)
                longest = max(sum(b - a for a, b in m) for m in merged)
                if longest < s_local:
                    rows = merged
            return rows
        return layout_cached(self, ("kv_rows", world_size, s_local, mask), compute)

    def runs(self, seqlen: int, world_size: int, rank: int) -> Tuple[Run, ...]:
        """Rank's local rows as maximal runs of evenly spaced global positions. Raises as
        :meth:`positions` does for a ``seqlen``, ``world_size`` or ``rank`` that names no
        placement (before: rank -1 gave rank W - 1's runs, an odd zigzag length runs that
        left tokens out)."""
        seqlen = self._checked_placement(seqlen, world_size, rank)
        return self._runs(seqlen, world_size, rank)

    def _runs(self, seqlen: int, world_size: int, rank: int) -> Tuple[Run, ...]:
        """:meth:`runs` of checked arguments (generic: compressed from ``positions``; built-in
        layouts say it directly)."""
        pos = self.positions(seqlen, world_size, rank).tolist()
        runs, a = [], 0
        while a < len(pos):
            b = a + 1
            stride = pos[b] - pos[a] if b < len(pos) else 1
            if stride <= 0:
                stride = 1
            while b < len(pos) and pos[b] - pos[b - 1] == stride:
                b += 1
            if b - a == 1:
                stride = 1
            runs.append(Run(a, b - a, pos[a], stride))
            a = b
        return tuple(runs)

    # -- moving tokens ---------------------------------------------------------------------
    def shard(self, x: torch.Tensor, world_size: int, rank: int, dim: int) -> torch.Tensor:
        """Rank's tokens of the full ``x`` along ``dim`` (a new contiguous tensor, in local
        order). Generic: gathers ``positions`` by index; ``dim`` is non-negative here."""
        idx = self.positions(x.shape[dim], world_size, rank).to(x.device)
        return x.index_select(dim, idx)

    def scatter(self, full: torch.Tensor, part: torch.Tensor, world_size: int, rank: int,
                dim: int) -> None:
        """Writes rank's shard ``part`` back into its places in ``full`` (inverse of
        :meth:`shard`)."""
        idx = self.positions(full.shape[dim], world_size, rank).to(full.device)
        full.index_copy_(dim, idx, part)

    def bind(self, cu_seqlens: Optional[Tuple[int, ...]]) -> "Layout":
        """The layout to use for one batch whose GLOBAL document boundaries are ``cu_seqlens``
        (None: not a packed batch). Fixed layouts return themselves (attention is then
        restricted to the documents by the mask); the per-batch ``"documents"`` layout returns
        ``Documents(cu_seqlens)``. Every entry point binds once, so nothing below asks which
        kind of layout it holds."""
        return self

    def _positions(self, seqlen, world_size, rank):
        raise NotImplementedError(f"layout {self.name!r} ({type(self).__qualname__}) must "
                                  f"define _positions(seqlen, world_size, rank): the int64 "
                                  f"global positions of rank's tokens")

    def _tasks(self, rank, src, world_size, s_local):
        raise NotImplementedError(f"layout {self.name!r} ({type(self).__qualname__}) must "
                                  f"define _tasks(rank, src, world_size, s_local): the causal "
                                  f"block tasks of rank's queries against the K/V of src")

    def __repr__(self):
        return f"Layout({self.name!r})"


def _cut(text: str, length: int) -> str:
    return text if len(text) <= length else text[:length] + "..."


class _KeyWeights:
    """A random weight per key row (the same for every source shard), and per source rank
    its positions in order with the weights' running sums in that order: what
    :meth:`coverage_miss` compares a rank's causal tasks with."""

    def __init__(self, positions: List[torch.Tensor], s_local: int):
        self.s_local = s_local
        weight = torch.randint(1 << 20, (s_local,), generator=torch.Generator().manual_seed(0))
        self.prefix = _running_sums(weight)  # (s_local + 1,) the weights of rows [0, i)
        self.sources = []  # per source rank: (positions sorted, running sums in that order)
        for pos in positions:
            order = pos.argsort()
            self.sources.append((pos[order], _running_sums(weight[order])))

    def coverage_miss(self, q_pos: torch.Tensor, src: int,
                      tasks) -> Optional[Tuple[int, int, int]]:
        """The first local query row (global position ``q_pos[row]``) whose causal
        ``tasks`` against rank ``src``'s shard do not give it the keys it sees -- those at
        positions up to its own -- exactly once, as ``(row, keys it sees, keys the tasks
        give)``; None when every row's do. Counted per row with the keys' weights, so that a
        row given as many keys as it sees but other ones is caught too (but for a chance of
        about 2**-20)."""
        s_local = self.s_local
        sorted_pos, by_position = self.sources[src]
        seen = torch.searchsorted(sorted_pos, q_pos, right=True)  # (s_local,) keys per row
        count = torch.zeros(s_local, dtype=torch.int64)  # (s_local,) keys the tasks give
        total = torch.zeros(s_local, dtype=torch.int64)  # (s_local,) and their weights
        for task in tasks:
            q0, q1, _ = task.q.indices(s_local)
            k0, k1, _ = task.kv.indices(s_local)
            if q1 <= q0 or k1 <= k0:
                continue
            n = torch.full((q1 - q0,), k1 - k0)  # (q rows,) keys per row
            if task.causal:  # (bottom-right aligned: row i sees i + 1 + len(kv) - len(q))
                n = (torch.arange(q1 - q0) + (k1 - k0) - (q1 - q0) + 1).clamp(0, k1 - k0)
            count[q0:q1] += n
            total[q0:q1] += self.prefix[k0 + n] - self.prefix[k0]
        bad = ((count != seen) | (total != by_position[seen])).nonzero()
        if not bad.numel():
            return None
        row = int(bad[0])
        return row, int(seen[row]), int(count[row])


def _running_sums(values: torch.Tensor) -> torch.Tensor:
    """``(n + 1,)``: the sums of ``values[:i]``."""
    sums = torch.zeros(values.numel() + 1, dtype=values.dtype)
    sums[1:] = values.cumsum(0)
    return sums


def _rows_inside(rows, s_local: int) -> bool:
    """``rows`` is a slice of rows ``[start, stop)`` inside ``[0, s_local]`` with step 1 (None
    for a side: its end of the shard; NumPy's ints count)."""
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        return False
    start = 0 if rows.start is None else as_int(rows.start)
    stop = s_local if rows.stop is None else as_int(rows.stop)
    return start is not None and stop is not None and 0 <= start <= stop <= s_local


def span_keys(span) -> Tuple[int, int]:
    """The keys ``[a, b)`` (relative to the span's first kv row) that some query of the span
    ``(q_start, q_len, k_start, k_len, band_lo, band_hi)`` sees: ``j`` with
    ``band_lo <= j - i <= band_hi`` for some ``0 <= i < q_len``; (0, 0) when none."""
    _, nq, _, nk, lo, hi = span
    a, b = max(0, lo), min(nk, nq - 1 + hi + 1)
    return (a, b) if nq > 0 and a < b else (0, 0)


def merge_intervals(intervals) -> Tuple[Tuple[int, int], ...]:
    """Sorted, merged (adjacent or overlapping joined) non-empty half-open intervals."""
    out: List[List[int]] = []
    for a, b in sorted(x for x in intervals if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def masked_tasks(q_runs, k_runs, mask: AttnMask, s_local: int) -> List[BlockTask]:
    """Block tasks of one ring step under a window/document mask (see ringseq.masks). A batch
    of one span that is a plain dense or causal block becomes that simple task, so kernels
    without span support (and their fast paths) still serve it."""
    tasks = []
    for batch in span_tasks(q_runs, k_runs, mask):
        if len(batch) == 1:
            q0, nq, k0, nk, lo, hi = batch[0]
            q, kv = slice(q0, q0 + nq), slice(k0, k0 + nk)
            if lo <= -(nq - 1) and hi >= nk - 1:
                tasks.append(BlockTask(q, kv, False))
                continue
            if lo <= -(nq - 1) and hi == nk - nq:
                tasks.append(BlockTask(q, kv, True))
                continue
        whole = slice(0, s_local)
        tasks.append(BlockTask(whole, whole, False, spans=tuple(batch)))
    return tasks



LAYOUTS: Dict[str, Layout] = {}


def check_hashable(fn: str, layout: Layout) -> None:
    """TypeError naming ``fn`` for a layout that cannot be hashed: its plans and schedules are
    cached by it (a plain @dataclass has no __hash__; a frozen one with a list field fails)."""
    try:
        hash(layout)
    except TypeError as exc:
        raise TypeError(f"{fn}: layout {type(layout).__name__} must be hashable (its plans are "
                        f"cached by it), and hash() raised: {exc}; a @dataclass layout needs "
                        f"frozen=True with hashable fields (a tuple, not a list), or eq=False"
                        ) from None


def register_layout(layout: Layout) -> Layout:
    """Makes a layout available by name to every function taking ``layout=``. ValueError for
    a name that cannot travel as one (empty, or with ``|`` / ``#``, which separate the fields
    of the custom operator's keys), the base class's placeholder ``"?"`` (a subclass that set
    no name), and a built-in layout's name (re-registering your own under its name is fine);
    TypeError for what is not a Layout instance (a class, say) and for a layout that cannot be
    hashed (its plans are cached by it)."""
    if not isinstance(layout, Layout):
        hint = " (a class: register an instance of it, e.g. MyLayout())" \
            if isinstance(layout, type) else ""
        raise TypeError(f"register_layout: layout must be a ringseq.layouts.Layout instance, "
                        f"got {layout!r} ({type(layout).__name__}){hint}")
    name = getattr(layout, "name", None)
    if not isinstance(name, str) or not name or "|" in name or "#" in name or name == "?":
        raise ValueError(f"register_layout: a layout's name must be a non-empty string without "
                         f"'|' or '#' (set the class's `name`), got {name!r}")
    check_hashable("register_layout", layout)
    old = LAYOUTS.get(name)
    if old is not None and type(old) is not type(layout) and _built_in(type(old)):
        raise ValueError(f"register_layout: {name!r} is a built-in layout of ringseq; register "
                         f"yours under another name (got {layout!r})")
    LAYOUTS[name] = layout
    return layout


def get_layout(layout: Union[str, Layout], fn: str = "get_layout") -> Layout:
    """Returns the registered :class:`Layout` of a name, or passes a Layout through.

    Raises TypeError for anything else than a str or a Layout (a value of the wrong kind),
    ValueError for a name no layout is registered under; both name ``fn`` (the public function
    the user called: callers pass theirs)."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(f"{fn}: layout must be a layout name or a ringseq.layouts.Layout, got "
                        f"{given(layout)}")
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: unknown layout {layout!r}; expected one of {sorted(LAYOUTS)} "
                         f"or a ringseq.layouts.Layout instance")
    return LAYOUTS[layout]


def layout_field(name: str, layout: Layout, code: Optional[int] = None) -> tuple:
    """The cross-rank signature field ``(name, code, "layout", text)`` comparing ``layout``
    by its :attr:`Layout.signature_code` (or ``code``); ``text``
    (:meth:`Layout.signature_text`) is what a mismatch shows for each rank."""
    code = layout.signature_code if code is None else code
    return (name, code, "layout", layout.signature_text(code))


def layout_name_of_code(code: int) -> str:
    """The registered layout name whose :attr:`Layout.code` is ``code`` (for messages)."""
    for name, lay in LAYOUTS.items():
        if lay.code == code:
            return repr(name)
    return f"layout #{code}"


def check_rank(rank, world_size):
    if (as_int(world_size) or 0) < 1:  # (a NumPy int too)
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    # (before: rank 0.5 reached the layout, which was blamed for a float32 result; True was
    # rank 1)
    if as_int(rank) is None:  # (a value of the wrong kind: TypeError)
        raise TypeError(f"rank must be an int, got {given(rank)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
