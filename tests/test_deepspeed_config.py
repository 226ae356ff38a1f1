"""``zgraph.Config.from_deepspeed``: DeepSpeed JSON configs mapped to zgraph, and ``Config.autocast_dtype``."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zgraph
import zgraph.config_checks
import zgraph.deepspeed
from zgraph.deepspeed.config import config_fields_from_deepspeed

# the seeds' low-precision recipe: bf16 master weights, grads and optimizer states with torch.autocast
SEEDS_RECIPE = {
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
}

# what Hugging Face's examples ship: "auto" values, engine-only keys, sizes in elements
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 2e8,
        "stage3_prefetch_bucket_size": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_seeds_recipe_maps_to_low_precision_states_with_autocast(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SEEDS_RECIPE))
    config = zgraph.Config.from_deepspeed(path, backend="eager")
    assert config.stage == 3 and config.backend == "eager"
    assert config.master_dtype == config.optimizer_state_dtype == config.autocast_dtype == torch.bfloat16
    assert config.param_dtype is None, "under torch_autocast the parameters keep the master dtype"


def test_hugging_face_style_config():
    config = zgraph.Config.from_deepspeed(HF_ZERO2)
    assert config.stage == 2
    assert config.param_dtype == torch.bfloat16 and config.loss_scale is None, "fp16 'auto' stays off"
    assert config.max_grad_norm == 1.0
    assert config.reduce_bucket_bytes == 5e8 * 2 and config.allgather_bucket_bytes == 2e8 * 2, "bf16 elements"
    assert config.prefetch_bytes == "auto"


def test_fp16_dynamic_loss_scale():
    config = zgraph.Config.from_deepspeed(
        {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3}}
    )
    assert config.param_dtype == torch.float16
    assert config.loss_scale == zgraph.DynamicLossScale(init_scale=4096.0, growth_interval=500, hysteresis=3)


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "ZeRO >= 1"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "quantized weights"),
        ({"zero_optimization": {"stagee": 3}}, r"unknown key\(s\) \['stagee'\]"),
        ({"gradient_accumulation_steps": 4}, "micro-batch loop"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16 and fp16"),
        ({"fp16": {"enabled": True}, "bf16": {"bf16_optimizer_states": True}, "torch_autocast": {}}, None),
    ],
)
def test_what_zgraph_cannot_honour_is_rejected_by_name(ds, message):
    if message is None:  # fp16 with dynamic scaling, bf16 section present but disabled: fine
        zgraph.Config.from_deepspeed(ds)
        return
    with pytest.raises(ValueError, match=message):
        zgraph.Config.from_deepspeed(ds)


def test_autocast_dtype_equals_an_autocast_region_around_the_forward():
    """``Config(autocast_dtype=bf16)`` on a plain step is eager's step with ``torch.autocast`` around the model
    call (not around the loss): the same ops in the same dtypes, so bitwise equal."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def plain(model, opt, x, y):
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def autocast_forward(model, opt, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(3)]
    state = make()
    reference = make()
    compiled = zgraph.distribute(backend="eager", autocast_dtype=torch.bfloat16)(plain)
    for x, y in batches:
        got = compiled(*state, x, y)
        want = autocast_forward(*reference, x, y)
        assert torch.equal(got, want)
    for a, b in zip(state[0].parameters(), reference[0].parameters()):
        assert torch.equal(a, b)


def test_autocast_dtype_must_be_a_lower_precision_dtype():
    with pytest.raises(ValueError, match="autocast_dtype"):
        zgraph.Config(autocast_dtype=torch.float32)
    with pytest.raises(ValueError, match="loss_scale"):
        zgraph.Config(autocast_dtype=torch.float16)


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every module (and ``from``-imported name) ``path`` imports, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}:{node.lineno}: relative import"
            found += [(node.lineno, node.module or "")]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_deepspeed_package_and_config_checks_never_import_zgraph_config():
    """zgraph/deepspeed/ returns plain values (Config.from_deepspeed builds the Config), and zgraph.config_checks
    takes plain values: neither imports zgraph.config, not even inside a function, so there is no import circle."""
    paths = sorted(pathlib.Path(zgraph.deepspeed.__file__).parent.glob("*.py"))
    paths.append(pathlib.Path(zgraph.config_checks.__file__))
    assert len(paths) >= 6
    for path in paths:
        for line, name in _imported_modules(path):
            assert name != "zgraph.config" and not name.startswith("zgraph.config."), f"{path.name}:{line}: {name}"


def test_deepspeed_dynamic_loss_scale_is_plain_keyword_arguments():
    fields = config_fields_from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 12}})
    assert fields["loss_scale"] == {"init_scale": 4096.0, "growth_interval": 1000, "hysteresis": 2, "min_scale": 1.0}
    assert type(fields["loss_scale"]) is dict
    assert config_fields_from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})["loss_scale"] == 128.0
    config = zgraph.Config.from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 12}})
    assert config.loss_scale == zgraph.DynamicLossScale(init_scale=4096.0)
