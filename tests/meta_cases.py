"""Models built on the meta device, made real by zgraph (issue 27, item 1): cases run in one process by
``test_meta_init.py`` and on spawned gloo ranks. Each compares with the eager model the same initialisation gives
from the same seed: the model built on the host (module ``reset_parameters`` in construction order), or for a
Hugging Face model ``to_empty`` then ``init_weights()``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import zgraph
from zgraph.demos.llama import Llama, LlamaConfig
from zgraph.demos.models import GPT, GPTConfig, lm_loss

VOCAB, SEQ, BATCH = 64, 8, 4


def gpt(tie: bool = True) -> GPT:
    return GPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=32, heads=4, layers=2, tie_weights=tie))


def llama() -> Llama:
    return Llama(LlamaConfig(vocab=VOCAB, d_model=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=SEQ))


def hf_llama(tie: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers import LlamaConfig as HFLlamaConfig

    cfg = HFLlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt": gpt,
    "gpt-untied": lambda: gpt(tie=False),
    "llama": llama,
    "hf-llama": hf_llama,
    "hf-llama-tied": lambda: hf_llama(tie=True),
}


def eager_model(name: str, seed: int = 0) -> nn.Module:
    """The reference: built on the host from ``seed`` (a Hugging Face model: ``to_empty`` + ``init_weights``)."""
    if name.startswith("hf"):
        model = BUILDERS[name]()
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        model.init_weights()
        return model
    torch.manual_seed(seed)
    return BUILDERS[name]()


def meta_model(name: str) -> nn.Module:
    with torch.device("meta"):
        return BUILDERS[name]()


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(logits(model, x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(n)
    ]


def assert_same_state(model: nn.Module, reference: nn.Module, what: str, rtol: float = 0.0) -> None:
    """``zgraph.full_state_dict(model)`` and its buffers equal ``reference``'s (bitwise for ``rtol=0``)."""
    got = zgraph.full_state_dict(model)
    for key, want in reference.state_dict().items():
        torch.testing.assert_close(
            got[key], want, rtol=rtol, atol=rtol * 1e-2, msg=lambda m, k=key: f"{what}: {k}: {m}"
        )
    buffers = dict(model.named_buffers())
    for key, want in reference.named_buffers():
        torch.testing.assert_close(buffers[key], want, rtol=0, atol=0, msg=lambda m, k=key: f"{what}: buffer {k}: {m}")


def init_and_train(rank: int, world: int, names: list[str], stages: list[int]) -> None:
    """Each model built on meta, then a step of each stage: the first call's values equal the eager model's
    bitwise (checked before training, through ``zgraph.materialize`` on a twin), the random state after it too,
    and two training steps on each rank's slice of the batch equal eager training on the global batch."""
    per = BATCH // world
    for name in names:
        for stage in stages:
            what = f"{name} stage {stage} on {world} ranks"
            config = zgraph.Config(stage=stage, param_persistence_threshold=0, backend="eager")
            twin = meta_model(name)
            torch.manual_seed(0)
            zgraph.materialize(twin, config)
            after = torch.rand(4)
            eager = eager_model(name)
            assert torch.equal(after, torch.rand(4)), f"{what}: the random state after initialisation differs"
            assert_same_state(twin, eager, f"{what}: materialised")
            model = meta_model(name)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # Adam would magnify the
            eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)  # reduction order's last bits
            step = zgraph.distribute(config)(train_step)
            torch.manual_seed(0)
            for x, y in batches():
                want = train_step(eager, eager_opt, x, y)
                got = step(model, opt, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
                if world > 1:
                    got = got.detach().clone()
                    dist.all_reduce(got)
                    got /= world
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
            assert_same_state(model, eager, f"{what}: trained", rtol=1e-4)


def rank0_holds_the_model(rank: int, world: int) -> None:
    """FSDP1's ``sync_module_states`` idiom: rank 0 builds the real model (from another seed than the others
    would), the other ranks build on meta; every rank ends with rank 0's values, then trains as eager does."""
    reference = eager_model("gpt", seed=5)
    model = eager_model("gpt", seed=5) if rank == 0 else meta_model("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager")(train_step)
    per = BATCH // world
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches():
        step(model, opt, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        train_step(reference, reference_opt, x, y)
    assert_same_state(model, reference, "rank 0's model trained", rtol=1e-4)


def ranks_disagree(rank: int, world: int) -> None:
    """Rank 0 on meta, the others real: every rank raises the named error at once (no broadcast waits)."""
    from zgraph.runtime.meta_init import MetaInitError

    model = meta_model("gpt") if rank == 0 else eager_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager", collective_timeout=60)(train_step)
    x, y = batches(1)[0]
    try:
        step(model, opt, x, y)
    except MetaInitError as error:
        assert "ranks [0] hold the model on the meta device" in str(error), error
    else:
        raise AssertionError("a step whose ranks disagree on meta-device state ran")
    assert all(p.is_meta for p in model.parameters()) == (rank == 0), "the refused call changed the model"
