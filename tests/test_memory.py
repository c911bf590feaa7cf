"""ringseq.memory: the estimate of one training step's per-rank peak.

Without any process group: how the estimate scales with the sequence length and the mesh
(sp, tp, zero), the parameter count against transformers' own models, the errors, the table,
the planner CLI on a Llama-3-8B-shaped config. On spawned gloo ranks: the estimate within
±10 % of the peak MemTracker measures for one training step through the plugin, for every
configuration benchmarks/memory_check.py marks ``quick`` (one spawn for all of them).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

import ringseq.memory as mem
from ringseq.memory import MemoryEstimate, ModelShape, estimate_memory

GiB = 2 ** 30
# Llama-3-8B's shapes
LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               tie_word_embeddings=False)
TINY = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)


def est(config=TINY, **kw):
    args = dict(seqlen=4096, world_size=8, sp_size=4)
    args.update(kw)
    return estimate_memory(config, **args)


def live(e: MemoryEstimate) -> dict:
    return dict(e.breakdown)


# ---------------------------------------------------------------- the model's parameters
@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_params_are_the_models_parameter_bytes(family, tied):
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config,
                                    transformers.Qwen2ForCausalLM)}[family]
    cfg = cfg_cls(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  tie_word_embeddings=tied)
    n = sum(p.numel() for p in model_cls(cfg).parameters())  # tied weights counted once
    e = estimate_memory(cfg, seqlen=64, world_size=1, sp_size=1, precision="fp32")
    assert e.params == 4 * n
    assert e.optimizer == 8 * n  # AdamW: exp_avg and exp_avg_sq in float32
    assert e.grads == 4 * n
    assert e.comm_buffers == 0  # one rank: the plugin wraps no DDP


def test_head_dim_defaults_to_hidden_over_heads():
    with_dim = dict(TINY, head_dim=TINY["hidden_size"] // TINY["num_attention_heads"])
    assert est(TINY) == est(with_dim)
    assert ModelShape.from_config(TINY).head_dim == 32
    assert est(dict(TINY, head_dim=64)).activations > est(TINY).activations


def test_kv_heads_default_to_the_query_heads():
    """As transformers' Llama does for a config.json without num_key_value_heads (Llama 1's;
    before: KeyError, so the CLI refused a file transformers loads)."""
    mha = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert ModelShape.from_config(mha).kv_heads == TINY["num_attention_heads"]
    assert est(mha) == est(dict(TINY, num_key_value_heads=TINY["num_attention_heads"]))
    assert est(dict(mha, num_key_value_heads=None)) == est(mha)


@pytest.mark.parametrize("key", mem._REQUIRED)
def test_missing_key_is_named(key):
    cfg = {k: v for k, v in TINY.items() if k != key}
    with pytest.raises(KeyError, match=key):
        est(cfg)


# ---------------------------------------------------------------- scaling
def test_activations_are_linear_in_seqlen_and_state_is_not():
    a, b = est(seqlen=4096), est(seqlen=8192)
    assert b.activations == 2 * a.activations
    assert b.activations_per_layer == 2 * a.activations_per_layer
    assert b.logits_loss == 2 * a.logits_loss
    assert (b.params, b.grads, b.optimizer, b.comm_buffers) == \
        (a.params, a.grads, a.optimizer, a.comm_buffers)
    # the exchange buffers hold one K/V block of s / sp tokens (64-byte aligned segments)
    assert b.attention_buffers == pytest.approx(2 * a.attention_buffers, rel=1e-3)
    assert a.total < b.total < 2 * a.total
    # Megatron's formula is quadratic in s (its 5as/h term), without that term linear
    assert b.megatron > 2 * a.megatron and b.megatron_flash == 2 * a.megatron_flash


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_sequence_parallelism_divides_activations(mode):
    base = est(seqlen=8192, world_size=8, sp_size=1)
    for sp in ((2, 4, 8) if mode == "ring" else (2, 4)):  # Ulysses splits the 4 heads
        e = est(seqlen=8192, world_size=8, sp_size=sp, sp_mode=mode)
        if mode == "ring":
            assert e.activations == base.activations // sp
        else:
            # Ulysses saves o_proj's sequence-shard copy of the output besides the head
            # shards: more per token than the ring, still divided by sp
            assert base.activations // sp < e.activations < 2 * base.activations // sp
        assert e.logits_loss == base.logits_loss // sp
        assert e.params == base.params  # DDP replicates the model over dp x sp
    ring8 = est(seqlen=8192, world_size=8, sp_size=8)
    # sp = 1 still keeps the backward's dK/dV accumulator; a ring also the K/V double
    # buffer of the forward and the K/V segment of the backward's
    assert 0 < base.attention_buffers
    assert ring8.attention_buffers > base.attention_buffers // 8
    assert est(seqlen=8192, world_size=8, sp_size=4, sp_mode="ulysses").attention_buffers == 0


def test_tensor_parallelism_splits_heads_and_mlp_but_not_embeddings():
    s = ModelShape.from_config(LLAMA8B)
    h, I, d, L, V = s.hidden, s.intermediate, s.head_dim, s.layers, s.vocab
    for tp in (1, 2, 4, 8):
        e = est(LLAMA8B, seqlen=8192, world_size=8, sp_size=1, tp_size=tp, zero_stage=0)
        layer = (h * s.heads * d * 2 + 2 * h * s.kv_heads * d + 3 * h * I) // tp + 2 * h
        assert e.params == 4 * (L * layer + 2 * V * h + h)
    one = est(LLAMA8B, seqlen=8192, world_size=8, sp_size=1, tp_size=1)
    two = est(LLAMA8B, seqlen=8192, world_size=8, sp_size=1, tp_size=2)
    # heads, MLP columns, norms and the residual stream are split, but each block saves its
    # all-gathered input (autocast: one bf16 cast of it per colwise projection), so less than
    # half is saved away
    assert one.activations_per_layer / 2 < two.activations_per_layer < one.activations_per_layer
    # without DDP (it cannot take DTensor parameters) the plugin sums the gradients itself:
    # no buckets, one flat copy of every gradient at the end of the backward
    assert two.comm_buffers == 0
    assert dict(two.moments)["backward end, gradient sum"] == \
        two.params + two.optimizer + two.attention_buffers + 2 * two.grads


def test_meshes_are_what_the_plugin_runs():
    from ringseq.parallel.dims import ParallelDims
    for config, tps in ((TINY, {1, 2}), (LLAMA8B, {1, 2, 4, 8})):
        shape = ModelShape.from_config(config)
        listed = mem.meshes(config, 8)
        assert {m["tp_size"] for m in listed} == tps  # tp divides query and K/V heads
        assert {m["zero_stage"] for m in listed} == {0, 2, 3}
        for m in listed:  # the plugin's own validation accepts every one
            ParallelDims(world_size=8, sp_size=m["sp_size"], tp_size=m["tp_size"],
                         zero_stage=m["zero_stage"], sp_mode=m["sp_mode"],
                         ulysses_size=m["ulysses_size"]).with_model(shape.heads, shape.kv_heads)
        # fp16 needs one GradScaler over unsharded gradients: no tp, no FSDP
        fp16 = mem.meshes(config, 8, precision="fp16")
        assert fp16 and all(m["tp_size"] == 1 and m["zero_stage"] == 0 for m in fp16)


def test_zero_shards_state_over_dp_and_sp():
    W = 8
    zero0 = est(LLAMA8B, seqlen=8192, world_size=W, sp_size=4, zero_stage=0)
    for stage in (2, 3):
        for tp in (1, 2):
            e = est(LLAMA8B, seqlen=8192, world_size=W, sp_size=4 // tp, tp_size=tp,
                    zero_stage=stage)
            ref = est(LLAMA8B, seqlen=8192, world_size=W, sp_size=4 // tp, tp_size=tp,
                      zero_stage=0)
            n = W // tp  # FSDP2 shards over the dp x sp ranks of a tp rank
            assert e.params == ref.params // n
            assert e.grads == ref.grads // n
            assert e.optimizer == ref.optimizer // n
    # DDP's buckets hold a float32 copy of every gradient; FSDP2 holds unsharded layers
    assert zero0.comm_buffers == zero0.params
    z2 = est(LLAMA8B, seqlen=8192, world_size=W, sp_size=4, zero_stage=2)
    z3 = est(LLAMA8B, seqlen=8192, world_size=W, sp_size=4, zero_stage=3)
    assert z2.comm_buffers > z3.comm_buffers > 0  # zero 2 keeps every layer gathered
    assert z3.total < z2.total < zero0.total
    # an 8B model with AdamW does not fit replicated on 80 GiB, sharded it does
    assert zero0.params + zero0.grads + zero0.optimizer > 80 * GiB
    assert z3.total < 80 * GiB


def test_gradient_accumulation_keeps_the_float32_gradient_sum_through_the_next_forward():
    """From the second micro-batch on, the earlier micro-batches' gradients are live through
    the forward: float32 and unsharded on every mesh (the .grad autograd adds to under DDP and
    tensor parallelism, FSDP2's unsharded sum until its reduce-scatter). Before: not
    modeled, 5.7-7.8 % below the peak MemTracker measured with two micro-batches."""
    for kw in (dict(zero_stage=0), dict(zero_stage=3), dict(zero_stage=2, tp_size=2),
               dict(zero_stage=0, tp_size=2)):
        one, two = est(**kw), est(gradient_accumulation_steps=2, **kw)
        unsharded = one.grads * (one.world_size // one.tp_size if kw["zero_stage"] else 1)
        at_loss = {name: v for name, v in two.moments}["loss backward"]
        assert at_loss - {name: v for name, v in one.moments}["loss backward"] == unsharded
        assert two.total >= one.total + unsharded - one.grads  # (the step's own grads overlap)
        assert est(gradient_accumulation_steps=3, **kw).total == two.total
        # the optimizer step comes after the last reduction: no sum is left
        assert dict(two.moments)["optimizer step"] == dict(one.moments)["optimizer step"]
    assert "2 micro-batches per optimizer step" in str(est(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=r"^estimate_memory: gradient_accumulation_steps must "
                                         r"be an integer >= 1, got 0"):
        est(gradient_accumulation_steps=0)


def test_a_tied_heads_gradient_waits_for_the_embeddings_under_accumulation():
    """A tied embedding's weight gets two gradients in the backward: the LM head's waits in
    autograd's input buffer until the embedding's is added to it. Under DDP or tp with
    accumulation, the weight's .grad exists besides it: one float32 (V, h) tensor more from
    the head's backward to the end (before: not counted, -0.15 % / -0.29 % below MemTracker
    for model B sp 2 / sp 2 x tp 2 bf16 with two micro-batches). FSDP2 keeps no such extra."""
    V, h = TINY["vocab_size"], TINY["hidden_size"]
    tied = dict(TINY, tie_word_embeddings=True)
    for kw, extra in ((dict(zero_stage=0), 4 * V * h), (dict(zero_stage=0, tp_size=2), 4 * V * h),
                      (dict(zero_stage=2), 0), (dict(zero_stage=3), 0)):
        for accum in (1, 2):
            pending = extra if accum > 1 else 0
            # the untied model's extra (V, h) parameter costs the same at every moment of the
            # micro-batch; the tied one's pending gradient narrows the gap after the head
            untied_m = dict(est(gradient_accumulation_steps=accum, **kw).moments)
            tied_m = dict(est(tied, gradient_accumulation_steps=accum, **kw).moments)
            gap = {name: untied_m[name] - tied_m[name] for name in tied_m}
            before = gap["loss backward"]
            assert gap["forward end"] == before
            for name, g in gap.items():
                if name.startswith("backward, "):
                    assert g == before - pending, (kw, accum, name)


def test_checkpointing_keeps_layer_input_and_attention_outputs():
    off = est(precision="bf16")
    on = est(precision="bf16", activation_checkpointing=True)
    T, s = 4096 // 4, ModelShape.from_config(TINY)
    a, k, d = s.heads, s.kv_heads, s.head_dim
    # per layer: the float32 layer input, the attention output (bf16) and lse (float32)
    assert on.activations_per_layer == T * (4 * s.hidden + 2 * a * d + 4 * a)
    assert on.activations < off.activations
    assert on.total < off.total
    # Ulysses' operator also outputs the head shards it saves (q, k, v and out in bf16, lse;
    # as many elements as their sequence shards): checkpointing keeps them too, so its
    # all-to-alls are not repeated
    uly = est(precision="bf16", activation_checkpointing=True, sp_mode="ulysses", sp_size=2)
    T = 4096 // 2
    assert uly.activations_per_layer == T * (4 * s.hidden + 2 * (3 * a * d + 2 * k * d)
                                             + 2 * 4 * a)
    # FSDP2's bf16 model: the layer input checkpointing saves is bf16
    mp = est(precision="bf16", activation_checkpointing=True, zero_stage=3)
    assert mp.activations_per_layer == on.activations_per_layer - 2 * s.hidden * (4096 // 4)


def test_optimizer_implementations():
    e = {o: est(seqlen=64, optimizer=o) for o in mem.OPTIMIZERS}
    # at a short sequence the optimizer step holds the peak: foreach's sqrt of every
    # exp_avg_sq is one more float32 copy of the parameters, fused has none
    assert e["adamw"].peak_phase == "optimizer step"
    assert live(e["adamw"])["temporaries"] == e["adamw"].params
    assert e["adamw_fused"].total < e["adamw_forloop"].total < e["adamw"].total


def test_forloop_step_holds_the_previous_parameters_denominator():
    """torch's for-loop AdamW (_single_tensor_adam) makes the sqrt of exp_avg_sq and its
    quotient for one parameter while the loop's variable still holds the previous parameter's
    denominator: the step's temporaries are the largest 2 x size + previous size, parameters
    in model order (before: 2 x the largest, 2.7 % short of MemTracker when MLP weights
    follow each other)."""
    h, inter = TINY["hidden_size"], TINY["intermediate_size"]

    def temporaries(config):
        e = {o: estimate_memory(config, seqlen=2, world_size=1, sp_size=1, precision="fp32",
                                optimizer=o) for o in ("adamw_fused", "adamw_forloop")}
        assert {x.peak_phase for x in e.values()} == {"optimizer step"}
        return e["adamw_forloop"].total - e["adamw_fused"].total  # fused: in place

    # a small vocabulary: up after gate (or down after up), each h x intermediate
    assert temporaries(dict(TINY, vocab_size=64)) == 4 * 3 * h * inter
    # TINY's embedding is the largest and comes first; its untied LM head follows the norm
    assert temporaries(TINY) == 4 * (2 * TINY["vocab_size"] * h + h)


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True},
                                  {"model_type": "qwen2"}, {"attention_bias": True,
                                                            "mlp_bias": True}])
def test_parameter_sizes_in_model_order_sum_to_the_parameters(over):
    p = mem._plan(dict(TINY, **over), seqlen=64, micro_batch=1, world_size=4, sp_size=2,
                  tp_size=2, zero_stage=0, precision="fp32", optimizer="adamw_forloop",
                  activation_checkpointing=False, sp_mode="ring", ulysses_size=None,
                  layout="zigzag")
    assert sum(p.param_sizes()) == p.params()


@pytest.mark.parametrize("fn, kwargs, error, match", [
    ("fitting_meshes", dict(device_memory=-1), ValueError, "device_memory must be a positive"),
    ("fitting_meshes", dict(device_memory=0), ValueError, "device_memory must be a positive"),
    ("fitting_meshes", dict(device_memory=float("nan")), ValueError, "device_memory"),
    ("fitting_meshes", dict(device_memory="80GiB"), ValueError, "parse_bytes"),
    # (before: OverflowError from math.isfinite)
    ("fitting_meshes", dict(device_memory=10 ** 400), ValueError, r"at most 2\*\*63 - 1"),
    ("max_seqlen", dict(device_memory=-1, sp_size=8), ValueError, "device_memory"),
    ("max_seqlen", dict(device_memory=GiB, sp_size=8, limit=7), ValueError,
     "limit must be an integer >= 16"),
    ("max_seqlen", dict(device_memory=GiB), TypeError, r"missing keyword argument\(s\) "
                                                       r"\['sp_size'\]"),
])
def test_planner_budget_and_limit_errors(fn, kwargs, error, match):
    args = dict(world_size=8, **kwargs)
    if fn == "fitting_meshes":
        args["seqlen"] = 4096
    with pytest.raises(error, match=match):
        getattr(mem, fn)(TINY, **args)


@pytest.mark.parametrize("over, match", [
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    ({"hidden_size": "128"}, "hidden_size must be an integer, got '128'"),
    ({"hidden_size": 128.7}, "hidden_size must be an integer, got 128.7"),
    ({"head_dim": 0}, "head_dim must be >= 1"),
    # bool("false") is True: before, a tied model of 2,001,408 parameter bytes instead of
    # 2,525,696, and both biases counted
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be a bool, got 'false'"),
    ({"attention_bias": "false"}, "attention_bias must be a bool, got 'false'"),
    ({"mlp_bias": "no"}, "mlp_bias must be a bool, got 'no'"),
    # before: TypeError "'>' not supported between instances of 'str' and 'int'"
    ({"num_local_experts": "8"}, "num_local_experts must be an integer, got '8'"),
    # the config's own keys (before: the estimate's field names, "kv_heads", "vocab", ...)
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be >= 1, got 0"),
    ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers must be >= 1, got 0"),
    ({"intermediate_size": 0}, r"intermediate_size must be >= 1, got 0"),
    ({"num_key_value_heads": 2.5}, r"num_key_value_heads must be an integer, got 2.5"),
    # (before: OverflowError "integer division result too large for a float" from str())
    ({"vocab_size": 10 ** 320}, r"vocab_size must be at most 2\*\*63 - 1 \(int64\)"),
])
def test_config_sizes_are_whole_positive_numbers(over, match):
    with pytest.raises(ValueError, match="^estimate_memory: config " + match):
        ModelShape.from_config(dict(TINY, **over))
    assert ModelShape.from_config(dict(TINY, hidden_size=128.0)).hidden == 128  # JSON floats
    np = pytest.importorskip("numpy")  # NumPy's bools are bools
    assert ModelShape.from_config(dict(TINY, tie_word_embeddings=np.bool_(True))).tied


def test_meshes_and_zero_stage_refuse_what_is_no_option():
    with pytest.raises(ValueError, match="precision must be one of"):
        mem.meshes(TINY, 8, precision="bf61")
    with pytest.raises(ValueError, match="zero_stage=3.0 is not supported"):
        est(zero_stage=3.0)


def test_megatron_formula():
    e = est(LLAMA8B, seqlen=32768, world_size=8, sp_size=4, tp_size=2, zero_stage=3)
    s, b, h, a, t, L = 32768 // 4, 1, 4096, 32, 2, 32
    assert e.megatron == int(L * s * b * h * (34 / t + 5 * a * s / (h * t)))
    assert e.megatron_flash == int(L * s * b * h * 34 / t)


# ---------------------------------------------------------------- the result and errors
def test_table_and_breakdown():
    e = est(LLAMA8B, seqlen=131072, world_size=8, sp_size=8, zero_stage=3,
            activation_checkpointing=True)
    assert sum(v for _, v in e.breakdown) == e.total
    assert e.total == max(v for _, v in e.moments)
    assert dict(e.moments)[e.peak_phase] == e.total
    text = str(e)
    for word in ("params", "grads", "optimizer", "activations_per_layer", "attention_buffers",
                 "logits_loss", "temporaries", "total (peak)", e.peak_phase, "Megatron",
                 "GiB", "dp1 sp8 ring tp1 zero3 ckpt"):
        assert word in text, word
    with pytest.raises(Exception):
        e.total = 0  # frozen


# the mesh is checked by the plugin's own ParallelDims: what the plugin refuses, the
# estimate refuses with the same message
@pytest.mark.parametrize("kwargs,match", [
    (dict(sp_size=3), "sp_size=3 x tp_size=1 does not divide the world size 8"),
    (dict(sp_size=2, tp_size=3), "tp_size=3 does not divide the world size 8"),
    (dict(sp_size=1, tp_size=8, world_size=8), "tp_size=8 cannot split num_attention_heads=4"),
    # K/V heads are never replicated over tp (2 K/V heads, tp 4)
    (dict(sp_size=2, tp_size=4), "tp_size must divide both"),
    (dict(sp_mode="ulysses", sp_size=8),
     "sp_mode='ulysses' splits num_attention_heads=4 over all sp_size=8 ranks"),
    (dict(sp_mode="hybrid", sp_size=4), "needs ulysses_size"),
    (dict(sp_mode="ring", ulysses_size=2), "has no Ulysses dimension"),
    (dict(seqlen=4100), "seqlen=4100 must be a multiple of 8"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(precision="fp16", zero_stage=3), "precision='fp16' with tp_size=1 / zero_stage=3"),
    (dict(optimizer="sgd"), "optimizer must be one of"),
    (dict(zero_stage=1), "zero_stage=1 is not supported; supported: \\[0, 2, 3\\]"),
    (dict(sp_mode="tree"), "sp_mode must be one of"),
    (dict(micro_batch=0), "micro_batch must be an integer >= 1"),
    # (before: OverflowError "cannot convert float infinity to integer")
    (dict(seqlen=8 * 10 ** 300), r"seqlen must be at most 2\*\*63 - 1 \(int64\)"),
])
def test_argument_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        est(**kwargs)


def test_parse_bytes():
    assert mem.parse_bytes("80GiB") == 80 * GiB
    assert mem.parse_bytes("80 GB") == 80 * 10 ** 9
    assert mem.parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="memory size"):
        mem.parse_bytes("eighty")
    # exact, not through a float (before: OverflowError for 401 digits)
    assert mem.parse_bytes("9223372036854775807") == 2 ** 63 - 1
    assert mem.parse_bytes("0.5KiB") == 512
    with pytest.raises(ValueError, match=r"^parse_bytes: a memory size must be at most "
                                         r"2\*\*63 - 1 bytes"):
        mem.parse_bytes("1" + "0" * 400)
    with pytest.raises(ValueError, match=r"^parse_bytes: a memory size must be at most 2\*\*63 "
                                         r"- 1 bytes, got '1000.*\(5001 characters\)"):
        mem.parse_bytes("1" + "0" * 5000)  # (before: Python's 4300-digit limit message)
    # the digits that matter: leading zeros and a long fraction are a size like any other
    assert mem.parse_bytes("0" * 70 + "1GiB") == mem.parse_bytes("1." + "0" * 70 + "GiB") == GiB
    assert mem.parse_bytes("0." + "0" * 5000 + "1KB") == 0
    with pytest.raises(ValueError, match=r"^parse_bytes: a memory size must be at most"):
        mem.parse_bytes(10 ** 100)  # (an int: before, TypeError from len())


# ---------------------------------------------------------------- the planner
@pytest.fixture
def llama8b_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA8B, model_type="llama")))
    return str(path)


def test_cli_lists_meshes_that_fit_best_first(llama8b_json, capsys):
    assert mem.main(["--config", llama8b_json, "--seqlen", "65536", "--world-size", "8",
                     "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows, out
    for line in rows:  # peak and headroom (GiB), the first two decimals of a row
        peak, headroom = map(float, re.findall(r"\d+\.\d\d", line)[:2])
        assert peak <= 80 and peak + headroom == pytest.approx(80, abs=0.011)
    # no replicated 8B model fits; the first row is the cheapest mesh that does
    fit = mem.fitting_meshes(LLAMA8B, world_size=8, seqlen=65536, device_memory=80 * GiB)
    assert len(rows) == len(fit) > 0
    assert all(e.zero_stage > 0 or e.tp_size > 1 for e in fit)
    assert [mem._cost_key(e) for e in fit] == sorted(mem._cost_key(e) for e in fit)


@pytest.mark.parametrize("option,needle", [
    (dict(optimizer="adam"), "adam"), (dict(precision="bf61"), "bf61"),
    (dict(micro_batch=0), "micro_batch")])
def test_fitting_meshes_names_a_bad_option(option, needle):
    # a misspelled option is an error, not "no mesh fits"
    with pytest.raises(ValueError, match=needle):
        mem.fitting_meshes(LLAMA8B, world_size=8, seqlen=4096, device_memory=80 * GiB, **option)
    with pytest.raises(TypeError, match="optimiser"):  # a misspelled keyword
        mem.fitting_meshes(LLAMA8B, world_size=8, seqlen=4096, device_memory=80 * GiB,
                           optimiser="adamw")
    assert mem.fitting_meshes(LLAMA8B, world_size=8, seqlen=4096, device_memory=80 * GiB)


def test_planner_errors_name_the_function_called():
    """(before: "estimate_memory: ..." from fitting_meshes and max_seqlen)"""
    with pytest.raises(ValueError, match=r"^fitting_meshes: micro_batch"):
        mem.fitting_meshes(LLAMA8B, world_size=8, seqlen=4096, device_memory=80 * GiB,
                           micro_batch=0)
    with pytest.raises(ValueError, match=r"^max_seqlen: "):
        mem.max_seqlen(dict(TINY, num_attention_heads=6, num_key_value_heads=3),
                       device_memory=80 * GiB, world_size=2, sp_size=1, tp_size=2)


def test_meshes_and_parse_bytes_errors_name_themselves():
    """(before: meshes' config errors named estimate_memory; parse_bytes' no function, and
    max_seqlen's unknown layout an internal one)"""
    with pytest.raises(TypeError, match=r"^meshes: config must be"):
        mem.meshes(None, 2)
    with pytest.raises(KeyError, match=r"^.meshes: config is missing 'vocab_size'"):
        mem.meshes({k: v for k, v in TINY.items() if k != "vocab_size"}, 2)
    with pytest.raises(ValueError, match=r"^meshes: config model_type 'gemma'"):
        mem.meshes(dict(TINY, model_type="gemma"), 2)
    with pytest.raises(ValueError, match=r"^parse_bytes: a memory size must be a non-negative "
                                         r"number .* got '-5GiB'$"):
        mem.parse_bytes("-5GiB")
    with pytest.raises(ValueError, match=r"^max_seqlen: unknown layout 'zigzig'"):
        mem.max_seqlen(TINY, device_memory=80 * GiB, world_size=2, sp_size=2, layout="zigzig")
    with pytest.raises(ValueError, match=r"^estimate_memory: config is a mixture of experts "
                                         r"\(num_local_experts=8\)"):
        est(dict(TINY, num_local_experts=8))


def test_double_ring_counts_the_inner_rings_buffers():
    """A double ring (inner_ring_size) runs its outer ring and its inner rings as two rings,
    each keeping its exchange buffers, and an inner lap's backward holds its own float32 dK/dV
    scratch and the gradients it returns (before: estimated as the plain ring, 19 % below the
    measured peak; the measured cases are benchmarks/memory_check.py's)."""
    plain = est(precision="fp32")
    inner1, inner4 = est(precision="fp32", inner_ring_size=1), est(precision="fp32",
                                                                      inner_ring_size=4)
    assert inner1 == plain and inner4 == plain  # an inner ring of one rank or of all: no double
    double = est(precision="fp32", inner_ring_size=2)
    assert double.inner_ring_size == 2 and plain.inner_ring_size is None
    assert "sp4 ring inner2" in double.mesh() and "inner" not in plain.mesh()
    # (b, s_local, h_kv, d) = (1, 1024, 2, 32): one K/V block is 2 x 1024 x 2 x 32 float32
    kv = 2 * 1024 * 2 * 32 * 4
    ring = plain.attention_buffers  # the outer ring of 2 (one hop) keeps the plain ring's
    assert ring > 3 * kv
    assert double.attention_buffers == 2 * ring  # the inner ring of 2: one hop too
    assert double.total >= plain.total + ring  # (persistent: at every moment)
    assert dict(double.moments)["backward, first layer's attention"] >= (
        dict(plain.moments)["backward, first layer's attention"] + ring + 2 * kv)
    with pytest.raises(ValueError, match=r"^estimate_memory: inner_ring_size=3 does not divide "
                                         r"the ring size 4"):
        est(inner_ring_size=3)
    with pytest.raises(ValueError, match=r"^estimate_memory: sp_mode='ulysses' has no ring"):
        est(sp_mode="ulysses", inner_ring_size=2)


def test_a_hybrid_whose_ring_has_one_rank_keeps_no_ring_buffers():
    """A hybrid of Ulysses 2 x ring 1 runs Ulysses alone (before: the ring's exchange
    buffers counted, 512 KiB over the measured peak in the audit's case)."""
    kw = dict(seqlen=8192, world_size=2, sp_size=2)
    hybrid = est(sp_mode="hybrid", ulysses_size=2, **kw)
    assert hybrid.attention_buffers == est(sp_mode="ulysses", **kw).attention_buffers == 0
    assert hybrid.total == est(sp_mode="ulysses", **kw).total


def test_cli_max_seqlen(llama8b_json, capsys):
    assert mem.main(["--config", llama8b_json, "--world-size", "8", "--device-memory",
                     "80GiB", "--max-seqlen"]) == 0
    out = capsys.readouterr().out
    assert "longest sequence each mesh fits" in out
    best = mem.max_seqlen(LLAMA8B, device_memory=80 * GiB, world_size=8, sp_size=8,
                          zero_stage=3, activation_checkpointing=True)
    assert best is not None and best.total <= 80 * GiB
    # one more step of the mesh's granularity (2 x sp for the zigzag ring) does not fit
    longer = est(LLAMA8B, seqlen=best.seqlen + 16, world_size=8, sp_size=8, zero_stage=3,
                 activation_checkpointing=True)
    assert longer.total > 80 * GiB
    assert str(best.seqlen) in out


@pytest.mark.parametrize("argv,match", [
    (["--device-memory", "lots"], "--device-memory"),
    ([], "give --seqlen N, --max-seqlen, or both"),
    (["--seqlen", "0"], "--seqlen must be >= 1"),
    (["--device-memory", "0GiB"], "--device-memory must be at least one byte, got 0GiB "
                                  "(0 bytes)"),  # (a traceback before)
    (["--device-memory", "0.5"], "--device-memory must be at least one byte, got 0.5 (0 bytes)"),
    (["--device-memory", "1" + "0" * 400], "at most 2**63 - 1 bytes"),  # (a traceback before)
    # (before: the header, then no end)
    (["--seqlen", "1024", "--world-size", "1000000007"],
     "--world-size must be at most 16777216 (the meshes listed), got 1000000007"),
    # (before: a traceback naming fitting_meshes / max_seqlen and their keywords)
    (["--seqlen", "9" * 20], "--seqlen must be at most 2**63 - 1 (int64), got " + "9" * 20),
    (["--max-seqlen", "--micro-batch", "9" * 20], "--micro-batch must be at most 2**63 - 1"),
    (["--seqlen", "1024", "--gradient-accumulation-steps", "9" * 20],
     "--gradient-accumulation-steps must be at most 2**63 - 1"),
])
def test_cli_argument_errors(llama8b_json, capsys, argv, match):
    base = ["--config", llama8b_json, "--world-size", "8"]
    if "--device-memory" not in argv:
        base += ["--device-memory", "80GiB"]
    with pytest.raises(SystemExit) as exc:
        mem.main(base + argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_config_without_a_key(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA8B.items() if k != "vocab_size"}))
    with pytest.raises(SystemExit):
        mem.main(["--config", str(path), "--seqlen", "8192", "--world-size", "8",
                  "--device-memory", "80GiB"])
    # (the message itself: before, a KeyError's repr in quotes, naming estimate_memory)
    assert f"--config {path}: config is missing 'vocab_size'" in capsys.readouterr().err
    # a head_dim the config does not give, derived as 0: named by what it comes from
    path.write_text(json.dumps({**{k: v for k, v in LLAMA8B.items() if k != "head_dim"},
                                "hidden_size": 2}))
    with pytest.raises(SystemExit):
        mem.main(["--config", str(path), "--seqlen", "8192", "--world-size", "8",
                  "--device-memory", "80GiB"])
    assert ("config has no head_dim, and hidden_size 2 // num_attention_heads 32 = 0"
            in capsys.readouterr().err)


def test_max_seqlen_names_what_it_takes():
    """(before: Python's own TypeErrors of estimate_memory's call, naming that function)"""
    with pytest.raises(TypeError, match=r"^max_seqlen: seqlen is what it searches"):
        mem.max_seqlen(LLAMA8B, device_memory=80 * GiB, world_size=8, sp_size=8, seqlen=4096)
    with pytest.raises(TypeError, match=r"^max_seqlen: unexpected keyword argument\(s\) "
                                        r"\['bogus'\]; it takes device_memory, limit and the "
                                        r"mesh: \['activation_checkpointing', "):
        mem.max_seqlen(LLAMA8B, device_memory=80 * GiB, world_size=8, sp_size=8, bogus=1)


def test_cli_max_seqlen_marks_meshes_at_the_search_limit(tmp_path, capsys):
    """A mesh that fits the longest length searched says so (before: the limit was printed
    as the longest sequence it fits, with hundreds of GiB to spare)."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({**{k: v for k, v in LLAMA8B.items() if k != "head_dim"},
                                "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "vocab_size": 128}))
    assert mem.main(["--config", str(path), "--world-size", "2", "--device-memory", "1TiB",
                     "--max-seqlen"]) == 0
    out = capsys.readouterr().out
    assert f">= {mem.SEARCH_LIMIT} (search limit)" in out
    fits_more = est(json.loads(path.read_text()), seqlen=2 * mem.SEARCH_LIMIT, world_size=2,
                    sp_size=2, zero_stage=2, activation_checkpointing=True)
    assert fits_more.total < 1024 * GiB
    assert mem.main(["--config", str(path), "--world-size", "2", "--device-memory", "8GiB",
                     "--max-seqlen"]) == 0
    assert "(search limit)" not in capsys.readouterr().out
    # on 6 ranks a mesh whose length step does not divide the limit stops below it, and is
    # listed with the others that reach it (before: below every mesh it is no shorter than)
    assert mem.main(["--config", str(path), "--world-size", "6", "--device-memory", "1TiB",
                     "--max-seqlen"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "GiB" not in line
            and ("search limit" in line or line[:2].strip().isdigit())]
    capped = ["(search limit)" in line for line in rows]
    below = [i for i, line in enumerate(rows) if ">= 67108860 (search limit)" in line]
    at = [i for i, line in enumerate(rows) if f">= {mem.SEARCH_LIMIT} (search limit)" in line]
    assert capped == sorted(capped, reverse=True), rows
    assert below and at and below[0] < at[-1], rows  # (by cost among them, not by length)


def test_cli_on_the_largest_world_it_takes_answers_in_seconds(llama8b_json, capsys):
    """(before: each hybrid mesh's estimate built the coordinates of its 2**24 ranks, and
    the command printed its header, then nothing for hours)"""
    import time
    start = time.monotonic()
    assert mem.main(["--config", llama8b_json, "--seqlen", str(1 << 25), "--world-size",
                     str(mem.MESHES_WORLD_MAX), "--device-memory", "80GiB"]) == 0
    assert "hybrid u" in capsys.readouterr().out
    assert time.monotonic() - start < 120


def test_cli_says_which_meshes_a_length_left_out(llama8b_json, capsys):
    """6 ranks at a power-of-two length: the meshes with a factor 3 in their ring cannot split
    it; the CLI says so and why (before: "no mesh fits" as if every mesh had been estimated)."""
    assert mem.main(["--config", llama8b_json, "--seqlen", "131072", "--world-size", "6",
                     "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "no mesh of the" in out and "estimated fits" in out, out
    assert re.search(r"left out, \d+ mesh\(es\) \(e\.g\. sp 6, tp 1, ring\): seqlen=131072 must "
                     r"be a multiple of 12", out), out


def test_what_the_estimate_does_not_model_is_refused():
    """A mixture of experts (counted as one dense MLP per layer: Mixtral-8x7B as 7.2 B
    parameters instead of 46.7 B) and other model types (Gemma 2 measured 15-22 % above the
    estimate) are refused instead of estimated as Llama; a dict without model_type is a Llama
    of its sizes. What the plugin refuses (packed documents under tp) is refused too."""
    with pytest.raises(ValueError, match=r"config 'mixtral' is a mixture of experts "
                                         r"\(num_local_experts=8"):
        est(dict(TINY, model_type="mixtral", num_local_experts=8))
    with pytest.raises(ValueError, match=r"config model_type 'gemma2' is not one the estimate "
                                         r"models \(\['llama', 'mistral', 'qwen2'\]\)"):
        est(dict(TINY, model_type="gemma2"))
    assert est(dict(TINY, model_type="mistral")).total == est(TINY).total
    with pytest.raises(ValueError, match=r"layout 'documents' \(packed batches\) is not "
                                         r"supported with tp_size > 1 by the plugin"):
        est(tp_size=2, layout="documents")
    fit = mem.fitting_meshes(TINY, world_size=2, seqlen=4096, device_memory=80 * GiB,
                             layout="documents")
    assert fit and all(e.tp_size == 1 for e in fit)


def test_arguments_of_another_kind_are_named():
    """A model where its config goes, a checkpointing flag that is a string, NumPy integers."""
    np = pytest.importorskip("numpy")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    with pytest.raises(TypeError, match=r"config must be a transformers config or a dict of its "
                                        r"sizes, got LlamaForCausalLM \(a model: pass "
                                        r"model.config"):
        est(model)
    with pytest.raises(TypeError, match="got NoneType"):
        est(None)
    with pytest.raises(ValueError, match=r"activation_checkpointing must be True or False, got "
                                         r"'no'"):  # (before: checkpointing on)
        est(activation_checkpointing="no")
    assert est(seqlen=np.int64(4096)).total == est().total == est(model.config).total
    # max_seqlen takes the mesh's NumPy sizes as estimate_memory does (before: "world_size
    # must be a positive integer, got np.int64(8)")
    mesh = dict(world_size=8, sp_size=4, zero_stage=3)
    assert mem.max_seqlen(TINY, device_memory=GiB, **{k: np.int64(v) for k, v in mesh.items()}
                          ) == mem.max_seqlen(TINY, device_memory=GiB, **mesh)
    with pytest.raises(ValueError, match=r"^max_seqlen: sp_size=3 x tp_size=1 does not divide"):
        mem.max_seqlen(TINY, device_memory=80 * GiB, world_size=4, sp_size=3)


# ---------------------------------------------------------------- against measurement
def _memory_check():
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)  # the spawned ranks import it by name
    import memory_check
    return memory_check


def test_estimate_within_ten_percent_of_memtracker():
    pytest.importorskip("transformers")
    mc = _memory_check()
    configs = [c for c in mc.CONFIGS if c["quick"]]
    rows = mc.run(configs, timeout=600)
    report = "\n".join(f"{r['name']}: estimate {r['estimate']} measured {r['measured']} "
                       f"({r['error']:+.2%}, peak at {r['peak_phase']})" for r in rows)
    for r in rows:
        assert abs(r["error"]) <= 0.10, report
        # below the measurement is the direction that calls a mesh that does not fit one that
        # does: what is not counted (the double ring's inner laps, a tied embedding's gradient
        # part under accumulation) stays below 0.3 % here (before: tp 4 with checkpointing
        # 8.8 % below, without it 3.3 %)
        assert r["error"] >= -0.01, report
    # the configurations exercise every kind of moment the estimate distinguishes
    phases = {r["peak_phase"].split(",")[0] if "layer" not in r["peak_phase"]
              else r["peak_phase"].split("'s ")[-1] for r in rows}
    assert {"loss backward", "optimizer step", "MLP", "attention"} <= phases, phases


def test_huge_worlds_and_configs_of_another_kind_are_answered_at_once():
    """Before: the error for sp_size=3 in a world of 2**40 never came (its list of the valid
    sizes tried every integer up to the world size), meshes() of a prime world of 10**9 + 7 ran
    without end, a list as the config was a KeyError naming hidden_size, and a negative
    hidden_size was blamed on a missing head_dim."""
    with pytest.raises(ValueError, match=r"sp_size must be one of \[1, 2, 4, 8, .*, "
                                         r"1099511627776\]$"):
        est(world_size=2 ** 40, sp_size=3)
    with pytest.raises(ValueError, match=r"sp_size must be one of the divisors of "
                                         r"4611686018427387904$"):
        est(world_size=2 ** 62, sp_size=3)
    for world in (10 ** 9 + 7, 2 ** 31 - 1):
        with pytest.raises(ValueError, match=rf"^meshes: world_size must be at most 16777216 "
                                             rf"to list its meshes, got {world}"):
            mem.meshes(TINY, world)
    assert [m["tp_size"] for m in mem.meshes(TINY, 2 ** 24)][:1] == [1]  # (the largest: listed)
    with pytest.raises(ValueError, match=r"^fitting_meshes: world_size must be at most 16777216"):
        mem.fitting_meshes(TINY, world_size=2 ** 25, seqlen=4096, device_memory=GiB)
    # (a config object without sizes of its own is named by its type first: a composite
    # transformers config keeps them in sub-configs)
    import types
    with pytest.raises(ValueError, match=r"^estimate_memory: config 'mixtral' is a mixture of "
                                         r"experts"):
        est(types.SimpleNamespace(model_type="mixtral", num_local_experts=8))
    for config in ([1, 2], (TINY,), object()):
        with pytest.raises(TypeError, match=r"^estimate_memory: config must be a transformers "
                                            r"config or a dict of its sizes, got "
                                            rf"{type(config).__name__} without any of "
                                            r"hidden_size, "):
            est(config)
    with pytest.raises(ValueError, match=r"^estimate_memory: config hidden_size must be >= 1, "
                                         r"got -128$"):
        est(dict(TINY, hidden_size=-128))


def test_a_ring_of_one_rank_keeps_its_layouts_multiple():
    """At sp 1 in the ring's mode the plugin's loader still shards with the layout (zigzag:
    two chunks, an even length). Before, the planner listed dp-only meshes at 1023 tokens and
    max_seqlen answered odd lengths, which the loader refused at the first batch."""
    from ringseq.layouts import get_layout
    from ringseq.parallel.dims import ParallelDims
    assert ParallelDims(world_size=2, sp_size=1).seq_multiple("zigzag") == \
        get_layout("zigzag").multiple(1) == 2  # (what shard_batch refuses at sp 1)
    assert ParallelDims(world_size=2, sp_size=1, sp_mode="ulysses").seq_multiple() == 1
    with pytest.raises(ValueError, match=r"seqlen=1023 must be a multiple of 2 \(the zigzag"):
        est(seqlen=1023, world_size=2, sp_size=1)
    assert est(seqlen=1023, world_size=2, sp_size=1, layout="contiguous").seqlen == 1023
    fits = mem.fitting_meshes(TINY, world_size=2, seqlen=1023, device_memory=1 << 40)
    assert not [e.mesh() for e in fits if e.sp_size == 1 and e.sp_mode == "ring"]
    for over in (dict(sp_size=1), dict(sp_size=1, zero_stage=2),
                 dict(sp_size=2, sp_mode="ulysses")):
        found = mem.max_seqlen(TINY, device_memory=64 * 2 ** 20, world_size=2, **over)
        assert found.seqlen % 2 == 0, (over, found.seqlen)


def test_layout_decides_only_the_length_multiple():
    """The plugin's data layout changes no size (every layout gives each rank s / sp tokens);
    it decides what the length must be a multiple of: 4100 tokens split over 4 ranks
    contiguously or striped, not in zigzag's 8 chunks."""
    contiguous = est(seqlen=4100, world_size=4, sp_size=4, layout="contiguous")
    assert contiguous == est(seqlen=4100, world_size=4, sp_size=4, layout="stripe")
    assert est(seqlen=4096, world_size=4, sp_size=4).total == est(
        seqlen=4096, world_size=4, sp_size=4, layout="contiguous").total
    with pytest.raises(ValueError, match=r"multiple of 8 \(the zigzag layout"):
        est(seqlen=4100, world_size=4, sp_size=4)
    with pytest.raises(ValueError, match="estimate_memory: unknown layout 'zigzig'"):
        est(world_size=4, sp_size=4, layout="zigzig")
    fits = mem.fitting_meshes(TINY, world_size=4, seqlen=4100, device_memory=1 << 40,
                          layout="contiguous")
    assert fits and all(e.seqlen == 4100 for e in fits)
    with pytest.raises(ValueError, match="unknown layout 'zigzig'"):  # not "no sp mesh fits"
        mem.fitting_meshes(TINY, world_size=4, seqlen=4096, device_memory=1 << 40,
                           layout="zigzig")
    assert mem.max_seqlen(TINY, device_memory=1 << 30, world_size=4, sp_size=4,
                      layout="contiguous").seqlen % 4 == 0
