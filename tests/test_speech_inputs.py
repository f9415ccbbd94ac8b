"""A batch whose model input is not tokens (Whisper's log-mel `input_features`, wav2vec2's
raw `input_values`, a ViT's `pixel_values`) and that holds no `input_ids`: its
`attention_mask` (Whisper's feature extractor's, `return_attention_mask=True`, for
SpecAugment) marks frames, not tokens. No loop counts token figures from it (tokens/real,
tokens/s, TFLOP/s and MFU, padding, lengths); samples/s is its rows in every loop."""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
from nbwatch.probes.data import input_tokens  # noqa: E402
from nbwatch.probes.loss import input_mask  # noqa: E402
from tests.conftest import lightning_fit  # noqa: E402
from tests.test_families_more import VOCAB, run_under_trainer, speech  # noqa: E402

TOKEN_FIGURES = ("tokens/real", "throughput/tokens_per_s", "throughput/tflops",
                 "throughput/mfu", "data/padding_ratio", "data/seq_len_mean",
                 "data/seq_len_max")
FRAMES = 20


def whisper():
    torch.manual_seed(0)
    return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=16,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2))


def framed(n: int, seed: int) -> list[dict]:
    """`speech` items with the feature extractor's frames mask: 12 to 20 of 20 frames real
    (a batch of 4 holds 63 of them in the audit's run: what was counted as its tokens)."""
    items, g = speech(n, seed), torch.Generator().manual_seed(seed + 100)
    for it in items:
        real = int(torch.randint(12, FRAMES + 1, (1,), generator=g))
        it["attention_mask"] = (torch.arange(FRAMES) < real).long()
    return items


def batched(items: list[dict], size: int = 4) -> list[dict]:
    return [{k: torch.stack([it[k] for it in items[i:i + size]]) for k in items[0]}
            for i in range(0, len(items), size)]


def assert_no_token_figures(df) -> None:
    for name in TOKEN_FIGURES:
        assert name not in df.columns or df[name].isna().all(), name


def assert_no_seq_len_histogram(run_dir, model: str = "model") -> None:
    """No `data/seq_len` histogram (the weights' are there: the run wrote histograms)."""
    run = nbwatch.open_run(run_dir)
    assert run.histograms(f"weight/{model}.encoder.conv1")[0].size
    with pytest.raises(KeyError, match="no histogram series 'data/seq_len'"):
        run.histograms("data/seq_len")


def assert_samples_per_s(df, rows: int = 4) -> None:
    """samples/s: the batch's rows over the step's time, wherever the step has a time."""
    timed = df.dropna(subset=["time/step"])
    assert len(timed) >= 2
    assert timed["throughput/samples_per_s"].tolist() == pytest.approx(
        (rows / timed["time/step"]).tolist(), rel=1e-5)


def test_a_frames_mask_is_not_tokens():
    """Unit: the keys decide, one look at the dict; a batch with input_ids (a
    vision-language or audio-language model's text) still counts its text's mask."""
    from nbwatch.probes.data import reads_tokens

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for key in ("input_features", "input_values", "pixel_values"):
        batch = {key: torch.randn(2, 3), "attention_mask": mask}
        assert not reads_tokens(batch)
        assert input_tokens(batch) is None and input_mask(batch) is None
        text = {**batch, "input_ids": torch.ones(2, 3, dtype=torch.long)}
        assert reads_tokens(text) and int(input_tokens(text).sum()) == 3
        assert int(input_mask(text).sum()) == 3
    assert int(input_tokens({"input_ids": torch.ones(2, 3, dtype=torch.long),
                             "attention_mask": mask}).sum()) == 3
    assert reads_tokens((torch.randn(2, 3), mask))  # not a dict: as before


def test_whispers_frames_mask_counts_no_tokens_under_the_trainer(tmp_path):
    """4 samples × 20 frames, 12 to 20 real each: tokens/real was 63 (frames) at a step, the
    padding ratio and lengths in frames, tokens/s and TFLOP/s per frame. Now none of them;
    samples/s 4 a step, as without the mask."""
    train = framed(24, 0)
    frames = [int(b["attention_mask"].sum()) for b in batched(train)]
    assert all(n < 4 * FRAMES for n in frames) and 63 in frames  # padded, the audit's 63
    run, df, _ = run_under_trainer(tmp_path, whisper(), train, framed(4, 1))
    assert_no_token_figures(df)
    assert_samples_per_s(df)
    assert_no_seq_len_histogram(tmp_path / "run")


def test_whispers_frames_mask_counts_no_tokens_under_start(tmp_path):
    """start(): a bare loss (the adapters' rule, the batch's attention_mask read as its
    tokens) and {'loss', 'mask'} with the frames mask: no token figures either way."""
    batches = batched(framed(12, 0))
    for name, step in (("loss", lambda m, b: m(**b).loss),
                       ("mask", lambda m, b: {"loss": m(**b).loss,
                                              "mask": b["attention_mask"]})):
        model = whisper()
        mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              run_dir=tmp_path / name, display=False)
        mon.start(step, batches, max_steps=3, display=False).wait()
        assert mon.state == "finished", name
        df = nbwatch.open_run(tmp_path / name).df
        assert_no_token_figures(df)
        assert_samples_per_s(df)
        assert_no_seq_len_histogram(tmp_path / name)


def test_whispers_frames_mask_counts_no_tokens_under_lightning(tmp_path):
    lightning_fit(tmp_path, whisper(), lambda net, b: net(**b).loss, batched(framed(12, 0)),
                  tmp_path / "run")
    df = nbwatch.open_run(tmp_path / "run").df
    assert len(df) == 3
    assert_no_token_figures(df)
    assert_samples_per_s(df)
    assert_no_seq_len_histogram(tmp_path / "run", "net.model")


def test_whispers_frames_mask_counts_no_tokens_in_a_loop_of_ones_own(tmp_path):
    model = whisper()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False) as mon:
        for b in batched(framed(16, 0)):
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss, batch=b)
    df = nbwatch.open_run(tmp_path / "run").df
    assert len(df) == 4
    assert_no_token_figures(df)
    assert_no_seq_len_histogram(tmp_path / "run")


def vit():
    torch.manual_seed(0)
    return tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3))


def images(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(3, 8, 8, generator=g),
             "labels": torch.randint(0, 3, (), generator=g)} for _ in range(n)]


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)


@pytest.mark.parametrize(("case", "micro"), [
    ("whisper", 1), ("whisper_frames", 1), ("vit", 1), ("x_y", 1),
    ("whisper", 2), ("whisper_frames", 2), ("vit", 2)])
def test_a_loop_of_ones_own_counts_a_batch_without_tokens_by_its_rows(tmp_path, case, micro):
    """`log(loss, batch=batch)` of a batch with no token mask (speech features, pixels, an
    (x, y) pair) records samples/s as the other loops do: the rows of its first batched
    tensor over the step's time (4 a micro-batch; `batch=[b1, b2]` of dicts under
    accumulation, a backward each: 8); it recorded none (the rows of an attention_mask or
    input_ids only)."""
    if case.startswith("whisper"):
        model, forward = whisper(), (lambda m, b: m(**b).loss)
        batches = batched(framed(16 * micro, 0) if case == "whisper_frames"
                          else speech(16 * micro, 0))
    elif case == "vit":
        model, forward = vit(), (lambda m, b: m(**b).loss)
        batches = batched(images(16 * micro))
    else:
        model, forward = _Mlp(), (lambda m, b: m(*b))
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(4, 6, generator=g), torch.randn(4, generator=g))
                   for _ in range(4 * micro)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False) as mon:
        for i in range(0, len(batches), micro):
            step = batches[i:i + micro]
            losses = [forward(model, b) for b in step]
            for one in losses:
                (one / micro).backward()
            opt.step()
            opt.zero_grad()
            if micro == 1:
                mon.log(losses[0], batch=step[0])
            else:
                mon.log(losses, batch=step)
    df = nbwatch.open_run(tmp_path / "run").df
    assert len(df) == 4
    assert df.loc[1, "time/step"] != df.loc[1, "time/step"]  # step 1: no time, no rate
    assert_samples_per_s(df, rows=4 * micro)
    if case == "vit":  # its TFLOP/s counts its patches, no tokens (probes/test_throughput.py)
        assert df["throughput/tflops"].iloc[1:].notna().all()
        df = df.drop(columns=["throughput/tflops"])
    assert_no_token_figures(df)


@pytest.mark.parametrize("loop", ["start", "log", "lightning"])
def test_whisper_with_no_tokens_says_nothing_of_tflops_it_does_not_record(tmp_path, loop):
    """Whisper fed `input_features` alone (no mask) records no tokens/s, TFLOP/s or MFU:
    the run said, at its start, that its TFLOP/s and MFU were encoder-decoder estimates.
    The note waits for a step with tokens/s (a T5's: `test_throughput.py`); this run has
    none (the Trainer's: `test_families_more.py`)."""
    from nbwatch.probes.throughput import ENCODER_DECODER

    batches, run_dir = batched(speech(12, 0)), tmp_path / "run"
    model = whisper()
    if loop == "lightning":
        lightning_fit(tmp_path, model, lambda net, b: net(**b).loss, batches, run_dir)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False)
        if loop == "start":
            mon.start(lambda m, b: m(**b).loss, batches, max_steps=3, display=False).wait()
        else:
            with mon:
                for b in batches:
                    loss = model(**b).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    mon.log(loss, batch=b)
    run = nbwatch.open_run(run_dir)
    assert len(run.df) == 3
    assert_no_token_figures(run.df)
    assert_samples_per_s(run.df)
    assert ENCODER_DECODER not in set(run.events.message)
    assert not run.events.message.str.contains("estimates").any()
