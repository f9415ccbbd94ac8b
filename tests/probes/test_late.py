"""`probes.late`: a CPU step's mask and logits figures taken with its record, from copies
kept at the step: the same bits as the step's own, whatever the masks do after."""

from __future__ import annotations

import math

import torch

from nbwatch.probes import late
from nbwatch.probes.data import batch_figures
from nbwatch.probes.logit_rows import NAMES, ROW_BYTES, logit_parts, row_copy


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_a_batch_of_steps_gives_each_the_bits_its_own_step_would():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = int(torch.randint(2, 2048, (1,), generator=g))
        steps = []
        for _ in range(int(torch.randint(1, 17, (1,), generator=g))):
            b = int(torch.randint(1, 9, (1,), generator=g))
            t = int(torch.randint(1, 200, (1,), generator=g))
            logits = torch.randn(b, t, vocab, generator=g) * float(torch.rand(1, generator=g) * 30)
            mask = (torch.rand(b, t, generator=g) > 0.3).long() if trial % 3 else None
            if trial % 5 == 0 and mask is not None:
                mask[:] = 0  # no real row: log Z and max |logit| NaN, not a false 0
            host: dict = {}
            assert late.keep_rows(host, *row_copy(logits), mask)
            eager = [x.item() for x in logit_parts(logits, mask)]
            masks = None
            if mask is not None:
                assert late.keep_masks(host, [mask])
                masks = batch_figures([mask])
            steps.append((host, eager, masks))
        lengths = late.resolve([(h, h.pop(late.KEY)) for h, _, _ in steps])
        for (host, eager, masks), n in zip(steps, lengths):
            assert all(same(host[k], v) for k, v in zip(NAMES, eager)), (host, eager)
            if masks is not None:
                assert {k: host[k] for k in masks.host} == masks.host
                assert host["_padded"] == masks.padded and torch.equal(n, masks.lengths)


def test_the_micro_batches_masks_of_a_step_give_its_figures():
    g = torch.Generator().manual_seed(2)
    masks = [(torch.rand(b, t, generator=g) > 0.4).to(dtype)
             for b, t, dtype in ((4, 9, torch.long), (2, 13, torch.bool), (3, 5, torch.float32),
                                 (2, 7, torch.bfloat16))]
    want = batch_figures(masks)
    host: dict = {}
    assert late.keep_masks(host, masks)
    (lengths,) = late.resolve([(host, host.pop(late.KEY))])
    assert {k: host[k] for k in want.host} == want.host and host["_padded"] == 91.0
    assert torch.equal(lengths, want.lengths)


def test_a_bfloat16_mask_is_kept_as_float32_and_weights_the_rows_alike():
    """numpy cannot read bfloat16: the copy is float32, the same 0/1 values."""
    logits = torch.randn(3, 10, 17)
    mask = (torch.arange(10) < torch.tensor([[4], [10], [7]])).to(torch.bfloat16)
    want = [x.item() for x in logit_parts(logits, mask)], batch_figures([mask])
    host: dict = {}
    assert late.keep_rows(host, *row_copy(logits), mask)
    assert late.keep_masks(host, [mask])
    assert host[late.KEY].masks[0].dtype == torch.float32
    (lengths,) = late.resolve([(host, host.pop(late.KEY))])
    assert [host[k] for k in NAMES] == want[0]
    assert {k: host[k] for k in want[1].host} == want[1].host
    assert torch.equal(lengths, want[1].lengths)


def test_what_the_loop_does_to_its_tensors_after_the_step_changes_nothing():
    logits, mask = torch.randn(2, 8, 11), torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    want = [x.item() for x in logit_parts(logits, mask)], batch_figures([mask]).host
    host: dict = {}
    late.keep_rows(host, *row_copy(logits), mask)
    late.keep_masks(host, [mask])
    assert len(host[late.KEY].copies) == 1  # one copy of a mask given twice
    logits.fill_(7.0)  # a buffer the loop reuses
    mask.zero_()
    late.resolve([(host, host.pop(late.KEY))])
    assert [host[k] for k in NAMES] == want[0]
    assert {k: host[k] for k in want[1]} == want[1]


def test_a_mask_of_other_values_is_counted_for_the_record_to_leave_out():
    mask = torch.tensor([[1, 1, 0, 2], [1, -1, 1, 1]])
    host: dict = {}
    assert late.keep_masks(host, [mask])  # no look at the step: found with the record
    assert late.resolve([(host, host.pop(late.KEY))]) == [None]
    assert host == {"_mask_bad": 2.0}  # `bad_mask` drops its figures and says so


def test_what_numpy_cannot_read_or_rows_too_wide_are_taken_at_the_step():
    host: dict = {}
    assert not late.keep_masks(host, [torch.ones(2, 3, dtype=torch.complex64)])
    assert not late.keep_masks(host, [torch.ones(0, 3)])
    assert not late.keep_masks(host, [])
    vocab = ROW_BYTES // (64 * 4) + 1
    assert row_copy(torch.zeros(1, 64, vocab)) is None  # its ops cost more than the toll
    assert row_copy(torch.zeros(1, 64, vocab - 1)) is not None
    assert host == {}
