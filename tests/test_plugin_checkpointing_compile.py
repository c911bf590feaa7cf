"""The plugin's activation checkpointing beside transformers' own, in copies of the model, and
torch.compile of the model boost returns.

- A copy of a checkpointed model (an EMA, a teacher) computes with its own weights. (Before:
  the checkpointed forward was a closure over the original layer's forward, and the copy ran
  the original's layers.)
- transformers' gradient checkpointing on top of the plugin's is refused on every rank, at
  boost and at a training forward after ``gradient_checkpointing_enable()``. (Before: every
  layer was recomputed twice and the backward ran the ring again, 4 backward ring calls for
  2 layers instead of 2, against the docs' "no ring exchange is repeated".)
- A compiled model boosted with tensor parallelism trains as the eager one. (Before: every rank
  failed in dynamo, tracing ringseq's count of the tp group's collectives.)
- A deep copy of a model boosted with tensor parallelism is refused by name, and the state-dict
  route the message gives runs the same weights. (Before: a TypeError about pickling a
  ProcessGroup.)
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from utils import error_text, token_dataset

transformers = pytest.importorskip("transformers")

SEQLEN, VOCAB = 32, 128


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256))


def test_a_copy_of_a_checkpointed_model_runs_its_own_layers():
    import ringseq  # noqa: F401 - registers the operator the policy keeps
    from ringseq.parallel.checkpointing import apply_activation_checkpointing
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
    apply_activation_checkpointing(list(layers))
    twin = copy.deepcopy(layers)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    # (the copy's layers are checkpointed already: a copy of a boosted model boosted again;
    # before, wrapping them again made their forward call itself: RecursionError)
    assert apply_activation_checkpointing(list(twin)) == 2
    x = torch.randn(3, 8, requires_grad=True)
    for original, copied in zip(layers, twin):
        assert torch.equal(copied(x), torch.tanh(torch.zeros(3, 8)))
        assert not torch.equal(original(x), copied(x))
        copied(x).sum().backward()
        assert original[0].weight.grad is None  # (the copy's backward reaches its own weights)
        assert copied[0].weight.grad is not None


def _worker():
    import torch.distributed as dist
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    out = {}
    # transformers' checkpointing on at boost, and enabled after it
    plugin = RingSequenceParallelPlugin(sp_size=2, activation_checkpointing=True)
    booster = Booster(plugin=plugin)
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out["at_boost"] = error_text(lambda: booster.boost(model))
    model = _llama()
    loader = plugin.prepare_dataloader(token_dataset(2, SEQLEN, VOCAB), batch_size=1)
    model, _, criterion, loader, _ = booster.boost(model, dataloader=loader)
    batch = next(iter(loader))
    model.unwrap().gradient_checkpointing_enable()
    with torch.no_grad():  # (transformers checkpoints nothing without gradients: taken)
        out["no_grad"] = error_text(lambda: model(**batch))
    out["after_boost"] = error_text(lambda: model(**batch))
    booster.reset()
    model.unwrap().gradient_checkpointing_disable()
    if dist.get_rank() == 0:  # enabled on one rank only: every rank raises, at once
        model.unwrap().gradient_checkpointing_enable()
    start = time.monotonic()
    out["one_rank"] = error_text(lambda: model(**batch))
    out["one_rank_s"] = time.monotonic() - start
    booster.reset()
    model.unwrap().gradient_checkpointing_disable()
    loss = criterion(model(**batch), batch)
    loss.backward()
    out["trains_again"] = bool(torch.isfinite(loss))
    # a copy of the checkpointed model (a frozen teacher), boosted too, runs its own weights
    teacher = copy.deepcopy(model.unwrap()).requires_grad_(False)
    with torch.no_grad():
        teacher.lm_head.weight.zero_()
    teacher = booster.boost(teacher)[0]
    with torch.no_grad():
        out["teacher_logits"] = float(teacher(**batch).logits.abs().max())

    # tensor parallelism, eager and compiled, from the same weights and batch
    grads = []
    for compiled in (False, True):
        plugin = RingSequenceParallelPlugin(sp_size=1, tp_size=2)
        booster = Booster(plugin=plugin)
        loader = plugin.prepare_dataloader(token_dataset(2, SEQLEN, VOCAB), batch_size=1)
        model, _, criterion, loader, _ = booster.boost(_llama(), dataloader=loader)
        batch = next(iter(loader))
        run = torch.compile(model, backend="aot_eager") if compiled else model
        criterion(run(**batch), batch).backward()
        grads.append([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                      for p in model.unwrap().parameters()])
    out["compiled_tp_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(*grads))
    out["grad_scale"] = max(float(a.abs().max()) for a in grads[0])
    # a copy of the tp model is refused by name; the way the message gives runs the same weights
    out["tp_copy"] = error_text(lambda: copy.deepcopy(model.unwrap()))
    twin = booster.boost(_llama())[0]
    with torch.no_grad():
        for p in twin.unwrap().parameters():
            p.zero_()
        twin.unwrap().load_state_dict(model.unwrap().state_dict())
        out["tp_twin_diff"] = float((twin(**batch).logits - model(**batch).logits).abs().max())
    return out


@pytest.fixture(scope="module")
def w2():
    return run_ranks(_worker, 2, timeout=400, env={"RINGSEQ_TIMEOUT": "20"})


def test_transformers_checkpointing_on_top_of_the_plugins_is_refused(w2):
    for r in w2:
        for key, where in (("at_boost", "ValueError: boost: "),
                           ("after_boost", "ValueError: LlamaForCausalLM: ")):
            assert r[key].startswith(where + "transformers' gradient checkpointing is on in "
                                             "this LlamaForCausalLM"), (key, r[key])
            assert "gradient_checkpointing_disable(), or activation_checkpointing=False (after a "\
                "refused forward, then booster.reset() on every rank)" in r[key], r[key]
        assert r["trains_again"] and r["no_grad"] == "no error", r
        assert r["teacher_logits"] == 0.0, r  # (its own zeroed head)
    assert w2[0]["one_rank"].startswith("ValueError: LlamaForCausalLM: transformers' gradient "
                                        "checkpointing is on"), w2[0]["one_rank"]
    assert w2[1]["one_rank"].startswith(("RingBrokenError", "RingPeerError")), w2[1]["one_rank"]
    assert "transformers' gradient checkpointing is on" in w2[1]["one_rank"], w2[1]["one_rank"]
    assert all(r["one_rank_s"] < 10 for r in w2), [r["one_rank_s"] for r in w2]


def test_a_copy_of_a_tensor_parallel_model_is_refused_by_name(w2):
    # (before: "TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")
    for r in w2:
        assert r["tp_copy"].startswith(
            "TypeError: copy.deepcopy: a model with tensor parallelism (tp_size > 1) at "
            "zero_stage 0 cannot be copied"), r["tp_copy"]
        assert "boost a fresh model with the same plugin, then load_state_dict(" in r["tp_copy"]
        assert r["tp_twin_diff"] == 0.0, r["tp_twin_diff"]


def test_a_compiled_model_with_tensor_parallelism_trains_as_the_eager_one(w2):
    for r in w2:
        # (the same operations, up to the compiled graph's reassociation)
        assert r["compiled_tp_max_diff"] <= 1e-5 * r["grad_scale"], r
