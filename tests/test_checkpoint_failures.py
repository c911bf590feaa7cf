"""Checkpoints when something goes wrong: a failed sharded save never leaves a directory that
loads as a mix of old and new shards, an unsharded optimizer directory given to the ranks at
different steps is refused like a plain file, rank 0's own save error names the checkpoint,
a planted temporary index name is not written through, a replicated load's digest reads every
kind of tensor a file holds (and its failure on one rank raises on every rank at once), and a
damaged model directory is refused naming the file."""
from __future__ import annotations

import collections
import os

import pytest
import torch

from dist_utils import run_ranks
from test_plugin_loader_options import _Net
from utils import error_text, node_copy


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
    # ... or one path, which rank 1's node holds at the other step (a node-local copy): the
    # contents read are compared
    import torch.distributed.checkpoint as dcp
    real_load = dcp.load
    if rank == 1:
        dcp.load = lambda state, checkpoint_id: real_load(state, checkpoint_id=f"{tmp}/optim1")
    try:
        out["optim_copies"] = error_text(lambda: booster.load_optimizer(opt, f"{tmp}/optim2"))
    finally:
        dcp.load = real_load
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
        assert r["optim_dirs"].startswith(
            "RingMismatchError: load_optimizer: the ranks made different checkpoint calls "
            "(rank 0: load_optimizer("), r["optim_dirs"]
        assert "optim1')" in r["optim_dirs"] and "optim2'))" in r["optim_dirs"], r["optim_dirs"]
        assert r["optim_copies"].startswith("ValueError: load_optimizer: loading the "
                                            "checkpoint") and \
            "the ranks read different contents" in r["optim_copies"], r["optim_copies"]
        assert r["replicas_equal"] and r["moved"], r


def test_a_failed_sharded_save_leaves_no_index_to_load(w2):
    assert "File too large" in w2[0]["failed_save"], w2[0]["failed_save"]
    assert "saving the checkpoint" in w2[0]["failed_save"], w2[0]["failed_save"]
    assert w2[1]["failed_save"] != "no error", w2[1]
    for r in w2:
        assert "pytorch_model.bin.index.json" in r["load_after_failed_save"], r


def test_rank_0s_save_error_names_the_checkpoint(w2):
    assert w2[0]["save_error"].startswith("FileExistsError: [Errno 17] save_lr_scheduler: rank "
                                          "0: saving the checkpoint"), w2[0]["save_error"]
    assert "rank 0 failed to write the checkpoint" in w2[1]["save_error"], w2[1]["save_error"]


def test_a_planted_temporary_index_is_not_written_through(w2):
    assert w2[0]["victim"] == "precious"
    for r in w2:
        assert not r["index_is_link"] and r["reload"] == "no error", r


def test_a_failed_sharded_optimizer_save_leaves_no_metadata_to_load(w2):
    for r in w2:
        assert r["failed_optim_save"] != "no error", r
        assert r["load_after_failed_optim_save"] != "no error", r


def _worker_calls(tmp):
    """Checkpoint calls the ranks make differently, or with arguments they do not take."""
    import torch.distributed as dist
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank, out = dist.get_rank(), {}

    def boosted(**plugin):
        booster = Booster(RingSequenceParallelPlugin(sp_size=1, **plugin))
        torch.manual_seed(0)
        net = _Net()
        model, opt, *_ = booster.boost(net, torch.optim.Adam(net.parameters(), lr=0.1))
        return booster, model, opt

    def step(booster, model, opt):
        booster.backward(model(torch.randn(2, 4)).sum(), opt)  # (fp16: scaled)
        opt.step()
        opt.zero_grad()

    # a plain optimizer file at two steps, from replicated training (dp 2)
    booster, model, opt = boosted()
    for n in (1, 2):
        step(booster, model, opt)
        booster.save_optimizer(opt, f"{tmp}/optim{n}.pt")
    # ... loaded into sharded parameters (zero 3) from one path that rank 1's node holds at
    # step 1 (before: no error, step 1.0 on rank 0 and 2.0 on rank 1)
    booster, model, opt = boosted(zero_stage=3)
    path = f"{tmp}/optim2.pt"
    with node_copy(path, f"{tmp}/optim1.pt", active=rank == 1):
        out["file_copies_into_sharded"] = error_text(lambda: booster.load_optimizer(opt, path))
    out["fresh_after_refusal"] = not opt.optim.state
    step(booster, model, opt)
    # each rank its own path (before: no error; rank 1's shards and files were lost)
    out["save_paths"] = error_text(lambda: booster.save_model(model, f"{tmp}/model_r{rank}.pt"))
    out["optim_paths"] = error_text(lambda: booster.save_optimizer(opt, f"{tmp}/optim_r{rank}"))
    dist.barrier()
    out["written"] = sorted(n for n in os.listdir(tmp) if "_r" in n)
    # arguments the calls do not take (before: ignored, a single file written)
    target = f"{tmp}/model_sharded"
    out["colossalai_shard"] = error_text(lambda: booster.save_model(
        model, target, shard=True, size_per_shard=1))
    out["typo"] = error_text(lambda: booster.save_model(model, target, max_shard=1000))
    # (save_optimizer's own option is hinted, not save_model's: before, "see max_shard_size")
    out["colossalai_shard_optimizer"] = error_text(lambda: booster.save_optimizer(
        opt, target, shard=True, size_per_shard=1))
    out["one_rank_typo"] = error_text(lambda: booster.save_model(
        model, target, **({"max_shard": 1000} if rank == 1 else {})))
    # (before: Python's TypeError on rank 1, the ring timeout on rank 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optim, lambda s: 1.0)
    out["one_rank_typo_scheduler"] = error_text(lambda: booster.save_lr_scheduler(
        sched, target, **({"prefix": "x"} if rank == 1 else {})))
    out["one_rank_typo_scheduler_load"] = error_text(lambda: booster.load_lr_scheduler(
        sched, target, **({"prefix": "x"} if rank == 1 else {})))
    for size in (0, True, "0.1B"):
        out[f"size_{size}"] = error_text(lambda: booster.save_model(model, target,
                                                                      max_shard_size=size))
    out["sharded_no"] = error_text(lambda: booster.save_optimizer(opt, target, sharded="no"))
    out["strict_no"] = error_text(lambda: booster.load_model(model, target, strict="no"))
    out["not_a_path"] = error_text(lambda: booster.save_model(model, 3))
    # objects of another kind (before: the model's weights written over an optimizer
    # checkpoint; None on one rank raised there alone, the others waited)
    out["model_as_optimizer"] = error_text(lambda: booster.save_optimizer(model, target))
    out["optimizer_as_model"] = error_text(lambda: booster.save_model(opt, target))
    out["model_as_scheduler"] = error_text(lambda: booster.save_lr_scheduler(model, target))
    out["optimizer_as_scheduler"] = error_text(lambda: booster.save_lr_scheduler(opt, target))
    out["none_on_one_rank"] = error_text(lambda: booster.load_model(
        None if rank == 1 else model, target))
    out["too_many"] = error_text(lambda: booster.checkpoint_io.save_model(model, target, 1000, 5))

    class Schedule:  # (its state fails on the writing rank: before, the other rank waited)
        def state_dict(self):
            if rank == 0:
                raise RuntimeError("injected")
            return {}

        def load_state_dict(self, state):
            pass

    out["state_fails"] = error_text(lambda: booster.save_lr_scheduler(Schedule(), target))
    # options that change which collectives run, different on one rank (before: rank 0 raised
    # alone while rank 1 waited in the save's vote)
    out["sharded_differs"] = error_text(lambda: booster.save_optimizer(
        opt, f"{tmp}/optim_dir", sharded=True if rank == 0 else None))
    # a sharded optimizer checkpoint onto an existing file (before: FileExistsError from
    # torch.distributed.checkpoint on every rank, naming no call)
    if rank == 0:
        with open(f"{tmp}/a_file", "w") as f:
            f.write("not a directory")
    dist.barrier()
    out["sharded_onto_file"] = error_text(lambda: booster.save_optimizer(
        opt, f"{tmp}/a_file", sharded=True))
    # a file checkpoint onto a directory, a directory of shards onto a file (before:
    # IsADirectoryError naming a temporary file, FileExistsError naming no expectation)
    os.makedirs(f"{tmp}/a_dir", exist_ok=True)
    out["file_onto_directory"] = error_text(lambda: booster.save_model(model, f"{tmp}/a_dir"))
    out["shards_onto_file"] = error_text(lambda: booster.save_model(
        model, f"{tmp}/a_file", max_shard_size="1KB"))
    # keywords: by name, and ColossalAI's at the values that ask for what the plugin does
    io = booster.checkpoint_io
    out["by_keyword"] = error_text(lambda: io.save_model(model=model,
                                                        checkpoint=f"{tmp}/kw.pt"))
    out["colossalai_defaults"] = error_text(lambda: booster.save_model(
        model, f"{tmp}/kw.pt", shard=False, use_safetensors=False, prefix=None,
        gather_dtensor=True, size_per_shard=1024))
    dist.barrier()
    out["target_written"] = os.path.exists(target)
    # a grad scaler file an fp16 run left beside a path: the next save without one removes it
    # (before: an fp16 run resuming the fp32 run's file took the old run's loss scale)
    booster, model, opt = boosted(precision="fp16")
    step(booster, model, opt)
    booster.save_optimizer(opt, f"{tmp}/mixed.pt")
    out["scaler_saved"] = os.path.exists(f"{tmp}/mixed.pt.grad_scaler")
    booster, model, opt = boosted()
    step(booster, model, opt)
    booster.save_optimizer(opt, f"{tmp}/mixed.pt")
    out["scaler_left"] = os.path.exists(f"{tmp}/mixed.pt.grad_scaler")
    return out


@pytest.fixture(scope="module")
def w2_calls(tmp_path_factory):
    return run_ranks(_worker_calls, 2, str(tmp_path_factory.mktemp("calls")), timeout=240)


def test_a_plain_file_read_into_sharded_parameters_is_compared_across_ranks(w2_calls):
    for r in w2_calls:
        assert r["file_copies_into_sharded"].startswith(
            "ValueError: load_optimizer: loading the checkpoint"), r["file_copies_into_sharded"]
        assert "the ranks read different contents" in r["file_copies_into_sharded"]
        assert r["fresh_after_refusal"]


@pytest.mark.parametrize("key, fn, path", [("save_paths", "save_model", "model_r"),
                                           ("optim_paths", "save_optimizer", "optim_r")])
def test_ranks_given_different_paths_write_nothing(w2_calls, key, fn, path):
    for r in w2_calls:
        text = r[key]
        assert text.startswith(f"RingMismatchError: {fn}: the ranks made different checkpoint "
                               f"calls (rank 0: {fn}("), text
        assert f"{path}0" in text and f"{path}1" in text, text
        assert r["written"] == [], r["written"]


@pytest.mark.parametrize("key, expected", [
    ("colossalai_shard", "TypeError: save_model: unexpected keyword argument(s) ['shard', "
                         "'size_per_shard']; it takes ['max_shard_size']"),
    ("colossalai_shard_optimizer", "TypeError: save_optimizer: unexpected keyword argument(s) "
                                   "['shard', 'size_per_shard']; it takes ['sharded'] (shard: "
                                   "see sharded)"),
    ("typo", "TypeError: save_model: unexpected keyword argument(s) ['max_shard']"),
    ("size_0", "ValueError: save_model: max_shard_size must be a positive number of bytes"),
    ("size_True", "ValueError: save_model: max_shard_size must be a positive number of bytes"),
    ("size_0.1B", "ValueError: save_model: max_shard_size must be a positive number of bytes"),
    ("sharded_no", "TypeError: save_optimizer: sharded must be a bool or None, got 'no'"),
    ("strict_no", "TypeError: load_model: strict must be a bool, got 'no'"),
    ("not_a_path", "TypeError: save_model: checkpoint must be a path (str or os.PathLike), "
                   "got 3 (int)"),
    ("model_as_optimizer", "TypeError: save_optimizer: optimizer must be a "
                           "torch.optim.Optimizer (the boosted optimizer), got ModelWrapper "
                           "(without param_groups)"),
    ("optimizer_as_model", "TypeError: save_model: model must be a torch.nn.Module (the "
                           "boosted model), got OptimizerWrapper (without "),
    ("model_as_scheduler", "TypeError: save_lr_scheduler: lr_scheduler must be an lr scheduler "
                           "(an object with state_dict and load_state_dict), got ModelWrapper "
                           "(a model's parameters: a scheduler has none)"),
    ("optimizer_as_scheduler", "TypeError: save_lr_scheduler: lr_scheduler must be an lr "
                               "scheduler (an object with state_dict and load_state_dict), got "
                               "OptimizerWrapper (without optimizer)"),
    ("too_many", "TypeError: save_model: too many positional arguments; it takes (model, "
                 "checkpoint, max_shard_size)"),
    ("sharded_onto_file", "ValueError: save_optimizer: "),
    ("file_onto_directory", "ValueError: save_model: "),
    ("shards_onto_file", "ValueError: save_model: "),
])
def test_arguments_a_checkpoint_call_does_not_take_are_refused_on_every_rank(w2_calls, key,
                                                                            expected):
    for r in w2_calls:
        assert r[key].startswith(expected), r[key]
        assert not r["target_written"]
        if key in ("sharded_onto_file", "shards_onto_file"):
            assert "a_file' is a file; this checkpoint is a directory" in r[key] or \
                "rank 0 failed to write the checkpoint" in r[key], r[key]
        if key == "file_onto_directory":
            assert "a_dir' is a directory; this checkpoint is a file" in r[key] or \
                "rank 0 failed to write the checkpoint" in r[key], r[key]
    assert w2_calls[1]["none_on_one_rank"].startswith(
        "TypeError: load_model: model must be a torch.nn.Module (the boosted model), got "
        "NoneType"), w2_calls[1]
    assert w2_calls[0]["none_on_one_rank"].startswith("RingPeerError"), w2_calls[0]
    assert w2_calls[0]["state_fails"].startswith(
        "RuntimeError: save_lr_scheduler: rank 0: saving the checkpoint"), w2_calls[0]
    assert "injected" in w2_calls[0]["state_fails"]
    assert "rank 0 failed to write the checkpoint" in w2_calls[1]["state_fails"], w2_calls[1]
    assert w2_calls[1]["one_rank_typo"].startswith(
        "TypeError: save_model: unexpected keyword argument(s) ['max_shard']")
    assert w2_calls[0]["one_rank_typo"].startswith("RingPeerError"), w2_calls[0]
    for call in ("save_lr_scheduler", "load_lr_scheduler"):
        key = "one_rank_typo_scheduler" + ("_load" if call.startswith("load") else "")
        assert w2_calls[1][key].startswith(
            f"TypeError: {call}: unexpected keyword argument(s) ['prefix']"), w2_calls[1][key]
        assert w2_calls[0][key].startswith("RingPeerError"), w2_calls[0][key]


def test_options_that_differ_between_ranks_are_refused_and_keywords_are_taken(w2_calls):
    for r in w2_calls:
        assert r["sharded_differs"].startswith("RingMismatchError: save_optimizer: the ranks "
                                               "made different checkpoint calls"), r
        assert "sharded=True)" in r["sharded_differs"] and "sharded=None)" in \
            r["sharded_differs"], r["sharded_differs"]
        assert r["by_keyword"] == "no error" and r["colossalai_defaults"] == "no error", r


def test_a_save_without_a_grad_scaler_removes_an_earlier_ones_file(w2_calls):
    for r in w2_calls:
        assert r["scaler_saved"] and not r["scaler_left"], r


#: tensors a state dict can hold that the replicated load's digest once raised on (after the
#: ranks' vote: a rank reading one alone raised, its peers waited the ring timeout)
_ODD_TENSORS = {
    "sparse": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "meta": lambda: torch.empty(3, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8),
}


def _worker_digest(tmp):
    """Replicated loads (dp 2) of files holding tensors the digest once raised on, on every
    rank or on rank 1 alone; the digest failing on rank 1 alone; a module's extra state
    holding a sparse tensor saved and loaded."""
    import time
    import warnings

    import torch.distributed as dist

    import ringseq.plugin.checkpoint as ck
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    warnings.simplefilter("ignore")  # (quantized and sparse CSR tensors: beta, deprecated)
    rank, out = dist.get_rank(), {}
    booster = Booster(RingSequenceParallelPlugin(sp_size=1))  # dp 2: replicated state
    torch.manual_seed(0)
    net = _Net()
    model, opt, *_ = booster.boost(net, torch.optim.Adam(net.parameters(), lr=0.1))
    good = f"{tmp}/good.pt"
    booster.save_model(model, good)
    for kind, make in _ODD_TENSORS.items():  # the good file and one extra entry
        if rank == 0:
            torch.save({**torch.load(good, weights_only=True), "extra": make()},
                       f"{tmp}/extra_{kind}.pt")
    dist.barrier()
    for kind in _ODD_TENSORS:  # every rank reads the file: strict=False passes the extra entry
        out[f"{kind} on every rank"] = error_text(
            lambda: booster.load_model(model, f"{tmp}/extra_{kind}.pt", strict=False))
    booster.backward(model(torch.randn(2, 4)).sum(), opt)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    for kind in _ODD_TENSORS:
        # rank 1's node holds the file with the extra entry at the good file's path
        start = time.monotonic()
        with node_copy(good, f"{tmp}/extra_{kind}.pt", active=rank == 1):
            out[f"{kind} on one rank"] = error_text(
                lambda: booster.load_model(model, good, strict=False))
        out[f"{kind} on one rank seconds"] = time.monotonic() - start
    # the digest failing on rank 1 alone (out of memory, say)
    real = ck.state_digest
    if rank == 1:
        def failing(state):
            raise MemoryError("injected")
        ck.state_digest = failing
    start = time.monotonic()
    try:
        out["digest fails on one rank"] = error_text(lambda: booster.load_model(model, good))
    finally:
        ck.state_digest = real
    out["digest fails on one rank seconds"] = time.monotonic() - start
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # a module's extra state holding a sparse tensor: saved, so it must load (before: saved,
    # then "reshape is not implemented for sparse tensors" on every rank at the load)
    linear, got = type(model.unwrap().lin), []
    linear.get_extra_state = lambda self: {"adjacency": torch.eye(3).to_sparse()}
    linear.set_extra_state = lambda self, state: got.append(state)
    try:
        out["sparse extra state save"] = error_text(
            lambda: booster.save_model(model, f"{tmp}/sparse_extra.pt"))
        out["sparse extra state load"] = error_text(
            lambda: booster.load_model(model, f"{tmp}/sparse_extra.pt"))
    finally:
        del linear.get_extra_state, linear.set_extra_state
    out["sparse extra state loaded"] = [
        (s["adjacency"].layout, s["adjacency"].to_dense().tolist()) for s in got]
    return out


@pytest.fixture(scope="module")
def w2_digest(tmp_path_factory):
    return run_ranks(_worker_digest, 2, str(tmp_path_factory.mktemp("digest")), timeout=240,
                     env={"RINGSEQ_TIMEOUT": "20"})


@pytest.mark.parametrize("kind", sorted(_ODD_TENSORS))
def test_a_file_holding_a_sparse_meta_or_quantized_tensor_loads_on_every_rank(w2_digest, kind):
    for r in w2_digest:
        assert r[f"{kind} on every rank"] == "no error", r[f"{kind} on every rank"]


@pytest.mark.parametrize("kind", sorted(_ODD_TENSORS))
def test_one_ranks_file_holding_such_a_tensor_is_refused_on_every_rank_at_once(w2_digest,
                                                                               kind):
    """(before: a bare RuntimeError on rank 1, and rank 0 waited the ring timeout)"""
    for r in w2_digest:
        error = r[f"{kind} on one rank"]
        assert error.startswith("ValueError: load_model: loading the checkpoint ") and \
            "good.pt': the ranks read different contents" in error, error
        assert r[f"{kind} on one rank seconds"] < 10, r
        assert r["unchanged"], r


def test_a_digest_failing_on_one_rank_raises_on_every_rank_at_once(w2_digest):
    """Comparing what the ranks read is voted on as the read is: the failing rank raises its
    own error naming the call and the checkpoint, the others RingPeerError at once (before:
    rank 1's bare error, rank 0 waited the ring timeout)."""
    failed, peer = w2_digest[1], w2_digest[0]
    assert failed["digest fails on one rank"].startswith(
        "MemoryError: load_model: rank 1: loading the checkpoint "), failed
    assert "good.pt' failed (nothing was loaded on any rank)" in \
        failed["digest fails on one rank"], failed
    assert failed["digest fails on one rank"].endswith("MemoryError: injected"), failed
    assert peer["digest fails on one rank"].startswith("RingPeerError: "), peer
    assert "good.pt' failed (nothing was loaded" in peer["digest fails on one rank"], peer
    for r in w2_digest:
        assert r["digest fails on one rank seconds"] < 10, r
        assert r["unchanged"], r


def test_an_extra_state_holding_a_sparse_tensor_round_trips(w2_digest):
    """README: save_model refuses what the load cannot read back, so what it writes loads."""
    for r in w2_digest:
        assert r["sparse extra state save"] == "no error", r
        assert r["sparse extra state load"] == "no error", r
        assert r["sparse extra state loaded"] == [
            (torch.sparse_coo, torch.eye(3).tolist())], r


class _Config:
    """An object of a class of its own: not what torch.load(weights_only=True) reads."""


_Pair = collections.namedtuple("_Pair", "lo hi")  # (read back once add_safe_globals names it)


def _extra_states(booster, model, tmp, out, kind):
    """save_model of a module's extra state, into ``out[kind + ...]``: what
    torch.load(weights_only=True) cannot read back is refused at the save on every rank,
    nothing written (before: the replicated path wrote it, and load_model failed); what it
    reads back (an OrderedDict, a torch.Size, a dtype, a device, a set, a complex, a
    defaultdict, written as a dict, a namedtuple its class registered) is saved and loads (the
    tensor-by-tensor gather's first versions refused the first two, then the next four, then
    the defaultdict, then the namedtuple, which the write failed on before)."""
    linear = type(model.unwrap().lin)
    linear.get_extra_state = lambda self: {"note": "v1", "config": _Config()}
    path = f"{tmp}/{kind}_extra.pt"
    try:
        out[kind + " extra state"] = error_text(lambda: booster.save_model(model, path))
    finally:
        del linear.get_extra_state
    out[kind + " extra state wrote nothing"] = not os.path.exists(path)
    got, path = [], f"{tmp}/{kind}_extra_ok.pt"
    counts = collections.defaultdict(int, docs=3)  # (written as a plain dict)
    torch.serialization.add_safe_globals([_Pair])
    linear.get_extra_state = lambda self: collections.OrderedDict(
        scale=torch.full((2,), 3.0), shape=torch.Size([4, 4]), dtype=torch.bfloat16,
        device=torch.device("cpu"), tags={"a"}, z=1 + 2j, counts=counts, pair=_Pair(1, 2))
    linear.set_extra_state = lambda self, state: got.append(state)
    try:
        out[kind + " extra state save"] = error_text(lambda: booster.save_model(model, path))
        out[kind + " extra state load"] = error_text(lambda: booster.load_model(model, path))
    finally:
        del linear.get_extra_state, linear.set_extra_state
    out[kind + " extra state loaded"] = [
        (s["scale"].tolist(), s["shape"], s["dtype"], s["device"], s["tags"],
         s["z"], s["counts"], s["pair"]) for s in got]


def _worker_fails_inside(tmp):
    """Zero stage 3: rank 1 runs out of memory (simulated) where a checkpoint call works on
    this rank alone, before or between the collectives: laying out its optimizer state for a
    save, cutting its shards from a loaded model or a plain optimizer file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dsd
    import torch.distributed.tensor as dtensor
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank, out = dist.get_rank(), {}
    booster = Booster(RingSequenceParallelPlugin(sp_size=1))  # a plain optimizer file
    net = _Net()
    model, opt, *_ = booster.boost(net, torch.optim.Adam(net.parameters(), lr=0.1))
    booster.backward(model(torch.randn(2, 4)).sum(), opt)
    opt.step()
    booster.save_optimizer(opt, f"{tmp}/optim.pt")
    _extra_states(booster, model, tmp, out, "replicated")
    booster = Booster(RingSequenceParallelPlugin(sp_size=1, zero_stage=3))
    torch.manual_seed(0)
    net = _Net()
    model, opt, *_ = booster.boost(net, torch.optim.Adam(net.parameters(), lr=0.1))

    def step():
        booster.backward(model(torch.randn(2, 4)).sum(), opt)
        opt.step()
        opt.zero_grad()

    def params():  # (and the optimizer's state)
        return [p.full_tensor().clone() for p in model.unwrap().parameters()] + [
            v.full_tensor().clone() for s in opt.unwrap().state.values() for v in s.values()
            if isinstance(v, dtensor.DTensor)]

    def fails_on_rank_1(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            if rank == 1:
                raise MemoryError(f"simulated: out of memory in {name}")
            return real(*args, **kwargs)
        return call, real

    booster.save_model(model, f"{tmp}/model.pt")
    step()
    # rank 0 runs out of memory copying the second tensor of the state it gathers for a save
    # (before: rank 1 went on to gather the third and waited there until the process group's
    # timeout); nothing is written
    from ringseq.plugin import sharded_checkpoint
    real_copy, copies = sharded_checkpoint._host_copy, []

    def copy_fails_second(key, t):
        copies.append(t)
        if len(copies) == 2:
            raise MemoryError("simulated: out of memory copying the state")
        return real_copy(key, t)
    sharded_checkpoint._host_copy = copy_fails_second
    try:
        out["save_model copy"] = error_text(lambda: booster.save_model(model, f"{tmp}/m2.pt"))
    finally:
        sharded_checkpoint._host_copy = real_copy
    out["save_model copy wrote nothing"] = not os.path.exists(f"{tmp}/m2.pt")
    _extra_states(booster, model, tmp, out, "sharded")
    for key, module, name, call in (
            ("save_model", dsd, "get_model_state_dict",
             lambda: booster.save_model(model, f"{tmp}/m3.pt")),
            ("save_optimizer", dsd, "get_optimizer_state_dict",
             lambda: booster.save_optimizer(opt, f"{tmp}/optim")),
            ("load_model", dtensor, "distribute_tensor",
             lambda: booster.load_model(model, f"{tmp}/model.pt")),
            ("load_optimizer", dtensor, "distribute_tensor",
             lambda: booster.load_optimizer(opt, f"{tmp}/optim.pt"))):
        before = params()
        failing, real = fails_on_rank_1(module, name)
        setattr(module, name, failing)
        try:
            out[key] = error_text(call)
        finally:
            setattr(module, name, real)
        out[key + " unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params()))
        out[key + " then a step"] = error_text(step)  # the ranks are still in step
    # a directory checkpoint rank 1 does not see as one (a lagging file system): before, it
    # read a file while the other waited in torch.distributed.checkpoint's collectives
    booster.save_optimizer(opt, f"{tmp}/optim_dir")
    before = params()
    real = os.path.isdir
    if rank == 1:
        os.path.isdir = lambda p: False if str(p).startswith(f"{tmp}/optim_dir") else real(p)
    try:
        out["not a directory on rank 1"] = error_text(
            lambda: booster.load_optimizer(opt, f"{tmp}/optim_dir"))
    finally:
        os.path.isdir = real
    out["not a directory on rank 1 unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, params()))
    out["not a directory on rank 1 then a step"] = error_text(step)
    return out


def test_a_rank_failing_alone_inside_a_sharded_checkpoint_call_raises_on_every_rank(tmp_path):
    """(before: the other rank waited in torch.distributed.checkpoint's save, or in the scatter
    of torch's full-state loads of a model or a plain optimizer file, until the process
    group's timeout)"""
    results = run_ranks(_worker_fails_inside, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        text = r["save_model copy"]
        if rank == 0:
            assert text.startswith("MemoryError") and "simulated" in text, text
        else:
            assert text.startswith("ValueError: save_model: copying 'lin.bias'"), text
            assert "of the model's state failed on another rank" in text, text
        assert r["save_model copy wrote nothing"], r
        for kind in ("replicated", "sharded"):
            text = r[kind + " extra state"]
            if rank == 0:
                assert text.startswith("TypeError: save_model: rank 0: saving the checkpoint"), text
                assert (" failed: TypeError: the state entry 'lin._extra_state' (dict) cannot "
                        "be read back by torch.load(weights_only=True), which the loads read "
                        "with (it holds a test_checkpoint_failures._Config)") in text, text
            else:
                assert text.startswith("ValueError: save_model: rank 0 failed to write the "
                                       "checkpoint"), text
            assert r[kind + " extra state wrote nothing"], r
            assert r[kind + " extra state save"] == r[kind + " extra state load"] == "no error", r
            assert r[kind + " extra state loaded"] == [
                ([3.0, 3.0], torch.Size([4, 4]), torch.bfloat16,
                 torch.device("cpu"), {"a"}, 1 + 2j, {"docs": 3}, _Pair(1, 2))], r
        for key in ("save_model", "save_optimizer", "load_model", "load_optimizer"):
            if rank == 1:
                assert r[key].startswith("MemoryError") and "simulated" in r[key], r[key]
            else:
                assert r[key].startswith("ValueError") and "another rank" in r[key], r[key]
            assert r[key + " unchanged"] and r[key + " then a step"] == "no error", r
        text = r["not a directory on rank 1"]
        assert text.startswith("RingMismatchError") and "is a directory (rank 0: a directory, " \
            "rank 1: not a directory)" in text, text
        assert r["not a directory on rank 1 unchanged"], r
        assert r["not a directory on rank 1 then a step"] == "no error", r


@pytest.mark.parametrize("sharded, fail", [(False, "scaler write"), (False, "scaler rename"),
                                            (False, "no scaler, optimizer rename"),
                                            (True, "scaler write")],
                         ids=["file", "file_renamed_in_part", "file_without_scaler",
                              "directory"])
def test_a_save_failing_part_way_loads_no_mix_of_two_saves(tmp_path, monkeypatch, sharded,
                                                            fail):
    """The optimizer and grad scaler files are one save: a disk full at the scaler's file
    leaves the plain pair as it was and a directory without metadata (refused at load); a
    rename failing between the two files, or after the stale scaler file of a save without
    one was removed, leaves files whose save ids disagree: refused at load. Before, the new
    optimizer state loaded beside the old loss scale, without an error."""
    import errno

    from ringseq.plugin import checkpoint as ck
    from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
    from ringseq.plugin.wrappers import OptimizerWrapper

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    scaler = torch.amp.GradScaler("cpu")
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), scaler, model=model)
    io, path = DistributedCheckpointIO(), str(tmp_path / ("optim_dir" if sharded else "optim.pt"))

    def step(scale):
        opt.backward(model(torch.ones(4, 3)).sum())
        opt.step()
        scaler.update(new_scale=scale)

    step(8.0)
    io.save_optimizer(opt, path, sharded=sharded)  # a good save: step 1, loss scale 8
    step(1024.0)
    write, rename = ck._temporary_file, os.replace

    def disk_full_at_the_scaler(obj, file):
        if "grad_scaler" in os.path.basename(file):
            raise OSError(errno.ENOSPC, "No space left on device", file)
        return write(obj, file)

    def rename_fails(src, dst):
        if os.path.basename(dst) == ("optim.pt" if "optimizer" in fail else "optim.pt.grad_scaler"):
            raise OSError(errno.EIO, "Input/output error", dst)
        return rename(src, dst)

    if fail == "scaler write":
        monkeypatch.setattr(ck, "_temporary_file", disk_full_at_the_scaler)
    else:
        monkeypatch.setattr(ck.os, "replace", rename_fails)
    if fail.startswith("no scaler"):
        opt.scaler = None  # (this save has none: the old one's file goes)
    with pytest.raises(OSError, match="save_optimizer: rank 0: saving the checkpoint .* failed: "):
        io.save_optimizer(opt, path, sharded=sharded)
    monkeypatch.undo()
    opt.scaler = scaler
    step(1.0)
    if fail == "scaler write" and not sharded:  # the old pair, whole
        io.load_optimizer(opt, path)
        assert int(opt.unwrap().state[model.weight]["step"]) == 1 and scaler.get_scale() == 8.0
    else:
        want = {"scaler rename": "holds the grad scaler's state of another save",
                "no scaler, optimizer rename": "is missing, but the optimizer state",
                "scaler write": r"\.metadata"}[fail]
        with pytest.raises((ValueError, FileNotFoundError), match=f"^load_optimizer: .*{want}"):
            io.load_optimizer(opt, path)
        assert int(opt.unwrap().state[model.weight]["step"]) == 3  # (unchanged)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_checkpoint_of_another_kind_is_refused_by_what_it_is(tmp_path):
    """A directory or file that is not the checkpoint the call loads is refused by what it is
    (before: FileNotFoundError of an index or .metadata file, KeyError 'weight_map', an empty
    EOFError, or "0 parameter group(s)" for a directory of model weights)."""
    import json

    import torch.distributed.checkpoint as dcp

    from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
    from ringseq.plugin.wrappers import OptimizerWrapper

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters()), None, model=model)
    opt.backward(model(torch.ones(4, 3)).sum())
    opt.step()
    io = DistributedCheckpointIO()
    shards, optim = str(tmp_path / "shards"), str(tmp_path / "optim")
    io.save_model(model, shards, max_shard_size=16)
    io.save_optimizer(opt, optim, sharded=True)
    no_map, empty_dir = tmp_path / "no_map", tmp_path / "empty_dir"
    no_map.mkdir(), empty_dir.mkdir()
    (no_map / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}}))
    (tmp_path / "empty.pt").write_bytes(b"")
    dcp.save({"weight": model.weight.detach().clone()}, checkpoint_id=str(tmp_path / "weights"))
    def load_model(path):
        return io.load_model(model, path)

    def load_optimizer(path):
        return io.load_optimizer(opt, path)
    for call, path, words in (
            (load_model, optim, "is a directory without pytorch_model.bin.index.json: not a "
                                "model checkpoint .*: it holds torch.distributed.checkpoint's "
                                r"\.metadata, an optimizer checkpoint \(for load_optimizer\)"),
            (load_model, empty_dir, "is a directory without pytorch_model.bin.index.json: not a "
                                    r"model checkpoint save_model wrote, or one whose save "
                                    r"failed part way \(the index is written last\)$"),
            (load_model, no_map, r"has no weight_map \(parameter name -> shard file\)"),
            (load_model, tmp_path / "empty.pt", r"is empty \(0 bytes\)"),
            (load_optimizer, shards, r"has no \.metadata: not an optimizer checkpoint directory "
                                     ".*: it holds pytorch_model.bin.index.json, a model "
                                     r"checkpoint \(for load_model\)"),
            (load_optimizer, empty_dir, r"has no \.metadata: not an optimizer checkpoint"),
            (load_optimizer, tmp_path / "weights", r"holds no optimizer state \(its metadata "
                                                   r"names \['weight'\]")):
        with pytest.raises(ValueError, match=f"^load_(model|optimizer): rank 0: loading the "
                                             f"checkpoint .* failed .*{words}"):
            call(str(path))
    io.load_model(model, shards)  # (the right kinds load)
    io.load_optimizer(opt, optim)
    # a state dict given as the path: named by its kind, its repr cut short
    with pytest.raises(TypeError, match=r"^save_model: checkpoint must be a path \(str or "
                                        r"os.PathLike\), got OrderedDict\(.{0,60}\(OrderedDict\)$"):
        io.save_model(model, model.state_dict())


def test_a_damaged_model_directory_is_refused_naming_the_file(tmp_path):
    """A shard index cut short and a shard holding a list are refused naming load_model, the
    file, what it holds and what was expected, nothing changed (before: the JSON decoder's
    words naming no file; dict.update's "cannot convert dictionary update sequence")."""
    import json
    import re

    from ringseq.plugin.sharded_checkpoint import INDEX_NAME, DistributedCheckpointIO
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    io, directory = DistributedCheckpointIO(), str(tmp_path / "model")
    io.save_model(model, directory, max_shard_size=16)  # (one file per tensor)
    index = os.path.join(directory, INDEX_NAME)
    with open(index) as f:
        text = f.read()
    shard = os.path.join(directory, json.loads(text)["weight_map"]["1.bias"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with open(index, "w") as f:
        f.write(text[:len(text) // 2])
    with pytest.raises(ValueError, match=f"^load_model: rank 0: loading the checkpoint "
                                         f"{re.escape(repr(directory))} failed .*: ValueError: "
                                         f"{re.escape(repr(index))} is not the JSON index "
                                         f"save_model writes \\(Unterminated string"):
        io.load_model(model, directory)
    with open(index, "w") as f:
        f.write(text)
    torch.save([1, 2, 3], shard)
    with pytest.raises(ValueError, match=f"^load_model: rank 0: loading the checkpoint "
                                         f"{re.escape(repr(directory))} failed .*: ValueError: "
                                         f"{re.escape(repr(shard))}, a shard {INDEX_NAME} names, "
                                         f"holds a list, not the dict of tensors"):
        io.load_model(model, directory)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_shard_size_is_taken_as_a_number_or_a_size_string():
    """(before: 1e30 was refused, its text '1e+30' missing the size pattern, while 2**70 was
    taken)"""
    from ringseq.plugin.checkpoint_call import shard_bytes
    assert shard_bytes(1e30) == int(1e30) and shard_bytes(2 ** 70) == 2 ** 70
    assert shard_bytes("500MB") == 500 * 10 ** 6 and shard_bytes("2GiB") == 2 * 2 ** 30
    assert shard_bytes(1.5) == 1
    np = pytest.importorskip("numpy")
    assert shard_bytes(np.float32(2e9)) == int(np.float32(2e9)) and shard_bytes(np.int64(7)) == 7
    for size in (0, -5, 0.5, True, float("inf"), float("nan"), "0.1B", "lots"):
        with pytest.raises(ValueError, match=r"^save_model: max_shard_size must be a positive "):
            shard_bytes(size)


def test_a_file_path_ending_in_a_separator_is_refused_naming_it(tmp_path):
    """(before: NotADirectoryError naming a temporary file '..XXXX.tmp' the user never
    passed, nothing about the slash)"""
    from ringseq.plugin.sharded_checkpoint import DistributedCheckpointIO
    path = os.path.join(str(tmp_path), "ckpt", "model.pt") + os.sep
    with pytest.raises(ValueError, match=rf"^save_model: '{path}' ends in '{os.sep}', a "
                                         r"directory's path; this checkpoint is a file"):
        DistributedCheckpointIO().save_model(torch.nn.Linear(2, 2), path)
    assert not os.path.exists(os.path.join(str(tmp_path), "ckpt"))  # nothing written
