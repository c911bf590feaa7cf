"""Checkpoints when something goes wrong: a failed sharded save never leaves a directory that
loads as a mix of old and new shards, an unsharded optimizer directory given to the ranks at
different steps is refused like a plain file, rank 0's own save error names the checkpoint,
and a planted temporary index name is not written through."""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_ranks
from test_plugin_loader_options import _Net
from utils import error_text


def _worker(tmp):
    import torch.distributed as dist
    import ringseq.plugin.sharded_checkpoint as sharded
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank = dist.get_rank()
    booster = Booster(RingSequenceParallelPlugin(sp_size=1))  # dp 2: DDP, replicated state
    torch.manual_seed(0)
    net = _Net()
    model, opt, *_ = booster.boost(net, torch.optim.Adam(net.parameters(), lr=0.1))
    out = {}

    def step():
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    booster.save_optimizer(opt, f"{tmp}/optim1", sharded=True)
    step()
    booster.save_optimizer(opt, f"{tmp}/optim2", sharded=True)
    before = [p.detach().clone() for p in model.parameters()]
    # each rank given another step's directory (before: loaded; the replicas then diverged)
    out["optim_dirs"] = error_text(lambda: booster.load_optimizer(
        opt, f"{tmp}/optim1" if rank == 0 else f"{tmp}/optim2"))
    step()
    gathered = [None, None]
    dist.all_gather_object(gathered, [p.detach() for p in model.parameters()])
    out["replicas_equal"] = all(torch.equal(a, b) for a, b in zip(*gathered))
    out["moved"] = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))

    # a sharded optimizer save that fails (torch's writer rewrites the files in place: before,
    # the old .metadata stayed over them)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    real_save = dcp.save

    def failing_save(*args, **kwargs):
        raise CheckpointException("injected", {0: RuntimeError("disk full")})

    dcp.save = failing_save
    try:
        out["failed_optim_save"] = error_text(lambda: booster.save_optimizer(
            opt, f"{tmp}/optim2", sharded=True))
    finally:
        dcp.save = real_save
    out["load_after_failed_optim_save"] = error_text(lambda: booster.load_optimizer(
        opt, f"{tmp}/optim2"))

    # a sharded model save that fails part way over an existing one (before: the old index
    # stayed and loaded 7 old and 5 new tensors)
    booster.save_model(model, f"{tmp}/model", max_shard_size=64)
    real, calls = sharded._write, {"n": 0}

    def failing(obj, path):
        calls["n"] += 1
        if rank == 0 and calls["n"] == 2:
            raise OSError(27, "File too large")
        return real(obj, path)

    sharded._write = failing
    try:
        out["failed_save"] = error_text(lambda: booster.save_model(model, f"{tmp}/model",
                                                                   max_shard_size=64))
    finally:
        sharded._write = real
    out["load_after_failed_save"] = error_text(lambda: booster.load_model(model, f"{tmp}/model"))

    # rank 0's own error names the checkpoint (before: only "[Errno 17] File exists: ...")
    if rank == 0:
        open(f"{tmp}/afile", "w").close()
    dist.barrier()
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optim, lambda s: 1.0)
    out["save_error"] = error_text(lambda: booster.save_lr_scheduler(sched, f"{tmp}/afile/lr"))

    # a planted temporary index name is not written through
    if rank == 0:
        os.makedirs(f"{tmp}/model2", exist_ok=True)
        with open(f"{tmp}/victim", "w") as f:
            f.write("precious")
        os.symlink(f"{tmp}/victim", f"{tmp}/model2/.pytorch_model.bin.index.json.tmp")
    dist.barrier()
    booster.save_model(model, f"{tmp}/model2", max_shard_size=64)
    out["victim"] = open(f"{tmp}/victim").read() if rank == 0 else None
    out["index_is_link"] = os.path.islink(f"{tmp}/model2/pytorch_model.bin.index.json")
    out["reload"] = error_text(lambda: booster.load_model(model, f"{tmp}/model2"))
    return out


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("ckf")), timeout=240)


def test_an_unsharded_optimizer_directory_read_at_different_steps_is_refused(w2):
    for r in w2:
        assert r["optim_dirs"].startswith("ValueError") and \
            "the ranks read different contents" in r["optim_dirs"], r["optim_dirs"]
        assert r["replicas_equal"] and r["moved"], r


def test_a_failed_sharded_save_leaves_no_index_to_load(w2):
    assert "File too large" in w2[0]["failed_save"], w2[0]["failed_save"]
    assert "saving the checkpoint" in w2[0]["failed_save"], w2[0]["failed_save"]
    assert w2[1]["failed_save"] != "no error", w2[1]
    for r in w2:
        assert "pytorch_model.bin.index.json" in r["load_after_failed_save"], r


def test_rank_0s_save_error_names_the_checkpoint(w2):
    assert w2[0]["save_error"].startswith("FileExistsError: [Errno 17] rank 0: saving the "
                                          "checkpoint"), w2[0]["save_error"]
    assert "rank 0 failed to write the checkpoint" in w2[1]["save_error"], w2[1]["save_error"]


def test_a_planted_temporary_index_is_not_written_through(w2):
    assert w2[0]["victim"] == "precious"
    for r in w2:
        assert not r["index_is_link"] and r["reload"] == "no error", r


def test_a_failed_sharded_optimizer_save_leaves_no_metadata_to_load(w2):
    for r in w2:
        assert r["failed_optim_save"] != "no error", r
        assert r["load_after_failed_optim_save"] != "no error", r
