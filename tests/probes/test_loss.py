import math

import pytest
import torch

from nbwatch import masked_cross_entropy
from nbwatch.probes.loss import check_not_copying, parse_step_output


def test_masked_cross_entropy_is_mean_over_real_tokens_only():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]]])  # [1, 3, 2]
    labels = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[1, 1, 0]])
    def ce(l0, l1, y):
        z = math.log(math.exp(l0) + math.exp(l1))
        return z - (l0 if y == 0 else l1)
    hand = (ce(2.0, 0.0, 0) + ce(0.0, 1.0, 1)) / 2  # the padded third token is ignored
    assert masked_cross_entropy(logits, labels, mask).item() == pytest.approx(hand, rel=1e-6)
    everything = (ce(2.0, 0.0, 0) + ce(0.0, 1.0, 1) + ce(5.0, -5.0, 1)) / 3
    assert masked_cross_entropy(logits, labels).item() == pytest.approx(everything, rel=1e-6)


def test_masked_cross_entropy_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="mask .* does not match labels"):
        masked_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long),
                             torch.ones(2, 4))


def test_dict_with_logits_gets_the_masked_mean():
    logits = torch.randn(2, 4, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = parse_step_output({"logits": logits, "labels": labels, "mask": mask})
    assert torch.allclose(out.loss, masked_cross_entropy(logits, labels, mask))
    assert out.reduction.startswith("masked token mean")
    assert out.mask is mask


@pytest.mark.parametrize(
    "value, error, match",
    [
        (None, TypeError, "returned None"),
        (3.0, TypeError, "loss is a float, not a tensor"),
        (torch.ones(3, requires_grad=True), ValueError, "not a scalar"),
        (torch.tensor(1.0), ValueError, "does not require grad"),
        ({"logits": torch.zeros(1)}, KeyError, "dict with keys"),
        ({"loss": torch.ones((), requires_grad=True), "mask": [1, 0]}, TypeError, "mask"),
        ({"logits": torch.zeros(2, 3, 5, requires_grad=True),
          "labels": torch.zeros(2, 3, dtype=torch.long), "mask": torch.ones(2, 4)},
         ValueError, "does not match"),
    ],
)
def test_bad_step_output_says_what_to_return(value, error, match):
    with pytest.raises(error, match=match):
        parse_step_output(value)


def test_masked_cross_entropy_ignores_hf_padded_labels():
    """Labels of -100 (a Hugging Face model's padded labels) are padding, as in
    `F.cross_entropy`'s own mean: not counted in the denominator, with or without a mask."""
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, 3:] = -100
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))
    assert masked_cross_entropy(logits, labels).item() == pytest.approx(theirs.item(), rel=1e-6)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 4] = 0
    keep = (labels != -100) & (mask == 1)
    hand = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert masked_cross_entropy(logits, labels, mask).item() == pytest.approx(hand.item(),
                                                                              rel=1e-6)


def test_a_module_holding_an_encoder_decoder_is_one():
    """A user's module around a T5 (a task head, a wrapper of its own): its labels equal
    to the source are a copy task (not refused), and its TFLOP/s are said to be estimates,
    as the T5's own are; `is_encoder_decoder` looks inside, the checks looked at the top
    module's config alone."""
    from types import SimpleNamespace

    from nbwatch.probes.throughput import ENCODER_DECODER, Mfu

    class Seq2Seq(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = torch.nn.Linear(8, 8)
            self.t5.config = SimpleNamespace(is_encoder_decoder=True)  # type: ignore[assignment]

    ids = torch.randint(0, 8, (2, 5))
    out = {"logits": torch.randn(2, 5, 8), "labels": ids}
    check_not_copying({"input_ids": ids}, out, Seq2Seq())
    with pytest.raises(ValueError, match="copy its input"):
        check_not_copying({"input_ids": ids}, out, torch.nn.Linear(8, 8))
    assert ENCODER_DECODER in Mfu.of(Seq2Seq(), peak=None).notes
