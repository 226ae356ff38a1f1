"""The seeds' disaggregated multimodal training, in small: a vision encoder and a language model that reads its
embeddings, trained by two separate groups of ranks.

Each side is an ordinary zgraph program on its own process group. The vision side's step returns the
embeddings (split mode: they carry a compiled, sharded backward); the language side's step takes them as an
input that requires grad, runs ``loss.backward()`` and its optimizer, and leaves ``emb.grad``; the vision side
then calls ``out.backward(gradient=emb.grad)`` and steps its own optimizer, exactly as the seeds' Ray actors do.
With ``sequence_parallel=N`` the language side runs DeepSpeed-Ulysses over groups of N of its ranks, as the seeds
describe: a group shares its ranks' rows, each rank computes its slice of every joined sequence (image prefix, then
caption), and each rank's ``emb.grad`` covers its slice's positions (the vision rank adds its group's).
How the tensors travel between the groups (Ray, or point-to-point sends) is the launcher's business
(``zgraph.demos.multimodal_demo``); this module holds the models, the data and one rank's part of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zgraph
from zgraph.demos.data import VOCAB, corpus_tokens
from zgraph.demos.models import Block, lm_loss


@dataclass(frozen=True, kw_only=True)
class MultimodalConfig:
    """Shapes and training settings of the demo (both sides read the same one).

    Attributes:
        image: side of the square images, in pixels.
        patch: side of a patch; the encoder emits ``(image // patch) ** 2`` embeddings per image.
        channels: image channels.
        d_model: width of both models (the embeddings cross between them unchanged).
        layers: language-model blocks.
        heads: attention heads.
        text: caption tokens per image.
        classes: image classes; each has its own caption, so the loss falls as the encoder learns them.
        per_rank: images per rank per step (the global batch is ``per_rank`` times the ranks of a side).
        sequence_parallel: ranks of the language side that share each sequence (``Config.sequence_parallel``,
            Ulysses): a group of them trains its ranks' rows together, each rank one slice of every joined
            sequence; 1: none.
        lr: AdamW learning rate of both optimizers.
        stage: ZeRO stage of both sides.
        seed: seed of the models' initialisation and of the data.
    """

    image: int = 16
    patch: int = 4
    channels: int = 3
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    text: int = 24
    classes: int = 8
    per_rank: int = 4
    sequence_parallel: int = 1
    lr: float = 3e-3
    stage: int = 3
    seed: int = 0

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


class PatchEncoder(nn.Module):
    """Vision encoder: non-overlapping patches, a linear projection and a residual GELU MLP."""

    def __init__(self, config: MultimodalConfig):
        super().__init__()
        self.patch = config.patch
        self.proj = nn.Linear(config.channels * config.patch**2, config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)
        self.ln = nn.LayerNorm(config.d_model)

    def forward(self, images: Tensor) -> Tensor:
        b, c, h, w = images.shape
        p = self.patch
        x = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        x = self.proj(x)
        return self.ln(x + self.fc2(F.gelu(self.fc(x))))


class CaptionLM(nn.Module):
    """Decoder that reads the image's embeddings as a prefix and predicts the caption's next tokens."""

    def __init__(self, config: MultimodalConfig):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, config.d_model)
        self.pos = nn.Embedding(config.patches + config.text, config.d_model)
        self.blocks = nn.ModuleList([Block(config.d_model, config.heads) for _ in range(config.layers)])
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB, bias=False)

    def forward(self, vision: Tensor, idx: Tensor) -> Tensor:
        """Logits of the caption's positions, from the image's embeddings (the prefix) and the caption's tokens."""
        vision_at, ids, image, _ = joined(vision, idx)
        return self.decode(vision_at, ids, image)[:, vision.shape[1] :]

    def decode(self, vision_at: Tensor, ids: Tensor, image: Tensor) -> Tensor:
        """Logits of every position of a joined sequence (``joined``) or of a rank's slice of it (its computed
        positions are moved to the slice's place by the ``sequence_parallel`` pass): the image's embedding where
        ``image`` is true, else the token's, as Hugging Face's multimodal models merge them."""
        x = torch.where(image, vision_at, self.tok(ids))
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


IGNORE = -100  # cross_entropy's ignore_index: the image's positions have no caption token to predict


def joined(vision: Tensor, idx: Tensor, tgt: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The joined sequence (the image's ``P`` positions, then the caption's) as ``CaptionLM.decode`` reads it:
    the image's embeddings then zeros, zeros then the caption's tokens, ``(B, P + T, 1)`` true at the image's
    positions, and the next-token labels (``IGNORE`` at the image's, then ``tgt``; None without ``tgt``)."""
    b, p, d = vision.shape
    vision_at = torch.cat([vision, vision.new_zeros(b, idx.shape[1], d)], dim=1)
    ids = torch.cat([idx.new_zeros(b, p), idx], dim=1)
    image = (torch.arange(ids.shape[1], device=ids.device) < p).expand(b, -1).unsqueeze(-1)
    labels = None if tgt is None else torch.cat([tgt.new_full((b, p), IGNORE), tgt], dim=1)
    return vision_at, ids, image, labels


def build_models(config: MultimodalConfig) -> tuple[PatchEncoder, CaptionLM]:
    """Both models, initialised from ``config.seed`` (every rank and the eager reference build the same)."""
    torch.manual_seed(config.seed)
    encoder = PatchEncoder(config)
    torch.manual_seed(config.seed + 1)
    return encoder, CaptionLM(config)


class Data:
    """The global batch of step ``i``: images of random classes (a class's pattern plus noise) and their
    captions (a class's own window of the text corpus). A pure function of the seed and ``i``."""

    def __init__(self, config: MultimodalConfig, ranks: int):
        self.config = config
        self.ranks = ranks
        g = torch.Generator().manual_seed(config.seed + 12345)
        shape = (config.classes, config.channels, config.image, config.image)
        self.patterns = torch.randn(shape, generator=g)
        tokens = corpus_tokens()
        starts = torch.randint(0, tokens.numel() - config.text - 1, (config.classes,), generator=g).tolist()
        self.captions = torch.stack([tokens[s : s + config.text + 1] for s in starts])

    def global_batch(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """Images, caption inputs and caption targets of the whole step (every rank's rows)."""
        c = self.config
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + i)
        classes = torch.randint(0, c.classes, (c.per_rank * self.ranks,), generator=g)
        images = self.patterns[classes] + 0.3 * torch.randn((len(classes), c.channels, c.image, c.image), generator=g)
        captions = self.captions[classes]
        return images, captions[:, :-1], captions[:, 1:]

    def rank_batch(self, i: int, rank: int, ranks: int = 1) -> tuple[Tensor, Tensor, Tensor]:
        """The rows of step ``i``'s global batch of rank ``rank`` and the ``ranks - 1`` after it."""
        rows = slice(rank * self.config.per_rank, (rank + ranks) * self.config.per_rank)
        return tuple(t[rows] for t in self.global_batch(i))  # type: ignore[return-value]


def _encode(encoder: nn.Module, images: Tensor) -> Tensor:
    return encoder(images)


def _update(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad()


def _text_step(
    lm: CaptionLM, opt: torch.optim.Optimizer, vision_at: Tensor, ids: Tensor, image: Tensor, labels: Tensor
) -> Tensor:
    """The language step on joined sequences (``joined``), or on a rank's slice of each."""
    logits = lm.decode(vision_at, ids, image)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


class VisionSide:
    """One rank of the vision group: forward to embeddings, later backward from their gradient, then update."""

    def __init__(self, config: MultimodalConfig, rank: int, ranks: int, group: object = None, device: str = "cpu"):
        self.encoder = build_models(config)[0].to(device)
        self.opt = torch.optim.AdamW(self.encoder.parameters(), lr=config.lr)
        options = {"stage": config.stage, "process_group": group, "param_persistence_threshold": 0}
        self.encode = zgraph.distribute(**options)(_encode)
        self.update = zgraph.distribute(**options)(_update)
        self.data, self.rank, self.device = Data(config, ranks), rank, device
        self.out: Tensor | None = None

    def forward(self, i: int) -> Tensor:
        """Embeddings of this rank's images of step ``i`` (detached, on the CPU: what crosses to the LLM)."""
        images = self.data.rank_batch(i, self.rank)[0].to(self.device)
        self.out = self.encode(self.encoder, images)
        return self.out.detach().cpu()

    def backward(self, grads: list[Tensor]) -> None:
        """The seeds' ``vision_output.backward(gradient=...)``, then the encoder's optimizer step. ``grads``: the
        gradient of the embeddings from each rank of the language side's sequence group this rank's images went
        to (one without sequence parallelism), in their order: their slices of the group's joined sequences; this
        rank's rows of the image's positions of them."""
        assert self.out is not None, "forward first"
        n, block = self.data.config.per_rank, self.rank % len(grads)
        grad = torch.cat(grads, dim=1)[block * n : (block + 1) * n, : self.out.shape[1]]
        self.out.backward(gradient=grad.to(self.device))
        self.out = None
        self.update(self.opt)


class TextSide:
    """One rank of the language group: embeddings in, loss and the embeddings' gradient out. With sequence
    parallelism, ranks ``first .. first + sp - 1`` (a sequence group) train those ranks' rows together."""

    def __init__(self, config: MultimodalConfig, rank: int, ranks: int, group: object = None, device: str = "cpu"):
        self.lm = build_models(config)[1].to(device)
        self.opt = torch.optim.AdamW(self.lm.parameters(), lr=config.lr)
        self.sp = config.sequence_parallel
        options = {"stage": config.stage, "process_group": group, "param_persistence_threshold": 0}
        options["sequence_parallel"] = self.sp if self.sp > 1 else None
        self.step_fn = zgraph.distribute(**options)(_text_step)  # small models: stage 3 shards every parameter
        self.data, self.rank, self.device = Data(config, ranks), rank, device
        self.first = rank - rank % self.sp

    def step(self, i: int, embeddings: Tensor) -> tuple[float, Tensor]:
        """Train on step ``i`` from the ``embeddings`` of the sequence group's rows (its ranks' images, in rank
        order): this rank's loss, and the gradient of its embeddings input (the seeds' ``vision_embeddings.grad``),
        over the positions of this rank's slice of the joined sequences (all of them without sequence
        parallelism)."""
        _, idx, tgt = self.data.rank_batch(i, self.first, self.sp)
        whole = joined(embeddings.to(self.device), idx.to(self.device), tgt.to(self.device))
        vision_at, ids, image, labels = zgraph.shard_sequence(whole, self.sp, rank=self.rank)  # (Ulysses' loader)
        vision_at.requires_grad_()
        loss = self.step_fn(self.lm, self.opt, vision_at, ids, image, labels)
        return loss.item(), vision_at.grad.detach().cpu()


def eager_losses(config: MultimodalConfig, ranks: int, steps: int, device: torch.device | str = "cpu") -> list[float]:
    """The same training in one process with plain PyTorch: the combined model on each step's global batch, on
    ``device`` (the kind the ranks trained on: a GPU's kernels round differently from the CPU's)."""
    encoder, lm = (m.to(device) for m in build_models(config))
    opts = [torch.optim.AdamW(m.parameters(), lr=config.lr) for m in (encoder, lm)]
    data = Data(config, ranks)
    losses = []
    for i in range(steps):
        images, idx, tgt = (t.to(device) for t in data.global_batch(i))
        loss = lm_loss(lm(encoder(images), idx), tgt)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses
