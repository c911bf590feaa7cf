"""Ring integrity: what makes a faulted or diverging ring raise instead of returning garbage.

Three mechanisms, all driven by :class:`RingCall` (one per forward or backward call of ring,
Ulysses or hybrid attention, opened on the call's :class:`ringseq.engine.ring.Ring`):

* **Control collectives** (``Transport.control``: for a process group a small all-gather on a
  gloo group of the ring's members, host memory only). A call *begins* with one carrying its
  kind (forward/backward), the rank's sequence number, the current call tag
  (:func:`call_tag`), its status and the call's signature (shapes, dtype, layout, causal,
  scale, ...; :meth:`ringseq.spec.AttnSpec.signature`), and *ends* with one carrying its
  outcome. Ranks that disagree raise together before any payload moves, so no size-mismatched
  transfer is ever posted and nothing is computed from mismatched data: different arguments
  raise :class:`ringseq.RingMismatchError` (the ring stays usable); ranks at different calls
  (one skipped its backward, or runs another step: different tags) raise
  :class:`ringseq.RingDesyncError`; an argument that one rank alone finds invalid raises that
  rank's own error there and :class:`ringseq.RingPeerError` (naming the rank and its message)
  on the others (the ring stays usable). (A context-parallel KV-cache decode,
  ``ringseq.ring_flash_attn_with_kvcache``, begins so and has no end collective: a failure in
  a rank's part travels in its gathered payload, the others raise RingPeerError, and the ring
  stays usable.)
* **Exchange headers**: every exchange carries an 8-word header (magic, call sequence number,
  kind, signature hash, exchange index, call tag) in the same buffer as its payload, checked after
  ``wait()``; the comparison runs where the buffer lives (on CUDA: on the device) and its
  verdict is read once, at the end of the call. A mismatch raises RingDesyncError naming both
  ranks' views. It is what still protects a ring whose control collectives are off.
* **Failure semantics**: an exception inside the call on one rank does not strand its peers.
  The rank stops computing but completes every remaining exchange of the call (same sizes, so
  the peers' transfers complete), reports the failure at the end collective and re-raises it;
  every other rank raises :class:`ringseq.RingBrokenError` naming it. The ring is then
  *broken* on every rank: each later call raises RingBrokenError right after its begin
  collective, until ``ringseq.reset_ring(group)`` is called on every rank, which also rebuilds
  the channels a timeout broke. A failure outside a call is reported with
  ``Ring.report_failure`` (the plugin does this for exceptions in the model).

Rings of one rank have no peers: failures simply raise and nothing is marked broken.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from .._dist import (RESET_ADVICE, RingBrokenError, RingDesyncError, RingMismatchError,
                     RingPeerError, RingTimeoutError)
from .._hash import INTS, stable_hash_ints

__all__ = ["BWD", "CHECK", "END", "FAIL", "FWD", "HEADER_BASE_WORDS", "HEADER_BYTES",
           "HEADER_WORDS", "KIND_NAMES", "RingCall", "agreement_code", "call_tag", "current_tag",
           "describe_field", "judge", "mismatch_error", "operation_field"]

HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8  # travels with every exchange (a multiple of 64: no padding)
# A header's words that carry something: magic, sequence number, kind, signature hash,
# exchange index, call tag (the rest are zero)
HEADER_BASE_WORDS = 6
_MAGIC = 0x52534551  # "RSEQ"
# The magic of a header sent with the checks off by a rank that saw the ring desynchronized
# earlier in the same call: the ranks after it raise too (see RingCall.stamp)
_MAGIC_RELAYED = 0x52534552  # "RSER"
# Kinds of control operations (calls use FWD / BWD; the same numbers travel in headers).
FWD, BWD, FAIL, CHECK, END = 1, 2, 3, 4, 5
KIND_NAMES = {FWD: "forward", BWD: "backward", FAIL: "failure report", CHECK: "argument check",
              END: "end of call"}
# A signature field of this kind may differ between ranks: it is gathered at the call's begin
# (RingCall.any_rank), not compared and not part of the headers' signature hash.
ANY = "any"
# The operation a call runs, the first field of the signature of every operation that opens
# calls on a ring: ranks in different operations meet in one control collective, and their
# other fields, named and ordered per operation, cannot be compared.
OPERATION = "operation"
# A field ``(name, code, TEXT, text)`` of a call's signature: compared by its code; on a
# mismatch each rank's text is shown (exchanged then, as a layout field's).
TEXT = "text"
_OPERATIONS = ("ring attention", "double-ring attention", "Ulysses attention",
               "ring kv-cache decoding")

# What an agreement outside ring calls is about: a word of every control vector (0 for the
# calls' own begin and end collectives and failure reports, whose kind says what they are).
# Ranks at different agreements (one skipped its optimizer step and meets the others' step vote
# with its next batch's) raise RingDesyncError together: by the fields alone each rank would
# judge by the fields it passed itself, and the ranks could reach different verdicts.
AGREEMENTS = ("argument check", "optimizer step", "optimizer step refusal", "batch", "loss",
              "attention inputs", "plugin options", "boosted model", "checkpoint load",
              "loader state", "checkpoint call", "backward", "unshard", "unshard backward",
              "failure report taken", "clip_grad_by_norm", "optimizer param group",
              "forward inputs")


def agreement_code(about: str) -> int:
    """The control-vector word of agreement ``about`` (one of ``AGREEMENTS``)."""
    return 1 + AGREEMENTS.index(about)


# Status words of a control vector.
OK, FAILED, BROKEN, DESYNC, INVALID = 0, 1, 2, 3, 4
_N_FIELDS = 25  # (24 for a signature, and Ring.check's names beside 24 fields of a user's)
FIELD0 = 6  # the first field's word: [magic, status, kind, seq, tag, agreement, fields...]
CONTROL_WORDS = FIELD0 + _N_FIELDS
_MESSAGE_BYTES = 1024


# ---------------------------------------------------------------------------------- call tags
# Per thread (and per asyncio task): two threads that drive two rings with their own steps must
# not see each other's tags. A backward carries the tag its forward ran under (the attention
# operator saves it), so one that runs on an autograd worker thread keeps it.
_TAG: contextvars.ContextVar = contextvars.ContextVar("ringseq_call_tag", default=0)


@contextlib.contextmanager
def call_tag(tag: int):
    """Ring calls inside the block carry ``tag`` (an int, e.g. the training step), and every
    rank of a call must carry the same one: a rank that skipped work and runs another step's
    call raises :class:`ringseq.RingDesyncError` on every rank instead of pairing with the wrong
    call (sequence numbers alone cannot tell two steps' identical calls apart). The plugin
    tags every call with its step; without tags ringseq cannot see a rank that silently
    skipped a whole call outside ring attention (README: what is guaranteed).

    The tag belongs to the calling thread (a ``contextvars`` variable): other threads keep
    theirs. The backward of an attention call carries its forward's tag, wherever and
    whenever it runs; a forward recomputed in the backward (activation checkpointing) runs
    under the tag current there, so run such backwards under the same tag on every rank (the
    plugin does: its step's). Under ``torch.compile(fullgraph=True)`` enter the block outside the
    compiled function (dynamo does not trace setting a context variable; without fullgraph
    it breaks the graph there). Raises TypeError when ``tag`` is not an int, ValueError when
    it is outside int64 (it travels in the calls' int64 control vectors)."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"call_tag: tag must be an int, got {tag!r} ({type(tag).__name__})")
    if not -2 ** 63 <= tag < 2 ** 63:
        raise ValueError(f"call_tag: tag must fit in int64 [-2**63, 2**63), got {tag}")
    token = _TAG.set(tag)
    try:
        yield
    finally:
        _TAG.reset(token)


def current_tag() -> int:
    """The calling thread's tag (0 outside every :func:`call_tag` block)."""
    return _TAG.get()


# -------------------------------------------------------------------------- control vectors
def control_vector(kind: int, status: int, seq: int, fields: Sequence[int] = (),
                   about: int = 0) -> torch.Tensor:
    """[magic, status, kind, seq, tag, agreement (``about``), fields (zero-padded to 25)] as
    int64: the same length for every control operation, so ranks at different operations still
    meet in one collective and can tell each other apart."""
    if len(fields) > _N_FIELDS:
        raise ValueError(f"ringseq: at most {_N_FIELDS} control fields, got {len(fields)}")
    words = [_MAGIC, status, kind, seq, current_tag(), about, *[int(f) for f in fields]]
    return torch.tensor(words + [0] * (CONTROL_WORDS - len(words)), dtype=torch.int64)


def broken_ring_error(ring) -> RingBrokenError:
    """What a call on ``ring``, broken by an earlier failure, raises where no control
    collective ran (the checks off, or channels a timeout closed): with them on, the peers'
    rows say it."""
    cause = ring.broken
    err = RingBrokenError(f"ringseq: the ring is broken by an earlier failure "
                          f"({type(cause).__name__}: {cause}); to reset it: "
                          f"{RESET_ADVICE}")
    err.__cause__ = cause
    return err


def control_name(words: torch.Tensor, kind: int, seq: int) -> str:
    """What a control collective of ``words`` is, for its errors: the call or agreement a
    control vector names or heads ("loss agreement #7 (tag 3)"), else (a message's bytes) its
    kind."""
    if words.numel() >= CONTROL_WORDS and int(words[0]) == _MAGIC:
        return _call_name(kind, seq, int(words[4]), int(words[5]))
    return f"the {KIND_NAMES.get(kind, kind)} step of control operation #{seq}"


def fit_message(text: str, suffix: str) -> str:
    """``text`` cut (marked " ...") so that ``text + suffix`` fits the bytes a control message
    carries, then ``suffix``: a marker the peers look for survives a long error message."""
    room = _MESSAGE_BYTES - len(suffix.encode("utf-8", "replace")) - len(" ...")
    raw = text.encode("utf-8", "replace")
    if len(raw) > room:
        text = raw[:room].decode("utf-8", "ignore") + " ..."
    return text + suffix


def _message_words(message: str) -> torch.Tensor:
    raw = message.encode("utf-8", "replace")[:_MESSAGE_BYTES]
    buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.view(torch.int64)


def _message_text(words: torch.Tensor) -> str:
    raw = bytes(words.view(torch.uint8).tolist())
    return raw.rstrip(b"\0").decode("utf-8", "replace")


@functools.lru_cache(maxsize=512)
def signature_hash(values: Tuple[int, ...]) -> int:
    """A 31-bit hash of the call signature (pure Python: the same on every rank; cached, a
    plan's signature repeats every call)."""
    return stable_hash_ints(values)


def operation_field(name: str) -> tuple:
    """The signature field naming the operation of a call (one of ``_OPERATIONS``)."""
    return ("operation", _OPERATIONS.index(name), OPERATION)


# A field of kind INTS (``_hash.ints_field``) is compared by its hash and shown, when ranks
# differ, by its values, which then travel in one more control exchange (_listed_values).
_LISTED = 64  # the values of an INTS field a mismatch shows at most (per rank)


def describe_field(kind: str, code: int) -> str:
    """How a signature field value is shown in a mismatch message."""
    from ..spec import _DTYPES, FLOAT, float_field_text
    if kind == OPERATION:
        return _OPERATIONS[code] if 0 <= code < len(_OPERATIONS) else f"operation #{code}"
    if isinstance(kind, tuple):  # the field is an index into these choices
        return repr(kind[code]) if 0 <= code < len(kind) else f"choice #{code}"
    if kind == "dtype":
        return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else f"dtype #{code}"
    if kind == "bool":
        return str(bool(code))
    if kind == FLOAT:
        return float_field_text(code)
    if kind == "layout":
        from ..layouts import layout_name_of_code
        return layout_name_of_code(code)
    return str(code)


def _call_name(kind: int, seq: int, tag: int = 0, about: int = 0) -> str:
    if 0 < about <= len(AGREEMENTS):
        name = f"{AGREEMENTS[about - 1]} agreement #{int(seq)}"
    else:
        name = f"{KIND_NAMES.get(int(kind), f'operation {int(kind)}')} #{int(seq)}"
    return name + (f" (tag {int(tag)})" if tag else "")


def _failed_call_name(row) -> str:
    """The call a control row's rank failed in: an END row carries its call's kind (a failure
    inside a forward is reported at the forward's end), named so, not as the end."""
    kind, seq = int(row[2]), int(row[3])
    if kind == END and int(row[FIELD0]) in (FWD, BWD):
        return (f"{KIND_NAMES[int(row[FIELD0])]} (call #{seq})"
                + (f" (tag {int(row[4])})" if row[4] else ""))
    return _call_name(*row[2:FIELD0])


def gather(ring, kind: int, status: int, fields: Sequence[int] = (),
           message: Optional[str] = None, about: int = 0) -> Optional[List[List[int]]]:
    """One control collective on ``ring``: every rank's control vector as rows of ints (and,
    when any rank's status is FAILED or INVALID, a second collective with their messages,
    kept as ``ring.peer_messages``), or None where no control collective runs."""
    seq = ring._seq
    ring._seq += 1
    if not ring.checks_on:
        return None
    rows = ring.control(control_vector(kind, status, seq, fields, about), kind, seq)
    if rows is None:
        return None
    rows = rows.tolist()
    ring.peer_messages = {}
    if any(r[1] in (FAILED, INVALID) for r in rows):
        texts = ring.control(_message_words(message or ""), kind, seq)
        ring.peer_messages = {r: _message_text(texts[r]) for r, row in enumerate(rows)
                              if row[1] in (FAILED, INVALID)}
    return rows


def _listed_texts(ring, text: str, name, codes: Sequence[int]) -> str:
    """Every rank's ``text`` (a layout field's) in one more control exchange, shown per
    rank; with the field's ``codes`` where the texts (cut to the message's bytes) do not
    tell the ranks apart."""
    seq = ring._seq
    ring._seq += 1
    words = torch.cat([control_vector(CHECK, OK, seq, (), 0),
                       _message_words(text)])  # (CONTROL_WORDS + message words,)
    got = ring.control(words, CHECK, seq)
    if got is None:
        return "differ"
    texts = [_message_text(row[CONTROL_WORDS:].contiguous()) for row in got]
    if len(set(texts)) < len(set(codes)):
        texts = [f"{t} (#{c})" for t, c in zip(texts, codes)]
    return ", ".join(f"{name(r)}: {t}" for r, t in enumerate(texts))


def _listed_values(ring, values: Sequence[int], name, hashes: Sequence[int]) -> str:
    """Every rank's ``values`` (an INTS field's; the first 64 and their count) in one more
    control exchange, shown per rank around the first index where ranks differ; where they
    differ only past the 64th, the ranks are grouped by their lists' ``hashes`` (the field's
    column)."""
    own = list(values)[:_LISTED]
    seq = ring._seq
    ring._seq += 1
    words = torch.cat([control_vector(CHECK, OK, seq, (), 0),
                       torch.tensor([len(values)] + own + [0] * (_LISTED - len(own)),
                                    dtype=torch.int64)])  # (CONTROL_WORDS + 1 + 64,)
    got = ring.control(words, CHECK, seq)
    if got is None:
        return "differ"
    counts = [int(row[CONTROL_WORDS]) for row in got.tolist()]
    lists = [row[CONTROL_WORDS + 1:CONTROL_WORDS + 1 + min(n, _LISTED)]
             for row, n in zip(got.tolist(), counts)]
    longest = max(len(v) for v in lists)
    first = next((i for i in range(longest) if len({tuple(v[i:i + 1]) for v in lists}) > 1),
                 longest)
    lo, hi = max(0, first - 2), first + 3

    def shown(v, n):
        middle = ", ".join(str(x) for x in v[lo:hi])
        return (f"[{'..., ' if lo else ''}{middle}{', ...' if hi < n else ''}] "
                f"({n} value{'s' if n != 1 else ''})")
    if first < _LISTED:
        where = f"first difference at index {first}"
    else:  # (past the first 64 only the counts and the hashes are known)
        groups = {}
        for r, h in enumerate(hashes):
            groups.setdefault(h, []).append(r)
        where = (f"the first {_LISTED} agree; alike after them: "
                 + " / ".join(f"rank(s) {rs}" for rs in groups.values()))
    return ", ".join(f"{name(r)}: {shown(v, n)}"
                     for r, (v, n) in enumerate(zip(lists, counts))) + f"; {where}"


def _global_names(ring):
    """``(name of group rank r, suffix for a list of group ranks)``: group ranks, with their
    global ranks where the ring's group numbers them otherwise (a subgroup)."""
    members = list(getattr(ring.transport, "members", None) or [])
    if not members or members == list(range(len(members))):
        return (lambda r: f"rank {r}"), (lambda rs: "")
    return ((lambda r: f"rank {r} (global rank {members[r]})"),
            (lambda rs: f" (global rank(s) {[members[r] for r in rs]})"))


def judge(ring, rows: List[List[int]], kind: int, signature: Sequence[tuple] = (),
          called: str = "", hint: Optional[str] = None) -> None:
    """Raises on this rank what the gathered control vectors say is wrong (the same verdict on
    every rank, since every rank sees the same rows); marks the ring broken where needed.
    Ranks are named by their place in the ring's group (and their global rank where the group
    is a subgroup); ``called``: the public function called, named by a mismatch, and ``hint``
    the rule its message gives (default: the attention calls')."""
    name, names = _global_names(ring)
    bad_magic = [r for r, row in enumerate(rows) if row[0] != _MAGIC]
    if bad_magic:
        err = RingDesyncError(f"ringseq: control data from rank(s) {bad_magic} is not ringseq's "
                              f"(foreign or corrupted collective on the ring's control group)")
        ring.mark_broken(err)
        raise err
    messages = getattr(ring, "peer_messages", {})
    invalid = [r for r, row in enumerate(rows) if row[1] == INVALID]
    failed = [r for r, row in enumerate(rows) if row[1] not in (OK, INVALID)]
    if failed:
        what = {FAILED: "failed", BROKEN: "was already broken", DESYNC: "saw a desynchronized ring"}
        members = list(getattr(ring.transport, "members", None) or range(len(rows)))

        def failure(r, rank_name):
            text = messages.get(r, "")
            if text.startswith(_RELAYED):  # (a rank that only heard of a failure elsewhere)
                return (f"{rank_name} stopped because another ring it is in broke, where "
                        f"{text[len(_RELAYED):]}")
            return (f"{rank_name} {what.get(rows[r][1], 'failed')} in its "
                    f"{_failed_call_name(rows[r])}" + (f": {text}" if text else ""))

        detail = "; ".join(failure(r, name(r)) for r in failed)
        own = ring.broken
        err = RingBrokenError(
            f"ringseq: {called + ': ' if called else ''}the ring is broken: {detail}. The "
            f"results of this call are invalid; every rank raises until the ring is reset: "
            f"{RESET_ADVICE}"
            + (f" (this rank's original error: {type(own).__name__}: {own})" if own else ""))
        # What a rank raising this inside another ring's call (a hybrid or double ring's
        # outer call) reports there: the failures by global rank, not "this rank failed"
        # (before: the outer ring named an innocent rank as the one that failed).
        err.ringseq_origin = "; ".join(
            messages[r][len(_RELAYED):] if messages.get(r, "").startswith(_RELAYED)
            else failure(r, f"global rank {members[r]}") for r in failed)
        ring.mark_broken(err)
        raise err from own
    if invalid:
        detail = "; ".join(f"{name(r)}: {messages.get(r, '?')}" for r in invalid)
        what = (f"{KIND_NAMES[kind]} not run: rank(s) {invalid}{names(invalid)} of the ring "
                f"refused the call's arguments" if kind in (FWD, BWD) else
                f"rank(s) {invalid}{names(invalid)} of the group failed where this rank did not")
        raise RingPeerError(f"ringseq: {what} ({detail}). The ring stays usable.", ranks=invalid)
    views = {tuple(row[2:FIELD0]) for row in rows}  # kind, seq, tag, agreement
    if len(views) > 1:
        detail = ", ".join(f"{name(r)}: {_call_name(*row[2:FIELD0])}"
                           for r, row in enumerate(rows))
        err = RingDesyncError(
            f"ringseq: the ranks of the ring are at different ring calls ({detail}): a rank "
            f"skipped or repeated a call (e.g. its backward or its optimizer step), or raised "
            f"outside ring attention without reporting it and went on. Bring the ranks back in "
            f"step (the same call tag), then reset the ring: {RESET_ADVICE}")
        ring.mark_broken(err)
        raise err
    for j, f in enumerate(signature):
        column = [row[FIELD0 + j] for row in rows]
        if f[2:3] == (OPERATION,) and len(set(column)) > 1:
            per_rank = ", ".join(f"{name(r)}: {describe_field(OPERATION, c)}"
                                 for r, c in enumerate(column))
            raise RingMismatchError(
                f"ringseq: the ranks of the ring are in different operations ({per_rank}). "
                f"Every rank of the group must make the same call (the same function, the "
                f"same sequence-parallel mode).")
    err = mismatch_error(ring, [row[FIELD0:FIELD0 + len(signature)] for row in rows],
                         signature, called, hint)
    if err is not None:
        raise err


def mismatch_error(ring, values: List[List[int]], signature: Sequence[tuple], called: str = "",
                   hint: Optional[str] = None) -> Optional[RingMismatchError]:
    """The RingMismatchError naming each field of ``signature`` on which the ranks' ``values``
    (a list per rank, one value per field, as every rank sees them) differ, with each rank's
    value; None where they agree. Collective where an INTS field differs (its values travel
    then), on every rank alike."""
    name, diffs = None, []
    for j, f in enumerate(signature):
        column = [row[j] for row in values]
        fkind = f[2] if len(f) > 2 else "int"
        if len(set(column)) > 1 and fkind != ANY and name is None:
            name, _ = _global_names(ring)  # (only for a message: every call passes here)
        if len(set(column)) > 1 and fkind == INTS:
            # (every rank sees the same rows, so every rank makes this exchange)
            diffs.append(f"{f[0]} ({_listed_values(ring, f[3], name, column)})")
        elif len(set(column)) > 1 and fkind in ("layout", TEXT) and len(f) > 3:
            # (layout_field's: each rank knows its own layout only; the texts travel)
            diffs.append(f"{f[0]} ({_listed_texts(ring, f[3], name, column)})")
        elif len(set(column)) > 1 and fkind != ANY:
            per_rank = ", ".join(f"{name(r)}: {describe_field(fkind, c)}"
                                 for r, c in enumerate(column))
            diffs.append(f"{f[0]} ({per_rank})")
    if not diffs:
        return None
    # (a field that says what to do where it differs: its own advice, not the shards')
    own = [_FIELD_HINTS[f[0]] for j, f in enumerate(signature) if f[0] in _FIELD_HINTS
           and len({row[j] for row in values}) > 1]
    return RingMismatchError(
        f"ringseq: {called + ': ' if called else ''}the ranks of the ring were called with "
        f"different arguments: " + "; ".join(diffs) + ". " + (" ".join(own) or hint
                                                                 or _SAME_SHARDS))


_SAME_SHARDS = ("Every rank of the group must pass shards of the same shape, dtype, layout and "
                "options.")
# Signature fields of the ring's own (not of the arguments), and what to do where they differ
THREAD_FIELD = "calling thread"
FORWARD_FIELD = "its forward (control count)"
_FIELD_HINTS = {
    THREAD_FIELD: "Call from threads of the same name on every rank (threads that run one "
                  "function on different data need names of their own: threading.Thread("
                  "name=...)), or give each thread its own process group.",
    FORWARD_FIELD: "Each backward names the forward it belongs to: run the backwards of alike "
                   "calls (same shapes and call tag) in the same order on every rank."}


class RingCall:
    """The bookkeeping of one call on one rank (see the module doc).

    The engine uses it as::

        with ring.open_call(FWD, signature, device) as call:
            if call.ok: with call.guard(): ...prepare buffers...
            call.begin()                      # control collective; raises on disagreement
            for each step:
                pending = buffers.exchange(...)   # stamps and later checks a header
                if call.ok: with call.guard(): ...compute...
                pending.wait()
            call.end()                        # control collective; raises on any failure
    """

    def __init__(self, ring, kind: int, signature: Sequence[tuple], device, name: str = ""):
        self.ring = ring
        self.kind = kind
        self.name = name  # the public function called (a mismatch names it)
        self.signature = tuple(signature)
        self.values = tuple(int(f[1]) for f in self.signature)
        # the exchanges' headers carry the fields every rank must agree on
        self.sig = signature_hash(tuple(int(f[1]) for f in self.signature
                                        if (f[2] if len(f) > 2 else "int") != ANY))
        self.rows: Optional[List[List[int]]] = None  # every rank's fields, after begin()
        self.device = torch.device(device)
        self.failure: Optional[BaseException] = None
        self.exchanges = 0
        self._seq = None
        self._base = None
        self._bad = None
        #: (exchange index, received header, sender's name or None: the previous rank)
        self._received: List[Tuple[int, torch.Tensor, Optional[str]]] = []

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "RingCall":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.ring.last_exchanges = self.exchanges
            if exc is not None and not isinstance(exc, (RingMismatchError, RingPeerError)):
                # Mismatches and refused arguments are found before any payload moves: the
                # ring stays in step.
                self.ring.mark_broken(exc)
        finally:
            self.ring._release()
        return False

    @property
    def ok(self) -> bool:
        """False once this rank failed: it then only completes the call's exchanges."""
        return self.failure is None

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    @contextlib.contextmanager
    def guard(self):
        """Turns an exception of this rank's own work into a recorded failure, so that the
        exchanges the peers wait for still happen. KeyboardInterrupt too: a Ctrl-C that the
        user's loop catches (a notebook) would otherwise leave the peers waiting for this
        rank's exchanges until the ring timeout; it is re-raised once the call has ended
        (a second Ctrl-C while the call waits on a peer at a control collective interrupts
        that wait and breaks the ring; a payload exchange is waited for, or times out).
        SystemExit (a SIGTERM handler's ``sys.exit()``) and every other BaseException alike
        (before: the peers waited for the ring timeout)."""
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - re-raised by end()/begin()
            self.fail(exc)

    def begin(self) -> None:
        """The begin control collective (see module doc). Raises this rank's own failure if
        preparing the call failed (the peers raise RingBrokenError)."""
        ring = self.ring
        if isinstance(ring.broken, RingTimeoutError) and ring.checks_on:
            # a timeout closed the channels (gloo closes the pairs it gave up on): no peer can
            # be met on them, and their error would read as a new timeout (before:
            # "waited more than N s" at once); the ring is broken until reset_ring
            raise broken_ring_error(ring)
        status = BROKEN if ring.broken is not None else (FAILED if self.failure else OK)
        self._seq = ring._seq
        rows = gather(ring, self.kind, status, self.values,
                      None if self.failure is None else failure_report(self.failure))
        if status == FAILED:  # the peers learn it from the rows and raise RingBrokenError
            ring.mark_broken(self.failure)
            raise self.failure
        self.rows = rows
        if rows is not None:
            judge(ring, rows, self.kind, self.signature, self.name)
        elif ring.broken is not None:
            raise broken_ring_error(ring)
        if ring.world_size == 1:
            return  # no exchange: no header
        # Filled element by element with Python scalars: on CUDA these are small kernels,
        # where a host->device copy of a (pageable) list would synchronize the stream.
        # The call tag too: with the checks off the headers are all that compares ranks, and
        # ranks a step apart (alike calls, as many of them) pair otherwise. Word 4, the
        # exchange's index, is set per exchange (stamp; check's copy, _expect).
        self._base = torch.empty(HEADER_BASE_WORDS, dtype=torch.int64, device=self.device)
        for i, value in enumerate((_MAGIC, self._seq, self.kind, self.sig, 0, current_tag())):
            self._base[i] = value
        self._expect = self._base.clone()
        self._bad = torch.zeros((), dtype=torch.bool, device=self.device)

    def any_rank(self, name: str) -> bool:
        """Whether any rank's ``ANY`` field ``name`` was nonzero at begin(); True when no
        control collective ran on a ring of several ranks (checks off): the caller then takes
        the branch that works whatever the others chose (see :meth:`gathered`)."""
        j = next(i for i, f in enumerate(self.signature) if f[0] == name)
        if self.rows is None:
            return True if self.ring.world_size > 1 else bool(self.values[j])
        return any(row[FIELD0 + j] for row in self.rows)

    @property
    def gathered(self) -> bool:
        """Whether begin() gathered every rank's fields (False with the checks off)."""
        return self.rows is not None

    def end(self) -> None:
        """The end control collective: raises on every rank when any rank failed during the
        call or saw a desynchronized header; this rank's own exception on the failing rank."""
        ring = self.ring
        desync = self._desync_message()
        status = FAILED if self.failure else (DESYNC if desync else OK)
        # (the call's kind travels along: a peer's failure is named by the call it failed in)
        rows = gather(ring, END, status, (self.kind,),
                      None if self.failure is None else failure_report(self.failure))
        if status == FAILED:
            ring.mark_broken(self.failure)
            raise self.failure
        if desync:
            err = RingDesyncError(desync)
            ring.mark_broken(err)
            raise err
        if rows is not None:
            judge(ring, rows, END, called=self.name)

    # -- headers ---------------------------------------------------------------------------
    def stamp(self, header: torch.Tensor) -> int:
        """Writes this rank's header for its next exchange into the send buffer; returns the
        exchange's index."""
        step = self.exchanges
        self.exchanges += 1
        header[:HEADER_BASE_WORDS].copy_(self._base)
        header[4] = step
        header[HEADER_BASE_WORDS:] = 0
        if not self.ring.checks_on:
            # With the checks off the headers are all that reaches the other ranks: a rank
            # that received a bad header earlier in this call (or whose inner ring did: a
            # RingDesyncError recorded as its failure) marks what it sends on, so the ranks its
            # data reaches raise RingDesyncError too, one rank per exchange (before: only the
            # rank next to the one out of step raised, and those after it computed with the
            # blocks it forwarded, or its zeros, without a word). On the device: no
            # synchronization. (A rank's own failure is not relayed: its peers' results miss
            # its part, as documented.)
            if isinstance(self.failure, RingDesyncError):
                header[0] = _MAGIC_RELAYED
            else:
                header[0].add_(self._bad, alpha=_MAGIC_RELAYED - _MAGIC)
        return step

    @property
    def stamps_headers(self) -> bool:
        """Whether this call's exchanges carry headers (after begin(), on a ring of several
        ranks)."""
        return self._base is not None

    def check(self, header: torch.Tensor, step: int, sender: Optional[str] = None) -> None:
        """Compares a received header with this rank's view of exchange ``step`` (no host
        synchronization: the verdict is read in end()). ``sender``: who sent it, for the
        message (None: the ring's previous rank)."""
        got = header.clone()
        self._received.append((step, got, sender))
        self._expect[4] = step  # (in stream order: the previous check has compared already)
        self._bad.logical_or_((got[:HEADER_BASE_WORDS] != self._expect).any())

    def _desync_message(self) -> Optional[str]:
        # (reading the verdict synchronizes with the device: only when headers travelled)
        if self._bad is None or self.exchanges == 0 or not bool(self._bad):
            return None
        ring = self.ring
        prev = getattr(ring.transport, "prev_rank", (ring.rank - 1) % ring.world_size)
        base = self._base.tolist()  # magic, seq, kind, signature, (exchange), tag
        for step, got, sender in self._received:
            g = got.tolist()  # magic, seq, kind, signature, exchange, tag
            if g[:4] != base[:4] or g[4] != step or g[5] != base[5]:
                theirs = (f"a header of its {_call_name(g[2], g[1], g[5])} (signature {g[3]}) "
                          f"at exchange {g[4]}" if g[0] == _MAGIC else
                          f"a header of its {_call_name(g[2], g[1], g[5])} at exchange {g[4]} "
                          f"marked as sent after it, or a rank before it, saw the ring "
                          f"desynchronized in this call (the checks are off: the first rank "
                          f"out of step raised its own error)"
                          if g[0] == _MAGIC_RELAYED else
                          "data without a ringseq header (foreign or corrupted)")
                # (who(): the group rank with its global rank where they differ, as the sender)
                return (f"ringseq: ring desynchronized: {ring.transport.who()} was at exchange "
                        f"{step} of its {_call_name(self.kind, self._seq, base[5])} (signature "
                        f"{self.sig}) but "
                        f"{sender or f'the previous rank (global rank {prev})'} sent {theirs}")
        return "ringseq: ring desynchronized (a received exchange header did not match)"


_RELAYED = "[relayed] "  # (a report of a ring's failure that another ring's rank raised)


def failure_report(exc: BaseException) -> str:
    """What a ring's control collective tells the peers of this rank's failure ``exc``:
    :func:`describe_error`, but for a ``RingBrokenError`` that reports other ranks' failures
    (:func:`judge`'s, raised in a ring this rank is also in: a hybrid or double ring's inner
    ring) those failures, by global rank, marked as relayed, so that the peers do not read
    it as this rank's own failure."""
    origin = getattr(exc, "ringseq_origin", None)
    if isinstance(exc, RingBrokenError) and origin:
        return _RELAYED + origin
    return describe_error(exc)


def describe_error(exc: BaseException) -> str:
    """``"{type}: {message}"`` of ``exc``; its type alone where its ``str()`` raises (the
    report of such an error still reaches the peers)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return type(exc).__name__


__all__ += ["CONTROL_WORDS", "FIELD0", "INVALID", "OK", "FAILED", "BROKEN", "DESYNC",
            "control_vector", "fit_message", "gather", "signature_hash"]
