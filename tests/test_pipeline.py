"""Pipeline parallelism end to end (issue 42, item 4): ``Config(pipeline_parallel=P, microbatches=M, schedule=...)``
on the user's unchanged step, each rank running its stages by the schedule with gloo point-to-point sends, against
eager PyTorch on the whole batch: the loss every rank returns, and the parameters each rank's stages own, after 3
AdamW steps. Also on one process (two stages on one rank, no sends), and the refusals of bad input."""

from __future__ import annotations

import copy

import pipeline_cases
import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import Net, batches, step, step_of, train

import zgraph

CASES = ["gpipe", "one_f_one_b", "zb_h1", "interleaved", "split", "sum_loss", "token_mean", "kept_grads"]
CASES += ["memory_budget", "stage_three", "momentum"]
COMPOSED = ["clipped", "loss_scaled", "low_precision_states"]  # issue 42, item 2
PARAMS = [name for name, _ in Net().named_parameters()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dist_harness import run_ranks

    path = tmp_path_factory.mktemp("pipeline") / "results.pt"
    run_ranks(
        2,
        "pipeline_cases.run",
        str(path),
        [*CASES, *COMPOSED, "stage_state", "varying_lengths", "different_rows"],
        timeout=300,
    )
    return torch.load(path, weights_only=False)


def assert_equals_eager(ranks: list[dict]) -> None:
    owned = [name for result in ranks for name in result["owned"]]
    assert sorted(owned) == sorted(PARAMS), "each parameter is updated by exactly one rank"
    for result in ranks:
        torch.testing.assert_close(torch.stack(result["got"]), torch.stack(result["want"]), rtol=1e-6, atol=1e-6)
        assert result["distance"] < 1e-6, result["distance"]


@pytest.mark.parametrize("case", CASES)
def test_two_stages_on_two_ranks_equal_eager_on_the_whole_batch(two_ranks, case):
    result = two_ranks[case]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    assert_equals_eager(result)


def test_a_sequence_length_that_changes_captures_once_more_with_symbolic_sizes(two_ranks):
    """The demo GPT in two stages on two ranks, its sequence 8, 12, 5 and 12 tokens long: the second length
    captures the step with a symbolic length (sizes its reshapes read on one stage and use on the other are
    computed from the arguments' sizes in each; receive buffers shaped at the call's sizes), which serves every
    later length; each loss is eager's on the whole batch, each stage's parameters eager's after the 4 steps."""
    ranks = two_ranks["varying_lengths"]
    assert sorted(n for r in ranks for n in r["owned"]) == sorted(set(n for r in ranks for n in r["owned"]))
    for r in ranks:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-5, atol=1e-6)
        assert r["distance"] < 1e-4, r["distance"]
        assert r["variants"] == 2, r["variants"]


def test_ranks_of_a_pipeline_passing_different_rows_are_refused_before_anything_changes(two_ranks):
    """Stage 0 would run one rank's inputs and the last stage score them against another's labels: each rank
    raises ``RankMismatchError`` naming the arguments, its parameters as they were and no step taken."""
    for r in two_ranks["different_rows"]:
        assert "passed different values of x, y" in r["error"] and "zgraph.pipeline_batch" in r["error"], r
        assert r["kept"]


@pytest.mark.inductor
def test_inductor_compiles_the_stage_graphs_the_schedule_runs(tmp_path):
    """``backend="inductor"``: each rank compiles its stage's forward, input-gradient, weight-gradient and update
    graphs (ZB-H1 runs no whole backward: that one is not compiled); losses and parameters equal eager's within
    inductor's fp32 rounding."""
    from dist_harness import run_ranks

    run_ranks(2, "pipeline_cases.run", str(tmp_path / "results.pt"), ["inductor"], timeout=300)
    result = torch.load(tmp_path / "results.pt", weights_only=False)["inductor"]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    for r in result:
        torch.testing.assert_close(torch.stack(r["got"]), torch.stack(r["want"]), rtol=1e-5, atol=1e-6)
        assert r["distance"] < 1e-5, r["distance"]
        assert r["backends"] == {"forward": "inductor", "backward": "eager", "input_grad": "inductor",
                                 "weight_grad": "inductor", "update": "inductor"}  # fmt: skip


@pytest.mark.parametrize("case", COMPOSED)
def test_max_grad_norm_loss_scaling_and_bf16_states_with_remat_equal_eager_on_the_whole_batch(two_ranks, case):
    """Issue 42, item 2: ``clipped``: every step clips (eager's global norm above ``max_grad_norm``), by the norm
    over both stages' gradients; ``loss_scaled``: the first step overflows in stage 0's gradients only, and both
    stages skip it, the scale backing off on both ranks as eager's; ``low_precision_states``: bf16 optimizer states
    and full remat, against the same Config without pipelines."""
    result = two_ranks[case]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    assert_equals_eager(result)
    for r in result:
        if case == "clipped":
            assert min(r["norms"]) > pipeline_cases.CLIP, r["norms"]
        if case == "loss_scaled":
            assert r["skipped"] == [True, False, False] and r["scales"] == r["eager_scales"] == [2.0**27] * 3, r
        if case == "low_precision_states":
            assert r["state_dtypes"] == ["torch.bfloat16"], r["state_dtypes"]


def test_max_grad_norm_over_two_stages_on_one_rank_equals_eager():
    """Issue 42, item 2: two stages on one process (P=1, interleaved): the rank combines its stages' partials of
    the norm itself, without a collective; every step clips."""
    norms: list[float] = []
    config = {"pipeline_virtual_stages": 2, "schedule": "interleaved_1f1b", "microbatches": 2}
    eager = pipeline_cases.clipping_step(norms)
    result = pipeline_cases.against(
        eager, pipeline_cases.SGD, batches(), pipeline_parallel=1, max_grad_norm=0.05, **config
    )
    assert_equals_eager([result])
    assert min(norms) > 0.05, norms


def test_each_rank_holds_only_its_stages_state_and_the_whole_model_still_comes_out(two_ranks):
    """Model state per rank (parameters, gradients, optimizer state; counted from the live state and by a tracker
    of every allocation since the model was copied) is its stages' share, within the cut's imbalance; the params
    after 3 steps equal eager's; full_state_dict, gather, save and save_pretrained (loaded into a fresh model) give
    the whole model; ``zgraph.load_pretrained`` and ``zgraph.load`` into the pipelined model (each rank reading its
    own stages' tensors) restore the saved state, its stages' share still, and the next step equals eager's."""
    result = two_ranks["stage_state"]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    whole = result[0]["whole"]["total"]
    assert sum(r["state"]["total"] for r in result) == whole, "each parameter's state is held by one rank"
    owned = [name for r in result for name in r["owned"]]
    assert sorted(owned) == sorted(PARAMS)
    for r in result:
        assert r["state"]["total"] <= whole / 2 * 1.05, r["state"]
        assert r["state"]["total"] <= r["tracked"] <= r["state"]["total"] + 64, r  # + the step's own scalars
        assert r["after_gather"] == r["state"], "gather receives other stages' parameters for the block only"
        assert r["distance"] < 1e-6
        reloads = ("pretrained", "reloaded", "reloaded_opt")
        for key in ("full", "full_opt", "gathered", "loaded", "loaded_opt", "exported", *reloads):
            assert r[key] < 1e-6, (key, r[key])
        assert r["continued"] < 1e-6 and r["after_load"] == r["state"]


def test_the_estimate_gives_each_rank_the_state_a_pipelined_run_holds(two_ranks):
    """``step.estimate`` (issue 42, item 4), in this process, against the state bytes each rank held after
    ``stage_state``'s 3 pipelined steps (1F1B, 4 micro-batches)."""
    result = two_ranks["stage_state"]
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = zgraph.Config(backend="eager", pipeline_parallel=2, schedule="1f1b", microbatches=4)
    e = zgraph.distribute(config)(step).estimate(model, opt, *batches()[0], world_size=2)
    for rank, held in enumerate(result):
        stages = [s for s in e.stages if s.rank == rank]
        for kind in ("params", "grads", "optimizer", "total"):
            assert sum(s.model_state_bytes[kind] for s in stages) == held["state"][kind], (rank, kind)


def test_a_memory_budget_recomputes_only_the_blocks_of_the_rank_that_needs_it(two_ranks):
    """``Config.memory_budget`` with pipelines (issue 42, item 4): planned per rank on every rank alike; the
    parameters equal eager's (``test_two_stages_on_two_ranks_equal_eager_on_the_whole_batch``)."""
    first, second = two_ranks["memory_budget"]
    want = {f"model.blocks.{i}": "full" if i < 2 else None for i in range(4)}
    assert first["plan"] == second["plan"] == {"remat": want}


def test_interleaving_puts_every_other_block_on_each_rank(two_ranks):
    first, second = two_ranks["interleaved"]
    assert {n.split(".")[1] for n in first["owned"] if n.startswith("blocks.")} == {"0", "2"}
    assert {n.split(".")[1] for n in second["owned"] if n.startswith("blocks.")} == {"1", "3"}


@pytest.mark.parametrize("virtual,microbatches", [(2, 2), (4, 4)])
def test_stages_on_one_rank_equal_eager(virtual, microbatches):
    config = {"schedule": "interleaved_1f1b", "pipeline_virtual_stages": virtual, "microbatches": microbatches}
    assert_equals_eager([train(pipeline_parallel=1, **config)])


def pipelined(**config: object) -> zgraph.DistributedStep:
    return zgraph.distribute(zgraph.Config(backend="eager", **config))(step)


@pytest.mark.parametrize(
    "config,error,message",
    [
        ({"pipeline_parallel": 2}, ValueError, r"pipeline_parallel=2 must divide the world size \(1\)"),
        ({"pipeline_parallel": 1, "microbatches": 3}, ValueError, "microbatches=3 does not divide the batch of argu"),
        (
            {"pipeline_parallel": 1, "pipeline_virtual_stages": 8, "schedule": "interleaved_1f1b"},
            zgraph.PassError,
            "a pipeline of 8 stages needs at least 8 repeated blocks",
        ),
        (
            {"pipeline_parallel": 1, "pipeline_virtual_stages": 2, "schedule": "interleaved_1f1b",
             "pipeline_split": ("layers.2",)},
            zgraph.PassError,
            "pipeline_split name 'layers.2' is not one of the step's blocks",
        ),
    ],
    ids=["world", "batch", "blocks", "split_name"],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_changes(config, error, message):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    x, y = batches()[0]
    with pytest.raises(error, match=message):
        pipelined(**config)(model, opt, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state, "no optimizer state was made"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"microbatches": 2}, "Config.microbatches is a pipeline parallelism option: set Config.pipeline_parallel"),
        ({"pipeline_parallel": 2, "stage": 3, "secondary_shard_group_size": 2}, "with secondary_shard_group_size=2"),
        ({"pipeline_parallel": 2, "schedule": "pipedream"}, "unknown pipeline schedule 'pipedream'"),
        ({"pipeline_parallel": 2, "pipeline_virtual_stages": 2}, "'1f1b' runs one stage per rank"),
        ({"pipeline_parallel": 2, "pipeline_split": ("a", "b")}, "after the first, 1 for 2 x 1 stages; got 2"),
        ({"pipeline_parallel": 0}, "Config.pipeline_parallel must be a positive int; got 0"),
        ({"pipeline_regather": True}, "Config.pipeline_regather is a pipeline parallelism option"),
        (
            {"pipeline_parallel": 2, "stage": 2, "pipeline_regather": True},
            r"ZeRO 3's parameter shards: set stage=3 \(got 2\)",
        ),
        ({"pipeline_parallel": 2, "stage": 3, "pipeline_regather": 1}, "pipeline_regather must be"),
    ],
)
def test_bad_options_are_refused_by_the_config(config, message):
    with pytest.raises(ValueError, match=message):
        zgraph.Config(**{"backend": "eager", **config})


def test_explain_shows_each_blocks_stage_and_the_schedules_timeline():
    compiled = pipelined(pipeline_parallel=1, pipeline_virtual_stages=2, schedule="interleaved_1f1b", microbatches=2)
    model = Net()
    x, y = batches()[0]
    compiled(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y)
    text = compiled.explain()
    assert "pipeline: interleaved_1f1b, 1 ranks x 2 stages each, 2 micro-batches; this is rank 0" in text
    assert "stage 0 (rank 0): 2 blocks (model.blocks.0, model.blocks.1)" in text
    assert "stage 1 (rank 0): 2 blocks (model.blocks.2, model.blocks.3)" in text
    assert "rank 0: 0F0 1F0 1B0 1B0 0F1 0B0 0B0 1F1 1B1 1B1 0B1 0B1" in text
    assert {"stage0.forward", "stage1.update"} <= set(compiled.graphs)
    e = compiled.estimate(model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y)  # issue 42, item 4
    assert [(s.stage, s.rank, s.blocks) for s in e.stages] == [
        (0, 0, ("model.blocks.0", "model.blocks.1")),
        (1, 0, ("model.blocks.2", "model.blocks.3")),
    ]
    assert e.bubble == 0.0 and not e.comm_bytes, "stages on one rank: no idle time, nothing sent"


@pytest.mark.parametrize(
    "loss",
    ["sum", "token_mean", "scaled_mean", "label_smoothing", "masked_mean", "token_mean_plus_sum", "complement_count"],
)
def test_losses_combine_over_micro_batches_as_eager_on_the_whole_batch(loss):
    """A sum is summed, a cross_entropy mean over the labels not ignored (micro-batches count 0 to 2 of them) is
    the whole batch's sum over its count (with label smoothing, its smoothing term too: a masked sum over the
    labels' count), as is a masked sum over a count of labels (also counted as the labels' number less the ignored:
    Hugging Face's ``LabelSmoother``), and such a mean plus a sum; a mean (times a constant, plus another) is
    averaged."""
    config = {"schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2, "microbatches": 4}
    assert_equals_eager([train(pipeline_parallel=1, loss=loss, **config)])


def _contrastive(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = F.normalize(logits, dim=-1)
    return F.cross_entropy(z @ z.T, torch.arange(len(z)))


def _batch_statistics(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out - out.mean(0), y)


def _batch_norm(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.batch_norm(out, None, None, training=True), y)


def _ratio(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.sum(-1) * (y > 0)).sum() / out.detach().abs().sum()  # over a sum of activations, not of labels


def _mean_over_count(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    count = (y > 0).sum()  # one count, a sum over it, then a mean over it
    return (out.sum(-1) * (y > 0)).sum() / count + out.pow(2).mean() / count


def _not_a_count(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    kept = y > 0
    return (out.sum(-1) * kept).sum() / (kept.numel() + 1 - kept.sum())  # not the number of labels less a sum


@pytest.mark.parametrize(
    "loss,message",
    [
        (_contrastive, r"mm combines the samples of the batch \(aten.mm.default contracts the batch or multiplies"),
        (_batch_statistics, r"mean combines the samples of the batch \(aten.mean.dim across dim 0, the batch"),
        (_batch_norm, r"combines the samples of the batch \(batch norm in training mode"),
        (lambda out, y: F.cross_entropy(F.dropout(out, 0.1), y), r"the forward draws random numbers \(bernoulli"),
        (lambda out, y: F.cross_entropy(out, y, reduction="sum") / len(out), "div divides a sum by 4, a multiple of"),
        (_ratio, r"div \(aten.div.Tensor\) makes a loss or 0-d result zgraph cannot split into micro-batches"),
        (_mean_over_count, r"div_1 \(aten.div.Tensor\) makes a loss or 0-d result zgraph cannot split"),
        (_not_a_count, r"div \(aten.div.Tensor\) makes a loss or 0-d result zgraph cannot split"),
        (
            lambda out, y: F.mse_loss(out, F.one_hot(y, 3).float()) + out.pow(2).sum(),
            "adds a mean over samples and a sum, which",
        ),
    ],
    ids=[
        "contrastive",
        "batch_statistics",
        "batch_norm",
        "dropout",
        "sum_over_batch_size",
        "ratio",
        "mean_over_a_count",
        "not_a_count",
        "mixed_kinds",
    ],
)
def test_what_micro_batches_cannot_combine_exactly_is_refused_before_anything_changes(loss, message):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    x, y = batches()[0]
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=1, microbatches=2))(step_of(loss))
    with pytest.raises(zgraph.PassError, match=message):
        compiled(model, opt, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state, "no optimizer state was made"


def test_a_result_without_the_samples_along_dim_0_is_refused():
    def step_returning_logits_transposed(model, opt, x, y):
        logits = model(x)
        F.cross_entropy(logits, y).backward()
        opt.step()
        opt.zero_grad()
        return logits.detach().T

    model = Net()
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=1, microbatches=2))
    with pytest.raises(zgraph.PassError, match="does not hold the samples along dim 0"):
        compiled(step_returning_logits_transposed)(model, torch.optim.AdamW(model.parameters(), lr=1e-2), *batches()[0])


def test_split_mode_is_refused_naming_what_to_move():
    """A step returning the loss for ``loss.backward()`` outside it (split mode) cannot run as a pipeline's
    schedule: refused at the call, nothing run, naming what to move into the step."""

    def forward(model, x, y):
        return F.cross_entropy(model(x), y)

    model = Net()
    before = copy.deepcopy(model.state_dict())
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=1, microbatches=2))(forward)
    with pytest.raises(zgraph.CaptureError, match=r"split mode\), which pipelines do not run. Move loss.backward"):
        compiled(model, *batches()[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_step_that_leaves_grad_is_refused_naming_zero_grad():
    """A pipelined step must consume its gradients (summed over the micro-batches) in its update: one that leaves
    ``.grad`` for after it returns is refused naming ``opt.zero_grad()``, not as a buffer the forward updates."""

    def no_zero_grad(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=1, microbatches=2))(no_zero_grad)
    message = r"leaves the gradient of .* in .grad after it returns .*opt.zero_grad\(\) after opt.step"
    with pytest.raises(zgraph.PassError, match=message):
        compiled(model, opt, *batches()[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
