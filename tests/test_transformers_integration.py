"""HuggingFace transformers models on ring attention, on spawned gloo ranks (CPU, fp32).

Models come from tiny configs with random weights (no downloads): Llama (GQA 4:2, RoPE) and
Qwen2 (GQA, qkv bias) for the numerics (sliding windows, soft-capping and packed documents:
tests/test_masked_ring.py). The parent
builds each model once, computes the float64 reference (same weights, full sequence, one
process) and the plain float32 single-process run; the ranks load the same weights, switch to
ring attention with ``ringseq.integrations.transformers.apply``, shard the batch with
``ringseq.shard_batch``, take ``ringseq.sharded_cross_entropy`` and back-propagate, sum the
parameter gradients over their group, and unshard the logits.

Tolerance (docs/design.md): |ring - float64| <= 2x (loss, logits) / 3x (gradients) the error of
the plain float32 single-process model against the same float64 reference, plus a floor of
1e-6 + 4 float32 ulps at the tensor's magnitude (``utils.scaled_floor``): a sum over tokens
and ranks in another order is a few ulps off even where plain float32 is exact by luck.

Two spawns (W=2: three model cases + errors; W=4: one case + two models on different groups,
both switched first and then run interleaved) carry everything; each check is a separate test reading the spawn's result.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from utils import assert_close_per_design, error_text, scaled_floor  # noqa: E402

BATCH, SEQLEN = 2, 48  # 48 = 2*W*k for W = 2 and 4 (zigzag), never a power of two
SEEDS = {"llama": 1, "qwen2": 2}


def _config(arch, **over):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256, attention_dropout=0.0, tie_word_embeddings=False)
    common.update(over)
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if arch == "mistral":
        return transformers.MistralConfig(**common), transformers.MistralForCausalLM
    raise ValueError(arch)


def _model(arch, state_dict=None, **over):
    cfg, cls = _config(arch, **over)
    torch.manual_seed(SEEDS.get(arch, 0))
    model = cls(cfg)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQLEN), generator=g)
    labels = ids.clone()
    labels[:, 3::5] = -100  # ignored targets on both sides of shard borders
    return ids, labels


# ---------------------------------------------------------------- rank side
def _ring_setup(arch, state_dict, layout, group, seed):
    """A model switched to the ring and this rank's sharded batch."""
    import ringseq
    from ringseq.integrations.transformers import apply

    model = apply(_model(arch, state_dict), group=group, layout=layout)
    ids, labels = _batch(seed)
    batch = ringseq.shard_batch({"input_ids": ids, "labels": labels,
                                 "attention_mask": torch.ones_like(ids)}, group=group,
                                layout=layout)
    targets = batch.pop("shift_labels")
    return {"model": model, "batch": batch, "targets": targets, "group": group,
            "layout": layout}


def _ring_forward(run):
    import ringseq
    run["logits"] = run["model"](**run["batch"], use_cache=False).logits
    run["loss"] = ringseq.sharded_cross_entropy(run["logits"], run["targets"], group=run["group"])


def _ring_result(run):
    """Loss, unsharded logits and group-summed parameter gradients of a ring run."""
    import torch.distributed as dist

    import ringseq
    model, group, layout = run["model"], run["group"], run["layout"]
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    full_targets = ringseq.unshard(run["targets"], layout, group)
    return {"loss": run["loss"].detach(),
            "logits": ringseq.unshard(run["logits"].detach(), layout, group),
            "targets": full_targets, "grads": grads, "impl": model.config._attn_implementation,
            "settings_group_size": dist.get_world_size(
                model.model.layers[0].self_attn.ringseq_settings.group)}


def _ring_run(arch, state_dict, layout, group, seed):
    run = _ring_setup(arch, state_dict, layout, group, seed)
    _ring_forward(run)
    run["loss"].backward()
    return _ring_result(run)


def _error_cases(state_dict):
    import inspect

    import torch.distributed as dist

    import ringseq
    from ringseq.integrations.transformers import apply

    ids, labels = _batch(5)
    out = {}
    pad = torch.ones_like(ids)
    pad[1, -4:] = 0
    out["shard_batch_padding"] = error_text(
        lambda: ringseq.shard_batch({"input_ids": ids, "attention_mask": pad}))

    model = apply(_model("llama", state_dict))
    batch = ringseq.shard_batch({"input_ids": ids})
    mask = torch.ones_like(batch["input_ids"])
    if dist.get_rank() == 0:
        mask[0, 2] = 0  # padding seen by one rank only: every rank must raise, none hang
    out["padding_one_rank"] = error_text(
        lambda: model(**batch, attention_mask=mask, use_cache=False))
    out["no_position_ids"] = error_text(
        lambda: model(input_ids=batch["input_ids"], use_cache=False))
    # a local length the zigzag layout cannot place, on rank 1 only: every rank must raise
    zigzag = apply(_model("llama", state_dict), layout="zigzag")
    zbatch = ringseq.shard_batch({"input_ids": ids}, layout="zigzag")
    if dist.get_rank() == 1:
        zbatch = {key: t[:, :-1] for key, t in zbatch.items()}
    out["length_one_rank"] = error_text(lambda: zigzag(**zbatch, use_cache=False))
    out["output_attentions"] = error_text(
        lambda: model(**batch, output_attentions=True, use_cache=False))
    out["kv_cache"] = error_text(
        lambda: model(**batch, **{_cache_kwarg(model): _prefilled_cache(model, batch)},
                      use_cache=True))

    # generate() keeps the last position's logits: over a ring each rank's own shard's last
    # (before: every rank but the one holding the sequence's end gave another next token)
    with torch.no_grad():
        out["generate"] = error_text(lambda: model.generate(
            **batch, max_new_tokens=1, do_sample=False, use_cache=False))
        out["logits_to_keep"] = error_text(
            lambda: model(**batch, logits_to_keep=1, use_cache=False))
        out["logits_to_keep_0"] = error_text(
            lambda: model(**batch, logits_to_keep=0, use_cache=False))
        # the same given by position (before: not seen, so each rank's own loss / last logits)
        params = list(inspect.signature(model.forward).parameters)

        def by_position(**named):
            return [named.get(n) for n in params[:1 + max(map(params.index, named))]]
        out["labels_positional"] = error_text(lambda: model(*by_position(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"],
            labels=batch["input_ids"], use_cache=False)))
        out["logits_to_keep_positional"] = error_text(lambda: model(*by_position(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
            logits_to_keep=1)))

    # pickling a model applied over a process group (before: cannot pickle 'ProcessGroup')
    import pickle
    grouped = apply(_model("llama", state_dict), group=dist.group.WORLD)
    out["pickle_group"] = error_text(lambda: pickle.dumps(grouped))

    dropout_model = apply(_model("llama", attention_dropout=0.1)).train()
    out["dropout_train"] = error_text(lambda: dropout_model(**batch, use_cache=False))
    dropout_model.eval()
    out["dropout_eval"] = error_text(lambda: dropout_model(**batch, use_cache=False))
    return out


def _cache_kwarg(model):
    import inspect
    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prefilled_cache(model, batch):
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**batch, **{_cache_kwarg(model): cache}, use_cache=True)
    return cache


def _loss_only_cases():
    """sharded_cross_entropy against F.cross_entropy on the full logits, value and gradient."""
    import torch.distributed as dist

    import ringseq
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(BATCH, SEQLEN, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (BATCH, SEQLEN), generator=g)
    labels[0, :30] = -100  # rank 0 holds many more ignored targets than rank 1 (zigzag)
    local = ringseq.shard(logits, "zigzag").requires_grad_()
    loss = ringseq.sharded_cross_entropy(local, ringseq.shard(labels, "zigzag"))
    loss.backward()
    full = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full.reshape(-1, 11), labels.reshape(-1))
    ref.backward()
    empty = ringseq.sharded_cross_entropy(local, torch.full_like(ringseq.shard(labels, "zigzag"),
                                                                 -100))
    return {"loss_err": float((loss - ref).detach().abs()),
            "grad_err": float((local.grad - ringseq.shard(full.grad, "zigzag")).abs().max()),
            "empty": float(empty), "world": dist.get_world_size()}


def _worker_w2(sds):
    from custom_layout import ReversedContiguous
    res = {
        "llama-zigzag": _ring_run("llama", sds["llama"], "zigzag", None, 11),
        "llama-contiguous": _ring_run("llama", sds["llama"], "contiguous", None, 11),
        # a user's own Layout subclass through apply() and shard_batch
        "llama-custom": _ring_run("llama", sds["llama"], ReversedContiguous(), None, 11),
        "qwen2-zigzag": _ring_run("qwen2", sds["qwen2"], "zigzag", None, 12),
    }
    res["errors"] = _error_cases(sds["llama"])
    res["loss_only"] = _loss_only_cases()
    return res


def _worker_w4(sds):
    import torch.distributed as dist
    rank = dist.get_rank()
    res = {"llama-zigzag": _ring_run("llama", sds["llama"], "zigzag", None, 11)}
    # Every rank creates every group (new_group is collective); each rank then belongs to one
    # pair {0,1}/{2,3} and one stride {0,2}/{1,3}, and runs one model on each, interleaved.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strides = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    # Both models are switched before either runs, and both graphs are alive at once: each
    # attention call must find its own settings on its module, not the last apply's.
    llama = _ring_setup("llama", sds["llama"], "zigzag", pairs[rank // 2], 11)
    qwen2 = _ring_setup("qwen2", sds["qwen2"], "contiguous", strides[rank % 2], 12)
    _ring_forward(llama)
    _ring_forward(qwen2)
    llama["loss"].backward()
    qwen2["loss"].backward()
    res["two-groups-llama"] = _ring_result(llama)
    res["two-groups-qwen2"] = _ring_result(qwen2)
    return res


# ---------------------------------------------------------------- parent side
def _single_process(arch, state_dict, seed, dtype):
    model = _model(arch, state_dict).to(dtype)
    ids, labels = _batch(seed)
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def state_dicts():
    return {arch: _model(arch).state_dict() for arch in SEEDS}


@pytest.fixture(scope="module")
def references(state_dicts):
    seeds = {"llama": 11, "qwen2": 12}
    return {arch: {"ref": _single_process(arch, sd, seeds[arch], torch.float64),
                   "plain": _single_process(arch, sd, seeds[arch], torch.float32)}
            for arch, sd in state_dicts.items()}


@pytest.fixture(scope="module")
def w2(state_dicts):
    return run_ranks(_worker_w2, 2, state_dicts, timeout=150)


@pytest.fixture(scope="module")
def w4(state_dicts):
    return run_ranks(_worker_w4, 4, state_dicts, timeout=150)


def _check_against_reference(result, refs, what):
    ref, plain = refs["ref"], refs["plain"]
    assert result["impl"] == "ringseq"
    assert_close_per_design(result["loss"], ref["loss"], plain["loss"], f"{what} loss", 2.0,
                            scaled_floor(torch.float32, ref["loss"]))
    assert_close_per_design(result["logits"], ref["logits"], plain["logits"], f"{what} logits",
                            2.0, scaled_floor(torch.float32, ref["logits"]))
    assert set(result["grads"]) == set(ref["grads"])
    for name, g in result["grads"].items():
        assert_close_per_design(g, ref["grads"][name], plain["grads"][name],
                                f"{what} grad {name}", 3.0,
                                scaled_floor(torch.float32, ref["grads"][name]))


@pytest.mark.parametrize("case", ["llama-zigzag", "llama-contiguous", "llama-custom",
                                  "qwen2-zigzag"])
def test_w2_matches_single_process(w2, references, case):
    arch = case.split("-")[0]
    for rank, res in enumerate(w2):
        _check_against_reference(res[case], references[arch], f"W=2 rank {rank} {case}")


def test_w2_shift_labels_keep_every_target(w2):
    # the unsharded targets are exactly the full-sequence shift: none lost at a shard border
    _, labels = _batch(11)
    expected = torch.full_like(labels, -100)
    expected[:, :-1] = labels[:, 1:]
    for res in w2:
        for case in ("llama-zigzag", "llama-contiguous"):
            assert torch.equal(res[case]["targets"], expected)


def test_w4_zigzag_matches_single_process(w4, references):
    for rank, res in enumerate(w4):
        _check_against_reference(res["llama-zigzag"], references["llama"], f"W=4 rank {rank}")


def test_w4_two_models_on_different_groups(w4, references):
    for rank, res in enumerate(w4):
        assert res["two-groups-llama"]["settings_group_size"] == 2
        assert res["two-groups-qwen2"]["settings_group_size"] == 2
        _check_against_reference(res["two-groups-llama"], references["llama"],
                                 f"W=4 rank {rank} llama on pair group")
        _check_against_reference(res["two-groups-qwen2"], references["qwen2"],
                                 f"W=4 rank {rank} qwen2 on strided group")


def test_sharded_cross_entropy_value_and_grad(w2):
    for res in w2:
        lo = res["loss_only"]
        assert lo["world"] == 2
        assert lo["loss_err"] < 1e-12
        assert lo["grad_err"] < 1e-14
        assert lo["empty"] == 0.0


@pytest.mark.parametrize("name,needle", [
    ("shard_batch_padding", "padding"),
    ("padding_one_rank", None),  # rank 0: "padding"; rank 1: RingPeerError naming rank 0
    ("no_position_ids", "position_ids"),
    ("output_attentions", "output_attentions"),
    ("kv_cache", "use_cache=False"),
    ("dropout_train", "dropout"),
    ("generate", "logits_to_keep=1 (model.generate() passes 1) over 2 ranks"),
    ("logits_to_keep", "logits_to_keep=1 (model.generate() passes 1) over 2 ranks"),
    ("labels_positional", "labels passed to the model over 2 ranks"),
    ("logits_to_keep_positional", "logits_to_keep=1 (model.generate() passes 1) over 2 ranks"),
])
def test_unsupported_inputs_raise_clearly(w2, name, needle):
    for rank, res in enumerate(w2):
        msg = res["errors"][name]
        peer = needle is None and rank == 1  # the rank that only hears of rank 0's refusal
        kind = "RingPeerError" if peer else "ValueError"
        assert msg.startswith(kind), f"rank {rank} {name}: {msg}"
        want = needle or ("rank(s) [0] of the group failed" if peer else "padding")
        assert want in msg, f"rank {rank} {name}: {msg}"


def test_a_model_applied_over_a_process_group_says_why_it_does_not_pickle(w2):
    for res in w2:
        msg = res["errors"]["pickle_group"]
        assert msg.startswith("TypeError: ringseq: a model applied with group= (a process "
                              "group, or SequenceParallelGroups) cannot be pickled"), msg


def test_local_length_the_layout_cannot_place_raises_on_every_rank(w2):
    # rank 1's shard is one token short: its own ValueError there, RingPeerError on rank 0
    # (the check's agreement), not rank 1 raising alone while rank 0 waits
    assert w2[1]["errors"]["length_one_rank"].startswith("ValueError"), w2[1]["errors"]
    assert "cannot place" in w2[1]["errors"]["length_one_rank"], w2[1]["errors"]
    assert w2[0]["errors"]["length_one_rank"].startswith("RingPeerError"), w2[0]["errors"]
    assert "rank(s) [1]" in w2[0]["errors"]["length_one_rank"], w2[0]["errors"]


def test_every_positions_logits_are_fine(w2):
    for res in w2:
        assert res["errors"]["logits_to_keep_0"] == "no error", res["errors"]


def test_dropout_in_eval_is_fine(w2):
    assert all(res["errors"]["dropout_eval"] == "no error" for res in w2)


def test_import_ringseq_does_not_import_transformers():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, ringseq, ringseq.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "print(ringseq.shard_batch.__name__, ringseq.sharded_cross_entropy.__name__)")
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "shard_batch sharded_cross_entropy" in r.stdout


def test_apply_single_process_is_plain_attention(references, state_dicts):
    # without a process group the ring is one rank: same numbers as the model's own attention
    from ringseq.integrations.transformers import apply
    import ringseq
    model = apply(_model("llama", state_dicts["llama"]))
    ids, labels = _batch(11)
    batch = ringseq.shard_batch({"input_ids": ids, "labels": labels})
    targets = batch.pop("shift_labels")
    loss = ringseq.sharded_cross_entropy(model(**batch, use_cache=False).logits, targets)
    ref = references["llama"]
    assert_close_per_design(loss.detach(), ref["ref"]["loss"], ref["plain"]["loss"], "loss",
                            2.0, scaled_floor(torch.float32, ref["ref"]["loss"]))


def test_single_process_refuses_restarting_position_ids(state_dicts):
    # W=1 (no process group): packed documents whose positions restart would otherwise
    # attend across the document border without an error
    import ringseq
    from ringseq.integrations.transformers import apply
    model = apply(_model("llama", state_dicts["llama"]))
    ids, _ = _batch(11)
    half = SEQLEN // 2
    reset = torch.cat([torch.arange(half), torch.arange(SEQLEN - half)]).expand(BATCH, -1)
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, position_ids=reset, use_cache=False)
    # the global positions ringseq.shard_batch hands out are accepted
    batch = ringseq.shard_batch({"input_ids": ids})
    assert torch.equal(batch["position_ids"], torch.arange(SEQLEN).expand(BATCH, -1))
    model(**batch, use_cache=False)


def test_position_ids_are_checked_again_when_the_call_changes(state_dicts):
    """The input check runs once per forward, not once per tensor: the same position_ids
    tensor first with its documents' boundaries (exact), then without them (documents that
    would attend across their borders), or refilled in place with wrong positions, is refused
    (before: accepted silently, 0.2 from the documents run alone)."""
    from ringseq.integrations.transformers import apply
    model = apply(_model("llama", state_dicts["llama"]))
    ids, _ = _batch(12)
    half = SEQLEN // 2
    restart = torch.cat([torch.arange(half), torch.arange(SEQLEN - half)])[None]  # (1, s)
    cu = torch.tensor([0, half, SEQLEN], dtype=torch.int32)
    model(input_ids=ids[:1], position_ids=restart, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
          max_length_q=half, max_length_k=half, use_cache=False)
    with pytest.raises(ValueError, match="position_ids that restart within a row, as packed "
                                         "documents' do, without the documents' boundaries"):
        model(input_ids=ids[:1], position_ids=restart, use_cache=False)
    positions = torch.arange(SEQLEN)[None]
    model(input_ids=ids[:1], position_ids=positions, use_cache=False)
    positions[0, 3:] += 5  # the same buffer refilled in place
    with pytest.raises(ValueError, match="position_ids that are not the global positions"):
        model(input_ids=ids[:1], position_ids=positions, use_cache=False)


def test_a_call_without_a_mask_after_one_with_an_all_ones_mask(state_dicts):
    """Training batches with an all-ones attention_mask, then an evaluation batch without one
    (before: AttributeError, the checked mask's reference was dead and None was taken for it;
    on a ring, a rank that had seen a mask raised outside the agreement and its peer waited for
    the ring timeout). Both calls give the model's own logits."""
    from ringseq.integrations.transformers import apply
    ids, _ = _batch(13)
    with torch.no_grad():
        plain = _model("llama", state_dicts["llama"])(input_ids=ids, use_cache=False).logits
        ref64 = _model("llama", state_dicts["llama"]).double()(input_ids=ids,
                                                               use_cache=False).logits
        model = apply(_model("llama", state_dicts["llama"]))
        with_mask = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                          use_cache=False).logits
        without = model(input_ids=ids, use_cache=False).logits
    for name, got in (("with the mask", with_mask), ("without", without)):
        assert_close_per_design(got, ref64, plain, name, 2.0, scaled_floor(torch.float32, ref64))


def test_an_applied_model_pickles_after_a_call(state_dicts):
    """torch.save(model) of an applied model after a call, and the copy computes the same
    (before: TypeError, the weak references its input check keeps could not be pickled)."""
    import io

    from ringseq.integrations.transformers import apply
    ids = _batch(14)[0][:1, :8]
    model = apply(_model("llama", state_dicts["llama"]).eval())
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(copy(input_ids=ids, use_cache=False).logits, want)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "stripe", "documents"])
def test_single_process_generate_takes_any_length_under_any_layout(state_dicts, layout):
    """generate(use_cache=False) on one process adds a token per step: a model switched with
    layout="zigzag" takes odd lengths there (a ring of one holds the sequence in order under
    every layout; before: refused at the second token with "pad it to 12"; "documents"
    without boundaries is one document per row there, before: refused for want of
    cu_seqlens), and greedy decoding gives the eager model's tokens."""
    from ringseq.integrations.transformers import apply
    ids = _batch(14)[0][:1, :9]
    eager = _model("llama", state_dicts["llama"]).eval()
    want = eager.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    model = apply(_model("llama", state_dicts["llama"]).eval(), layout=layout)
    got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(got, want), (got, want)
    if layout == "zigzag":  # with the cache generate() uses by default: told what works
        with pytest.raises(ValueError, match=r"a KV cache is not supported: pass use_cache=False, "
                                             r"and input_ids: .* generate\(\) works so in a run "
                                             r"of one process, or after "
                                             r"model.set_attn_implementation\('sdpa'\)"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
        # a left-padded prompt: the padding named alone (before: also told to pass packed
        # documents' boundaries, for the position ids generate() makes for padded rows)
        rows = torch.cat([ids, ids]).clone()  # (2, 9)
        pad = torch.ones_like(rows)
        pad[0, :3] = 0
        with pytest.raises(ValueError) as refused:
            model.generate(rows, attention_mask=pad, max_new_tokens=1, do_sample=False,
                           use_cache=False)
        assert "an attention_mask with padding (zeros)" in str(refused.value)
        assert "cu_seq_lens_q" not in str(refused.value), str(refused.value)


def _gemma3_multimodal():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip("this transformers has no Gemma 3")
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, head_dim=16, sliding_window=6,
                query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=4, num_channels=3)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=90, boi_token_index=91, eoi_token_index=92,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg).double().eval()


def test_multimodal_model_rings_its_text_and_refuses_bidirectional_image_tokens():
    """Gemma 3 with its SigLIP tower: apply switches the language model only (each rank runs
    whole images: the vision tower keeps its implementation, before: it was switched too and
    its first forward raised "no ring settings"); text-only inputs then equal eager attention
    exactly, and image tokens, which attend to each other bidirectionally (transformers'
    blockwise overlay), are refused instead of running causally (before: 1.7e-2 off)."""
    import copy
    from ringseq.integrations.transformers import apply
    eager = _gemma3_multimodal()
    ring = apply(copy.deepcopy(eager))
    assert ring.config.text_config._attn_implementation == "ringseq"
    assert ring.config.vision_config._attn_implementation == "eager"
    ids = torch.randint(0, 80, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ring(input_ids=ids, use_cache=False).logits
               - eager(input_ids=ids, use_cache=False).logits).abs().max()
    # float64 weights, but eager's softmax runs in float32 (relative rounding 6e-8 per
    # probability): its own distance from float64 attention, not ringseq's
    assert err < 1e-6, err
    # token_type_ids without an image token (a text-only batch of a multimodal collator): no
    # block, nothing bidirectional, the same logits (before: refused)
    no_image = torch.zeros_like(ids)
    with torch.no_grad():
        err = (ring(input_ids=ids, token_type_ids=no_image, use_cache=False).logits
               - eager(input_ids=ids, token_type_ids=no_image, use_cache=False).logits
               ).abs().max()
    assert err < 1e-6, err
    ids[0, 4], ids[0, 5:9], ids[0, 9] = 91, 90, 92  # begin-of-image, 4 image tokens, end
    image_tokens = (ids == 90).long()
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)
    with pytest.raises(ValueError, match="bidirectional attention within blocks of tokens"), \
            torch.no_grad():
        ring(input_ids=ids, pixel_values=pixels, token_type_ids=image_tokens, use_cache=False)


def test_documents_layout_takes_a_one_document_row():
    """DataCollatorWithFlattening gives a batch of one sample position ids that never restart
    (and no boundaries without return_flash_attn_kwargs): with layout "documents" that row is
    one document, not an error at the step where it happens."""
    import ringseq
    ids = torch.arange(16).unsqueeze(0)  # (1, 16)
    for extra in ({"position_ids": torch.arange(16).unsqueeze(0)}, {}):
        batch = ringseq.shard_batch({"input_ids": ids, "labels": ids, **extra},
                                    layout="documents")
        assert batch["cu_seq_lens_q"].tolist() == [0, 16]
        assert batch["cu_seq_lens_k"].tolist() == [0, 16]
        assert batch["max_length_q"] == 16
        assert batch["position_ids"].tolist() == [list(range(16))]
        assert batch["shift_labels"].tolist() == [list(range(1, 16)) + [-100]]
    # positions that do not count from 0 are no document of a packed batch: the message
    # shows the first wrong position and says what a row without restarts is
    with pytest.raises(ValueError, match=r"position_ids of a packed batch .* got 5 at token 0, "
                                         r"expected 0 \(a one-row batch without cu_seq_lens_q "
                                         r"whose position_ids never restart is one document"):
        ringseq.shard_batch({"input_ids": ids, "position_ids": torch.arange(5, 21)[None]},
                            layout="documents")
    with pytest.raises(ValueError, match=r"got 3 at token 5, expected 2 \(the document there "
                                         r"starts at token 3\)$"):
        ringseq.shard_batch({"input_ids": ids[:, :8],
                             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 3, 0, 1]])},
                            layout="documents")
    # position ids of another length are named (before: advice to pass cu_seqlens)
    with pytest.raises(ValueError, match=r"^shard_batch: batch\['position_ids'\] must have "
                                         r"shape \(1, 16\) \(sequence length 16 from "
                                         r"batch\['input_ids'\]\), got a torch.Tensor of shape "
                                         r"\(1, 8\)"):
        ringseq.shard_batch({"input_ids": ids, "position_ids": torch.arange(8)[None]},
                            layout="documents")
    # several rows without boundaries are no packed batch (before: advice to pass
    # cu_seqlens, which shard_batch does not take)
    with pytest.raises(ValueError, match=r"^shard_batch: layout 'documents' balances the "
                                         r"documents of a packed batch: .* got 2 rows without "
                                         r"document boundaries; use a layout such as 'zigzag'"):
        ringseq.shard_batch({"input_ids": ids.expand(2, -1)}, layout="documents")


def test_mrope_rows_are_not_judged_as_a_packed_batch():
    """M-RoPE's (3, b, s) rows (an image's height and width rows hold zeros) are named by their
    shape (before: refused as a wrongly packed batch, "must restart at 0 in every
    document")."""
    import ringseq
    ids = torch.arange(12).unsqueeze(0)  # (1, 12)
    text = list(range(2, 10))  # after a 2 x 2 image: its temporal, height and width rows
    mrope = torch.tensor([[0, 0, 0, 0] + text, [0, 0, 1, 1] + text,
                          [0, 1, 0, 1] + text])[:, None]  # (3, 1, 12)
    with pytest.raises(ValueError, match=r"^shard_batch: batch\['position_ids'\] must have "
                                         r"shape \(1, 12\) .* got a torch.Tensor of shape "
                                         r"\(3, 1, 12\)"):
        ringseq.shard_batch({"input_ids": ids, "position_ids": mrope}, layout="zigzag")


def test_packed_batch_boundaries_from_any_source():
    """A packed batch's documents come from cu_seq_lens_q, cu_seq_lens_k alone, position ids
    that restart, or a layout built for them (Documents(cu_seqlens)): each gives positions
    within the documents, no target across a border and the boundaries for the attention
    (before: the last two were taken for one long sequence, silently)."""
    import ringseq
    from ringseq.layouts import Documents
    ids = torch.arange(100, 116).unsqueeze(0)  # (1, 16): documents of 5 and 11 tokens
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    want_pos = list(range(5)) + list(range(11))
    want_labels = list(range(101, 105)) + [-100] + list(range(106, 116)) + [-100]
    for extra, layout in (({"cu_seq_lens_q": cu}, "documents"),
                          ({"cu_seq_lens_k": cu}, "documents"),
                          ({"position_ids": torch.tensor([want_pos])}, "documents"),
                          ({}, Documents([0, 5, 16]))):
        batch = ringseq.shard_batch({"input_ids": ids, "labels": ids, **extra}, layout=layout)
        assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == \
            [0, 5, 16], (extra, layout)
        assert batch["position_ids"].tolist() == [want_pos], (extra, layout)
        assert batch["shift_labels"].tolist() == [want_labels], (extra, layout)
    # with a layout built for the documents, every row is packed alike and given position
    # ids are kept (two rows; global positions)
    two = torch.cat([ids, ids + 100])  # (2, 16)
    batch = ringseq.shard_batch({"input_ids": two, "labels": two,
                                 "position_ids": torch.arange(16)[None]},
                                layout=Documents([0, 5, 16]))
    assert batch["position_ids"].tolist() == [list(range(16))] * 2  # (1, s) given, (b, s) out
    assert batch["shift_labels"].tolist() == [want_labels,
                                              [x + 100 if x >= 0 else x for x in want_labels]]
    restarting = torch.tensor([want_pos] * 2)  # (2, s), per document
    batch = ringseq.shard_batch({"input_ids": two, "position_ids": restarting},
                                layout=Documents([0, 5, 16]))
    assert batch["position_ids"].tolist() == [want_pos] * 2
    with pytest.raises(ValueError, match="cu_seq_lens_q differs from the document boundaries"):
        ringseq.shard_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 8, 16])},
                            layout=Documents([0, 5, 16]))
    # a batch without a batch dimension is named as such
    with pytest.raises(ValueError, match=r"^shard_batch: batch\['input_ids'\] must be a tensor "
                                         r"of shape \(b, s\)"):
        ringseq.shard_batch({"input_ids": torch.arange(16)})


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_attention_it_cannot_compute_exactly_is_refused(family):
    """gpt-oss's learned attention sinks (s_aux) and Llama 4's chunked attention layers reach
    the attention function in ways the ring would silently drop: refused, naming them."""
    import ringseq
    transformers = pytest.importorskip("transformers")
    from ringseq.integrations.transformers import apply
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                  attention_dropout=0.0, head_dim=16, num_local_experts=2,
                  num_experts_per_tok=1)
    if family == "gpt_oss":
        if not hasattr(transformers, "GptOssConfig"):
            pytest.skip("this transformers has no gpt-oss")
        cfg = transformers.GptOssConfig(**common, intermediate_size=64, sliding_window=128,
                                        layer_types=["full_attention"] * 2)
        model_cls, needle = transformers.GptOssForCausalLM, "attention sinks"
    else:
        if not hasattr(transformers, "Llama4TextConfig"):
            pytest.skip("this transformers has no Llama 4")
        cfg = transformers.Llama4TextConfig(**common, intermediate_size=128,
                                            intermediate_size_mlp=128, attention_chunk_size=8)
        model_cls, needle = transformers.Llama4ForCausalLM, "chunked attention layer"
    torch.manual_seed(0)
    model = apply(model_cls(cfg).eval(), layout="contiguous")
    batch = ringseq.shard_batch({"input_ids": torch.randint(0, 128, (1, 24))},
                                layout="contiguous")
    with pytest.raises(ValueError, match=needle), torch.no_grad():
        model(**batch, use_cache=False)


def test_cross_attention_between_different_lengths_is_refused_naming_both():
    """An encoder-decoder model's cross-attention runs between inputs of the same length (the
    ring shards queries and keys alike); other lengths are refused naming cross-attention and
    both lengths (before: a message about KV caches, though no cache was used)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "T5GemmaConfig"):
        pytest.skip("this transformers has no T5Gemma")
    from ringseq.integrations.transformers import apply
    side = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16,
                attention_dropout=0.0, dropout_rate=0.0)
    cfg = transformers.T5GemmaConfig(encoder=transformers.T5GemmaModuleConfig(**side),
                                     decoder=transformers.T5GemmaModuleConfig(**side),
                                     vocab_size=128, dropout_rate=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    plain = transformers.T5GemmaForConditionalGeneration(cfg).eval()
    model = apply(copy.deepcopy(plain))
    gen = torch.Generator().manual_seed(1)
    enc, dec = (torch.randint(1, 128, (2, n), generator=gen) for n in (24, 8))  # (0: pad)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"CrossAttention: cross-attention of 8 decoder "
                                             r"tokens to 24 encoder tokens on this rank"):
            model(input_ids=enc, decoder_input_ids=dec, use_cache=False)
        same = torch.randint(1, 128, (2, 24), generator=gen)
        got = model(input_ids=enc, decoder_input_ids=same, use_cache=False).logits
        want = plain(input_ids=enc, decoder_input_ids=same, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _compiled_model_calls():
    """A model switched with apply and compiled without fullgraph: valid, valid, a call without
    position_ids (wrong on rank 1 only: rank 0's default positions are its global ones),
    valid; then a compiled loss twice. Returns (ring object per call, outcomes, the ring's
    control counter)."""
    import ringseq
    from ringseq.integrations.transformers import apply
    from transformers import LlamaConfig, LlamaForCausalLM
    ringseq.set_ring_timeout(60)
    torch.manual_seed(0)
    model = torch.compile(apply(LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, attention_dropout=0.0)), layout="contiguous"))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = ringseq.shard_batch({"input_ids": ids}, layout="contiguous")
    rings, outcome = [], []
    for kwargs in (batch, batch, {"input_ids": batch["input_ids"]}, batch):
        try:
            model(**kwargs, use_cache=False).logits.sum().backward()
            outcome.append("ok")
        except ValueError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        rings.append(id(ringseq.get_comm()))
    loss = torch.compile(ringseq.sharded_cross_entropy)
    for _ in range(2):
        loss(torch.randn(2, 16, 128), torch.randint(0, 128, (2, 16)))
        rings.append(id(ringseq.get_comm()))
    # host code given a process group object, compiled (before: InternalTorchDynamoError on
    # every call, from hasattr on the group)
    import torch.distributed as dist
    pg = dist.new_group([0, 1])
    x, labels = torch.randn(2, 16, 128), torch.randint(0, 128, (2, 16))
    with_pg = [(torch.compile(lambda t: ringseq.shard(t, "zigzag", pg), backend="aot_eager"),
                lambda t: ringseq.shard(t, "zigzag", pg), (x,)),
               (torch.compile(lambda t, y: ringseq.sharded_cross_entropy(t, y, group=pg),
                              backend="aot_eager"),
                lambda t, y: ringseq.sharded_cross_entropy(t, y, group=pg), (x, labels))]
    outcome.append([torch.equal(compiled(*args), eager(*args))
                    for compiled, eager, args in with_pg])
    return rings, outcome, ringseq.get_comm()._seq


def test_a_compiled_model_keeps_its_ring_and_refuses_as_eager_does():
    # Compiled, the ring lookup was traced with a guard on its dictionary's type alone: every
    # later compiled call made a new ring (control counter 0, channels opened again under the
    # old names), so a refusal on one rank met a peer on another ring: RingTimeoutError or a
    # stall (and valid calls could stall opening channels).
    results = run_ranks(_compiled_model_calls, 2, timeout=240)
    for rank, (rings, outcome, _) in enumerate(results):
        assert len(set(rings)) == 1, f"rank {rank}: a new ring per compiled call: {rings}"
        assert outcome[:2] == ["ok", "ok"] and outcome[3] == "ok", outcome
        assert outcome[4] == [True, True], outcome  # compiled with a process group object
        if rank == 1:
            assert outcome[2].startswith("ValueError") and "position_ids" in outcome[2], outcome
        else:
            assert outcome[2].startswith("RingPeerError") and "rank 1" in outcome[2], outcome
    assert results[0][2] == results[1][2]  # the control counters agree


def _compiled_packed_batches(steps: int = 5):
    """A model switched with layout="documents", compiled, fed batches of one length with
    other document boundaries each: (graphs dynamo made after each step, compiled loss -
    eager loss per step)."""
    import ringseq
    from torch._dynamo.utils import counters
    from ringseq.integrations.transformers import apply
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = apply(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)), layout="documents")
    compiled = torch.compile(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    graphs, diffs = [], []
    for step in range(steps):
        first = 8 + 4 * step  # (two documents of 64 tokens in all)
        ids = torch.randint(0, 64, (1, 64), generator=gen)
        batch = ringseq.shard_batch({"input_ids": ids, "labels": ids,
                                     "cu_seq_lens_q": torch.tensor([0, first, 64])},
                                    layout="documents")
        targets = batch.pop("shift_labels")
        got, want = (ringseq.sharded_cross_entropy(m(**batch, use_cache=False).logits, targets)
                     for m in (compiled, model))
        graphs.append(counters["stats"]["unique_graphs"])
        diffs.append(abs(float(got) - float(want)))
    return graphs, diffs


def test_a_compiled_model_on_packed_batches_compiles_once_for_their_boundaries():
    """Before: the attention frame guarded on the identity of each batch's documents layout,
    so every batch of new boundaries recompiled it (0.5 s against 0.04 s a step here), and
    past dynamo's recompile limit (8) it ran eagerly for the rest of the run."""
    for graphs, diffs in run_ranks(_compiled_packed_batches, 2, timeout=240):
        assert graphs[2:] == [graphs[1]] * (len(graphs) - 2), graphs  # (the 2nd: dynamic)
        assert max(diffs) < 1e-5, diffs


def _hybrid_fed_the_ring_sharding():
    import ringseq
    from ringseq.integrations.transformers import apply
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64))
    apply(model, sp_mode="hybrid", ulysses_size=2, layout="zigzag")
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    return error_text(lambda: model(**ringseq.shard_batch({"input_ids": ids}, layout="zigzag"),
                                    use_cache=False))


def test_a_hybrid_model_fed_the_plain_ring_sharding_is_told_its_own_sharder():
    """A model switched to Ulysses x ring and fed ringseq.shard_batch (the plain ring's
    sharding) is refused, with the advice to shard with sp.shard_batch (before: "pass the batch
    of ringseq.shard_batch", what the user had done)."""
    for text in run_ranks(_hybrid_fed_the_ring_sharding, 4, timeout=150):
        assert "position_ids that are not the global positions" in text, text
        assert "pass the batch of sp.shard_batch(batch, layout)" in text, text


def _position_case(case):
    """A tiny model whose position encoding the ring cannot feed, and the refusal's words."""
    import transformers as T
    common = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16)
    if case == "bart":  # numbers its decoder's tokens from 0, takes no position_ids
        cfg = T.BartConfig(d_model=64, decoder_layers=1, encoder_layers=1,
                           decoder_attention_heads=4, encoder_attention_heads=4,
                           decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=256,
                           vocab_size=128)
        return T.BartForCausalLM(cfg), "takes no position_ids"
    if case == "dynamic":
        cfg = T.LlamaConfig(**common, max_position_embeddings=32,
                            rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                             "rope_theta": 10000.0})
        return T.LlamaForCausalLM(cfg), "rope_type='dynamic'"
    if case == "longrope":
        cfg = T.Phi3Config(**common, max_position_embeddings=256, pad_token_id=0,
                           original_max_position_embeddings=40,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                            "original_max_position_embeddings": 40})
        return T.Phi3ForCausalLM(cfg), "rope_type='longrope'"
    cfg = T.Llama4TextConfig(**common, intermediate_size_mlp=64, num_local_experts=2,
                             num_experts_per_tok=1, attention_chunk_size=None,
                             no_rope_layers=[0], floor_scale=4)
    return T.Llama4ForCausalLM(cfg), "attn_temperature_tuning=True"


@pytest.mark.parametrize("case", ["bart", "dynamic", "longrope", "llama4_temperature"])
def test_position_encodings_the_shards_cannot_see_are_refused_at_apply(case):
    """Position encodings computed from each rank's own shard rather than the global positions
    (before: accepted, logits 6.3e-1 (BART), 1.3e-3 (dynamic NTK), 6.6e-3 (Phi-3 longrope) and
    3.4e-3 (Llama 4 NoPE temperature) from float64 at W=2, against ~2e-7 for plain float32):
    apply refuses them, naming the cause, before any communication."""
    pytest.importorskip("transformers")
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model, needle = _position_case(case)
    with pytest.raises(ValueError, match=r"^apply: .*" + needle.replace("(", r"\(")):
        apply(model)


def test_padding_outside_the_local_keys_is_refused_with_a_cache(state_dicts):
    """A full-length left-padded mask next to fewer input ids, with use_cache=True: transformers
    asks the mask function for the last kv_length columns only (before: the padding was cut
    away and the call ran, ignoring it); the whole mask is checked."""
    from ringseq.integrations.transformers import apply
    model = apply(_model("llama", state_dicts["llama"]))
    ids, _ = _batch(14)
    mask = torch.ones(ids.shape[0], 2 * ids.shape[1], dtype=torch.long)  # (b, 2 s)
    mask[-1, :6] = 0
    with torch.no_grad():
        for use_cache in (False, True):
            with pytest.raises(ValueError, match="attention_mask with padding"):
                model(input_ids=ids, attention_mask=mask, use_cache=use_cache)


def _reused_batch_on_one_rank():
    import torch.distributed as dist
    import ringseq
    import transformers as T
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model = apply(T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128)).eval())
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    batch = ringseq.shard_batch({"input_ids": ids})
    with torch.no_grad():
        first = model(**batch, use_cache=False).logits
        # identical content: rank 0 passes its dict again, rank 1 shards afresh
        again = batch if dist.get_rank() == 0 else ringseq.shard_batch({"input_ids": ids})
        second = error_text(lambda: model(**again, use_cache=False))
        third = model(**again, use_cache=False).logits
    return second, float((first - third).abs().max())


def test_a_batch_reused_on_one_rank_only_keeps_the_ranks_in_step():
    """The input check runs on every rank at each model call's first layer, whatever tensors a
    rank reuses (before: rank 0 skipped the agreement for the tensors it had checked, rank 1
    did not, and both raised RingDesyncError on valid input, the ring broken until reset)."""
    pytest.importorskip("transformers")
    for second, diff in run_ranks(_reused_batch_on_one_rank, 2, timeout=150):
        assert second == "no error", second
        assert diff == 0.0


def test_wrapped_models_and_look_alike_names_are_judged_by_the_model_inside():
    """A wrapper whose forward passes *args, **kwargs on (PEFT's get_base_model(), DDP's
    .module) is looked through to the transformers model (before: its Llama was refused as a
    model whose base takes no position_ids), and only whole words of a class name mark a
    position encoder (PositionwiseFeedForward is none)."""
    import transformers as T
    from ringseq.integrations.transformers import _position_encoders, apply

    class PeftLike(torch.nn.Module):  # PEFT's PeftModel: forward(*args, **kwargs)
        def __init__(self, model):
            super().__init__()
            self.base_model = model

        def get_base_model(self):
            return self.base_model

        def __getattr__(self, name):  # as PEFT forwards what it lacks (config, ...)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.base_model, name)

        def forward(self, *args, **kwargs):
            return self.base_model(*args, **kwargs)

    class PositionwiseFeedForward(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, vocab_size=64))
    wrapped = apply(PeftLike(llama))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert wrapped(input_ids=ids, use_cache=False).logits.shape == (1, 16, 64)
    assert _position_encoders(torch.nn.Sequential(PositionwiseFeedForward(2, 2))) == []
    assert _position_encoders(llama) == ["model.rotary_emb (LlamaRotaryEmbedding)"]
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    assert _position_encoders(gpt2) == ["transformer.wpe (Embedding)"]
    bart = T.BartForCausalLM(T.BartConfig(d_model=32, decoder_layers=1, encoder_layers=1,
                                          decoder_attention_heads=2, encoder_attention_heads=2,
                                          decoder_ffn_dim=32, encoder_ffn_dim=32,
                                          vocab_size=64))
    assert "model.decoder.embed_positions (BartLearnedPositionalEmbedding)" in \
        _position_encoders(bart)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(layout="zigzg"), ValueError, r"^apply: unknown layout 'zigzg'"),
    (dict(sp_mode="ulyses"), ValueError, r"^apply: sp_mode must be one of"),
    # before: accepted, the error came at the first forward
    (dict(backend="bogus"), ValueError, r"^apply: backend must be one of .* got 'bogus'"),
    (dict(backend=3), TypeError, r"^apply: backend must be one of .* got 3"),
])
def test_apply_names_itself_for_options_it_cannot_take(kwargs, error, needle):
    T = pytest.importorskip("transformers")
    from ringseq.integrations.transformers import apply
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1))
    with pytest.raises(error, match=needle):
        apply(model, **kwargs)
    assert model.config._attn_implementation != "ringseq"  # left as it was


def _layer_called_on_its_own():
    import torch.distributed as dist
    import ringseq
    from ringseq.integrations.transformers import RingSettings, ringseq_attention_forward

    class LlamaAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ringseq_settings = RingSettings(layout=ringseq.get_layout("contiguous"))
            self.is_causal, self.scaling = True, None

    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = LlamaAttention()
    q, k, v = (torch.randn(1, 2, 4, 16) for _ in range(3))  # (b, h, s_local, d)
    out = {}
    # valid on each rank: no mask on rank 0, an all-ones padding mask on rank 1
    out["mask_on_one_rank"] = error_text(lambda: ringseq_attention_forward(
        layer, q, k, v, None if rank == 0 else torch.ones(1, 4, dtype=torch.bool)))
    # the same all-ones mask, one tensor reused on rank 0, a new one per call on rank 1
    kept = torch.ones(1, 4, dtype=torch.bool)
    out["reused_on_one_rank"] = [error_text(lambda: ringseq_attention_forward(
        layer, q, k, v, kept if rank == 0 else torch.ones(1, 4, dtype=torch.bool)))
        for _ in range(2)]
    out["ring_after"] = error_text(lambda: ringseq.ring_flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True))
    return out


def test_a_layer_called_on_its_own_agrees_on_its_inputs_whatever_each_rank_passes():
    # Whether the input check's agreement runs depends on no rank's own tensors. (Before: a
    # rank without mask or with a reused mask skipped it, and both raised RingDesyncError.)
    for r in run_ranks(_layer_called_on_its_own, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        assert r == {"mask_on_one_rank": "no error", "reused_on_one_rank": ["no error"] * 2,
                     "ring_after": "no error"}, r


def test_the_attention_function_checks_its_options_as_the_flash_attn_forms_do():
    """transformers' dropout, sliding_window and softcap go through the entry points' rules
    (before: a negative or NaN dropout passed as none, a sliding_window of 2.9 ran as 2,
    softcap=True as 1.0), and an sp-mode layer's errors name the layer (before: usp_attn_func,
    which the user never called)."""
    import ringseq
    from ringseq.integrations.transformers import RingSettings, ringseq_attention_forward
    from ringseq.parallel.groups import make_sp_groups

    class LlamaAttention(torch.nn.Module):
        def __init__(self, settings):
            super().__init__()
            self.ringseq_settings, self.is_causal, self.scaling = settings, True, None

    layer = LlamaAttention(RingSettings(layout=ringseq.get_layout("contiguous")))
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))  # (b, h, s, d) as transformers
    for dropout in (-0.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"^LlamaAttention: attention dropout .* is not "
                                             r"supported"):
            ringseq_attention_forward(layer, q, k, v, None, dropout=dropout)
    with pytest.raises(ValueError, match=r"^LlamaAttention: sliding_window must be an int >= 1, "
                                         r"got 2.9"):
        ringseq_attention_forward(layer, q, k, v, None, sliding_window=2.9)
    with pytest.raises(TypeError, match=r"^LlamaAttention: softcap must be a float"):
        ringseq_attention_forward(layer, q, k, v, None, softcap=True)
    assert ringseq_attention_forward(layer, q, k, v, None, dropout=0.0, softcap=None)[0].shape \
        == (1, 8, 2, 16)
    # what ran before stays taken: no dropout as False, an integral float window
    assert torch.equal(ringseq_attention_forward(layer, q, k, v, None, dropout=False,
                                                 sliding_window=4.0)[0],
                       ringseq_attention_forward(layer, q, k, v, None, sliding_window=4)[0])
    sp_layer = LlamaAttention(RingSettings(sp=make_sp_groups(),
                                           ring_layout=ringseq.get_layout("zigzag")))
    with pytest.raises(ValueError, match=r"^LlamaAttention: query, key and value must have the "
                                         r"same dtype"):
        ringseq_attention_forward(sp_layer, q, k.double(), v.double(), None)


def _nested_model_calls():
    import ringseq
    import ringseq.engine.ring as ring_module
    from ringseq.integrations.transformers import apply
    from transformers import LlamaConfig, LlamaForCausalLM

    count = {"inputs": 0}
    ring_cls, agree = ring_module.Ring, ring_module.Ring.agree

    def counting(self, *args, about="argument check", **kwargs):
        count["inputs"] += about == "attention inputs"
        return agree(self, *args, about=about, **kwargs)

    ring_cls.agree = counting  # (this rank's process only)
    torch.manual_seed(0)
    model = apply(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)), layout="contiguous")
    teacher = copy.deepcopy(model)  # (shares the ring settings, as a copy runs on the same ring)
    batch = ringseq.shard_batch({"input_ids": torch.arange(16)[None] % 64}, layout="contiguous")
    counts = []
    with torch.no_grad():
        model(**batch, use_cache=False)
        counts.append(count["inputs"])
        hook = model.model.layers[1].register_forward_pre_hook(
            lambda *_: teacher(**batch, use_cache=False) and None)
        model(**batch, use_cache=False)
        hook.remove()
        counts.append(count["inputs"] - counts[0])
    return counts


def test_a_model_call_agrees_on_its_inputs_once_also_around_a_nested_call():
    # one agreement per model call: the student's, and the teacher's inside it (before the
    # depth count: the student's two remaining layers agreed again after the teacher's ended)
    for counts in run_ranks(_nested_model_calls, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        assert counts == [1, 2], counts
