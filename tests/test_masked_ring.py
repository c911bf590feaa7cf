"""Windows, soft-capping and packed documents on spawned gloo ranks (W = 2 and 4).

* Ring functions with the default block kernel (ours) against float64 masked attention:
  ``ring_flash_attn_func(window_size=..., softcap=...)`` and
  ``ring_flash_attn_varlen_func`` (global cu_seqlens, the Documents layout), with the number
  of exchanges per call asserted for a short window on contiguous shards.
* transformers models: a Mistral and a Qwen2 model whose sliding window is shorter than the
  sequence, and a Gemma-2-style model (soft-capped logits, alternating sliding/full layers),
  against single-process training of the same weights; a Llama and a Qwen2 on a packed batch of
  5 documents against running every document alone, through ``apply`` and (Llama) through the
  plugin (``prepare_dataloader(pack=True)``, ``layout="documents"``, ``Booster.backward``).

Tolerance (docs/design.md): |ring - float64| <= 2x (loss, outputs) / 3x (gradients) the error
of plain single-process float32 against float64, plus a floor (``utils.scaled_floor``).
"""
from __future__ import annotations

import pytest
import torch

import ringseq

from dist_utils import run_ranks
from masks_reference import global_mask, masked_attention
from utils import assert_close_per_design, scaled_floor

transformers = pytest.importorskip("transformers")

VOCAB, SEQLEN = 96, 48
DOCS = (5, 17, 1, 9, 16)  # 5 documents, 48 tokens: any lengths (only the total divides W)


# ---------------------------------------------------------------- models
def _model(arch, dtype=torch.float32, **over):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=128, attention_dropout=0.0)
    common.update(over)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif arch == "gemma2":
        common.update(head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=None)
        cfg, cls = transformers.Gemma2Config(**common), transformers.Gemma2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(11)
    return cls(cfg).to(dtype)


MODEL_CASES = {
    "mistral-window8": ("mistral", dict(sliding_window=8)),
    "qwen2-window6": ("qwen2", dict(use_sliding_window=True, sliding_window=6,
                                    max_window_layers=0)),
    "gemma2-softcap-alternating": ("gemma2", dict(sliding_window=7, attn_logit_softcapping=5.0,
                                                  layer_types=["sliding_attention",
                                                               "full_attention"])),
}


def _batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, SEQLEN), generator=g)
    return ids


def _packed_batch():
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in DOCS]
    col = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = col([{"input_ids": d.tolist()} for d in docs])
    return docs, dict(batch)


# ---------------------------------------------------------------- rank side
def _grads_summed(model):
    import torch.distributed as dist
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        out[name] = g
    return out


def _model_run(arch, over, layout):
    from ringseq.integrations.transformers import apply
    model = apply(_model(arch, **over), layout=layout)
    ids = _batch()
    batch = ringseq.shard_batch({"input_ids": ids, "labels": ids}, layout=layout)
    targets = batch.pop("shift_labels")
    loss = ringseq.sharded_cross_entropy(model(**batch, use_cache=False).logits, targets)
    loss.backward()
    return {"loss": loss.detach(), "grads": _grads_summed(model)}


def _packed_run(arch, layout):
    from ringseq.integrations.transformers import apply
    model = apply(_model(arch), layout=layout)
    _, full = _packed_batch()
    full["labels"] = full["input_ids"].clone()
    batch = ringseq.shard_batch(full, layout=layout)
    targets = batch.pop("shift_labels")
    loss = ringseq.sharded_cross_entropy(model(**batch, use_cache=False).logits, targets)
    loss.backward()
    return {"loss": loss.detach(), "grads": _grads_summed(model)}


def _plugin_packed_run(arch):
    """One step through the plugin: pack=True loader (the 5 documents as 5 samples), layout
    "documents", Booster.backward; the gradients are the plugin's (all-reduced over the ring)."""
    import torch.distributed as dist
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    plugin = RingSequenceParallelPlugin(sp_size=dist.get_world_size(), layout="documents")
    booster = Booster(plugin=plugin)
    model = _model(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    docs, _ = _packed_batch()
    loader = plugin.prepare_dataloader([{"input_ids": d} for d in docs], batch_size=len(docs),
                                       pack=True)
    model, opt, criterion, loader, _ = booster.boost(model, opt, dataloader=loader)
    batch = next(iter(loader))
    loss = criterion(model(**batch), batch)
    booster.backward(loss, opt)
    return {"loss": loss.detach(), "local_len": batch["input_ids"].shape[1],
            "grads": {n: p.grad.detach().clone() for n, p in model.unwrap().named_parameters()}}


def _ring_function_cases():
    """Ring functions with our kernel: windows + softcap, and packed documents."""
    import torch.distributed as dist
    w = dist.get_world_size()
    s = 24 * w
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(1, s, n, 16, generator=g) for n in (4, 2, 2, 4)]
    res = {}
    for name, layout, causal, window, cap in (
            ("contiguous-window5", "contiguous", True, (5, -1), 0.0),
            ("zigzag-window9-softcap", "zigzag", True, (9, -1), 5.0),
            ("stripe-both-sides", "stripe", False, (6, 3), 0.0)):
        q, k, v, dout = (ringseq.shard(t, layout).requires_grad_() for t in full)
        out = ringseq.ring_flash_attn_func(q, k, v, causal=causal, window_size=window,
                                           layout=layout, softcap=cap)
        fwd_exchanges = ringseq.get_comm().last_exchanges
        out.backward(dout.detach())
        res[name] = {"got": [out.detach(), q.grad, k.grad, v.grad], "layout": layout,
                     "causal": causal, "window": window, "cap": cap, "fwd": fwd_exchanges}
    cu = [0]
    for n in (1, 2, 17, 25, 3):
        cu.append(cu[-1] + n)
    cu.append(s)
    lay = ringseq.layouts.Documents(cu)
    q, k, v, dout = (ringseq.shard(t[0], lay, dim=0).requires_grad_() for t in full)
    out = ringseq.ring_flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32),
                                              causal=True)
    out.backward(dout.detach())
    res["varlen"] = {"got": [out.detach(), q.grad, k.grad, v.grad], "cu": cu}
    return res


def _worker():
    res = {"functions": _ring_function_cases()}
    for case, (arch, over) in MODEL_CASES.items():
        res[case] = _model_run(arch, over, "contiguous")
    for arch in ("llama", "qwen2"):
        res[f"packed-{arch}"] = _packed_run(arch, "documents")
    res["packed-llama-zigzag"] = _packed_run("llama", "zigzag")
    res["plugin-packed-llama"] = _plugin_packed_run("llama")
    return res


# ---------------------------------------------------------------- parent side
@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_ranks(_worker, request.param, timeout=300)


def _single(arch, over, dtype):
    model = _model(arch, dtype, **over)
    ids = _batch()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach(), "grads": {n: p.grad.detach().clone()
                                                 for n, p in model.named_parameters()}}


def _per_document(arch, dtype):
    """Every document alone in one process; the loss is the token mean over all targets."""
    model = _model(arch, dtype)
    docs, _ = _packed_batch()
    n_targets = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        logits = model(input_ids=d[None], use_cache=False).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits.to(dtype), d[1:], reduction="sum")
        (loss / n_targets).backward()
        total = total + loss.detach()
    return {"loss": total / n_targets, "grads": {n: p.grad.detach().clone()
                                                 for n, p in model.named_parameters()}}


def _compare(got, ref, plain, what):
    assert_close_per_design(got["loss"], ref["loss"].float(), plain["loss"], f"{what} loss", 2.0,
                            scaled_floor(torch.float32, ref["loss"]))
    for name, g in got["grads"].items():
        assert_close_per_design(g, ref["grads"][name].float(), plain["grads"][name],
                                f"{what} grad {name}", 3.0,
                                scaled_floor(torch.float32, ref["grads"][name]))


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_windowed_and_softcapped_models_match_single_process(ranks, case):
    w, per_rank = ranks
    arch, over = MODEL_CASES[case]
    ref, plain = _single(arch, over, torch.float64), _single(arch, over, torch.float32)
    for r, res in enumerate(per_rank):
        _compare(res[case], ref, plain, f"W={w} rank {r} {case}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_documents_match_each_document_alone(ranks, arch):
    w, per_rank = ranks
    ref, plain = _per_document(arch, torch.float64), _per_document(arch, torch.float32)
    for r, res in enumerate(per_rank):
        _compare(res[f"packed-{arch}"], ref, plain, f"W={w} rank {r} packed {arch}")
        if arch == "llama":  # the document mask is exact on any layout
            _compare(res["packed-llama-zigzag"], ref, plain, f"W={w} rank {r} zigzag packed")


def test_plugin_trains_packed_documents_exactly(ranks):
    """prepare_dataloader(pack=True) + layout="documents" + Booster.backward: the loss and the
    gradients of one step equal every document trained alone."""
    w, per_rank = ranks
    ref, plain = _per_document("llama", torch.float64), _per_document("llama", torch.float32)
    for r, res in enumerate(per_rank):
        got = res["plugin-packed-llama"]
        assert got["local_len"] == SEQLEN // w, f"rank {r}: {got['local_len']} tokens"
        _compare(got, ref, plain, f"W={w} rank {r} plugin packed llama")


def test_ring_functions_with_our_kernel(ranks):
    w, per_rank = ranks
    s = 24 * w
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(1, s, n, 16, generator=g) for n in (4, 2, 2, 4)]
    for name, case in per_rank[0]["functions"].items():
        if name == "varlen":
            mask = global_mask(s, s, True, cu_seqlens=case["cu"])
            lay = ringseq.layouts.Documents(case["cu"])
            shard = (lambda t, r: ringseq.layouts.shard_local(t[0], lay, w, r, dim=0))
            cap = 0.0
        else:
            mask = global_mask(s, s, case["causal"], case["window"])
            lay, cap = case["layout"], case["cap"]
            shard = (lambda t, r, lay=lay: ringseq.layouts.shard_local(t, lay, w, r))
        refs = []
        for dtype in (torch.float64, torch.float32):
            q, k, v = (t.detach().to(dtype).requires_grad_() for t in full[:3])
            out, _ = masked_attention(q, k, v, mask, softcap=cap, dtype=dtype)
            out.backward(full[3].to(dtype))
            refs.append([out.detach(), q.grad, k.grad, v.grad])
        for r, res in enumerate(per_rank):
            got = res["functions"][name]["got"]
            for j, what in enumerate(("out", "dq", "dk", "dv")):
                assert_close_per_design(got[j], shard(refs[0][j], r).float(),
                                        shard(refs[1][j], r), f"W={w} rank {r} {name} {what}",
                                        2.0 if j == 0 else 3.0,
                                        scaled_floor(torch.float32, refs[0][j]))
        if name == "contiguous-window5":  # window 5 < s_local = 24: one forward hop
            assert all(res["functions"][name]["fwd"] == 1 for res in per_rank)
