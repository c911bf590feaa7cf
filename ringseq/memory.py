"""What fits before launching: per-rank memory of one training step, from the model's shape.

    from ringseq.memory import estimate_memory
    est = estimate_memory(config, seqlen=131072, world_size=8, sp_size=8, zero_stage=3)
    print(est)              # the table: every term, the moment of the peak, Megatron's formula
    est.total               # bytes per rank at the peak of forward + backward + optimizer step

    python -m ringseq.memory --config llama3_8b.json --seqlen 131072 --world-size 8 \\
        --device-memory 80GiB [--precision bf16] [--max-seqlen]

The model is a decoder-only transformer of the Llama / Qwen2 family (RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU MLP, untied or tied LM head) trained the way
``RingSequenceParallelPlugin`` trains it: float32 parameters, AdamW, the sharded
cross-entropy (no gathered logits), ring / Ulysses / hybrid sequence parallelism.
docs/memory.md derives every term and compares the estimate with a measured peak.

How the estimate is built. Every term is the size of tensors the code allocates (the source
is named next to each term below): persistent state (parameters, AdamW states, gradients,
DDP buckets, the ring's cached exchange buffers), the tensors autograd saves per decoder layer,
the autocast copies of the weights, FSDP2's unsharded parameters and gradients, the logits and
loss, and the transient tensors of the moments that can hold the peak: the last layer's
attention in the forward, the end of the forward (with activation checkpointing), the loss's
forward and backward, the final norm's backward, the first, second (FSDP2) and last decoder
layer's backward (at the MLP, at the attention and, under FSDP2, at its reduce-scatter), the
end of the backward (FSDP2's root reduce-scatter; tp's gradient sum), the optimizer step. ``total`` is the largest of these moments; ``peak_phase`` names it.

What is measured. Every regime the plugin runs -- zero_stage 0 (DDP; with tp, the plugin's
own gradient sum), 2 and 3 (FSDP2), tp 1 / 2 (DTensor with Megatron sequence parallelism), sp
1..W in ring / Ulysses / hybrid mode, fp32 and bf16, the plugin's activation checkpointing --
is checked against ``torch.distributed._tools.mem_tracker.MemTracker`` on CPU ranks
(benchmarks/memory_check.py; tests/test_memory.py runs a subset), docs/memory.md has the
table. The mesh is validated by the plugin's own ``ParallelDims``: what the plugin refuses,
the estimate refuses (and the planner does not list).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import numbers
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from ._args import divisors, int_if_integer, is_bool
from ._dist import named_for
from .layouts import PerBatchDocuments, get_layout
from .parallel.dims import ZERO_STAGES, ParallelDims, renamed_dims_error  # the plugin's rules

__all__ = ["MemoryEstimate", "ModelShape", "estimate_memory", "fitting_meshes", "format_bytes",
           "max_seqlen", "meshes", "parse_bytes"]

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adamw_fused", "adamw_forloop")
_F32 = 4  # bytes of a float32 element
_I64 = 8
_ALIGN = 64  # ringseq.engine.loops.PackedBuffers aligns every segment of the exchange buffers
_HEADER = 64  # ringseq.engine.integrity.HEADER_BYTES: the header that travels with every exchange

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size", "tie_word_embeddings")
# ModelShape's fields by the config keys they come from (what its messages name)
_CONFIG_KEYS = {"hidden": "hidden_size", "intermediate": "intermediate_size",
                "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size"}
# The transformers model types whose tensors the estimate counts (measured against MemTracker:
# docs/memory.md); "" is a dict of sizes without a type, estimated as a Llama of those sizes.
MODELED_TYPES = ("", "llama", "mistral", "qwen2")
# Config keys of a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek, ...): the estimate counts
# one dense MLP per layer, so its parameters would be a fraction of the model's.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


# ------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama / Qwen2-style decoder that memory depends on.

    Built by :meth:`from_config` from a transformers config or a dict with the keys
    ``hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, vocab_size, tie_word_embeddings``. ``num_key_value_heads``
    and ``head_dim`` may be missing (or None): they then default to ``num_attention_heads``
    and ``hidden_size // num_attention_heads``, as transformers' Llama and Qwen2 do.
    Optional: ``attention_bias`` (q/k/v/o biases; Qwen2 has q/k/v biases always, detected from
    ``model_type == "qwen2"``) and ``mlp_bias``.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Raises KeyError naming the first missing key, ValueError for sizes that do not fit
        together (heads not a multiple of kv heads, non-positive sizes)."""
        if isinstance(config, ModelShape):
            return config
        if config is None or isinstance(config, (str, bytes, numbers.Number)) or \
                callable(getattr(config, "parameters", None)):
            hint = (" (a model: pass model.config, or plugin.estimate_memory(model, seqlen))"
                    if hasattr(config, "config") else "")
            raise TypeError(f"estimate_memory: config must be a transformers config or a dict of "
                            f"its sizes, got {type(config).__name__}{hint}")
        get = (config.get if isinstance(config, Mapping)
               else lambda k, d=None: getattr(config, k, d))
        model_type = str(get("model_type", "") or "")
        for k in _EXPERT_KEYS:
            if get(k, None) is not None and not _is_whole(get(k, None)):
                raise ValueError(f"estimate_memory: config {k} must be an integer, got "
                                 f"{get(k, None)!r}")
        experts = {k: get(k, None) for k in _EXPERT_KEYS if (get(k, None) or 0) > 1}
        if experts:
            raise ValueError(f"estimate_memory: config{f' {model_type!r}' if model_type else ''} "
                             f"is a mixture of experts "
                             f"({', '.join(f'{k}={v}' for k, v in experts.items())}); the "
                             f"estimate models dense decoders with one MLP per layer (types "
                             f"{list(MODELED_TYPES[1:])}), so it would count a fraction of "
                             f"the parameters")
        if model_type not in MODELED_TYPES:
            raise ValueError(f"estimate_memory: config model_type {model_type!r} is not one the "
                             f"estimate models ({list(MODELED_TYPES[1:])}): its other tensors "
                             f"(extra norms, q/k norms, scaled embeddings, ...) are not counted "
                             f"(Gemma 2 measured 15-22 % above the estimate). For the estimate "
                             f"of a Llama of the same sizes, pass ringseq.memory.estimate_memory "
                             f"a dict of the sizes without model_type ({{k: v for k, v in "
                             f"config.to_dict().items() if k != 'model_type'}})")
        if not isinstance(config, Mapping) and not any(hasattr(config, k) for k in _REQUIRED):
            # (a list, a tuple, any object without a single size: before, KeyError naming
            # hidden_size as if only that were missing; after the model type's check, which
            # names a composite config holding its sizes in sub-configs)
            raise TypeError(f"estimate_memory: config must be a transformers config or a dict of "
                            f"its sizes, got {type(config).__name__} without any of "
                            f"{', '.join(_REQUIRED)}")
        missing = object()
        vals = {}
        for key in _REQUIRED:
            v = get(key, missing)
            if v is missing or v is None:
                raise KeyError(f"estimate_memory: config is missing {key!r} (needed: "
                               f"{', '.join(_REQUIRED)}; num_key_value_heads defaults to "
                               f"num_attention_heads and head_dim to hidden_size // "
                               f"num_attention_heads, as in transformers)")
            if key != "tie_word_embeddings" and not _is_whole(v):
                raise ValueError(f"estimate_memory: config {key} must be an integer, got {v!r}")
            vals[key] = v
        flags = {k: get(k, False) or False for k in ("attention_bias", "mlp_bias")}
        flags["tie_word_embeddings"] = vals["tie_word_embeddings"]
        for k, v in flags.items():
            # bool("false") is True: a JSON config that spells a flag as a string would
            # count the other way
            if not is_bool(v):
                raise ValueError(f"estimate_memory: config {k} must be a bool, got {v!r}")
        if int(vals["num_attention_heads"]) < 1:
            raise ValueError(f"estimate_memory: config num_attention_heads must be >= 1, got "
                             f"{vals['num_attention_heads']!r}")
        kv_heads = get("num_key_value_heads", None)
        if kv_heads is None:  # transformers' default (Llama 1 configs have no such key)
            kv_heads = vals["num_attention_heads"]
        elif not _is_whole(kv_heads):
            raise ValueError(f"estimate_memory: config num_key_value_heads must be an integer, "
                             f"got {kv_heads!r}")
        head_dim = get("head_dim", None)
        if int(vals["hidden_size"]) < 1:  # (before: blamed on a missing head_dim)
            raise ValueError(f"estimate_memory: config hidden_size must be >= 1, got "
                             f"{vals['hidden_size']!r}")
        if head_dim is None:  # transformers' default
            head_dim = int(vals["hidden_size"]) // int(vals["num_attention_heads"])
            if head_dim < 1:
                raise ValueError(f"estimate_memory: config has no head_dim, and hidden_size "
                                 f"{vals['hidden_size']} // num_attention_heads "
                                 f"{vals['num_attention_heads']} = {head_dim}: give head_dim "
                                 f"or a hidden_size of at least num_attention_heads")
        elif not _is_whole(head_dim):
            raise ValueError(f"estimate_memory: config head_dim must be an integer, got "
                             f"{head_dim!r}")
        qwen2 = model_type == "qwen2"
        attention_bias = bool(flags["attention_bias"])
        shape = cls(hidden=int(vals["hidden_size"]), intermediate=int(vals["intermediate_size"]),
                    layers=int(vals["num_hidden_layers"]),
                    heads=int(vals["num_attention_heads"]),
                    kv_heads=int(kv_heads), head_dim=int(head_dim),
                    vocab=int(vals["vocab_size"]), tied=bool(flags["tie_word_embeddings"]),
                    qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
                    mlp_bias=bool(flags["mlp_bias"]))
        for f, key in _CONFIG_KEYS.items():
            if getattr(shape, f) < 1:
                raise ValueError(f"estimate_memory: config {key} must be >= 1, got "
                                 f"{getattr(shape, f)}")
            if getattr(shape, f) > MAX_SIZE:
                raise ValueError(f"estimate_memory: config {key} must be at most 2**63 - 1 "
                                 f"(int64), got {getattr(shape, f)}")
        if shape.heads % shape.kv_heads:
            raise ValueError(f"estimate_memory: num_attention_heads={shape.heads} must be a "
                             f"multiple of num_key_value_heads={shape.kv_heads}")
        return shape


def _is_whole(v) -> bool:
    """An integer, or a float holding one (JSON configs may say 4096.0); not a bool."""
    if isinstance(v, bool):
        return False
    if isinstance(v, numbers.Integral):
        return True
    return isinstance(v, float) and v.is_integer()


# ------------------------------------------------------------------------------ the result
@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of one training step, in bytes (see :func:`estimate_memory`).

    Sizes of the terms (each the full size of what it names):
        params: parameter storage (float32; this rank's shard under tp / zero).
        grads: gradients after the backward (float32, same sharding).
        optimizer: AdamW's exp_avg and exp_avg_sq (float32, same sharding).
        comm_buffers: DDP's gradient buckets (zero 0, tp 1, world > 1) or the most of
            FSDP2's unsharded parameters held at once (zero 2: every layer's and the root's
            after the forward; zero 3: the root's and two layers' in flight).
        weight_copies: autocast's bf16/fp16 copies of the weights (bf16/fp16 with zero 0),
            alive from the forward until each layer's backward.
        activations_per_layer: what autograd saves for one decoder layer.
        activations: everything saved at the end of the forward: the layers, the final norm,
            the rotary tables, the batch (not the logits).
        attention_buffers: the ring's cached exchange buffers (K/V double buffer of the
            forward; K/V and float32 dK/dV accumulators of the backward), allocated once and
            kept by the transport between steps.
        logits_loss: the loss's largest moment: float32 log-softmax output and two float32
            gradients of the logits in its backward (12 bytes x tokens x vocab).
        temporaries: what is live at the peak besides the terms above: transient tensors of
            the peak's moment (e.g. the MLP's gradients, the attention backward's float32
            accumulators, the optimizer's foreach temporaries).
        total: the peak over the step's moments (``moments``), ``peak_phase`` its name.
        megatron: Megatron's activation formula L * s b h (34/t + 5 a s / (h t)) evaluated at
            the per-rank sequence s = seqlen / sp (16-bit activations, no recompute);
            ``megatron_flash`` the same without the 5as/(ht) term of the s x s attention
            scores, which flash attention never stores.

    ``breakdown`` lists the terms live at the peak (they sum to ``total``); ``moments`` the
    peak of every moment considered. ``str()`` is a table of both.
    """

    # what was estimated
    shape: ModelShape
    seqlen: int
    micro_batch: int
    world_size: int
    sp_size: int
    tp_size: int
    zero_stage: int
    precision: str
    optimizer_name: str
    activation_checkpointing: bool
    sp_mode: str
    ulysses_size: int
    gradient_accumulation_steps: int
    # bytes per rank
    params: int
    grads: int
    optimizer: int
    comm_buffers: int
    weight_copies: int
    activations_per_layer: int
    activations: int
    attention_buffers: int
    logits_loss: int
    temporaries: int
    total: int
    peak_phase: str
    megatron: int
    megatron_flash: int
    breakdown: Tuple[Tuple[str, int], ...] = field(default=(), repr=False)
    moments: Tuple[Tuple[str, int], ...] = field(default=(), repr=False)
    #: a double ring's inner ring size (None: the plain ring)
    inner_ring_size: Optional[int] = None

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.sp_size * self.tp_size)

    def mesh(self) -> str:
        """A one-line name of the configuration, e.g. ``dp2 sp4 ring tp1 zero3 ckpt``."""
        mode = self.sp_mode if self.sp_size > 1 else "-"
        if self.sp_mode == "hybrid":
            mode = f"hybrid(u{self.ulysses_size})"
        if self.inner_ring_size is not None:
            mode += f" inner{self.inner_ring_size}"
        return (f"dp{self.dp_size} sp{self.sp_size} {mode} tp{self.tp_size} "
                f"zero{self.zero_stage}{' ckpt' if self.activation_checkpointing else ''}")

    def __str__(self) -> str:
        s = self.shape
        head = (f"ringseq memory estimate per rank: {s.layers} layers, hidden {s.hidden}, MLP "
                f"{s.intermediate}, heads {s.heads}/{s.kv_heads} (head_dim {s.head_dim}), vocab "
                f"{s.vocab}{' (tied)' if s.tied else ''}\n"
                f"seqlen {self.seqlen} x micro-batch {self.micro_batch} on {self.world_size} "
                f"ranks: {self.mesh()}, {self.precision}, {self.optimizer_name}; "
                f"{self.micro_batch * self.seqlen // self.sp_size} tokens per rank"
                + (f"; {self.gradient_accumulation_steps} micro-batches per optimizer step"
                   if self.gradient_accumulation_steps > 1 else "") + "\n")
        rows = [("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                ("comm_buffers", self.comm_buffers), ("weight_copies", self.weight_copies),
                ("activations_per_layer", self.activations_per_layer),
                ("activations", self.activations),
                ("attention_buffers", self.attention_buffers),
                ("logits_loss", self.logits_loss), ("temporaries", self.temporaries)]
        w = max(len(n) for n, _ in rows + list(self.breakdown) + list(self.moments)) + 2
        out = [head, f"{'term':<{w}}{'size':>12}", "-" * (w + 12)]
        out += [f"{n:<{w}}{format_bytes(v):>12}" for n, v in rows]
        out += ["-" * (w + 12), f"{'total (peak)':<{w}}{format_bytes(self.total):>12}  at "
                f"{self.peak_phase}", "",
                f"Megatron's activations sbh(34/t + 5as/(ht)) x layers at s = seqlen/sp: "
                f"{format_bytes(self.megatron)}; without 5as/(ht) (flash attention): "
                f"{format_bytes(self.megatron_flash)}; these activations: "
                f"{format_bytes(self.activations)}", "", "live at the peak:"]
        out += [f"  {n:<{w - 2}}{format_bytes(v):>12}" for n, v in self.breakdown]
        out += ["", "peak of every moment of the step:"]
        out += [f"  {n:<{w - 2}}{format_bytes(v):>12}" for n, v in self.moments]
        return "\n".join(out)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


#: the largest size (a length, a count of bytes) the planner takes: int64's, what torch
#: indexes; with every size below it the terms stay within a float's range
MAX_SIZE = 2 ** 63 - 1


def parse_bytes(text: str) -> int:
    """``'80GiB'`` -> 85899345920; ``'80GB'`` -> 80e9; a plain number is bytes (the bytes a
    fraction of a unit holds are rounded down). Raises ValueError for anything else (a
    negative size, or one above 2**63 - 1 bytes, too)."""
    s = str(text)
    shown = repr(s) if len(s) <= 80 else f"{s[:80]!r}... ({len(s)} characters)"
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"parse_bytes: a memory size must be a non-negative number with an "
                         f"optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {shown}")
    # Exact, not through a float (which would turn a long number into infinity), and with the
    # digits that can matter only: Python refuses ints of more than 4300 digits with a
    # message of its own. A whole part of more than 19 digits is above 2**63 - 1 already;
    # 64 digits of the fraction decide the bytes rounded down.
    whole, _, fraction = m.group(1).partition(".")
    whole = whole.lstrip("0")
    n = (MAX_SIZE + 1 if len(whole) > 19 else
         int(Fraction(f"{whole or 0}.{fraction[:64] or 0}") * _UNITS[m.group(2).lower()]))
    if n > MAX_SIZE:
        raise ValueError(f"parse_bytes: a memory size must be at most 2**63 - 1 bytes, got "
                         f"{shown}")
    return n


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class _Plan:
    """Every size the terms need, resolved and checked once (``estimate_memory`` builds it).

    Tokens per rank: ``T = b * seqlen / sp`` (the sequence shard); under tensor parallelism
    the residual stream and the norms hold ``T / tp`` of them (Megatron sequence parallelism)
    while q/k/v, attention and the MLP work on all ``T`` with ``heads / tp`` heads and
    ``intermediate / tp`` columns.

    Tensor parallelism (ringseq.parallel.tp): each attention / MLP block all-gathers its
    input once (``GatherSequence``: ``T x hidden``, saved for the block's colwise
    projections, which Megatron re-gathers in the backward instead); the embedding and the LM
    head stay replicated over tp and each rank computes the logits of its ``T / tp`` tokens
    (the sharded cross-entropy); query and K/V heads are split over tp (the plugin requires
    tp to divide both). FSDP2 (ringseq.parallel.fsdp) shards over the dp x sp ranks of a tp
    rank (``N = world / tp``); bf16 with zero >= 2 runs FSDP2's MixedPrecisionPolicy (bf16
    parameters in the compute, float32 reduce-scatter) instead of autocast (regime ``mp``).
    """

    shape: ModelShape
    b: int
    seqlen: int
    world: int
    sp: int
    tp: int
    zero: int
    precision: str
    optimizer: str
    ckpt: bool
    mode: str
    U: int  # Ulysses degree
    R: int  # ring degree
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    I: Optional[int] = None  # inner ring size of a double ring (None: R, a plain ring)

    @property
    def double_ring(self) -> bool:
        """Whether the ring runs as outer rings of inner rings (an inner ring of one rank, or
        of all R, is the plain ring)."""
        return self.I is not None and 1 < self.I < self.R

    # -- dtypes and regime -------------------------------------------------------------
    @property
    def e(self) -> int:
        """Bytes of the compute dtype (matmul outputs, attention inputs and outputs)."""
        return _F32 if self.precision == "fp32" else 2

    @property
    def regime(self) -> str:
        """``fp32``; ``autocast`` (the plugin's bf16/fp16 over float32 weights: zero 0);
        ``mp`` (FSDP2 MixedPrecisionPolicy: the model runs in bf16, zero >= 2)."""
        if self.precision == "fp32":
            return "fp32"
        return "autocast" if self.zero == 0 else "mp"

    # -- tokens ------------------------------------------------------------------------
    @property
    def T(self) -> int:
        return self.b * self.seqlen // self.sp

    @property
    def T_res(self) -> int:
        return self.T // self.tp

    # -- heads and widths per rank -----------------------------------------------------
    @property
    def heads_l(self) -> int:
        return self.shape.heads // self.tp

    @property
    def kv_l(self) -> int:
        return self.shape.kv_heads // self.tp  # tp divides them (ParallelDims' head rule)

    @property
    def rep(self) -> int:
        # ringseq.parallel.ulysses.kv_replication: K/V heads copied so that U ranks split them
        return self.U // math.gcd(self.U, self.kv_l)

    @property
    def inter_l(self) -> int:
        return self.shape.intermediate // self.tp

    # -- parameters --------------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one decoder layer on this tp rank (before FSDP sharding)."""
        s, h, d = self.shape, self.shape.hidden, self.shape.head_dim
        q, kv, o = h * self.heads_l * d, h * self.kv_l * d, self.heads_l * d * h
        n = q + 2 * kv + o + 3 * h * self.inter_l + 2 * h  # + 2 RMSNorm weights
        if s.qkv_bias:
            n += self.heads_l * d + 2 * self.kv_l * d
        if s.o_bias:
            n += h  # (replicated in rowwise TP: a simplification of at most h per layer)
        if s.mlp_bias:
            n += 2 * self.inter_l + h
        return n

    def mlp_o_params(self) -> Tuple[int, int]:
        """(down_proj's parameters, those of gate/up/down, o_proj and the second norm): what
        one layer's backward has produced gradients for when it reaches the MLP's product /
        the attention."""
        h, I, s = self.shape.hidden, self.inter_l, self.shape
        down = h * I + (h if s.mlp_bias else 0)
        mlp = 3 * h * I + ((2 * I + h) if s.mlp_bias else 0)
        o = self.heads_l * self.shape.head_dim * h + (h if s.o_bias else 0)
        return down, mlp + o + h

    def linear_params(self) -> int:
        """Parameters that nn.Linear layers use (their weights and biases, the LM head's
        weight included once even when tied): what autocast copies to bf16."""
        s = self.shape
        per_layer = self.layer_params() - 2 * s.hidden  # without the two norm weights
        return s.layers * per_layer + s.vocab * s.hidden

    def root_params(self) -> int:
        s = self.shape
        return s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden  # embed, head, final norm

    def params(self) -> int:
        return self.shape.layers * self.layer_params() + self.root_params()

    def param_sizes(self) -> List[int]:
        """Every parameter's size on this tp rank (before FSDP sharding), in the order of a
        Llama-family model's ``parameters()``: the embedding, per layer the attention's
        projections (each weight, then its bias), the MLP's gate, up, down, the two norms;
        the final norm and an untied LM head. Sums to :meth:`params`."""
        s, h, d, I = self.shape, self.shape.hidden, self.shape.head_dim, self.inter_l
        layer = []
        for out in (self.heads_l * d, self.kv_l * d, self.kv_l * d):  # q, k, v
            layer += [h * out] + ([out] if s.qkv_bias else [])
        layer += [self.heads_l * d * h] + ([h] if s.o_bias else [])
        for out in (I, I):  # gate, up
            layer += [h * out] + ([out] if s.mlp_bias else [])
        layer += [I * h] + ([h] if s.mlp_bias else []) + [h, h]  # down, the two norms
        return ([s.vocab * h] + layer * s.layers + [h]
                + ([] if s.tied else [s.vocab * h]))

    @property
    def shards(self) -> int:
        """FSDP2 shard count (dp x sp ranks of one tp rank), 1 without FSDP."""
        return self.world // self.tp if self.zero >= 2 else 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ------------------------------------------------------------------------------ the terms
class _Terms:
    """Byte sizes of everything the step allocates, for a plan (sources in the comments).

    Names of the layer's saved tensors follow transformers' LlamaDecoderLayer / Qwen2's
    (modeling_llama.py): ``residual + self_attn(input_layernorm(x))`` then
    ``residual + mlp(post_attention_layernorm(h))``, ``mlp = down(silu(gate(x)) * up(x))``.
    """

    def __init__(self, p: _Plan):
        self.p = p
        s, e, T, Tr = p.shape, p.e, p.T, p.T_res
        h, d, I = s.hidden, s.head_dim, p.inter_l
        a, k = p.heads_l, p.kv_l
        f32 = _F32
        regime = p.regime
        # ---- saved activations of one decoder layer -------------------------------------
        # Residual stream: the layer input (embedding output / previous layer output) and the
        # mid residual (residual + attention output), float32 under autocast and fp32
        # (float32 embedding + bf16 branch promotes), bf16 when the model itself runs in bf16
        # (FSDP2 mixed precision). The next RMSNorm's pow and mul save them as they are when
        # float32; a bf16 residual is not saved (RMSNorm saves its float32 copy, below).
        res = (2 if regime == "mp" else f32) * h
        self.residual = res * Tr  # one residual tensor (checkpointing saves the layer input)
        res_saved = 0 if regime == "mp" else self.residual
        # under checkpointing the layer input is saved by torch.utils.checkpoint, besides
        # what the recompute saves (the same tensor unless the recompute saves a copy: mp)
        self.ckpt_input_extra = self.residual - res_saved
        # RMSNorm (LlamaRMSNorm.forward): rsqrt (T, 1) float32 and x * rsqrt float32 (saved
        # by `weight * ...`); with a bf16 input also the float32 copy of x (saved by pow and
        # mul) and the bf16 cast of x * rsqrt (saved by the weight multiply).
        norm = f32 + f32 * h if regime != "mp" else f32 + f32 * h + 2 * h
        # The norm's output as the projections save it. autocast: one bf16 copy per
        # projection (autocast casts activations per op, only leaf weights are cached), 3 + 2,
        # each of the whole T tokens under tp (the cast follows ringseq.parallel.tp's
        # GatherSequence, whose float32 all-gather output no backward saves). Otherwise one
        # tensor shared by q/k/v and one by gate/up: the norm output itself (T / tp tokens;
        # only tp == 1) or, under tp, the block's all-gathered input (GatherSequence: one
        # all-gather per block, T tokens, in the norm's output dtype).
        if regime == "autocast":
            normed, normed_attn = 5 * e * h * T, 3 * e * h * T
        else:
            normed, normed_attn = 2 * e * h * T, e * h * T
        # Attention (ringseq::attention, ringseq/engine/op.py): the operator saves its output
        # in the input dtype (also o_proj's saved input) and lse float32 (b, h, s): out_lse.
        # The ring (and sp = 1) also saves its inputs: q and k after rotary and v (bf16 casts
        # by ringseq._args.autocast_inputs under autocast; float32 otherwise). Ulysses /
        # hybrid keep only the inputs' shapes and save the head shards instead
        # (UlyssesPlacement.forward): q_h, k_h, v_h (K/V replicated rep times), out_h and lse_h,
        # as many elements as q, k * rep, v * rep, out and lse.
        kv_saved = k * (p.rep if p.U > 1 else 1)
        out_lse = e * a * d * T + f32 * a * T
        if p.U == 1:
            attn = e * (a * d + 2 * k * d) * T + out_lse
            # what checkpointing keeps of the attention: the operator's outputs
            # (ringseq.parallel.checkpointing), here out and lse
            self.attn_out = out_lse
        else:
            attn = e * (a * d + 2 * kv_saved * d) * T + out_lse + out_lse
            # the operator's outputs are out, lse and every head shard it saves
            self.attn_out = attn
        # MLP: gate and up outputs, silu(gate) and the product (down_proj's input), in e.
        mlp = 4 * e * I * T
        self.layer = 2 * res_saved + 2 * norm * Tr + normed + attn + mlp
        # what is still saved when the backward reaches the attention: the layer input, the
        # first norm and the q/k/v projections' inputs, the attention's tensors (o_proj's
        # input is the operator's saved output: nothing is released before the attention)
        self.layer_attn_part = res_saved + norm * Tr + normed_attn + attn
        # ... and in the forward, once the attention has returned
        self.layer_attn_fwd = self.layer_attn_part
        self.prod = e * I * T  # the MLP product, freed by down_proj's backward
        # Under tp the rowwise projections (o_proj, down_proj: RowwiseParallel with the output
        # sharded along the sequence) reduce-scatter their partial output: the matmul's
        # (b, T, h) output in e, then torch's funcol reduce_scatter_tensor, which scatters
        # along dim 0 only, chunks it along the sequence (dim 1) and concatenates the chunks
        # into a contiguous (tp, T / tp, h) copy, and the (b, T / tp, h) result: measured, the
        # forward's peak of the last layer's MLP (at down_proj's reduce-scatter).
        self.rs_fwd = (2 * e * h * T + e * h * Tr) if p.tp > 1 else 0
        # ... beside the MLP's locals at its product (counted with the layer): under
        # checkpointing silu(gate) and up are gone by down_proj's reduce-scatter (nothing saves
        # them), only the product is left, so the larger of the two points counts
        self.rs_fwd_mlp = max(0, self.rs_fwd - 2 * self.prod) if p.ckpt else self.rs_fwd
        # The recompute of a checkpointed layer (torch.utils.checkpoint, non-reentrant) at the
        # start of its backward, at the rotary embedding (transformers' apply_rotary_pos_emb:
        # q * cos + rotate_half(q) * sin, then k's): q, k, v out of their projections (e,
        # T tokens, this rank's heads) held as LlamaAttention's locals; q * cos, the rotated
        # half times sin and their sum, in the rotary tables' dtype (float32 but in mp: the
        # bf16 q promotes), 3 x q's at q's add, or q's sum and 3 x k's at k's add.
        r = 2 if regime == "mp" else f32
        self.qkv_out = e * (a + 2 * k) * d * T
        self.rope_tmp = r * d * T * max(3 * a, a + 3 * k)
        # ... what the recompute has saved by then: the first norm and the q/k/v inputs
        # (autocast: their bf16 casts; else the norm output or tp's all-gathered input), and
        # the locals the attention module and the decoder layer hold (as at the MLP below:
        # the norm output where the projections do not save that very tensor, and under
        # autocast with tp the float32 all-gathered input, which no backward saves).
        self.recompute_attn = norm * Tr + normed_attn
        # The gradient of down_proj's output as its backward receives it: the bf16 cast of the
        # float32 residual gradient under autocast (T / tp tokens), under tp all-gathered to
        # all T tokens (the reduce-scatter's backward), in e; alive until down_proj's backward
        # has made its input gradient (and, under checkpointing, through the layer's recompute,
        # which down_proj's backward starts).
        self.grad_down_out = ((e * h * Tr if regime == "autocast" else 0)
                              + (e * h * T if p.tp > 1 else 0))
        # The forward of a layer's MLP at its product (silu(gate) * up): what the layer's
        # locals hold besides the saved tensors. The decoder layer holds the post-attention
        # norm's output (float32 under autocast and fp32, bf16 in mp) where the projections
        # do not save that very tensor (autocast saves bf16 casts; tp saves the all-gather);
        # under tp the MLP holds its all-gathered input (saved, except under autocast); in mp
        # the caller holds the layer input and the layer the mid residual (neither is saved).
        # Under checkpointing nothing of the layer is saved but its input and the attention
        # operator's outputs: the locals are the mid residual, the norm output (and its
        # all-gathered copy), silu(gate), up and the product.
        norm_out = (2 if regime == "mp" else f32) * h * Tr
        gathered_in = norm_out * p.tp if p.tp > 1 else 0
        # the locals a layer's recompute holds (see recompute_attn above): the norm output
        # where the projections save another tensor, the float32 gathered input under autocast
        self.recompute_held = ((norm_out if (regime == "autocast" or p.tp > 1) else 0)
                               + (gathered_in if regime == "autocast" else 0))
        # ... and at the recompute's MLP product (where it stops: torch.utils.checkpoint's
        # early stop, down_proj's input being the last tensor it saves): besides, the mid
        # residual where it is not saved (mp)
        self.recompute_mlp_held = self.recompute_held + (self.residual - res_saved)
        if p.ckpt:
            self.mlp_fwd_layer = (2 * self.residual + self.attn_out + norm_out + gathered_in
                                  + 3 * e * I * T)
        else:
            held = 2 * (self.residual - res_saved)
            if regime == "autocast" or p.tp > 1:
                held += norm_out
            if regime == "autocast" and p.tp > 1:
                held += gathered_in
            self.mlp_fwd_layer = self.layer + held
        # ---- checkpointing: per layer the input (torch.utils.checkpoint saves it) plus the
        # attention operator's outputs (attn_out above: kept so the recompute does not run
        # the ring or the all-to-alls again)
        self.layer_ckpt = self.residual + self.attn_out
        # ---- saved outside the layers -------------------------------------------------------
        # The last layer's output (final norm's input), the final norm, the LM head's input
        # (a bf16 cast under autocast, the norm output otherwise), the rotary cos/sin
        # (LlamaRotaryEmbedding: float32 from the float32 embeddings; bf16 in mp), the batch
        # (input_ids, position_ids, shift_labels: int64).
        head_in = e * h * Tr
        rope = 2 * d * T * (2 if regime == "mp" else f32)
        # input_ids and shift_labels (b, T) int64; position_ids (b, T) int64 too, except for
        # one sample under Ulysses / hybrid: SequenceParallelLayout._positions slices a view
        # of the ring rank's positions (seqlen / R of them), which shard_batch keeps as is.
        positions = self.p.seqlen // p.R if (p.U > 1 and p.b == 1) else T
        self.batch = _I64 * (2 * T + positions)
        self.final = res_saved + norm * Tr + head_in
        # the final norm's float32 output under autocast (the LM head saves its bf16 cast):
        # held by the base model's output until the LM head has made the logits
        self.final_norm_out = f32 * h * Tr if regime == "autocast" else 0
        # the final norm's forward at its last multiply (weight * ...): its input (saved, or
        # in mp held by the caller), what it saves, mean's (T, 1) float32 output, its output
        # (float32, bf16 in mp) and, in mp, the float32 x * rsqrt before its bf16 cast
        self.final_norm_fwd = (self.residual + norm * Tr + f32 * Tr + norm_out
                               + (f32 * h * Tr if regime == "mp" else 0))
        self.head_in = head_in
        # RMSNorm backward (autograd of LlamaRMSNorm.forward, float32): once the output's
        # gradient and x * rsqrt are released, x's gradient from the product rule, mean's
        # expanded gradient, and pow's backward (grad * (2 * x.pow(1)): three temporaries of
        # one C++ expression) are live together: five float32 (T, h) tensors.
        self.norm_bwd = 5 * f32 * h * Tr
        # x * rsqrt as the weight multiply saves it (its bf16 cast in mp)
        self.norm_xr = (2 if regime == "mp" else f32) * h * Tr
        self.rope = rope
        # ---- logits and loss (ringseq.loss.sharded_cross_entropy) --------------------------
        # logits (b, T, V) from lm_head in e; the loss upcasts to float32 (a copy unless
        # already float32), F.cross_entropy = log_softmax (float32, saved) + nll. Backward:
        # nll_loss_backward's float32 gradient, log_softmax_backward's float32 output, next
        # to the saved log_softmax: 12 bytes per logit.
        Tl, V = Tr, s.vocab
        self.logits = e * V * Tl
        self.loss_fwd = self.logits + (f32 * V * Tl if e != f32 else 0) + f32 * V * Tl
        self.loss_bwd = 3 * f32 * V * Tl
        # ---- persistent state ----------------------------------------------------------
        P = p.params()
        N = p.shards
        self.params = f32 * P // N
        self.grads = f32 * P // N
        self.optimizer = 2 * f32 * P // N  # AdamW exp_avg + exp_avg_sq
        # Gradient accumulation (micro-batches after the first, booster.no_sync): the sum of
        # the earlier micro-batches' gradients, float32 and unsharded on every mesh -- the
        # parameters' .grad, which autograd adds to in place (DDP, tensor parallelism), or
        # FSDP2's unsharded accumulated gradients (reduce_dtype float32 under bf16; no_sync
        # skips the reduce-scatter), each unit's until its reduce in the last micro-batch.
        self.accumulated_layer = f32 * p.layer_params() if p.accum > 1 else 0
        self.accumulated_root = f32 * p.root_params() if p.accum > 1 else 0
        # A tied embedding's gradient from the LM head waits in autograd's input buffer of
        # the shared weight until the embedding's backward adds its own: with accumulation
        # (zero 0) the weight's .grad exists besides it, so it is one float32 (V, h) tensor
        # more from the LM head's backward to the embedding's (measured: model B sp 2 bf16
        # accum 2, 0.0625 MiB; FSDP2 reduces its unsharded gradients otherwise).
        self.tied_pending = (f32 * s.vocab * s.hidden
                             if s.tied and p.accum > 1 and p.zero == 0 else 0)
        # DDP: the reducer's gradient buckets, float32, the size of all gradients (grads are
        # copied in and out: gradient_as_bucket_view=False); the plugin uses no DDP on 1 rank.
        # With tp > 1 there is no DDP (it cannot take DTensor parameters):
        # ringseq.parallel.grad_sync.ReplicatedGradSync sums the gradients after the backward
        # through one flat torch.cat of all of them (float32, transient: ``grad_sync``).
        ddp = p.zero == 0 and p.tp == 1 and p.world > 1
        self.buckets = f32 * P if ddp else 0
        self.grad_sync = f32 * P if (p.zero == 0 and p.tp > 1 and p.world > p.tp) else 0
        # autocast's weight cache: a bf16 copy of every nn.Linear weight/bias, made at its
        # first use in the forward and saved by the matmul until that layer's backward.
        self.wcopy = e * p.linear_params() if regime == "autocast" else 0
        self.wcopy_layer = (e * (p.layer_params() - 2 * h) if regime == "autocast" else 0)
        # the LM head's copy (outside the decoder layers: saved even under checkpointing),
        # released by the LM head's backward
        self.e_vocab = e * s.vocab * h if regime == "autocast" else 0
        # FSDP2 (ringseq.parallel.fsdp; torch's _fully_shard/_fsdp_param_group.py and
        # _fsdp_collectives.py): every decoder layer is one unit, the root module (embedding,
        # final norm, LM head) another. Unsharded parameters are in the compute dtype (bf16
        # in mp, float32 otherwise): a unit's all-gather output (one flat buffer, unshard)
        # and, after wait_for_unshard's copy-out, one storage per parameter (the flat buffer
        # is then freed: in the forward at the next unit's copy-out). Gradients come out of
        # autograd unsharded in that dtype; a unit's post_backward copies them into one
        # float32 reduce-scatter input (foreach_reduce: reduce_dtype float32 for bf16 compute),
        # kept until the next unit's post_backward (reduce_scatter_states, one in flight), and
        # the sharded gradients are views of the reduce-scatter output (1 / N of it).
        # (Parameters sharded along dim 0 are padded to a multiple of N: not modeled.)
        ep = 2 if regime == "mp" else f32
        fsdp = p.zero >= 2
        self.gathered_layer = ep * p.layer_params() if fsdp else 0
        self.gathered_root = ep * p.root_params() if fsdp else 0
        self.rs_layer = f32 * p.layer_params() if fsdp else 0
        self.rs_root = f32 * p.root_params() if fsdp else 0
        gb = ep if fsdp else f32  # bytes per gradient element as autograd makes it
        self.layer_grads = f32 * p.layer_params() // N  # a layer's gradients, reduced
        self.layer_ugrads = gb * p.layer_params()  # ... as its backward made them
        self.root_ugrads = gb * p.root_params()
        down, mlp_o = p.mlp_o_params()
        self.grad_down, self.grad_mlp_o = gb * down, gb * mlp_o
        self.wcopy_down = e * down if regime == "autocast" else 0
        self.wcopy_mlp_o = e * (mlp_o - h) if regime == "autocast" else 0
        # the q/k/v weights' copies (the recompute casts them again before the rotary)
        self.wcopy_qkv = (self.wcopy_layer - self.wcopy_mlp_o - e * down
                          if regime == "autocast" else 0)
        # the LM head's (the embedding's, when tied) and the final norm's gradients exist from
        # the LM head's backward on (under FSDP2 unsharded until the root's post_backward at
        # the end of the backward); an untied embedding's only after the last layer's
        self.head_grads = gb * (s.vocab * h + h)
        # ---- the ring's cached exchange buffers (ringseq.engine.ring.Ring.buffers: two slots
        # of a packed buffer per direction, kept between calls; ringseq.engine.loops) -------------
        # (a hybrid whose ring has one rank runs Ulysses alone: no ring buffers)
        ring_used = p.mode == "ring" or (p.mode == "hybrid" and p.R > 1)
        hops = p.R - 1
        kv_block = 2 * T * k * (p.rep if p.U > 1 else 1) * d  # K and V elements of one block

        def exchange(hops: int) -> int:  # one ring's buffers
            fwd = 2 * (_HEADER + _align(kv_block * e)) if hops > 0 else 0
            return fwd + 2 * (_align(kv_block * f32) + _HEADER
                              + (_align(kv_block * e) if hops > 0 else 0))
        # A double ring (ringseq.parallel.double_ring) runs the outer ring and the inner rings
        # as two rings, each with its own cached buffers (measured: +4 MiB, the inner ring's
        # exchange() at I = 2, O = 2, bf16, b s k d = 1 2048 2 32).
        if not ring_used:
            self.ring_buffers = 0
        elif p.double_ring:
            self.ring_buffers = exchange(p.R // p.I - 1) + exchange(p.I - 1)
        else:
            self.ring_buffers = exchange(hops)
        # ---- transients of the backward ------------------------------------------------
        g = res * Tr  # the gradient of the residual stream flowing down the layers
        self.g = g
        # MLP backward (mul of silu(gate) * up): the product's gradient and the two new
        # gradients of silu(gate) and up, e bytes each (the product itself is freed).
        self.mlp_bwd = 3 * e * I * T
        # Attention backward (ringseq.engine.loops.ring_backward, or the C++ bwd for Ulysses): dout
        # (o_proj's input gradient, e) and
        #   delta = rowsum(dout.float() * out.float()): two float32 copies (when not float32)
        #   and their float32 product;                                       (kernels.compute_delta)
        #   then delta (b,h,s), dq float32, the scratch dK/dV accumulator (2 blocks, float32,
        #   when K/V travel), dk/dv and dq in the input dtype at the end.
        dout = e * a * d * T
        delta_tmp = (2 * f32 * a * d * T if e != f32 else 0) + f32 * a * d * T
        grads_h = e * (a * d + 2 * kv_saved * d) * T  # dq, dk, dv (head shards under Ulysses)
        if ring_used:
            scratch = f32 * kv_block if hops > 0 else 0
            acc_end = (f32 * a * T + f32 * a * d * T + scratch + e * kv_block
                       + (e * a * d * T if e != f32 else 0))
            if p.double_ring:
                # an inner lap's backward (InnerLap._bwd_accum) next to the outer accumulators:
                # its own float32 dK/dV scratch and the dq / dK / dV it returns in the input
                # dtype (dq: its float32 accumulator itself for float32 inputs)
                acc_end += (f32 + e) * kv_block + (e * a * d * T if e != f32 else 0)
        else:
            # ringseq::attention's C++ bwd (ops.cpp bwd_into) allocates dq, dk, dv before it
            # computes delta in one C++ expression, whose temporaries (the float32 copies, the
            # product, the row sums and their contiguous transpose) live until its end
            delta_tmp += grads_h + 2 * f32 * a * T
            acc_end = 0
        if p.U > 1:
            # UlyssesPlacement.backward: dout's all-to-all to the head shards (dout_h: a view of
            # its receive buffer, live to the end) before the inner backward; then the
            # all-to-all of dq, dk, dv back (ringseq.parallel.ulysses.all_to_all): the inner
            # gradients, the packed send and receive buffers and the sequence-shard copies,
            # four times grads_h at the last copy.
            dout += e * a * d * T
            acc_end = max(acc_end, 4 * grads_h)
        self.attn_bwd = dout + max(delta_tmp, acc_end)
        # ---- transients of the forward's attention (its peak within a layer) -----------
        # Local variables hold tensors through the attention call: the decoder layer the
        # norm's float32 output (autocast: the projections saved bf16 casts of it),
        # LlamaAttention q and k after rotary (float32 under autocast, where ringseq saves
        # bf16 casts) and v; under Ulysses, whose head shards are what is saved, also the
        # sequence-shard q, k, v in the kernel dtype (usp_attn_func's locals).
        held = (f32 * h * Tr + f32 * (a + k) * d * T) if regime == "autocast" else 0
        if p.U > 1:
            held += e * (a + 2 * k) * d * T
        # Inside the operator, relative to the attention tensors counted saved above: the
        # ring's float32 output accumulator next to its result in the input dtype
        # (RingPlacement.forward). Ulysses (UlyssesPlacement.forward, all_to_all): first
        # q, k, v (K/V repeated rep times when rep > 1) packed into one send buffer, a receive
        # buffer and the head-shard copies, before out and lse exist; last out_h and lse_h
        # packed, received and copied to the sequence shards.
        ring_out = f32 * a * d * T if (ring_used and e != f32) else 0
        if p.U > 1:
            qkv_h = e * (a + 2 * kv_saved) * d * T
            a2a_in = (2 * qkv_h + (2 * e * kv_saved * d * T if p.rep > 1 else 0)
                      - 2 * out_lse)
            inner = (ring_out - out_lse)
            a2a_out = 2 * out_lse
            transient = max(a2a_in, inner, a2a_out)
        else:
            transient = ring_out
        # (then o_proj's reduce-scatter under tp, the operator's transients freed)
        self.attn_fwd = held + max(transient, self.rs_fwd)
        # ---- optimizer step -------------------------------------------------------------
        if p.optimizer == "adamw":  # foreach (torch's default on CUDA): sqrt of every exp_avg_sq
            self.opt_tmp = f32 * P // N
        elif p.optimizer == "adamw_forloop":
            # Per tensor, float32: the sqrt of exp_avg_sq and its division, while the previous
            # parameter's `denom` is still held by the loop's variable (torch's
            # _single_tensor_adam), for parameters in model order (one param group).
            sizes = [n // N for n in p.param_sizes()]
            self.opt_tmp = f32 * max(2 * n + prev for n, prev in zip(sizes, [0] + sizes))
        else:  # fused: in place
            self.opt_tmp = 0


def _moments(p: _Plan, t: _Terms) -> List[Tuple[str, Dict[str, int]]]:
    """The candidate moments of the step and what is live at each."""
    L = p.shape.layers
    persistent = {"params": t.params, "optimizer": t.optimizer, "comm_buffers": t.buckets,
                  "attention_buffers": t.ring_buffers}
    per_layer = t.layer_ckpt if p.ckpt else t.layer
    other_acts = t.final + t.rope + t.batch
    acts_all = L * per_layer + other_acts
    G = t.gathered_layer

    def gathered(where: str, l: int = 0) -> int:
        """FSDP2's unsharded parameters at a moment (see _Terms): the root's from its forward
        to the end of the backward (reshard_after_forward=None on the root); zero 2
        (reshard_after_forward=False) every layer from its forward to its post_backward, no
        all-gather in the backward; zero 3 a layer from its pre-forward to its post-forward,
        the next layer's all-gather issued in a layer's pre_backward (_backward_prefetch) --
        and, in the forward, the flat all-gather output of the last unit."""
        if p.zero == 0:
            return 0
        z2 = p.zero == 2
        n = {"forward": L + 1 if z2 else 2,  # at the last layer: its storages + flat buffer
             "forward after layers": L + 1 if z2 else 1,  # the last layer resharded (zero 3)
             "after forward": L if z2 else 0,  # loss; the root's post-forward freed the flat
             "final norm": L if z2 else 1,  # zero 3: the last layer's prefetched all-gather
             "layer": l + 1 if z2 else 1 + (l > 0),  # this layer + the one prefetched below
             "reduce": l if z2 else int(l > 0),  # this layer resharded before its reduce
             }[where]
        return n * G + t.gathered_root

    out: List[Tuple[str, Dict[str, int]]] = []

    def add(name, unreduced: int = L, accumulating: bool = True, head_done: bool = False,
            **live):
        """A moment; ``unreduced``: the decoder layers whose accumulated gradients FSDP2 has
        not reduced yet at it (gradient accumulation; the root's count until the end);
        ``accumulating``: whether it is part of a micro-batch's forward or backward;
        ``head_done``: whether it lies between the LM head's backward and the embedding's."""
        d = dict(persistent)
        for key, v in live.items():
            d[key] = d.get(key, 0) + v
        if not accumulating:
            pass
        elif t.accumulated_root and p.zero == 0:
            # a micro-batch after the first: every gradient exists, and each new one is added
            # to it in place (freed at once: no new gradient is held but a tied head's)
            d["grads"] = t.grads + (t.tied_pending if head_done else 0)
        elif t.accumulated_root:
            d["grads"] = (d.get("grads", 0) + t.accumulated_root
                          + unreduced * t.accumulated_layer)
        out.append((name, d))

    wcopies_fwd = t.wcopy  # the autocast cache holds every copy until the forward returns
    # saved by the matmuls; under checkpointing only the LM head's (outside the layers)
    wcopies_bwd = t.e_vocab if p.ckpt else t.wcopy
    # The last layer's attention in the forward: the layers before it, this layer up to its
    # attention (under checkpointing only what the checkpoint keeps), the weight copies made
    # so far (the autocast cache holds them to the end of the forward), the transients.
    add("forward, last layer's attention",
        activations=(L - 1) * per_layer + t.rope + t.batch
        + (t.layer_ckpt if p.ckpt else t.layer_attn_fwd),
        weight_copies=L * t.wcopy_layer - t.wcopy_mlp_o,
        comm_buffers=gathered("forward"), temporaries=t.attn_fwd)
    # The last layer's MLP in the forward, at its product (under tp at down_proj's
    # reduce-scatter, its transients besides): every weight copy made
    add("forward, last layer's MLP",
        activations=(L - 1) * per_layer + t.rope + t.batch + t.mlp_fwd_layer,
        weight_copies=L * t.wcopy_layer, comm_buffers=gathered("forward"),
        temporaries=t.rs_fwd_mlp)
    # The final norm's forward, at its output: every layer's activations and the norm's
    add("forward, final norm",
        activations=L * per_layer + t.rope + t.batch + t.final_norm_fwd,
        weight_copies=wcopies_fwd, comm_buffers=gathered("forward after layers"))
    # end of the model's forward: the cache of weight copies (under checkpointing more than
    # the backward keeps) and the logits
    add("forward end", activations=acts_all, weight_copies=wcopies_fwd,
        comm_buffers=gathered("after forward"), logits_loss=t.logits,
        temporaries=t.final_norm_out)
    add("loss forward", activations=acts_all, weight_copies=wcopies_bwd,
        comm_buffers=gathered("after forward"), logits_loss=t.loss_fwd)
    add("loss backward", activations=acts_all, weight_copies=wcopies_bwd,
        comm_buffers=gathered("after forward"), logits_loss=t.loss_bwd)
    # The final norm's backward, after the LM head's: every layer's activations, the LM
    # head's gradient and the norm's backward temporaries.
    add("backward, final norm", head_done=True, grads=t.head_grads,
        comm_buffers=gathered("final norm"),
        weight_copies=wcopies_bwd - t.e_vocab,
        activations=L * per_layer + t.rope + t.batch + t.final - t.head_in - t.norm_xr,
        temporaries=t.norm_bwd)
    # The backward of the first layer it reaches (the most activations still saved), of the
    # second (under FSDP2 the first with both the reduce-scatter input of the layer above and
    # a prefetched layer below) and of the last (the most gradients made).
    layers = {L - 1: "first", max(L - 2, 0): "second", 0: "last"}
    for l, label in sorted(layers.items(), reverse=True):
        if label == "second" and (p.zero < 2 or l in (0, L - 1)):
            continue
        below = l * per_layer  # layers not yet reached by the backward
        done = L - 1 - l  # layers whose backward is complete
        grads = t.head_grads + done * t.layer_grads
        # FSDP2: the reduce-scatter input of the layer above, until this layer's own
        rs_above = t.rs_layer if l < L - 1 else 0
        # weight copies still saved: this layer's and those below (under checkpointing only
        # this layer's: its recompute casts its weights again)
        wc = t.wcopy_layer if p.ckpt else (l + 1) * t.wcopy_layer
        # this layer: recomputed in full under checkpointing, its saved input besides
        extra = t.ckpt_input_extra if p.ckpt else 0
        layer = t.layer + extra
        acts = below + t.rope + t.batch
        if p.ckpt:
            # checkpointing: the layer's recompute at the rotary embedding, before any of its
            # own gradients (the layer's input and kept attention outputs, what the recompute
            # saved and holds so far, the gradient from above)
            add(f"backward, {label} layer's recompute (rotary)", unreduced=l + 1,
                head_done=True,
                temporaries=(t.g + t.grad_down_out + t.qkv_out + t.rope_tmp + t.recompute_held
                             + rs_above),
                grads=grads, comm_buffers=gathered("layer", l), weight_copies=t.wcopy_qkv,
                activations=acts + t.layer_ckpt + t.recompute_attn)
            # the recompute at the MLP's product, where it stops: the whole layer saved again
            # (its weights cast again under autocast), its locals, the gradient from above
            add(f"backward, {label} layer's recompute (MLP)", unreduced=l + 1, head_done=True,
                temporaries=t.g + t.grad_down_out + t.recompute_mlp_held + rs_above,
                grads=grads, comm_buffers=gathered("layer", l), weight_copies=t.wcopy_layer,
                activations=acts + layer)
        # MLP backward: at down_proj's input gradient (the product still saved, the gradient
        # of down_proj's output, the product's gradient), then at the product's gradients
        # (all of this layer saved except the product; the product's gradient and those of
        # silu(gate) and up); down_proj's weight gradient made, its weight copy released
        add(f"backward, {label} layer's MLP", unreduced=l + 1, head_done=True,
            temporaries=t.g + max(2 * t.prod + t.grad_down_out, t.mlp_bwd) + rs_above,
            grads=grads + t.grad_down,
            comm_buffers=gathered("layer", l),
            weight_copies=wc - t.wcopy_down, activations=acts + layer - t.prod)
        # attention backward: the MLP's and o_proj's gradients made, their copies released
        add(f"backward, {label} layer's attention", unreduced=l + 1, head_done=True,
            temporaries=t.g + t.attn_bwd + rs_above, grads=grads + t.grad_mlp_o,
            comm_buffers=gathered("layer", l), weight_copies=wc - t.wcopy_mlp_o,
            activations=acts + t.layer_attn_part + extra)
        if p.zero >= 2:
            # FSDP2's post_backward of this layer, at the copy into the reduce-scatter input:
            # the layer's unsharded gradients next to it (the input of the layer above freed)
            add(f"backward, {label} layer's reduce-scatter", unreduced=l + 1, activations=acts,
                grads=grads, temporaries=t.g + t.layer_ugrads + t.rs_layer,
                comm_buffers=gathered("reduce", l))
    if p.zero >= 2:
        # the root's post_backward at the end of the backward: its unsharded gradients
        # (embedding, LM head, final norm) and their reduce-scatter input, every layer's
        # reduced gradients; only the batch is left of the forward
        add("backward end, root reduce-scatter", unreduced=0, activations=t.batch,
            grads=L * t.layer_grads + t.root_ugrads, temporaries=t.rs_root)
    if t.grad_sync:
        # the end of the backward under tp at zero 0: every gradient and their flat copy
        add("backward end, gradient sum", grads=t.grads, temporaries=t.grad_sync)
    add("optimizer step", accumulating=False, grads=t.grads, temporaries=t.opt_tmp)
    return out


def _megatron(p: _Plan, flash: bool = False) -> int:
    """Megatron's activation memory per layer with tensor and sequence parallelism, 16-bit
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"):
    s b h (34 / t + 5 a s / (h t)) bytes, times the layers, at the per-rank s = seqlen / sp
    (the formula has no context-parallel term)."""
    s, b, h, a, t, L = p.seqlen // p.sp, p.b, p.shape.hidden, p.shape.heads, p.tp, p.shape.layers
    return int(L * s * b * h * (34 / t + (0 if flash else 5 * a * s / (h * t))))


# ------------------------------------------------------------------------------ checks
def _check_int(name, value, minimum=1, fn="estimate_memory") -> int:
    """``value`` as an int (NumPy's integers too); ValueError unless it is one from
    ``minimum`` to :data:`MAX_SIZE`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{fn}: {name} must be an integer >= {minimum}, got {value!r}")
    if value > MAX_SIZE:
        raise ValueError(f"{fn}: {name} must be at most 2**63 - 1 (int64), got {value!r}")
    return int(value)


def _plan(config, *, seqlen, micro_batch, world_size, sp_size, tp_size, zero_stage, precision,
          optimizer, activation_checkpointing, sp_mode, ulysses_size, layout,
          gradient_accumulation_steps=1, inner_ring_size=None) -> _Plan:
    shape = ModelShape.from_config(config)
    seqlen, micro_batch, world_size, sp_size, tp_size, accum = (
        _check_int(name, v) for name, v in (
            ("seqlen", seqlen), ("micro_batch", micro_batch), ("world_size", world_size),
            ("sp_size", sp_size), ("tp_size", tp_size),
            ("gradient_accumulation_steps", gradient_accumulation_steps)))
    # (NumPy's integers as ints; what is no integer ParallelDims names)
    zero_stage, ulysses_size, inner_ring_size = (
        int_if_integer(zero_stage), int_if_integer(ulysses_size), int_if_integer(inner_ring_size))
    if not isinstance(activation_checkpointing, bool):
        raise ValueError(f"estimate_memory: activation_checkpointing must be True or False, got "
                         f"{activation_checkpointing!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"estimate_memory: precision must be one of {list(PRECISIONS)}, got "
                         f"{precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"estimate_memory: optimizer must be one of {list(OPTIMIZERS)}, got "
                         f"{optimizer!r}")
    # The mesh as the plugin validates it (RingSequenceParallelPlugin builds the same
    # ParallelDims before any process group): what raises there raises here, so the planner
    # never lists a mesh the plugin cannot run.
    try:
        dims = ParallelDims(world_size=world_size, sp_size=sp_size, tp_size=tp_size,
                            zero_stage=zero_stage, sp_mode=sp_mode, ulysses_size=ulysses_size,
                            inner_ring_size=inner_ring_size
                            ).with_model(shape.heads, shape.kv_heads)
    except ValueError as exc:
        raise renamed_dims_error("estimate_memory", exc) from None
    if precision == "fp16" and dims.sharded:
        raise ValueError(f"estimate_memory: precision='fp16' with tp_size={tp_size} / "
                         f"zero_stage={zero_stage} is refused by the plugin (one GradScaler "
                         f"over sharded gradients); use precision='bf16'")
    if shape.intermediate % tp_size:  # ringseq.parallel.tp: colwise gate/up split their rows
        raise ValueError(f"estimate_memory: tp_size={tp_size} must divide intermediate_size="
                         f"{shape.intermediate}")
    # the data layout's multiple on the ring dim and the split of a shard over tp (the
    # layout changes no size: every layout gives each rank s / sp tokens); the name is checked
    # on every mesh, also those without a ring (fitting_meshes' first check is one)
    lay = get_layout(layout, "estimate_memory")
    try:
        multiple = dims.seq_multiple(layout)
    except ValueError as exc:
        raise named_for("estimate_memory", exc) from None
    if tp_size > 1 and isinstance(lay, PerBatchDocuments):  # as the plugin refuses it
        raise ValueError(f"estimate_memory: layout {lay.name!r} (packed batches) is not "
                         f"supported with tp_size > 1 by the plugin, got tp_size={tp_size}")
    if seqlen % multiple:
        name = getattr(layout, "name", layout)
        raise ValueError(f"estimate_memory: seqlen={seqlen} must be a multiple of {multiple} "
                         f"(the {name} layout over the ring, the sequence split over tp)")
    U, R = dims.ulysses_size, dims.ring_size
    return _Plan(shape=shape, b=micro_batch, seqlen=seqlen, world=world_size, sp=sp_size,
                 tp=tp_size, zero=zero_stage, precision=precision, optimizer=optimizer,
                 ckpt=bool(activation_checkpointing), mode=sp_mode, U=U, R=R, accum=accum,
                 I=dims.inner_ring_size)


# ------------------------------------------------------------------------------ API
def estimate_memory(config, *, seqlen: int, micro_batch: int = 1, world_size: int,
                    sp_size: int, tp_size: int = 1, zero_stage: int = 0,
                    precision: str = "bf16", optimizer: str = "adamw",
                    activation_checkpointing: bool = False, sp_mode: str = "ring",
                    ulysses_size: Optional[int] = None, layout="zigzag",
                    gradient_accumulation_steps: int = 1,
                    inner_ring_size: Optional[int] = None) -> MemoryEstimate:
    """Per-rank memory of one training step (forward, backward, AdamW step), in bytes.

    Args:
        config: a transformers config (Llama / Qwen2 family) or a dict with its keys (see
            :class:`ModelShape`).
        seqlen: global sequence length of one sample; micro_batch: samples per dp group.
        world_size: ranks; sp_size: sequence-parallel ranks; tp_size: tensor-parallel ranks;
            dp = world_size / (sp_size * tp_size).
        zero_stage: 0 = DDP (everything replicated, plus DDP's gradient buckets), 2 = FSDP2
            without resharding after the forward, 3 = FSDP2 resharding after the forward
            (parameters, gradients and AdamW states sharded over dp x sp).
        precision: "fp32", "bf16" or "fp16" (as the plugin's ``precision``).
        optimizer: "adamw" (torch's foreach implementation, its default on CUDA),
            "adamw_fused" or "adamw_forloop" (the default on CPU).
        activation_checkpointing: per decoder layer, keeping the attention operator's outputs
            (output and lse; Ulysses and hybrid also the head shards: the recompute does not
            run the ring or the all-to-alls again).
        sp_mode, ulysses_size: as ``RingSequenceParallelPlugin``.
        layout: the plugin's data layout (a name or a ``ringseq.layouts.Layout``): it decides
            only what ``seqlen`` must be a multiple of.
        gradient_accumulation_steps: micro-batches per optimizer step (all but the last
            under ``booster.no_sync``); from the second on, the float32 sum of the earlier
            gradients is live through the forward and backward, unsharded on every mesh
            (FSDP2 keeps each unit's until its reduce-scatter in the last micro-batch).
        inner_ring_size: a double ring's inner ring size (as ``RingSequenceParallelPlugin``:
            ring and hybrid modes, dividing the ring size); its inner rings keep exchange
            buffers of their own next to the outer ring's.

    Returns a :class:`MemoryEstimate` (frozen). Raises TypeError for a config that is neither
    a config nor a dict (a model, None), KeyError for a config without a needed key (naming
    it), ValueError for a mixture of experts or a model type the estimate does not model
    (``MODELED_TYPES``; a dict without ``model_type`` is a Llama of its sizes), for sizes that
    do not fit together or a mesh the plugin refuses (naming the argument and what would
    work).
    """
    p = _plan(config, seqlen=seqlen, micro_batch=micro_batch, world_size=world_size,
              sp_size=sp_size, tp_size=tp_size, zero_stage=zero_stage, precision=precision,
              optimizer=optimizer, activation_checkpointing=activation_checkpointing,
              sp_mode=sp_mode, ulysses_size=ulysses_size, layout=layout,
              gradient_accumulation_steps=gradient_accumulation_steps,
              inner_ring_size=inner_ring_size)
    t = _Terms(p)
    moments = _moments(p, t)
    name, live = max(moments, key=lambda m: sum(m[1].values()))
    total = sum(live.values())
    L = p.shape.layers
    activations = L * (t.layer_ckpt if p.ckpt else t.layer) + t.final + t.rope + t.batch
    order = ("params", "grads", "optimizer", "comm_buffers", "weight_copies", "activations",
             "attention_buffers", "logits_loss", "temporaries")
    breakdown = tuple((k, live[k]) for k in order if live.get(k))
    # the most held at any moment (DDP's buckets always; FSDP2's unsharded parameters vary)
    comm = max(d.get("comm_buffers", 0) for _, d in moments)
    return MemoryEstimate(
        shape=p.shape, seqlen=seqlen, micro_batch=micro_batch, world_size=world_size,
        sp_size=sp_size, tp_size=tp_size, zero_stage=zero_stage, precision=precision,
        optimizer_name=optimizer, activation_checkpointing=bool(activation_checkpointing),
        sp_mode=sp_mode, ulysses_size=p.U, gradient_accumulation_steps=p.accum,
        params=t.params, grads=t.grads, optimizer=t.optimizer, comm_buffers=comm,
        weight_copies=t.wcopy, activations_per_layer=t.layer_ckpt if p.ckpt else t.layer,
        activations=activations, attention_buffers=t.ring_buffers,
        logits_loss=t.loss_bwd, temporaries=live.get("temporaries", 0), total=total,
        peak_phase=name, megatron=_megatron(p), megatron_flash=_megatron(p, flash=True),
        breakdown=breakdown,
        moments=tuple((n, sum(d.values())) for n, d in moments),
        inner_ring_size=p.I if p.double_ring else None)


# ------------------------------------------------------------------------------ planning
_MODE_RANK = {"ring": 0, "hybrid": 1, "ulysses": 2}


def _cost_key(est: MemoryEstimate):
    # Best first: no recompute (checkpointing costs about a third more compute), then fewer
    # tensor-parallel ranks (their collectives sit on the critical path of every layer), a
    # lower zero stage (zero 3 gathers the parameters again in the backward), fewer sequence-
    # parallel ranks (ring exchanges overlap with compute but grow with the ring), the ring
    # before Ulysses (whose all-to-alls do not overlap); then the smaller peak.
    return (est.activation_checkpointing, est.tp_size, est.zero_stage, est.sp_size,
            _MODE_RANK[est.sp_mode], est.total)


#: The largest world whose meshes :func:`meshes` lists (2**24 ranks: a power of two's in a
#: second, a highly divisible one's, 8,648,640, in about 10 s; past it, minutes to hours).
MESHES_WORLD_MAX = 1 << 24


def meshes(config, world_size: int, precision: str = "bf16") -> List[dict]:
    """Every mesh of ``world_size`` ranks that ``RingSequenceParallelPlugin`` runs for the
    model, as keyword arguments of :func:`estimate_memory`: each (tp, sp, sp_mode /
    ulysses_size, zero_stage) the plugin's ``ParallelDims`` accepts with the model's heads
    (tp dividing the query and the K/V heads, the Ulysses degree the heads per tp rank), tp
    dividing the MLP width, zero 0/2/3 (not sharded ones with fp16, which the plugin
    refuses), checkpointing off/on. Hybrid lists Ulysses degrees strictly between 1 and sp
    (the others are the ring and Ulysses)."""
    with _named_as("meshes"):
        shape = ModelShape.from_config(config)
    world_size = _check_int("world_size", world_size, fn="meshes")
    if world_size > MESHES_WORLD_MAX:  # (before: the enumeration ran for hours)
        raise ValueError(f"meshes: world_size must be at most {MESHES_WORLD_MAX} to list its "
                         f"meshes, got {world_size}; estimate_memory takes any one mesh")
    if precision not in PRECISIONS:
        raise ValueError(f"meshes: precision must be one of {list(PRECISIONS)}, got "
                         f"{precision!r}")
    out = []
    for tp in divisors(world_size):
        if shape.intermediate % tp:
            continue
        for sp in divisors(world_size // tp):
            modes = [("ring", None)]
            if sp > 1:
                modes += [("hybrid", u) for u in divisors(sp) if 1 < u < sp]
                modes.append(("ulysses", None))
            for mode, u in modes:
                for zero in ZERO_STAGES:
                    try:
                        dims = ParallelDims(world_size=world_size, sp_size=sp, tp_size=tp,
                                            zero_stage=zero, sp_mode=mode, ulysses_size=u
                                            ).with_model(shape.heads, shape.kv_heads)
                    except ValueError:
                        continue
                    if precision == "fp16" and dims.sharded:
                        continue
                    for ckpt in (False, True):
                        out.append(dict(world_size=world_size, sp_size=sp, tp_size=tp,
                                        zero_stage=zero, sp_mode=mode, ulysses_size=u,
                                        activation_checkpointing=ckpt))
    return out


def _check_budget(fn: str, device_memory) -> None:
    # (an int past MAX_SIZE first: math.isfinite cannot take one past a float's range)
    if (isinstance(device_memory, bool) or not isinstance(device_memory, numbers.Real)
            or (isinstance(device_memory, numbers.Integral) and device_memory > MAX_SIZE)
            or not math.isfinite(device_memory) or not 0 < device_memory <= MAX_SIZE):
        raise ValueError(f"{fn}: device_memory must be a positive number of bytes, at most "
                         f"2**63 - 1 (e.g. ringseq.memory.parse_bytes('80GiB')), got "
                         f"{device_memory!r}")


def fitting_meshes(config, *, world_size: int, seqlen: int, device_memory: int,
                   **kwargs) -> List[MemoryEstimate]:
    """The estimates of every mesh (:func:`meshes`) whose peak fits in ``device_memory``
    bytes at ``seqlen``, best first (see ``_cost_key``). ``kwargs``: micro_batch, precision,
    optimizer, layout, gradient_accumulation_steps. Meshes whose sizes do not divide
    ``seqlen`` are left out.

    Raises TypeError for another keyword and ValueError for a bad option value (a misspelled
    precision or optimizer, micro_batch < 1, seqlen < 1), checked once on the plain
    data-parallel mesh before the search, rather than leaving every mesh out."""
    fit, _, _ = _search(config, world_size=world_size, seqlen=seqlen,
                        device_memory=device_memory, **kwargs)
    return fit


def _search(config, *, world_size, seqlen, device_memory, **kwargs):
    """(the meshes that fit, best first; every mesh estimated; {reason: meshes left out})
    for :func:`fitting_meshes` and the CLI, which reports what was left out and why."""
    extra = set(kwargs) - {"micro_batch", "precision", "optimizer", "layout",
                           "gradient_accumulation_steps"}
    if extra:
        raise TypeError(f"fitting_meshes: unexpected keyword argument(s) {sorted(extra)}; it "
                        f"takes micro_batch, precision, optimizer, layout and "
                        f"gradient_accumulation_steps")
    _check_budget("fitting_meshes", device_memory)
    # the options' own errors (dp = world_size, nothing split: every seqlen >= 1 divides; in
    # Ulysses' mode, as the ring's zigzag shards a sequence even over one rank)
    with _named_as("fitting_meshes"):
        estimate_memory(config, seqlen=seqlen, world_size=world_size, sp_size=1,
                        sp_mode="ulysses", **kwargs)
    estimated, left_out = [], {}
    try:
        listed = meshes(config, world_size, kwargs.get("precision", "bf16"))
    except ValueError as exc:  # (its world-size limit, named for the call made)
        raise ValueError(f"fitting_meshes: {str(exc).removeprefix('meshes: ')}") from None
    for mesh in listed:
        try:
            estimated.append(estimate_memory(config, seqlen=seqlen, **mesh, **kwargs))
        except ValueError as exc:
            left_out.setdefault(str(exc).replace("estimate_memory: ", ""), []).append(mesh)
    fit = sorted((e for e in estimated if e.total <= device_memory), key=_cost_key)
    return fit, estimated, left_out


@contextlib.contextmanager
def _named_as(fn: str):
    """estimate_memory's errors, raised while ``fn`` (the function the user called) runs it,
    name ``fn``."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        if text.startswith("estimate_memory: "):
            raise type(exc)(f"{fn}: {text[len('estimate_memory: '):]}") from exc
        raise


#: the longest sequence :func:`max_seqlen` searches by default (and the CLI: its rows at the
#: limit say so)
SEARCH_LIMIT = 1 << 26


#: the mesh keywords of max_seqlen: estimate_memory's but the config and the length
_MESH_KEYS = frozenset(inspect.signature(estimate_memory).parameters) - {"config", "seqlen"}


def _seq_step(mesh: dict) -> int:
    """The shortest length ``mesh`` (the keyword arguments of :func:`estimate_memory`) and
    its layout can split: the lengths it takes are its multiples. (NumPy's integers as ints,
    as :func:`estimate_memory` takes them; what is no integer ParallelDims names.)"""
    sizes = {k: int_if_integer(mesh.get(k, d)) for k, d in (
        ("world_size", None), ("sp_size", None), ("tp_size", 1), ("zero_stage", 0),
        ("ulysses_size", None), ("inner_ring_size", None))}
    return ParallelDims(sp_mode=mesh.get("sp_mode", "ring"), **sizes
                        ).seq_multiple(mesh.get("layout", "zigzag"))


def max_seqlen(config, *, device_memory: int, limit: int = SEARCH_LIMIT,
               **mesh) -> Optional[MemoryEstimate]:
    """The estimate at the longest sequence length (a multiple of what the mesh needs, at
    most ``limit``) whose peak fits in ``device_memory`` bytes on one mesh (``mesh``: the
    other arguments of :func:`estimate_memory`), or None when not even the shortest fits.
    Bisection: the peak grows with the length.

    Raises TypeError without ``world_size`` or ``sp_size``, ValueError for a ``device_memory``
    that is not a positive number, a ``limit`` below the mesh's length multiple, and what
    :func:`estimate_memory` raises for the mesh."""
    if "seqlen" in mesh:
        raise TypeError("max_seqlen: seqlen is what it searches; pass device_memory, limit and "
                        "the mesh (the other arguments of estimate_memory) only")
    unknown = sorted(set(mesh) - _MESH_KEYS)
    if unknown:
        raise TypeError(f"max_seqlen: unexpected keyword argument(s) {unknown}; it takes "
                        f"device_memory, limit and the mesh: {sorted(_MESH_KEYS)}")
    missing = [k for k in ("world_size", "sp_size") if k not in mesh]
    if missing:
        raise TypeError(f"max_seqlen: missing keyword argument(s) {missing} (the mesh: "
                        f"world_size, sp_size and optionally the other arguments of "
                        f"estimate_memory)")
    _check_budget("max_seqlen", device_memory)
    get_layout(mesh.get("layout", "zigzag"), "max_seqlen")  # (named for the user's call)
    try:
        step = _seq_step(mesh)
    except (ValueError, TypeError) as exc:
        raise renamed_dims_error("max_seqlen", exc) from None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < step:
        raise ValueError(f"max_seqlen: limit must be an integer >= {step} (the shortest length "
                         f"this mesh and layout can split), got {limit!r}")

    def at(n):
        with _named_as("max_seqlen"):
            return estimate_memory(config, seqlen=n * step, **mesh)

    if at(1).total > device_memory:
        return None
    lo, hi = 1, 2
    while hi * step <= limit and at(hi).total <= device_memory:
        lo, hi = hi, hi * 2
    hi = min(hi, limit // step + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid).total <= device_memory:
            lo = mid
        else:
            hi = mid
    return at(lo)


# ------------------------------------------------------------------------------ CLI
def _load_config(path: str) -> dict:
    import json
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object (a transformers config.json)")
    return cfg


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m ringseq.memory``: which meshes fit (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m ringseq.memory",
        description="Which meshes of W ranks train a Llama/Qwen2-style model at a sequence "
                    "length within the device memory (per-rank peak of one training step "
                    "estimated by ringseq.memory.estimate_memory), best first: no activation "
                    "checkpointing, then fewer tp ranks, lower zero stage, fewer sp ranks, "
                    "ring before Ulysses, smaller peak.")
    p.add_argument("--config", required=True,
                   help="a transformers config.json (or a JSON object with its keys)")
    p.add_argument("--seqlen", type=int, default=None,
                   help="global sequence length per sample (required without --max-seqlen)")
    p.add_argument("--world-size", type=int, required=True, help="ranks (devices)")
    p.add_argument("--device-memory", required=True,
                   help="memory per device, e.g. 80GiB, 80GB or bytes")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per dp group")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1,
                   help="micro-batches per optimizer step (booster.no_sync)")
    p.add_argument("--max-seqlen", action="store_true",
                   help=f"also (or, without --seqlen, only) the longest sequence each mesh "
                        f"fits, searched up to {SEARCH_LIMIT} tokens (a mesh that fits that "
                        f"shows '>= N (search limit)')")
    args = p.parse_args(argv)
    try:
        memory = parse_bytes(args.device_memory)
    except ValueError as exc:
        p.error(f"--device-memory: {exc}")
    if memory <= 0:
        p.error(f"--device-memory must be at least one byte, got {args.device_memory} "
                f"({memory} bytes)")
    if args.seqlen is None and not args.max_seqlen:
        p.error("give --seqlen N, --max-seqlen, or both")
    for name in ("seqlen", "world_size", "micro_batch", "gradient_accumulation_steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if v is not None and v > MAX_SIZE:  # (before: a traceback naming an inner function)
            p.error(f"--{name.replace('_', '-')} must be at most 2**63 - 1 (int64), got {v}")
    if args.world_size > MESHES_WORLD_MAX:  # (before: the header, then no end)
        p.error(f"--world-size must be at most {MESHES_WORLD_MAX} (the meshes listed), got "
                f"{args.world_size}")
    try:
        config = _load_config(args.config)
        shape = ModelShape.from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # (a KeyError's str() is its repr, in quotes; the message's "estimate_memory: "
        # names a function this command does not show)
        text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        p.error(f"--config {args.config}: {text.removeprefix('estimate_memory: ')}")
    common = dict(micro_batch=args.micro_batch, precision=args.precision,
                  optimizer=args.optimizer,
                  gradient_accumulation_steps=args.gradient_accumulation_steps)
    n_params = _Plan(shape=shape, b=1, seqlen=1, world=1, sp=1, tp=1, zero=0, precision="fp32",
                     optimizer="adamw", ckpt=False, mode="ring", U=1, R=1).params()
    print(f"# {shape.layers} layers, hidden {shape.hidden}, MLP {shape.intermediate}, heads "
          f"{shape.heads}/{shape.kv_heads}, vocab {shape.vocab}: {n_params / 1e9:.2f} B "
          f"parameters; {args.world_size} ranks of {_gib(memory)} GiB, {args.precision}, "
          f"{args.optimizer}, micro-batch {args.micro_batch}"
          + (f", {args.gradient_accumulation_steps} micro-batches per optimizer step"
             if args.gradient_accumulation_steps > 1 else ""))
    header = ("dp", "sp", "mode", "tp", "zero", "ckpt")

    def mesh_cells(e: MemoryEstimate):
        mode = (e.sp_mode if e.sp_mode != "hybrid" else f"hybrid u{e.ulysses_size}") \
            if e.sp_size > 1 else "-"
        return (str(e.dp_size), str(e.sp_size), mode, str(e.tp_size), str(e.zero_stage),
                "yes" if e.activation_checkpointing else "no")

    if args.seqlen is not None:
        fit, estimated, left_out = _search(config, world_size=args.world_size,
                                           seqlen=args.seqlen, device_memory=memory, **common)
        print(f"\n## meshes that fit seqlen {args.seqlen}, best first ({len(fit)})")
        if fit:
            print(_table([mesh_cells(e) + (_gib(e.total), _gib(memory - e.total), e.peak_phase)
                          for e in fit], header + ("peak GiB", "headroom GiB", "peak at")))
        else:
            best = min(estimated, key=lambda e: e.total, default=None)
            print(f"no mesh of the {len(estimated)} estimated fits" +
                  ("" if best is None else f"; the smallest peak is {_gib(best.total)} GiB "
                                           f"({best.mesh()})"))
        for reason, left in sorted(left_out.items(), key=lambda kv: -len(kv[1])):
            # (a length that does not divide, most often: another seqlen brings them back)
            print(f"left out, {len(left)} mesh(es) (e.g. sp {left[0]['sp_size']}, tp "
                  f"{left[0]['tp_size']}, {left[0]['sp_mode']}): {reason}")
    if args.max_seqlen:
        rows = []
        capped = set()  # (meshes whose next length would pass the search limit: they fit more)
        for mesh in meshes(config, args.world_size, args.precision):
            e = max_seqlen(config, device_memory=memory, **mesh, **common)
            if e is not None:
                rows.append(e)
                if e.seqlen + _seq_step(mesh) > SEARCH_LIMIT:
                    capped.add(id(e))
        # (capped rows first, together: a mesh whose length step does not divide the limit
        # stops below it, 67108860 on 6 ranks, and sorted below rows it is no shorter than)
        rows.sort(key=lambda e: (-(SEARCH_LIMIT if id(e) in capped else e.seqlen),)
                  + _cost_key(e))
        print(f"\n## the longest sequence each mesh fits ({len(rows)} meshes)")
        print(_table([mesh_cells(e) + (
            f">= {e.seqlen} (search limit)" if id(e) in capped else str(e.seqlen),
            _gib(e.total), _gib(memory - e.total), e.peak_phase) for e in rows],
                     header + ("max seqlen", "peak GiB", "headroom GiB", "peak at"))
              if rows else "no mesh fits any sequence length")
    return 0


if __name__ == "__main__":
    sys.exit(main())
