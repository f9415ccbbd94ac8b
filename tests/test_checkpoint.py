import random

import numpy as np
import pytest
import torch

from nbwatch.checkpoint import Checkpointer, CheckpointError, load, rng_state, set_rng_state


def state(model):
    return {"model": model.state_dict(), "rng": rng_state()}


def test_rotation_keeps_last_n_and_best_apart(tmp_path):
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(tmp_path / "ck", keep_last=2)
    for step, val in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5)]:
        saved = ck.save(state(model), step, val)
        assert saved.bytes > 0 and saved.seconds >= 0
    assert [s for s, _ in ck.steps()] == [30, 40]
    best = load(tmp_path / "ck" / "best.pt")
    assert best["step"] == 20 and best["val_loss"] == 1.0
    assert ck.latest().name == "step_00000040.pt"
    assert not list((tmp_path / "ck").glob(".*tmp*"))


def test_loads_with_weights_only_and_restores_rngs(tmp_path):
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(tmp_path)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    ck.save(state(model), 1)
    draws = (torch.rand(1).item(), random.random(), np.random.rand())
    obj = torch.load(ck.latest(), weights_only=True)  # what a user would do
    torch.nn.Linear(3, 2).load_state_dict(obj["model"])
    set_rng_state(obj["rng"])
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == draws


def test_corrupt_checkpoint_names_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "step_00000005.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="step_00000005.pt cannot be read.*delete it"):
        load(bad)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, other)
    with pytest.raises(CheckpointError, match="not an nbwatch checkpoint"):
        load(other)


def test_a_resumed_run_keeps_the_earlier_best(tmp_path):
    model = torch.nn.Linear(3, 2)
    Checkpointer(tmp_path).save(state(model), 10, val_loss=1.0)
    resumed = Checkpointer(tmp_path)  # a new process, later
    assert resumed.best_val == 1.0
    assert not resumed.save(state(model), 20, val_loss=2.0).best
    assert load(tmp_path / "best.pt")["step"] == 10


def test_best_is_a_checkpoint_taken_at_its_eval(tmp_path):
    """Evals every 30 steps (and at the last), checkpoints every 25: only the last
    checkpoint holds an eval's weights, so only it can be "best" (the one at step 50 had
    taken step 30's val loss for its own); and the last step's eval is its checkpoint's,
    written once."""
    import nbwatch
    from nbwatch.demo import make_demo

    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    vals = iter([3.0, 2.0, 1.0, 0.5])
    mon = nbwatch.Monitor(demo.model, demo.optimizer, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, max_steps=100, val_fn=lambda m: next(vals),
              eval_every=30, checkpoint_every=25, dry_run=False, display=False).wait()
    assert mon.state == "finished", mon.error
    ev = mon.events
    saved = ev[ev.kind == "checkpoint"]
    assert saved.step.tolist() == [25, 50, 75, 100]
    assert [bool(d.get("best")) for d in saved.data] == [False, False, False, True]
    best = load(tmp_path / "r" / "checkpoints" / "best.pt")
    assert best["step"] == 100 and best["val_loss"] == 0.5
    assert mon.df["loss/val"].dropna().index.tolist() == [30, 60, 90, 100]


def test_a_ddp_runs_checkpoint_resumes_without_ddp_and_back(tmp_path):
    """A DDP job's checkpoints hold the module's own keys (no `module.`): the run resumes
    alone, unwrapped, and again under DDP; a checkpoint written with the prefix still loads."""
    import torch.distributed as dist

    import nbwatch
    from nbwatch.checkpoint import fit_keys
    from tests.test_fsdp import free_port

    def train(model, steps, resume):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", resume=resume, display=False)
        data = [torch.randn(4, 3) for _ in range(8)]
        mon.start(lambda m, x: m(x).square().mean(), data, max_steps=steps,
                  checkpoint_every=5).wait()
        return mon

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        train(torch.nn.parallel.DistributedDataParallel(net), 5, False)
        saved = load(tmp_path / "r" / "checkpoints" / "step_00000005.pt")["model"]
        assert set(saved) == set(net.state_dict())  # no "module." prefix
        assert train(net, 10, True).step == 10  # alone, unwrapped
        assert train(torch.nn.parallel.DistributedDataParallel(net), 15, True).step == 15
    finally:
        dist.destroy_process_group()
    prefixed = {f"module.{k}": v for k, v in saved.items()}  # as nbwatch wrote them before
    assert fit_keys(prefixed, net.state_dict().keys()).keys() == saved.keys()
    odd = {"module.x": torch.zeros(1)}  # a model whose own child is named "module"
    assert fit_keys(odd, ["module.x"]) == odd


def test_the_checkpoints_of_only_the_newest_rewinds_are_kept(tmp_path):
    """Each rewind sets its abandoned checkpoints aside (checkpoints/rewind/<n>/); rule
    driven rewinds over a long run must not fill the disk: the newest 3 branches' stay."""
    from nbwatch.checkpoint import KEEP_BRANCHES

    ck = Checkpointer(tmp_path, keep_last=10)
    model = torch.nn.Linear(2, 2)
    step = 0
    for n in range(1, 6):
        for _ in range(3):
            step += 1
            ck.save(state(model), step)
        ck.set_aside(step - 2, f"rewind/{n}")  # back over its last 2 checkpoints
        step -= 2
    kept = sorted(int(d.name) for d in (tmp_path / "rewind").iterdir())
    assert kept == list(range(6 - KEEP_BRANCHES, 6))
    assert all(len(list((tmp_path / "rewind" / str(n)).glob("*.pt"))) == 2 for n in kept)
    assert [s for s, _ in ck.steps()] == [1, 2, 3, 4, 5]  # the live line's, untouched


class _Net(torch.nn.Module):
    """A base for a PEFT model: `fc1` (where LoRA goes) and `fc2`, or `layer` for fc1."""

    def __init__(self, layer=None):
        super().__init__()
        self.fc1 = layer if layer is not None else torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train_logged(model, run_dir, steps=3, resume=False):
    """A loop of one's own over the trained parameters: its checkpoint at the end."""
    import nbwatch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False, resume=resume) as mon:
        for _ in range(steps):
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=torch.tensor(1.0))
        return mon.step


def test_a_qlora_style_base_leaves_its_quantization_statistics_out_and_resumes(tmp_path):
    """A quantized frozen base (bitsandbytes' Linear4bit, QLoRA) writes its weight's
    quantization statistics beside the weight in its state_dict (`weight.absmax`,
    `weight.quant_map`, `weight.quant_state.bitsandbytes__nf4`): they are the frozen base's,
    left out with it, and the checkpoint resumes into the base built again."""
    peft = pytest.importorskip("peft")

    class Quantized(torch.nn.Linear):
        def __init__(self):
            super().__init__(6, 6)
            self.weight.requires_grad_(False)

        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "weight.absmax"] = self.weight.detach().abs().amax(1)
            destination[prefix + "weight.quant_state.bitsandbytes__nf4"] = torch.zeros(4)

    def build():
        torch.manual_seed(0)
        return peft.get_peft_model(_Net(Quantized()), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["fc1"], init_lora_weights=False))

    model = build()
    assert _train_logged(model, tmp_path / "run") == 3
    (path,) = (tmp_path / "run" / "checkpoints").glob("step_*.pt")
    saved = load(path)["model"]
    assert not [k for k in saved if "base_layer.weight" in k], sorted(saved)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    again = build()
    assert _train_logged(again, tmp_path / "run", steps=0, resume=True) == 3
    for n, p in again.named_parameters():
        if n in trained:
            assert torch.equal(p, trained[n]), n



def test_a_frozen_second_adapter_is_kept_in_a_peft_checkpoint(tmp_path):
    """A PEFT model of two adapters, one trained before and now frozen (PEFT freezes every
    adapter but the active one) while the other trains: the checkpoint holds both, as the
    Trainer's (`save_pretrained`: every adapter) do; the frozen base alone is left out. A
    resume into the model built again gets the first adapter's trained weights back, not
    the new ones it was built with."""
    peft = pytest.importorskip("peft")

    def build():
        torch.manual_seed(0)
        model = peft.get_peft_model(_Net(), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["fc1"]), adapter_name="sft")
        model.add_adapter("dpo", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1"]))
        return model

    model = build()
    _train_logged(model, tmp_path / "sft")  # "sft" trains first
    model.set_adapter("dpo")  # then "dpo", "sft" frozen
    sft = {n: p.detach().clone() for n, p in model.named_parameters() if ".sft." in n}
    assert sft and not any(p.requires_grad for n, p in model.named_parameters() if n in sft)
    _train_logged(model, tmp_path / "dpo")
    (path,) = (tmp_path / "dpo" / "checkpoints").glob("step_*.pt")
    saved = load(path)["model"]
    assert set(sft) <= set(saved), sorted(saved)
    assert not [k for k in saved if "base_layer" in k or k.endswith("fc2.weight")]

    again = build()
    again.set_adapter("dpo")
    _train_logged(again, tmp_path / "dpo", steps=0, resume=True)
    for n, p in again.named_parameters():
        if n in sft:
            assert torch.equal(p, sft[n]), n


def test_a_peft_checkpoint_resumes_where_a_base_layer_was_unfrozen_mid_run(tmp_path):
    """A base layer unfrozen mid-run (`fc2` from the second step, its optimizer holding
    every parameter) is in the checkpoint, trained; the model built again for the resume
    has it frozen until its loop unfreezes it again. The resume loads it, and leaves out
    only what the checkpoint lacks of the frozen base (it refused the checkpoint: a weight
    of it frozen now read as an older full checkpoint, every base weight then missing)."""
    import nbwatch

    peft = pytest.importorskip("peft")

    def build():
        torch.manual_seed(0)
        return peft.get_peft_model(_Net(), peft.LoraConfig(r=2, lora_alpha=4,
                                                           target_modules=["fc1"]))

    def fc2(model):
        return model.base_model.model.fc2.weight

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False) as mon:
        for step in range(3):
            fc2(model).requires_grad_(step >= 1)
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=torch.tensor(1.0))
    trained = fc2(model).detach().clone()
    again = build()
    assert not fc2(again).requires_grad and not torch.equal(fc2(again), trained)
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1)
    with nbwatch.Monitor(again, opt2, run_dir=tmp_path / "run", display=False,
                         resume=True) as mon2:
        assert mon2.step == 3
    assert torch.equal(fc2(again), trained)
