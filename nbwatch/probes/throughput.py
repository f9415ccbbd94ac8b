"""Step-time split and throughput: what each loop's step records as time/* and throughput/*."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def timing_figures(step_s: float, data_s: float | None = None) -> dict[str, float]:
    """`time/step` (the whole step, boundary to boundary) and, where nbwatch iterates the
    data, `time/data` (waiting for the loader) and `time/compute` (the rest)."""
    out = {"time/step": step_s}
    if data_s is not None:
        out["time/data"] = data_s
        out["time/compute"] = max(step_s - data_s, 0.0)
    return out


def add_rates(values: dict[str, float], samples: int | None) -> None:
    """The step's throughput, the one place it is computed for every loop: samples/s from
    its sample count, tokens/s from `tokens/real` (real tokens, padding excluded), both
    over `time/step`."""
    step_s = values.get("time/step")
    if not step_s or step_s <= 0:
        return
    if samples:
        values["throughput/samples_per_s"] = samples / step_s
    tokens = values.get("tokens/real")
    if tokens is not None:
        values["throughput/tokens_per_s"] = tokens / step_s


def batch_samples(batch: object) -> int | None:
    """How many samples a batch holds, the one count of every loop (start(), log(batch=),
    the Trainer, Lightning): the rows (dim 0) of its first tensor of 1 dim or more (a
    Mapping's first such value, a dict's, a `BatchEncoding`'s or a `UserDict`'s, e.g.
    `input_ids` or `pixel_values`; a list's or tuple's, `(x, y)`'s x; a tensor's own).
    0-dim tensors and Python numbers are no samples; nested containers are looked into
    only where no tensor of its own has rows (their first count then). A Mapping whose
    `input_ids` is 1-D and that holds no tensor of 2 dims or more is one sequence (`[T]`,
    Hugging Face's unbatched input), one sample, as its token figures count it
    (`mask_rows`); a bare 1-D tensor keeps its length (a loader of scalars or indices
    batches them so). None where it holds no tensor of 1 dim or more. No host sync: a
    shape only (a packed batch counts its documents: `packed_figures`)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):
        items = list(batch.values())
        ids = batch.get("input_ids")
        if (isinstance(ids, torch.Tensor) and ids.ndim == 1 and ids.numel()
                and not any(isinstance(x, torch.Tensor) and x.ndim > 1 for x in items)):
            return 1
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for x in items:
        if isinstance(x, torch.Tensor) and x.ndim:
            return int(x.shape[0])
    for x in items:
        n = batch_samples(x) if isinstance(x, (Mapping, list, tuple)) else None
        if n:
            return n
    return None


def mask_rows(masks: list[Any]) -> int:
    """The sequences a step's [batch, T] token masks count, for samples/s: a mask's rows,
    a 1-D one's one (a single sequence's `[T]`, as `mask_stats` counts its tokens)."""
    return sum(int(m.shape[0]) if m.dim() > 1 else 1 for m in masks)


# -- model FLOPs utilisation ---------------------------------------------------------------
# Dense bf16 tensor-core peaks (datasheets, no sparsity), by a part of the NVML / CUDA device
# name; the first entry whose parts are all in the name wins (the specific before the
# general: "H100 PCIe" before "H100"). Monitor(peak_flops=...) overrides.
PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200", "nvl"), 836e12), (("h200",), 989e12),
    (("h100", "nvl"), 835e12), (("h100", "pcie"), 756e12), (("h100",), 989e12),
    (("a100",), 312e12), (("a800",), 312e12),
    (("l40s",), 362e12), (("l4",), 121e12), (("a10g",), 70e12), (("a10",), 125e12),
    (("a6000",), 155e12), (("a40",), 150e12), (("a30",), 165e12),
    (("rtx 4090",), 165e12), (("rtx 3090",), 71e12), (("t4",), 65e12), (("v100",), 125e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a GPU by its name ("NVIDIA H100 80GB HBM3"), or None
    for a device the table does not know."""
    name = device_name.lower()
    for parts, flops in PEAK_FLOPS:
        if all(p in name for p in parts):
            return flops
    return None


def flops_per_token(n_params: int, layers: int, seq_len: float, d_model: int,
                    n_trained: int | None = None) -> float:
    """Training FLOPs per token (forward and backward) of a decoder-only Transformer, as
    the PaLM paper counts them (Chowdhery et al. 2022, appendix B): 6·N for the weight
    matmuls plus 12·L·T·d for attention's (QKᵀ and AV over T positions, d = heads × head
    width). Rematerialisation is not counted: a model FLOPs figure, not hardware FLOPs.
    6·N is 2·N forward, 2·N for the backward's input gradients and 2·N for its weight
    gradients; where only `n_trained` of the N take a gradient (LoRA, a frozen backbone)
    the last is 2·n_trained (an upper bound where the layers below the lowest trained one
    need no backward at all)."""
    trained = n_params if n_trained is None else n_trained
    return 4.0 * n_params + 2.0 * trained + 12.0 * layers * seq_len * d_model


def add_mfu(values: dict[str, float], per_token: float, peak: float | None,
            rate: float | None = None) -> None:
    """`throughput/tflops` (model TFLOP/s achieved: tokens/s × `per_token`) and, against
    `peak` FLOP/s, `throughput/mfu` (a fraction). `rate`: the positions a second, where
    they are not tokens/s (a vision Transformer's patches)."""
    rate = values.get("throughput/tokens_per_s") if rate is None else rate
    if rate is None or per_token <= 0:
        return
    achieved = rate * per_token
    values["throughput/tflops"] = achieved / 1e12
    if peak:
        values["throughput/mfu"] = achieved / peak


def model_shape(model: object, experts: Any = None) -> tuple[int, int, int, int | None]:
    """(N, layers, d_model, context) of a Transformer, for `flops_per_token`. N counts the
    parameters a token's matmuls use: every parameter once (tied ones once), less the
    embedding tables that are only looked up (a position table; an input table not tied
    to the output layer), a routed expert's k/E times (`experts.find_experts`: top-k of E
    experts). A Hugging Face config gives layers, width and context; other
    models: the attention modules (outermost), the first embedding's width and a `ctx`
    attribute. layers or d_model 0 where they cannot be told: 6·N alone; layers 0 for a
    model known to have no attention (a state-space model, Mamba: its config's
    `num_hidden_layers` count mixers that have no QKᵀ or AV to add; `_without_attention`)."""
    from torch import nn

    from .attention import has_attention
    from .experts import find_experts
    from .paths import unwrapped

    assert isinstance(model, nn.Module)
    model = unwrapped(model)  # a DDP wrapper has no config
    n = round((experts or find_experts(model)).active(matmul_params(model)))
    cfg = getattr(model, "config", None)

    def read(*names: str) -> int | None:
        for name in names:
            v = getattr(cfg, name, None)
            if isinstance(v, int):
                return v
        return None

    layers = read("num_hidden_layers", "n_layer", "num_layers")
    d = read("hidden_size", "n_embd", "d_model")
    ctx = read("max_position_embeddings", "n_positions", "n_ctx")
    if layers is None:
        seen: list[str] = []
        for path, m in model.named_modules():
            attn = isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith(
                ("Attention", "SelfAttention"))
            if attn and path and not any(path.startswith(p + ".") for p in seen):
                seen.append(path)
        layers = len(seen)
    if d is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        mha = next((m for m in model.modules() if isinstance(m, nn.MultiheadAttention)), None)
        d = emb.embedding_dim if emb is not None else mha.embed_dim if mha is not None else 0
    own_ctx: object = getattr(model, "ctx", None)
    if ctx is None and isinstance(own_ctx, int):
        ctx = own_ctx
    if layers and not has_attention(model) and _without_attention(model, cfg):
        layers = 0
    return n, layers, d, ctx


def _without_attention(model: Any, cfg: object) -> bool:
    """Whether a model in which `has_attention` finds none is known to have none: a Hugging
    Face one (its modeling code names each attention module so), or one whose blocks mix by
    recurrence or a state space (an nn.RNN, LSTM or GRU; a module whose class says Mamba
    or SSM: mamba_ssm's mixers). A Transformer of one's own may call
    F.scaled_dot_product_attention from a block of any name (`Block.qkv`): the layers its
    config gives keep their attention term."""
    from torch import nn

    if any(c.__module__.startswith("transformers.") for c in type(cfg).__mro__):
        return True
    return any(isinstance(m, nn.RNNBase) or any(w in type(m).__name__.lower()
                                                for w in ("mamba", "ssm"))
               for m in model.modules())


def matmul_params(model: object) -> list:
    """The parameters a token's matmuls use: every parameter once (tied ones once), less the
    embedding tables that are only looked up and the side of a PEFT `modules_to_save`
    wrapper that its forward does not call."""
    from torch import nn

    from .paths import unwrapped

    assert isinstance(model, nn.Module)
    model = unwrapped(model)
    idle, wrappers = _idle_in_wrappers(model)
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    in_matmul = {id(m.weight) for m in model.modules()
                 if not isinstance(m, nn.Embedding) and id(m) not in wrappers
                 and getattr(m, "weight", None) is not None}
    return [p for p in model.parameters()
            if id(p) not in looked_up - in_matmul and id(p) not in idle]


def _idle_in_wrappers(model: Any) -> tuple[set[int], set[int]]:
    """PEFT's `modules_to_save`: a wrapper holding a module (`original_module`) and trained
    copies of it (`modules_to_save`), whose forward calls one of the two, never both. The
    ids of the parameters of the side its forward does not call (the frozen original while
    an adapter with a copy is active), and the ids of the wrappers, whose `weight` is a
    child's (an embedding copy's: still only looked up)."""
    from torch import nn

    idle: set[int] = set()
    wrappers: set[int] = set()
    for m in model.modules():
        original, copies = getattr(m, "original_module", None), getattr(m, "modules_to_save", None)
        if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
            continue
        wrappers.add(id(m))
        active = getattr(m, "active_adapters", None) or []
        if not getattr(m, "disable_adapters", False) and active and all(
                a in copies for a in active):
            idle |= {id(p) for p in original.parameters()}
        else:
            idle |= {id(p) for p in copies.parameters()}
    return idle, wrappers


ENCODER_DECODER = (
    "throughput/tflops and MFU of an encoder-decoder are estimates: they count every weight "
    "for every token of tokens/s (the source's, the encoder's input), where the encoder's "
    "weights see the source's tokens and the decoder's the target's; close where the two "
    "are alike in length (translation), too high (up to 2x) where the source is the longer "
    "(summarisation), too low where the target is")
VISION_TEXT = (
    "throughput/tflops and MFU of a model with a vision tower beside its text (CLIP, SigLIP, "
    "a vision-language model) are estimates: they count every weight for every token of "
    "tokens/s (the batch's text tokens), where the vision tower's weights see each image's "
    "patches instead; too low where an image has more patches than its text has tokens "
    "(CLIP ViT-B/16: 197 patches against a caption's ~20 tokens, about 6x), too high where "
    "the text is the longer")


IMAGE_TOKENS = (
    "throughput/tflops and MFU of a vision Transformer count its weights for each of the "
    "{t} positions its encoder sees an image (its position table's: the patches and a class "
    "token) for each sample of samples/s, attention's over those {t}; the classifier head, "
    "which sees one position, and the patch projection, which sees no class token, are "
    "counted at every position too (a slight overcount)")


ADDED = ("position_embeddings", "cls_token", "distillation_token", "mask_token",
         "register_tokens")


def image_tokens(model: Any) -> int | None:
    """The positions a vision Transformer's encoder sees an image (ViT's 16 patches and
    class token at 32 px in patches of 8: 17; DeiT's distillation token too): the length
    of the position table of a Hugging Face model whose config has an `image_size` and a
    `patch_size` and no text part (CLIP's two towers: `has_vision_tower`). None for any
    other model, or one whose table is not found: its batches of pixels get no TFLOP/s.
    None too where the table does not tell the positions each layer sees: a hierarchical
    one (Swin's `depths`: windowed attention, stages merging patches 4 to 1, its
    absolute table the first stage's), one that masks most patches before its encoder
    (ViTMAE's `mask_ratio`), or one that resizes its table to every input (Dinov2's: its
    Hub configs' 518 px table, 1,370 positions, where a fine-tune at 224 px sees 257)."""
    from torch import nn

    cfg = getattr(model, "config", None)
    if (getattr(cfg, "image_size", None) is None or getattr(cfg, "patch_size", None) is None
            or getattr(cfg, "text_config", None) is not None or has_vision_tower(model)
            or getattr(cfg, "depths", None) is not None
            or (getattr(cfg, "mask_ratio", None) or 0) > 0
            or str(getattr(cfg, "model_type", "")).startswith("dinov2")):
        return None
    for name, p in model.named_parameters():  # ViT, DeiT, BEiT: a [1, T, d] parameter
        if name.endswith("position_embeddings") and p.dim() == 3 and p.shape[0] == 1:
            return int(p.shape[1])
    for name, m in model.named_modules():  # a CLIP vision tower alone: an nn.Embedding
        if name.endswith("position_embedding") and isinstance(m, nn.Embedding):
            return int(m.num_embeddings)
    return None


def has_vision_tower(model: Any) -> bool:
    """A Hugging Face model (or one a module holds) whose config has both a vision and a
    text part: CLIP's and SigLIP's two towers, a vision-language model's encoder."""
    return any(getattr(cfg, "vision_config", None) is not None
               and getattr(cfg, "text_config", None) is not None
               for cfg in (getattr(m, "config", None) for m in model.modules()))


class Mfu:
    """Adds `throughput/tflops` and `throughput/mfu` to a step's figures (an alert engine's
    `derive`). The attention term's T is the step's padded sequence length where the step
    says it (tokens/s ÷ samples/s ÷ the real share), else the model's context. tokens/s
    counts real tokens only, so padding lowers MFU, as it wastes the device."""

    def __init__(self, n_params: int, layers: int, d_model: int, ctx: int | None,
                 peak: float | None, n_trained: int | None = None):
        self.n, self.layers, self.d, self.ctx, self.peak = n_params, layers, d_model, ctx, peak
        self.n_trained = n_trained
        self.retrained: list[tuple[int, int]] = []  # (from step, n_trained): changed mid-run
        self.experts: Any = None  # the model's routed experts (`experts.find_experts`)
        self.unknown_experts: list[str] = []  # routed experts counted whole: top-k unknown
        self.notes: list[str] = []  # what the run says once of how far to trust its figures
        # where they are said (the run's events): at the first step that has tokens/s, so
        # TFLOP/s and MFU to say them of; a run of none (speech features, pixels) says none
        self.say: Callable[[int, str], None] | None = None
        self._said = False
        self.image_tokens: int | None = None  # a vision Transformer's positions an image

    @classmethod
    def of(cls, model: object, peak: float | None) -> Mfu:
        """The model's shape, its matmul parameters that take a gradient (those frozen
        when the run opens take none: LoRA's base weights), and the `peak` given, else the
        GPU's by its name (None on a CPU or an unknown GPU: TFLOP/s alone)."""
        from torch import nn

        from .data import is_encoder_decoder
        from .experts import find_experts, unknown_note
        from .paths import unwrapped

        assert isinstance(model, nn.Module)
        dev = next((p.device for p in model.parameters()), None)
        if peak is None and dev is not None and dev.type == "cuda":
            import torch

            peak = peak_flops(torch.cuda.get_device_name(dev))
        experts = find_experts(unwrapped(model))
        trained = experts.active([p for p in matmul_params(model) if p.requires_grad])
        out = cls(*model_shape(model, experts), peak, n_trained=round(trained))
        out.experts, out.unknown_experts = experts, experts.unknown
        out.notes = [unknown_note(experts.unknown)] if experts.unknown else []
        if is_encoder_decoder(model):
            out.notes.append(ENCODER_DECODER)
        if has_vision_tower(model):
            out.notes.append(VISION_TEXT)
        out.image_tokens = image_tokens(unwrapped(model))
        if out.image_tokens:  # its position table and class token are added, as a
            # language model's looked-up position table: in no matmul
            added = [p for name, p in unwrapped(model).named_parameters()
                     if name.rsplit(".", 1)[-1] in ADDED and p.dim() == 3 and p.shape[0] == 1]
            out.n -= sum(p.numel() for p in added)
            out.n_trained = (out.n_trained or 0) - sum(
                p.numel() for p in added if p.requires_grad)
            out.notes.append(IMAGE_TOKENS.format(t=out.image_tokens))
        return out

    def meta(self) -> dict[str, Any]:
        """The shape the run records (`run.meta["run"]["flops"]`)."""
        return {"n_params": self.n, "layers": self.layers, "d_model": self.d, "ctx": self.ctx,
                "peak_flops": self.peak, "n_trained": self.n_trained,
                **({"image_tokens": self.image_tokens} if self.image_tokens else {})}

    def seq_len(self, values: dict[str, float]) -> float:
        tokens, samples = values.get("throughput/tokens_per_s"), values.get(
            "throughput/samples_per_s")
        if tokens and samples:
            return tokens / samples / max(1.0 - values.get("data/padding_ratio", 0.0), 1e-6)
        return float(self.ctx or 0)

    def retrain(self, model: Any, step: int) -> None:
        """From `step` on, count the weights that take a gradient again: a layer unfrozen
        (or frozen) mid-run changes what a token's backward pass costs."""
        from .experts import find_experts
        from .paths import unwrapped

        experts = self.experts or find_experts(unwrapped(model))
        trained = [p for p in matmul_params(model) if p.requires_grad]
        self.retrained.append((step, round(experts.active(trained))))

    def __call__(self, values: dict[str, float], step: int | None = None) -> None:
        rate, seq = values.get("throughput/tokens_per_s"), None
        images = values.get("throughput/samples_per_s")
        if rate is None and self.image_tokens and images:  # pixels: no tokens, patches
            rate, seq = images * self.image_tokens, float(self.image_tokens)
        if rate is not None:
            if not self._said and self.say is not None:
                self._said = True
                for note in self.notes:
                    self.say(step or 0, note)
            trained = next((n for since, n in reversed(self.retrained)
                            if step is None or since <= step), self.n_trained)
            add_mfu(values, flops_per_token(self.n, self.layers, seq or self.seq_len(values),
                                            self.d, trained), self.peak, rate)
