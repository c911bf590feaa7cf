"""RingSequenceParallelPlugin in its sequence-parallel modes, on 4 spawned gloo ranks (CPU):
five AdamW steps of the tiny transformers Llama of tests/test_plugin.py (4 heads, 2 K/V heads)
against single-process training on the whole global batch, checked step by step on the run's
own trajectory with that file's tolerance rule (``assert_steps_match_single_process``), then
a step failing on one rank, the recovery its peers' errors give, and a step after it.

Modes (one spawn): ``ulysses`` on 4 ranks (4 > 2 K/V heads: K/V replicated twice) and on 2 x
dp 2, ``hybrid`` 2 x 2 (zigzag on the ring, Ulysses inner) and ring inner through a user's
("dp", "sp_u", "sp_r") mesh, ``ring`` with ``inner_ring_size=2`` (double ring); one step of
``apply(model, sp_mode="hybrid", ...)`` without the plugin; a plain SDPA module on the
``ringseq_switch`` convention; and the misconfigurations, each raised on every rank before any
communication.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from test_plugin import (GLOBAL_BATCH, SEQLEN, STEPS, VOCAB, _dataset,  # noqa: E402
                         _grads_to_report, _model, _optimizer, _sdpa_single, _sdpa_step,
                         _single_process, assert_steps_match_single_process)
from utils import assert_close_per_design, error_text, max_err, scaled_floor  # noqa: E402

WORLD = 4
MODES = {
    "ulysses4": dict(sp_size=4, sp_mode="ulysses"),
    "ulysses2_dp2": dict(sp_size=2, sp_mode="ulysses"),
    "hybrid2x2": dict(sp_size=4, sp_mode="hybrid", ulysses_size=2, layout="zigzag"),
    "hybrid2x2_ring_inner_mesh": dict(sp_size=4, sp_mode="hybrid", layout="stripe",
                                      mesh_dims=("dp", "sp_u", "sp_r")),
    "double_ring2x2": dict(sp_size=4, sp_mode="ring", inner_ring_size=2, layout="zigzag"),
}


# ---------------------------------------------------------------- rank side
def _plugin(cfg):
    from ringseq.plugin import RingSequenceParallelPlugin
    cfg = dict(cfg)
    dims = cfg.pop("mesh_dims", None)
    if dims is not None:
        from torch.distributed.device_mesh import init_device_mesh
        cfg["mesh"] = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=dims)
    return RingSequenceParallelPlugin(**cfg)


def _train(cfg, state_dict):
    from ringseq.plugin import Booster
    plugin = _plugin(cfg)
    booster = Booster(plugin=plugin)
    model = _model(state_dict)
    loader = plugin.prepare_dataloader(_dataset(), batch_size=GLOBAL_BATCH // plugin.dp_size)
    model, opt, criterion, loader, _ = booster.boost(model, _optimizer(model), dataloader=loader)
    losses, step_grads, local_lens = [], [], set()
    for batch in loader:
        local_lens.add(batch["input_ids"].shape[1])
        loss = criterion(model(**batch), batch)
        booster.backward(loss, opt)
        step_grads.append(_grads_to_report(model, len(losses)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if len(losses) == STEPS:
            break
    sp = plugin.sp
    out = {"losses": losses, "grads": step_grads[0], "step_grads": step_grads,
           "local_lens": sorted(local_lens),
           "weights": {k: v.detach().clone() for k, v in model.unwrap().state_dict().items()},
           "mode": sp.mode, "sizes": (plugin.dp_size, sp.ulysses_size, sp.ring_size,
                                      sp.inner_ring_size), "ulysses_inner": sp.ulysses_inner,
           "repr": repr(plugin)}
    out["failure"] = _fail_then_reset(booster, model, opt, criterion, batch)
    return out


def _fail_then_reset(booster, model, opt, criterion, batch):
    """After the compared steps: a step whose layer 1 raises on rank 1 before its attention,
    then the recovery the errors give, then a step. Returns this rank's error text and the
    next step's loss."""
    import torch.distributed as dist
    rank = dist.get_rank()

    def fail_on_rank_1(*_):
        if rank == 1:
            raise MemoryError("injected: out of memory")
    hook = model.unwrap().model.layers[1].self_attn.q_proj.register_forward_hook(fail_on_rank_1)
    try:
        booster.backward(criterion(model(**batch), batch), opt)
        opt.step()
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads its text
        error = f"{type(exc).__name__}: {exc}"
    hook.remove()
    opt.zero_grad()
    booster.reset()
    loss = criterion(model(**batch), batch)
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    return error, float(loss.detach())


def _apply_case(state_dict):
    """apply() alone (no plugin): hybrid 2 x 2 over the default group, one forward/backward on
    the first global batch."""
    import torch.distributed as dist

    import ringseq
    from ringseq.integrations.transformers import apply
    model = apply(_model(state_dict), layout="zigzag", sp_mode="hybrid", ulysses_size=2)
    sp = model.model.layers[0].self_attn.ringseq_settings.sp
    data = _dataset()[:GLOBAL_BATCH]
    batch = sp.shard_batch({"input_ids": torch.stack([d["input_ids"] for d in data]),
                            "labels": torch.stack([d["labels"] for d in data])}, "zigzag")
    targets = batch.pop("shift_labels")
    loss = ringseq.sharded_cross_entropy(model(**batch, use_cache=False).logits, targets,
                                         group=sp.group)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=sp.group)
        grads[n] = g
    return {"loss": float(loss.detach()), "grads": grads, "mode": sp.mode,
            "impl": model.config._attn_implementation}


def _sdpa_case(ids, labels):
    """The plain SDPA module of test_plugin under hybrid 2 x 2: one SGD step."""
    return _sdpa_step(_plugin(MODES["hybrid2x2"]), ids, labels)


def _errors(state_dict):
    from ringseq import RingAttention
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    P = RingSequenceParallelPlugin
    out = {
        "mode": error_text(lambda: P(sp_size=4, sp_mode="tree")),
        "ulysses_size": error_text(lambda: P(sp_size=4, sp_mode="hybrid", ulysses_size=3)),
        "inner_ring_size": error_text(lambda: P(sp_size=4, sp_mode="ring", inner_ring_size=3)),
        "sp_size": error_text(lambda: P(sp_size=3, sp_mode="ulysses")),
    }
    from torch.distributed.device_mesh import init_device_mesh
    wrong = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "seq", "heads"))
    out["mesh_names"] = error_text(lambda: P(sp_size=4, sp_mode="hybrid", ulysses_size=2,
                                           mesh=wrong))
    # meshes that differ between ranks (before: rings of other ranks, a timeout on some
    # ranks; or the ranks passing None waited inside init_device_mesh)
    from torch.distributed.device_mesh import DeviceMesh
    rows = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "sp"))
    cols = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "sp"))
    rank = torch.distributed.get_rank()
    out["mesh_differs"] = error_text(lambda: P(sp_size=2, mesh=rows if rank < 2 else cols))
    out["mesh_on_one_rank"] = error_text(lambda: P(sp_size=2, mesh=rows if rank == 0 else None))
    # a dp dim that does not count up (before: a replica's ranks loaded different samples)
    out["dp_down"] = error_text(lambda: P(sp_size=2, mesh=DeviceMesh(
        "cpu", [[2, 3], [0, 1]], mesh_dim_names=("dp", "sp"))))
    out["dp_down_ulysses"] = error_text(lambda: P(sp_size=2, sp_mode="ulysses", mesh=DeviceMesh(
        "cpu", [[[0, 3]], [[1, 2]]], mesh_dim_names=("dp", "sp_r", "sp_u"))))
    # sp permuted: fine at zero 0; under FSDP the shards were saved at each other's offsets
    sp_down = DeviceMesh("cpu", [[1, 0], [3, 2]], mesh_dim_names=("dp", "sp"))
    out["sp_down_zero0"] = error_text(lambda: P(sp_size=2, mesh=sp_down))
    out["sp_down_zero3"] = error_text(lambda: P(sp_size=2, zero_stage=3, mesh=sp_down))
    # ... but not in a double ring or the hybrid (before: named sp_groups_from_tables' table)
    out["sp_down_double"] = error_text(lambda: P(sp_size=4, inner_ring_size=2, mesh=DeviceMesh(
        "cpu", [[1, 0, 3, 2]], mesh_dim_names=("dp", "sp"))))
    out["sp_down_hybrid"] = error_text(lambda: P(sp_size=4, sp_mode="hybrid", ulysses_size=2,
                                               mesh=DeviceMesh("cpu", [[[1, 0], [3, 2]]],
                                                               mesh_dim_names=("dp", "sp_r",
                                                                               "sp_u"))))
    # (before: told to "use zero_stage=0", which it was)
    out["tp_down_zero0"] = error_text(lambda: P(sp_size=2, tp_size=2, mesh=DeviceMesh(
        "cpu", [[[2, 3], [0, 1]]], mesh_dim_names=("dp", "sp", "tp"))))
    out["ulysses_inner"] = error_text(lambda: P(sp_size=4, sp_mode="hybrid", ulysses_size=2,
                                              ulysses_inner="no"))
    from ringseq.parallel.groups import sp_groups_from_tables
    out["tables"] = error_text(lambda: sp_groups_from_tables([torch.tensor([[-1, 1], [2, 3]])]))
    # 4 query heads cannot be split over Ulysses 4 if the model has 2 (and 1 K/V head)
    two_heads = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, attention_dropout=0.0))
    booster = Booster(plugin=P(sp_size=4, sp_mode="ulysses"))
    out["heads"] = error_text(lambda: booster.boost(two_heads))
    out["heads_untouched"] = two_heads.config._attn_implementation != "ringseq"
    from ringseq.integrations.transformers import apply
    out["apply_heads"] = error_text(lambda: apply(two_heads, sp_mode="ulysses"))
    out["apply_ulysses_inner"] = error_text(
        lambda: apply(two_heads, sp_mode="hybrid", ulysses_size=2, ulysses_inner="no"))

    class WithRingAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = RingAttention(causal=True)

    out["ring_attention"] = error_text(lambda: booster.boost(WithRingAttention()))
    return out


def _worker(state_dict, sdpa_ids, sdpa_labels):
    import torch.distributed as dist
    res = {name: _train(cfg, state_dict) for name, cfg in MODES.items()}
    res["apply"] = _apply_case(state_dict)
    res["sdpa"] = _sdpa_case(sdpa_ids, sdpa_labels)
    res["errors"] = _errors(state_dict)
    dist.barrier()  # every rank still alive and in step after the errors
    return res


# ---------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def run():
    state_dict = _model().state_dict()
    g = torch.Generator().manual_seed(9)
    sdpa_ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=g)
    sdpa_labels = sdpa_ids.clone()
    sdpa_labels[0, :20] = -100
    ranks = run_ranks(_worker, WORLD, state_dict, sdpa_ids, sdpa_labels, timeout=300)
    return {"ranks": ranks, "state_dict": state_dict,
            "ref": _single_process(state_dict, torch.float64),
            "plain": _single_process(state_dict, torch.float32),
            "sdpa_single": _sdpa_single(sdpa_ids, sdpa_labels)}


EXPECTED = {"ulysses4": ("ulysses", (1, 4, 1, 1), True),
            "ulysses2_dp2": ("ulysses", (2, 2, 1, 1), True),
            "hybrid2x2": ("hybrid", (1, 2, 2, 2), True),
            "hybrid2x2_ring_inner_mesh": ("hybrid", (1, 2, 2, 2), False),
            "double_ring2x2": ("ring", (1, 1, 4, 2), True)}


@pytest.mark.parametrize("case", list(MODES))
def test_training_parity_in_every_mode(run, case):
    ref, plain = run["ref"], run["plain"]
    first = run["ranks"][0][case]
    mode, sizes, ulysses_inner = EXPECTED[case]
    assert (first["mode"], first["sizes"], first["ulysses_inner"]) == (mode, sizes,
                                                                       ulysses_inner), first
    dp = sizes[0]
    assert first["local_lens"] == [SEQLEN * dp // WORLD]
    assert_steps_match_single_process(first, run["state_dict"], case)
    for r, res in enumerate(run["ranks"]):
        got = res[case]
        assert got["losses"] == first["losses"], f"rank {r}: losses differ from rank 0's"
        for name, g in got["grads"].items():  # the first gradient: summed, not averaged
            assert_close_per_design(g, ref["grads"][name], plain["grads"][name],
                                    f"rank {r} {case} grad {name}", 3.0,
                                    scaled_floor(torch.float32, ref["grads"][name]))
        for name, w in got["weights"].items():
            assert torch.equal(w, first["weights"][name]), f"rank {r}: {name} diverged"
        # a step failing on rank 1: every other rank's error gives the plugin's recovery
        # (before, a ring's error gave ringseq.reset_ring / sp.reset() alone, after which the
        # next step failed inside DDP or FSDP); after it the next step runs alike everywhere
        error, loss_after = got["failure"]
        if r == 1:
            assert error.startswith("MemoryError: injected"), error
        else:
            assert error.startswith(("RingBrokenError", "RingPeerError")), error
            assert "optimizer.zero_grad() and booster.reset() on every rank" in error, error
        assert loss_after == first["failure"][1] and loss_after == loss_after, (r, loss_after)


def test_apply_with_sp_mode(run):
    ref, plain = run["ref"], run["plain"]
    for r, res in enumerate(run["ranks"]):
        got = res["apply"]
        assert got["mode"] == "hybrid" and got["impl"] == "ringseq"
        loss = torch.tensor([got["loss"]], dtype=torch.float32)
        assert_close_per_design(loss, ref["losses"][:1], plain["losses"][:1], "apply loss", 2.0,
                                scaled_floor(torch.float32, ref["losses"][:1]))
        for name, g in got["grads"].items():
            assert_close_per_design(g, ref["grads"][name], plain["grads"][name],
                                    f"rank {r} apply grad {name}", 3.0,
                                    scaled_floor(torch.float32, ref["grads"][name]))


def test_plain_module_with_sdpa_switch_in_hybrid_mode(run):
    single = run["sdpa_single"]
    for r in run["ranks"]:
        assert abs(r["sdpa"]["loss"] - single["loss"]) <= 1e-5 * max(1.0, abs(single["loss"]))
        for name, w in r["sdpa"]["weights"].items():
            assert max_err(w, single["weights"][name]) <= 1e-5, name


def _raised(run, key):
    return [r["errors"][key] for r in run["ranks"]]


def test_unknown_sp_mode_raises(run):
    for e in _raised(run, "mode"):
        assert e.startswith("ValueError") and "'tree'" in e and "'hybrid'" in e, e


@pytest.mark.parametrize("key, given", [("ulysses_size", "ulysses_size=3"),
                                        ("inner_ring_size", "inner_ring_size=3"),
                                        ("sp_size", "sp_size=3")])
def test_size_not_dividing_its_group_raises_naming_the_sizes_that_would(run, key, given):
    for e in _raised(run, key):
        assert e.startswith("ValueError") and given in e and "[1, 2, 4]" in e, e


def test_mesh_with_other_dim_names_raises(run):
    for e in _raised(run, "mesh_names"):
        assert e.startswith("ValueError") and "('dp', 'sp_r', 'sp_u')" in e, e


def test_meshes_that_differ_between_ranks_raise_on_every_rank(run):
    for e in _raised(run, "mesh_differs"):
        assert e.startswith("RingMismatchError") and "mesh shape and ranks" in e and \
            "[..., 2, 0, 1, 2, 3]" in e and "[..., 2, 0, 2, 1, 3]" in e, e
    for e in _raised(run, "mesh_on_one_rank"):
        assert e.startswith("RingMismatchError") and "mesh shape and ranks" in e and \
            "rank 1: [] (0 values)" in e, e
        assert "mesh dim names (rank 0: 'dp,sp', rank 1: 'none passed'" in e, e


def test_a_mesh_whose_dp_dim_does_not_count_up_raises_on_every_rank(run):
    """torch numbers a dp group's ranks in sorted order, not by mesh coordinate: before, the
    sp or tp peers of one replica took different data-parallel indices, loaded different
    samples, and FSDP's shards gathered out of order -- silently."""
    for key, dp_slice, table in (("dp_down", "[2, 0]", "[[2, 3], [0, 1]]"),
                                 ("dp_down_ulysses", "[3, 2]", "[[[0, 3]], [[1, 2]]]")):
        for e in _raised(run, key):
            assert e == (f"ValueError: RingSequenceParallelPlugin: the mesh must list the ranks "
                         f"along its 'dp' dim in increasing order (torch numbers the "
                         f"data-parallel groups by sorted rank), got the dp slice {dp_slice} "
                         f"in {table}; permute the other dims instead"), e


def test_fsdp_refuses_a_mesh_whose_dp_x_sp_ranks_do_not_count_up(run):
    for e in _raised(run, "sp_down_zero0"):
        assert e == "no error", e
    for e in _raised(run, "sp_down_double"):
        assert e == ("ValueError: RingSequenceParallelPlugin: the mesh's sequence-parallel dims "
                     "('sp',) must hold increasing global ranks in sp_mode='ring' with "
                     "inner_ring_size=2 (process groups order their ranks by global rank, which "
                     "the ring ranks must follow), got [1, 0, 3, 2] at dp index 0; only a plain "
                     "ring (sp_mode='ring' without inner_ring_size) takes a permuted sp dim (at "
                     "zero stage 0 without tensor parallelism)"), e
    for e in _raised(run, "sp_down_hybrid"):
        assert e.startswith("ValueError: RingSequenceParallelPlugin: the mesh's "
                            "sequence-parallel dims ('sp_r', 'sp_u') must hold increasing global "
                            "ranks in sp_mode='hybrid' (process groups order their ranks by "
                            "global rank, which the Ulysses and ring ranks must follow), got "
                            "[[1, 0], [3, 2]] as (ring, Ulysses) rows at dp index 0;"), e
    for e in _raised(run, "sp_down_zero3"):
        assert e == ("ValueError: RingSequenceParallelPlugin: zero_stage 2 and 3 need a mesh "
                     "whose dp x sp ranks (flattened in that order) count up for each tp "
                     "index, and whose tp ranks count up (FSDP numbers them by sorted rank, "
                     "DTensor by mesh coordinate), got [1, 0, 3, 2] in [[1, 0], [3, 2]]; "
                     "order the ranks so, or use zero_stage=0"), e
    for e in _raised(run, "tp_down_zero0"):
        assert e == ("ValueError: RingSequenceParallelPlugin: tensor parallelism (tp_size=2) "
                     "needs a mesh whose dp x sp ranks (flattened in that order) count up for "
                     "each tp index, and whose tp ranks count up (FSDP numbers them by sorted "
                     "rank, DTensor by mesh coordinate), got [2, 0] in [[[2, 3], [0, 1]]]; "
                     "order the ranks so, or use tp_size=1"), e


def test_ulysses_inner_must_be_a_bool(run):
    for e in _raised(run, "ulysses_inner"):  # (before: "no" was truthy, silently)
        assert e == ("TypeError: RingSequenceParallelPlugin: ulysses_inner must be a bool or "
                     "None, got 'no'"), e


def test_tables_with_a_rank_outside_the_group_name_the_missing_rank(run):
    for e in _raised(run, "tables"):  # (before: -1 counted as rank 0, "missing []")
        assert e.startswith("ValueError: sp_groups_from_tables") and "missing [0]" in e and \
            "outside the group [-1]" in e, e


def test_heads_the_ulysses_degree_cannot_split_raise_before_switching(run):
    for r in run["ranks"]:
        e = r["errors"]["heads"]
        # named for the call made (before: "ParallelDims: ...", a class the user never calls)
        # (sp_mode='ulysses': the degree is sp_size, so the advice is the hybrid's degrees;
        # before: "ulysses_size values ... [1, 2]", which that mode does not take)
        assert e.startswith("ValueError: boost: sp_mode='ulysses' splits num_attention_heads=2 "
                            "over all sp_size=4 ranks") and "sp_mode='hybrid'" in e, e
        assert "ulysses_size that divides them and sp_size=4 ([2])" in e, e
        assert r["errors"]["heads_untouched"]
        # apply's own refusals are named for it (before: no function named)
        e = r["errors"]["apply_heads"]
        assert e.startswith("ValueError: apply: num_attention_heads=2 cannot be split over "
                            "ulysses_size=4"), e
        e = r["errors"]["apply_ulysses_inner"]
        assert e == "TypeError: apply: ulysses_inner must be a bool or None, got 'no'", e


def test_ring_attention_module_in_other_modes_raises(run):
    for e in _raised(run, "ring_attention"):
        assert e.startswith("ValueError") and "RingAttention" in e and "ulysses" in e, e
