"""Ranks that disagree raise on every rank, at once, before anything diverges (4 spawned gloo
ranks, CPU, dp 2 x sp 2 where the plugin runs):

* plugin options that differ between ranks (sp_size, zero_stage, ignore_index), or that one
  rank alone refuses (a precision, a CUDA device without CUDA), raise at construction on every
  rank (before: the ranks with other sizes waited inside init_device_mesh until the process
  group's timeout; a differing ignore_index trained on silently);
* a model whose dtype differs on one rank is refused by ``boost`` on every rank (before: gloo
  aborted processes inside DDP's construction);
* the ranks of one data-parallel group whose loaders yield different samples (another shuffle
  seed) raise at the first batch (before: each ring paired shards of different sequences);
* a rank that skipped ``zero_grad`` refuses the step and the others refuse with it, before any
  parameter moves (before: the others stepped, then waited in the vote after the step);
* a rank given another checkpoint file than the others (another path, or the same path holding
  other contents on its node): every rank raises, none loads (before: the ranks trained on
  from different weights);
* a rank that skipped an optimizer step meets the others' step agreement with its next batch's:
  every rank raises RingDesyncError (before: that rank raised, the others judged by their own
  empty fields, went on and waited until the ring timeout).
"""
from __future__ import annotations

import os
import time

import torch

from dist_utils import run_ranks
from utils import error_text, node_copy

TIMEOUT = 20  # the ranks' ring timeout: an error that waits for it fails the FAST bound
FAST = 10     # seconds within which every rank must raise
SEQ = 16


def _timed(fn):
    start = time.monotonic()
    return error_text(fn), time.monotonic() - start


def _llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0)
    return LlamaForCausalLM(cfg).to(dtype)


def _data(n=12):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (n, SEQ), generator=g)]


def _params_digest(model) -> float:
    return float(sum(p.detach().double().sum() * (i + 1)
                     for i, p in enumerate(model.parameters())))


def _worker(tmp):
    import torch.distributed as dist

    import ringseq
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank, out = dist.get_rank(), {}

    def plugin(**over):
        return RingSequenceParallelPlugin(**{"sp_size": 2, "layout": "zigzag", **over})

    out["sp_size"] = _timed(lambda: plugin(sp_size=2 if rank == 0 else 4))
    out["zero_ignore"] = _timed(lambda: plugin(zero_stage=3 if rank == 0 else 0,
                                               ignore_index=0 if rank == 0 else -100))
    out["precision_one_rank"] = _timed(lambda: plugin(precision="fp64" if rank == 1 else "fp32"))
    if not torch.cuda.is_available():  # before: accepted, then an AssertionError at boost
        out["cuda_one_rank"] = _timed(lambda: plugin(device="cuda" if rank == 3 else None))

    booster = Booster(plugin=plugin())
    model = _llama(torch.float64 if rank == 0 else torch.float32)
    out["dtype"] = _timed(lambda: booster.boost(model, torch.optim.SGD(model.parameters(), 0.1)))
    # the same counts, other shapes: a (4, 6) and a (6, 4) matrix (rank 0's weights are
    # broadcast where DDP is not used: tensors that did not pair would hang or mix there)
    shaped = torch.nn.Linear(4, 6) if rank == 2 else torch.nn.Linear(6, 4, bias=False)
    if rank != 2:
        shaped.register_parameter("bias", torch.nn.Parameter(torch.zeros(6)))
    out["shapes"] = _timed(lambda: Booster(plugin=plugin()).boost(shaped))
    # one parameter frozen on rank 1 only: named (before: the trainable elements' counts only)
    frozen = _llama(torch.float32)
    if rank == 1:
        frozen.model.norm.weight.requires_grad_(False)
    out["frozen"] = _timed(lambda: Booster(plugin=plugin()).boost(frozen))

    def first_batch(seed):
        loader = booster.plugin.prepare_dataloader(_data(), batch_size=2, shuffle=True, seed=seed)
        return next(iter(loader))
    out["loader_seed"] = _timed(lambda: first_batch(7 if rank == 1 else 0))
    # the same sampler over other samples on rank 1: only the batches' digests tell
    other = _data()[::-1] if rank == 1 else _data()
    out["loader_samples"] = _timed(lambda: next(iter(booster.plugin.prepare_dataloader(
        other, batch_size=2))))

    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, criterion, loader, _ = booster.boost(
        model, opt, dataloader=booster.plugin.prepare_dataloader(_data(), batch_size=1))
    batches = iter(loader)

    def backward(batch):
        booster.backward(criterion(model(**batch), batch), opt)

    backward(next(batches))
    opt.step()
    booster.save_model(model, os.path.join(tmp, "step1.pt"))
    if rank != 0:
        opt.zero_grad()  # rank 0 forgets: its next backward adds to the used gradients
    backward(next(batches))
    before = _params_digest(model.unwrap())
    out["zero_grad_one_rank"] = _timed(opt.step)
    out["moved"] = _params_digest(model.unwrap()) != before
    opt.zero_grad()
    backward(next(batches))
    opt.step()
    opt.zero_grad()
    booster.save_model(model, os.path.join(tmp, "step2.pt"))
    before = _params_digest(model.unwrap())
    name = "step1.pt" if rank == 1 else "step2.pt"
    out["checkpoint"] = _timed(lambda: booster.load_model(model, os.path.join(tmp, name)))
    # one path, which rank 1's node holds at step 1 (a node-local copy): contents compared
    step2 = os.path.join(tmp, "step2.pt")
    with node_copy(step2, os.path.join(tmp, "step1.pt"), active=rank == 1):
        out["checkpoint_copies"] = _timed(lambda: booster.load_model(model, step2))
    out["loaded"] = _params_digest(model.unwrap()) != before
    booster.load_model(model, os.path.join(tmp, "step2.pt"))  # the same file: loads
    out["params"] = _params_digest(model.unwrap())

    backward(next(batches))
    if rank != 2:  # rank 2 skips this step and goes on to the next batch
        out["skipped_step"] = _timed(opt.step)
    else:
        out["skipped_step"] = _timed(lambda: next(batches))
    ringseq.reset_ring()
    return out


def _assert_everywhere(results, case, own, peers=None, needle="", own_rank=None):
    """Every rank raised within FAST seconds: ``own`` (type name) on ``own_rank`` (all ranks
    when None), ``peers`` on the others, each message containing ``needle``."""
    for rank, res in enumerate(results):
        text, seconds = res[case]
        want = own if own_rank is None or rank == own_rank else peers
        assert text.startswith(want + ":"), (case, rank, text)
        assert needle in text, (case, rank, needle, text)
        assert seconds < FAST, (case, rank, seconds, text)


def test_ranks_that_disagree_raise_together(tmp_path):
    results = run_ranks(_worker, 4, str(tmp_path), timeout=240,
                        env={"RINGSEQ_TIMEOUT": str(TIMEOUT)})
    # (named for the plugin and boost, with their own advice: before, neither, and the
    # attention calls' "must pass shards of the same shape")
    _assert_everywhere(results, "sp_size", "RingMismatchError",
                       needle="sp_size (rank 0: 2, rank 1: 4, rank 2: 4, rank 3: 4)")
    _assert_everywhere(results, "sp_size", "RingMismatchError",
                       needle="ringseq: RingSequenceParallelPlugin: the ranks of the ring")
    _assert_everywhere(results, "sp_size", "RingMismatchError",
                       needle="Every rank must build the plugin with the same options")
    _assert_everywhere(results, "frozen", "RingMismatchError",
                       needle="ringseq: boost: the ranks of the ring were called with different "
                              "arguments: trainable parameter elements (rank 0: ")
    _assert_everywhere(results, "frozen", "RingMismatchError",
                       needle="frozen parameters (rank 0: none, rank 1: model.norm.weight, "
                              "rank 2: none, rank 3: none). Every rank must boost the same "
                              "model")
    _assert_everywhere(results, "zero_ignore", "RingMismatchError", needle="zero_stage (rank 0: 3")
    _assert_everywhere(results, "zero_ignore", "RingMismatchError",
                       needle="ignore_index (rank 0: 0, rank 1: -100")
    _assert_everywhere(results, "precision_one_rank", "ValueError", "RingPeerError",
                       needle="precision='fp64'", own_rank=1)
    if "cuda_one_rank" in results[0]:
        _assert_everywhere(results, "cuda_one_rank", "ValueError", "RingPeerError",
                           needle="device='cuda', but this torch sees no CUDA device", own_rank=3)
    _assert_everywhere(results, "dtype", "RingMismatchError",
                       needle="float64 parameter elements (rank 0: ")
    _assert_everywhere(results, "shapes", "RingMismatchError",
                       needle="parameter names, shapes and dtypes (hash)")
    _assert_everywhere(results, "loader_seed", "RingMismatchError",
                       needle="sampler seed (rank 0: 0, rank 1: 7, rank 2: 0, rank 3: 0)")
    _assert_everywhere(results, "loader_samples", "RingMismatchError",
                       needle="batch 1 differs between the ranks of one data-parallel group")
    _assert_everywhere(results, "zero_grad_one_rank", "ValueError", "RingPeerError",
                       needle="a backward added its gradients to gradients", own_rank=0)
    assert not any(res["moved"] for res in results)
    _assert_everywhere(results, "checkpoint", "RingMismatchError",
                       needle="load_model: the ranks made different checkpoint calls")
    _assert_everywhere(results, "checkpoint_copies", "ValueError",
                       needle="the ranks read different contents")
    assert not any(res["loaded"] for res in results)
    assert len({res["params"] for res in results}) == 1, [res["params"] for res in results]
    _assert_everywhere(results, "skipped_step", "RingDesyncError",
                       needle="optimizer step refusal agreement")
