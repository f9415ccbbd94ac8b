"""The per-step logits figures (`train_logits/log_z`, `train_logits/max_abs`) from each
source: `start()`'s step_fn returning `logits`, an own loop's `log(logits=...)`, and the
output layer's forward hook: under the Hugging Face Trainer and Lightning, and for a
step_fn or own loop that hands over no logits. Each recorded figure equals `logit_parts`
of the logits that step trained on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.probes.logit_rows import LOG_Z, MAX_ABS, logit_parts

from .conftest import make_batches


def tiny_lm(layers: int = 2, d: int = 32) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=d, layers=layers, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def expected(kept: list[tuple[torch.Tensor, torch.Tensor | None]]) -> np.ndarray:
    return np.array([[p.item() for p in logit_parts(x, m)] for x, m in kept])


def test_start_records_the_step_fns_logits_every_step(tmp_path):
    model, opt = tiny_lm()
    kept = []

    def step_fn(model, batch):
        logits = model(batch["input_ids"])
        if model.training:
            kept.append((logits.detach().clone(), batch["mask"]))
        return {"logits": logits, "labels": batch["labels"], "mask": batch["mask"]}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, make_batches(8), max_steps=8, accumulate=2, display=False).wait()
    df = nbwatch.open_run(tmp_path / "run").df
    got = df[[LOG_Z, MAX_ABS]].to_numpy()
    # the first micro-batch of each step: a cost that does not grow with accumulation
    assert got == pytest.approx(expected(kept[::2]), rel=1e-6)
    assert df[LOG_Z].gt(0).all()  # log Z ≥ log V − max|logit| > 0 for logits this small


def test_an_own_loop_passes_its_logits_to_log(tmp_path):
    model, opt = tiny_lm()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    kept = []
    with mon:
        for b in make_batches(5):
            logits = model(b["input_ids"])
            nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"]).backward()
            opt.step()
            opt.zero_grad()
            kept.append((logits.detach().clone(), b["mask"]))
            mon.log(logits=logits, mask=b["mask"])
    got = mon.df[[LOG_Z, MAX_ABS]].to_numpy()
    assert got == pytest.approx(expected(kept), rel=1e-6)
    assert "loss/train" not in mon.df  # no loss given: logits alone are no loss


class KeepsHead:
    """What the output layer of a model computed on each training forward, and the mask
    the step gave with it."""

    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self.hook = model.head.register_forward_hook(self.keep)

    def keep(self, mod, args, out):
        if mod.training and torch.is_grad_enabled():
            self.logits.append(out.detach().clone())


@pytest.mark.parametrize("d", [32, 64], ids=["narrow", "as wide as the vocabulary"])
def test_start_takes_the_output_layers_logits_when_the_step_fn_returns_a_loss(tmp_path, d):
    """Also where the blocks' Linears map onto as many features as the vocabulary (a
    char-level model's d = V, as the demo's): the head's logits, not a block's output."""
    model, opt = tiny_lm(d=d)
    heads = KeepsHead(model)
    masks = []

    def step_fn(model, batch):  # as a Hugging Face model's {"loss": out.loss}: no logits
        if model.training:
            masks.append(batch["mask"])
        loss = nbwatch.masked_cross_entropy(model(batch["input_ids"]), batch["labels"],
                                            batch["mask"])
        return {"loss": loss, "mask": batch["mask"]}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, make_batches(8), max_steps=4, accumulate=2, display=False).wait()
    heads.hook.remove()
    df = nbwatch.open_run(tmp_path / "run").df
    assert len(heads.logits) == 8 and len(df) == 4
    # set once step 1 handed no logits; then the first micro-batch of each step, its
    # padding left out by its mask
    assert np.isnan(df[LOG_Z].iloc[0])
    kept = list(zip(heads.logits[2::2], masks[2::2]))
    assert df[[LOG_Z, MAX_ABS]].iloc[1:].to_numpy() == pytest.approx(expected(kept), rel=1e-6)
    assert not model.head._forward_hooks  # nbwatch's hook goes with the run
    events = nbwatch.open_run(tmp_path / "run").events
    assert events[events["kind"] == "probe"].empty  # no word of figures missing


def test_start_sets_no_hook_when_the_step_fn_gives_its_logits(tmp_path):
    model, opt = tiny_lm()
    hooked = []

    def step_fn(model, batch):
        hooked.append(len(model.head._forward_hooks))
        return {"logits": model(batch["input_ids"]), "labels": batch["labels"],
                "mask": batch["mask"]}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, make_batches(5), max_steps=5, display=False).wait()
    assert hooked == [0] * 5  # never set: a compiled model would recompile for it
    assert nbwatch.open_run(tmp_path / "run").df[LOG_Z].notna().all()


def test_an_own_loop_without_logits_gets_the_output_layers_from_its_second_step(tmp_path):
    """The batch each step trained on: its last training forward before the optimizer
    step (the micro-batch whose mask `log()` is given), not a batch the loop dropped, an
    eval's forward, or another thread's forward in the meantime."""
    import threading

    model, opt = tiny_lm()
    heads = KeepsHead(model)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    batches = make_batches(12, T=16)
    trained = []
    with mon:
        for step in range(5):
            if step == 2:  # a batch the loop drops (a non-finite loss, say): never stepped
                model(batches[-1]["input_ids"])
            for b in batches[2 * step:2 * step + 2]:  # two micro-batches
                loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                                    b["mask"])
                loss.backward()
            trained.append((heads.logits[-1], b["mask"]))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.eval()
                model(b["input_ids"])  # an eval forward in the loop: not the training batch
                model.train()
            mon.log(loss=loss, mask=b["mask"])
            other = threading.Thread(target=model, args=(batches[-2]["input_ids"],))
            other.start()  # another thread's forward (a cell run while paused, say)
            other.join()
    heads.hook.remove()
    df = mon.df
    # the run opens at the first optimizer step: the hook is set at the first log()
    assert np.isnan(df[LOG_Z].iloc[0])
    got = df[[LOG_Z, MAX_ABS]].iloc[1:].to_numpy()
    assert got == pytest.approx(expected(trained[1:]), rel=1e-6)
    assert not model.head._forward_hooks


def test_the_hook_goes_when_the_final_checkpoint_fails(tmp_path):
    model, opt = tiny_lm(layers=1)
    b = make_batches(1)[0]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"), mon:
        for _ in range(2):
            model(b["input_ids"]).float().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=1.0)
        mon._session.recorder.ckpt.save = full_disk
    assert not model.head._forward_hooks


@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_without_an_output_layer_records_no_logits_figures(tmp_path, compiled):
    """Its output is a float tensor [B, 3]: not logits, compiled (watched at its output)
    or not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    mon = nbwatch.Monitor(torch.compile(model, backend="eager") if compiled else model, opt,
                          run_dir=tmp_path / "run")
    mon.start(lambda m, b: (m(b[0]) - b[1]).square().mean(), [(x, y)] * 3, max_steps=3,
              display=False).wait()
    df = nbwatch.open_run(tmp_path / "run").df
    assert len(df) == 3 and LOG_Z not in df


def test_log_refuses_what_cannot_be_logits(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    b = make_batches(1)[0]
    with mon:
        loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        with pytest.raises(TypeError, match=r"logits is a tensor of shape \(\).*logits=out"):
            mon.log(loss=loss, logits=loss)


def test_the_hf_trainer_records_its_lm_heads_logits_and_the_hook_goes(tmp_path):
    pytest.importorskip("transformers")
    import nbwatch.hf
    from tests.test_hf import make_trainer

    trainer = make_trainer(tmp_path / "out", max_steps=6, eval_steps=3)
    head = trainer.model.get_output_embeddings()
    kept, masks = [], []

    def keep(mod, args, out):  # what the Trainer's training forwards computed
        if mod.training and torch.is_grad_enabled():
            kept.append(out.detach().clone())

    def keep_mask(mod, args, kwargs):  # … and the padding they were given
        if mod.training and torch.is_grad_enabled():
            masks.append(kwargs["attention_mask"])

    mine = [head.register_forward_hook(keep),
            trainer.model.register_forward_pre_hook(keep_mask, with_kwargs=True)]
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    for h in mine:
        h.remove()
    assert run.state == "finished" and len(kept) == 6  # the evals' forwards did not count
    assert any(not m.all() for m in masks)  # padded batches: the mask leaves it out
    got = run.df[[LOG_Z, MAX_ABS]].to_numpy()
    assert got == pytest.approx(expected(list(zip(kept, masks))), rel=1e-6)
    assert not head._forward_hooks  # nbwatch's hook removed at the fit's end


def test_lightning_records_the_output_layers_logits_and_the_hook_goes(tmp_path):
    pytest.importorskip("lightning.pytorch")
    import nbwatch.lightning
    from tests.test_lightning import TinyModule, loader, make_trainer

    torch.manual_seed(0)
    module = TinyModule()
    trainer = make_trainer(tmp_path / "pl", max_steps=6, val_check_interval=3)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(8),
                                  val_dataloaders=loader(2, seed=1), run_dir=tmp_path / "run",
                                  display=False)
    run.wait()
    assert run.state == "finished"
    df = run.df.dropna(subset=["loss/train"])
    assert df[LOG_Z].notna().all() and df[MAX_ABS].gt(0).all() and len(df) == 6
    assert not module.net.head._forward_hooks


@pytest.mark.parametrize("shapes", ["varying", "fixed"])
@pytest.mark.parametrize("monitored", ["compiled", "original"])
def test_a_compiled_model_keeps_one_graph(tmp_path, monitored, shapes):
    """The hook never splits a `torch.compile`d graph (`fullgraph=True` holds): given the
    compiled model, nbwatch watches its output (outside the graph) and records the figures;
    given the module that a step_fn calls compiled, the output layer's hook does nothing
    inside the graph (or is never called: a graph compiled before it was set, whose shapes
    never change), and the run says why the figures are missing."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_fn(m, b):
        logits = compiled(b["input_ids"])
        return {"loss": nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"]),
                "mask": b["mask"]}

    batches = make_batches(4) if shapes == "varying" else make_batches(1) * 4
    mon = nbwatch.Monitor(compiled if monitored == "compiled" else model, opt,
                          run_dir=tmp_path / "run")
    mon.start(step_fn, batches, max_steps=4, display=False).wait()
    assert mon.state == "finished", mon.error
    assert not dynamo.utils.counters["graph_break"]
    df = nbwatch.open_run(tmp_path / "run").df
    if monitored == "compiled":
        assert df[LOG_Z].iloc[1:].notna().all()  # from step 2: step 1 handed no logits
    else:  # not recorded, and said once (the alerts feed shows it)
        assert LOG_Z not in df
        events = nbwatch.open_run(tmp_path / "run").events
        said = events[events["kind"] == "probe"]["message"].tolist()
        assert len(said) == 1 and "no training forward reached the hook" in said[0]
        assert "Return {'logits': ...} from the step_fn" in said[0]
    dynamo.reset()


def test_of_two_nets_the_figures_are_the_trained_ones(tmp_path):
    """A student and a frozen teacher each with a head onto the vocabulary: the training
    forward tells which one trains (the teacher runs without gradients)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "student": TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=32),
        "teacher": TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=32).requires_grad_(False)})
    opt = torch.optim.AdamW(model["student"].parameters(), lr=1e-3)
    heads = KeepsHead(model["student"])

    def step_fn(m, b):
        with torch.no_grad():
            m["teacher"](b["input_ids"])
        logits = m["student"](b["input_ids"])
        return {"loss": nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"])}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, make_batches(4), max_steps=4, display=False).wait()
    heads.hook.remove()
    got = nbwatch.open_run(tmp_path / "run").df[[LOG_Z, MAX_ABS]].iloc[1:].to_numpy()
    assert got == pytest.approx(expected([(x, None) for x in heads.logits[1:]]), rel=1e-6)


@pytest.mark.parametrize("loop", ["start", "own"])
def test_a_classifier_with_no_output_layer_records_its_models_logits(tmp_path, loop):
    """A Hugging Face image classifier (ViTForImageClassification: its
    get_output_embeddings() is None, it has no embedding onto a vocabulary) handing over
    only its loss: log Z over its classes, from the `.logits` its forward returns. A model
    whose output is a bare tensor stays without them
    (`test_a_model_without_an_output_layer_records_no_logits_figures`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_labels=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{"pixel_values": torch.randn(4, 3, 8, 8), "labels": torch.randint(0, 5, (4,))}
               for _ in range(4)]
    kept = []
    mine = model.register_forward_hook(
        lambda mod, args, out: kept.append(out.logits.detach().clone()) if mod.training else None)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    if loop == "start":
        mon.start(lambda m, b: m(**b).loss, batches, max_steps=4, display=False).wait()
    else:
        with mon:
            for b in batches:
                model(**b).loss.backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=1.0, batch=b)
    mine.remove()
    got = mon.df[[LOG_Z, MAX_ABS]].iloc[1:].to_numpy()  # the hook is set at step 1's end
    assert got == pytest.approx(expected([(x, None) for x in kept[1:]]), rel=1e-6)
    assert not model._forward_hooks


def test_a_regression_head_records_no_logits_figures(tmp_path):
    """A Hugging Face regression head of several outputs (problem_type="regression", its
    loss an MSE) names its outputs `.logits` too, but they are no scores over classes: no
    log Z of them is recorded, and its hook is gone after its first training forward (a
    classifier's are: `test_a_classifier_with_no_output_layer_records_its_models_logits`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, num_labels=3, problem_type="regression"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{"input_ids": torch.randint(0, 50, (4, 6)), "labels": torch.randn(4, 3)}
               for _ in range(4)]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(lambda m, b: m(**b).loss, batches, max_steps=4, display=False).wait()
    assert LOG_Z not in mon.df or mon.df[LOG_Z].isna().all()
    assert not model._forward_hooks
