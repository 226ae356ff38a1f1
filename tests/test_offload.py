"""Offload (issue 14, first slice): Config vocabulary and bad input, the NVMe tier for optimizer states (files
under offload_dir between steps, bitwise the same training), the CPU identity, checkpoints and a full disk."""

from __future__ import annotations

import errno
import functools
import gc
import os

import pytest
import torch
from dist_harness import run_ranks
from offload_cases import batches, make, make_step, same, train

import zgraph
from zgraph.runtime import offload as runtime_offload
from zgraph.runtime import offload_nvme

BASE = zgraph.Config(stage=1, backend="eager", measure_collectives=False)


@functools.cache
def trained_without_offload(config: zgraph.Config) -> tuple:
    """``train(config)`` of a config without offload, once per config (several tests compare against BASE's)."""
    return train(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(stage=1, offload_fraction=1.5), r"offload_fraction must be a number in \[0, 1\]"),
        (dict(stage=1, offload_fraction=-0.1), r"offload_fraction must be a number in \[0, 1\]"),
        (dict(stage=1, offload_optimizer="nvme"), "needs offload_dir"),
        (dict(stage=0, offload_optimizer="cpu"), "DeepSpeed requires ZeRO >= 1"),
        (dict(stage=2, offload_params="cpu"), "only when they are sharded, at stage 3"),
        (dict(stage=1, offload_optimizer="disk"), 'must be None, "cpu" or "nvme"'),
        (dict(stage=1, offload_optimizer="cpu", offload_dir=3), "offload_dir must be None or a directory"),
    ],
)
def test_bad_config_is_a_clear_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        zgraph.Config(**fields)


def test_from_deepspeed_maps_offload_sections():
    config = zgraph.Config.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "ratio": 0.3, "pin_memory": True,
                                      "buffer_count": 4, "pipeline_read": False, "fast_init": False},
                "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 10, "buffer_size": 8},
            }
        }
    )  # fmt: skip
    assert (config.offload_optimizer, config.offload_params) == ("nvme", "cpu")
    assert (config.offload_dir, config.offload_fraction) == ("/nvme", 0.3)
    off = zgraph.Config.from_deepspeed({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}})
    assert off.offload_optimizer is None


def test_missing_or_unwritable_dir_fails_at_first_call(tmp_path):
    model, opt = make()
    step = make_step(BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path / "absent")))
    with pytest.raises(runtime_offload.OffloadError, match="does not exist"):
        step(model, opt, *batches()[0])
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("running as root: every directory is writable")
    step = make_step(BASE.replace(offload_optimizer="nvme", offload_dir=str(locked)))
    with pytest.raises(runtime_offload.OffloadError, match="not writable"):
        step(model, opt, *batches()[0])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_nvme_training_is_bitwise_the_same(tmp_path, stage, state_dtype):
    base = BASE.replace(stage=stage, optimizer_state_dtype=state_dtype)
    assert same(trained_without_offload(base), train(base.replace(offload_optimizer="nvme", offload_dir=str(tmp_path))))
    gc.collect()
    assert os.listdir(tmp_path) == []  # the step was dropped: its files too


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    storages = {}
    for state in opt.state.values():
        for t in state.values():
            storage = getattr(t, "_local_tensor", t).untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_states_leave_memory_and_files_hold_them(tmp_path, fraction):
    model, opt = make()
    step = make_step(BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path), offload_fraction=fraction))
    for x, y in batches():
        step(model, opt, x, y)
    total = sum(2 * p.numel() * 4 for p in model.parameters())  # exp_avg, exp_avg_sq
    scalars = 4 * len(opt.state)  # each "step" count stays
    store = step._dispatch.last.offload
    assert store.bytes_total == total + (0 if fraction < 1 else 0)
    assert _state_bytes(opt) == total - store.bytes_offloaded + scalars
    assert store.bytes_offloaded >= fraction * total and (fraction > 0 or store.bytes_offloaded == 0)
    files = os.listdir(store.path)
    # two copies of each offloaded state: the current one and the one the next update writes
    assert sum(os.path.getsize(os.path.join(store.path, f)) for f in files) == 2 * store.bytes_offloaded
    assert os.path.basename(store.path).startswith(f"zgraph-offload-{os.getpid()}-")
    text = step.explain()
    assert f"({store.bytes_offloaded} of {total} optimizer state bytes) live in files" in text
    final = step.graphs["final"]
    reloads = [n for n in final.graph.nodes if n.target is torch.ops.zgraph.reload.default]
    writes = [n for n in final.graph.nodes if n.target is torch.ops.zgraph.write_back.default]
    assert len(reloads) == len(writes) == len(store.states)  # every offloaded state: one of each, in the graph
    assert all(n.meta["zgraph_pass"] == "offload" for n in reloads + writes)
    assert fraction == 0 or "zgraph.reload.default" in step.graphs["offload"].code
    if fraction == 1.0:  # the eager backend updates each reloaded state in place on its reload's buffer
        assert final.code.count("lerp_.") == final.code.count("zgraph.reload.default") // 2 == 6
    _, optim_state = zgraph.full_state_dict(model, opt)  # materialises them
    assert _state_bytes(opt) == total + scalars
    assert all(torch.isfinite(s["exp_avg"]).all() for s in optim_state["state"].values())


def test_cpu_tier_on_cpu_is_the_identity():
    config = BASE.replace(offload_optimizer="cpu")
    model, opt = make()
    step = make_step(config)
    step(model, opt, *batches()[0])
    assert step._dispatch.last.offload is None
    assert 'offload_optimizer="cpu": the identity here' in step.explain()
    assert same(trained_without_offload(BASE), train(config))


def test_full_disk_raises_and_keeps_the_state(tmp_path, monkeypatch):
    """The files are reserved when a state is first offloaded: a full disk is found there, before the step changed
    anything; once space is free the same call continues the training exactly."""
    expected = trained_without_offload(BASE)
    model, opt = make()
    untouched = zgraph.full_state_dict(model, opt)
    step = make_step(BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path)))
    data = batches()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_nvme.os, "posix_fallocate", full)
    with pytest.raises(runtime_offload.OffloadError, match="disk under offload_dir full.*training state is intact"):
        step(model, opt, *data[0])
    monkeypatch.undo()
    model_state, optim_state = zgraph.full_state_dict(model, opt)
    assert same(model_state, untouched[0])  # the parameters, and the optimizer's fresh (zero) states:
    assert all(not t.any() for state in optim_state["state"].values() for t in state.values())
    assert not [f for _, _, files in os.walk(tmp_path) for f in files]  # nothing half-reserved is left
    losses = [step(model, opt, x, y).item() for x, y in data]
    assert losses == expected[0]
    assert same(zgraph.full_state_dict(model, opt), expected[1:])


def test_peak_memory_of_the_step_drops_too(tmp_path):
    """In the graph, a state lives from its reload to its write-back only: the step's peak of live tensor bytes
    is lower by about the optimizer states, not only the memory between steps."""
    from zgraph.runtime.memory import LiveTensorBytes, state_bytes

    def deep() -> tuple[torch.nn.Module, torch.optim.Optimizer]:  # many parameters of one size, as a transformer
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), *(torch.nn.Linear(32, 32) for _ in range(11)))
        return model, torch.optim.AdamW(model.parameters())

    peaks = {}
    for name, config in (("memory", BASE), ("nvme", BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path)))):
        model, opt = deep()
        step = make_step(config)
        data = batches()
        step(model, opt, *data[0])
        held = state_bytes(model, opt)["total"]  # what the step starts with, plus what it allocates at most
        with LiveTensorBytes() as live:
            step(model, opt, *data[1])
        peaks[name] = held + live.peak
    states = sum(2 * p.numel() * 4 for p in deep()[0].parameters())
    assert peaks["memory"] - peaks["nvme"] >= 0.7 * states, (peaks, states)


def test_checkpoint_with_offloaded_states_resumes_without_offload(tmp_path):
    data = batches()
    offload = BASE.replace(stage=2, offload_optimizer="nvme", offload_dir=str(tmp_path))
    model, opt = make()
    step = make_step(offload)
    for x, y in data[:2]:
        step(model, opt, x, y)
    zgraph.save(tmp_path / "ckpt", model, opt)
    continued = [step(model, opt, x, y).item() for x, y in data[2:]]
    model2, opt2 = make(seed=1)
    zgraph.load(tmp_path / "ckpt", model2, opt2)
    step2 = make_step(BASE.replace(stage=2))
    resumed = [step2(model2, opt2, x, y).item() for x, y in data[2:]]
    assert resumed == continued
    model3, opt3 = make(seed=2)  # and into a step that offloads, after the states were loaded into memory
    step3 = make_step(offload)
    step3(model3, opt3, *data[0])  # its states are in files now; load replaces them
    zgraph.load(tmp_path / "ckpt", model3, opt3)
    assert [step3(model3, opt3, x, y).item() for x, y in data[2:]] == continued


def test_another_batch_shape_recaptures_and_keeps_the_same_files(tmp_path):
    config = BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path))
    model, opt = make()
    reference, ref_opt = make()
    step, eager_step = make_step(config), make_step(BASE)
    for x, y in batches():
        for rows in (8, 5):  # two graphs, one store: the states' files are found by the state, not the graph
            assert (
                step(model, opt, x[:rows], y[:rows]).item() == eager_step(reference, ref_opt, x[:rows], y[:rows]).item()
            )
    store = step._dispatch.last.offload
    assert len(os.listdir(store.path)) == 2 * len(store.states) == 2 * 2 * 6  # exp_avg, exp_avg_sq of 6 params


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_bitwise(stage):
    run_ranks(2, "offload_cases.compare_ranks", stage, None, timeout=300)
    run_ranks(2, "offload_cases.compare_ranks", stage, "bfloat16", timeout=300)


# ------------------------------------------------------------------------------- parameters (stage 3, issue 14)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_offloaded_params_train_bitwise_the_same(world, recipe):
    """offload_params="nvme" alone and with offload_optimizer="nvme": losses, whole parameters and optimizer
    state bitwise those of the same stage-3 config without offload; the files are gone once the step is."""
    run_ranks(world, "offload_cases.compare_params_ranks", recipe, [False, True], timeout=300)


def test_offloaded_params_leave_memory_and_the_graph_reloads_them_per_phase(tmp_path):
    run_ranks(1, "offload_cases.params_in_files_ranks", str(tmp_path), timeout=300)


def test_offloaded_params_gather_save_load_and_resume_without_offload(tmp_path):
    run_ranks(2, "offload_cases.params_checkpoint_ranks", str(tmp_path), timeout=300)


def test_offloaded_params_full_disk_keeps_the_state(tmp_path):
    run_ranks(1, "offload_cases.params_full_disk_ranks", str(tmp_path), timeout=300)


@pytest.mark.parametrize("split", [False, True])
def test_offloaded_params_eager_optimizer_step_outside_the_step(tmp_path, split):
    """Also a split step (backward outside the step, 2 ranks): its forward and backward graphs reload the shards."""
    run_ranks(2 if split else 1, "offload_cases.params_eager_optimizer_ranks", str(tmp_path), split, timeout=300)


def test_offloaded_params_eager_optimizer_step_after_another_offload_tier(tmp_path):
    """The same (split, 2 ranks) where the process had an offload tier before its first stage-3 step (fresh
    ranks: the order the process registered zgraph's global optimizer hooks in is the point)."""
    run_ranks(2, "offload_cases.params_eager_optimizer_after_another_store", str(tmp_path), timeout=300, fresh=True)


@pytest.mark.inductor
def test_offloaded_params_with_inductor(tmp_path):
    run_ranks(1, "offload_cases.params_inductor_ranks", str(tmp_path), timeout=600)


def test_offloaded_params_two_graphs_share_the_files(tmp_path):
    run_ranks(1, "offload_cases.params_recapture_ranks", str(tmp_path), timeout=300)


_RSS_RUN = """
import sys, torch, zgraph
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
config = zgraph.Config(stage=1, backend="eager", measure_collectives=False, offload_optimizer="nvme",
                       offload_dir=sys.argv[1], keep_host_memory=sys.argv[2] == "keep")
step = zgraph.distribute(config)(lambda m, o, x: (m(x).square().mean().backward(), o.step(), o.zero_grad()))
x = torch.randn(64, 1024)
for _ in range(3):
    step(model, opt, x)
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_offloaded_states_leave_the_resident_set_between_steps(tmp_path):
    """The store gives freed host memory back after each step: the 32 MiB of AdamW states in files are out of the
    resident set, not only out of the live tensors. Both runs get glibc tunables that never trim on their own, so
    the difference is the store's ``malloc_trim``; ``keep_host_memory=True`` asks to keep the memory (no trim)."""
    import subprocess
    import sys

    from zgraph.runtime.host_memory import GLIBC_TUNABLES

    env = {**os.environ, "GLIBC_TUNABLES": GLIBC_TUNABLES, "OMP_NUM_THREADS": "1"}
    rss = {}
    for mode in ("trim", "keep"):
        run = [sys.executable, "-c", _RSS_RUN, str(tmp_path), mode]
        done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        rss[mode] = int(done.stdout.split()[-1])
    states = 2 * 4 * 1024 * 1024 * 4  # exp_avg and exp_avg_sq of four 1024 x 1024 fp32 weights
    assert rss["trim"] < rss["keep"] - states // 2, {k: v / 2**20 for k, v in rss.items()}


def test_a_first_step_moves_each_new_state_to_the_tier_before_making_the_next(tmp_path, monkeypatch):
    """A first optimizer step creates its states one parameter at a time, each moved to the tier before the next
    is made: the states are never all in memory at once (on a GPU, what would not fit beside the model). Training
    stays bitwise the same."""
    model, opt = make()
    resident = []

    def offload_now(store, key, tensor):
        held = [v for state in opt.state.values() for v in state.values() if v.dim() > 0]
        resident.append(sum(v.untyped_storage().nbytes() for v in held))
        real(store, key, tensor)

    real = runtime_offload.TierStore.offload_now
    monkeypatch.setattr(runtime_offload.TierStore, "offload_now", offload_now)
    step = make_step(BASE.replace(offload_optimizer="nvme", offload_dir=str(tmp_path)))
    losses = [step(model, opt, x, y).item() for x, y in batches()]
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert len(resident) == 2 * len(list(model.parameters()))  # exp_avg and exp_avg_sq of each
    assert max(resident) <= 2 * largest < sum(2 * p.numel() * 4 for p in model.parameters())
    expected = trained_without_offload(BASE)
    assert losses == expected[0] and same(zgraph.full_state_dict(model, opt), expected[1:])


def test_a_read_hands_its_tensor_over_and_keeps_no_reference():
    """A bug: the I/O pool's worker keeps a finished task (and its future's result) a moment after the future is
    done, so under load a reloaded state was still alive after the step (the soak's tensor bytes grew once). The
    tensor now goes through a list the consumer empties; the future carries nothing."""
    import weakref
    from concurrent.futures import ThreadPoolExecutor

    from zgraph.runtime.offload_nvme import handed

    with ThreadPoolExecutor(max_workers=1) as io:
        pending = handed(io, torch.ones, 1000)
        value = pending.result()
        assert torch.equal(value, torch.ones(1000)) and pending.exception() is None
        assert pending.future.result() is None and not pending.box
        alive = weakref.ref(value)
        del value
        assert alive() is None
