"""What sample_fn may return: text, an image (array, tensor, PIL) or a small table, made
storable (nbwatch/samples.py), recorded at each eval, read back and built for the panel."""

from __future__ import annotations

import base64
import io

import numpy as np
import pandas as pd
import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo
from nbwatch.panels import samples as samples_panel
from nbwatch.samples import MAX_SAMPLE_TEXT, MAX_SIDE, sample_content

PIL = pytest.importorskip("PIL.Image", reason="Pillow decodes the PNGs to check them")


def decoded(content: dict) -> np.ndarray:
    return np.asarray(PIL.open(io.BytesIO(base64.b64decode(content["png"]))))


@pytest.mark.parametrize("shape", [(17, 23), (17, 23, 3), (17, 23, 4)])
def test_a_uint8_image_is_stored_as_a_png_of_the_same_pixels(shape):
    a = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    text, content = sample_content(a)
    assert text == "image 23×17" and (content["width"], content["height"]) == (23, 17)
    assert np.array_equal(decoded(content), a)


def test_tensors_pil_images_and_large_images():
    chw = torch.rand(3, 8, 9)  # a float [C, H, W] tensor in [0, 1], as torchvision gives
    _, c = sample_content(chw)
    want = np.rint(chw.permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    assert np.array_equal(decoded(c), want)
    _, c = sample_content(PIL.new("RGB", (40, 30), (10, 200, 30)))
    assert decoded(c).shape == (30, 40, 3) and (decoded(c)[0, 0] == [10, 200, 30]).all()
    text, c = sample_content(np.zeros((2000, 1000), np.uint8))
    assert max(c["width"], c["height"]) <= MAX_SIDE and "shown at" in text


def test_tables_from_a_dataframe_or_a_list_of_dicts():
    text, c = sample_content(pd.DataFrame({"prompt": ["a", "b"], "score": [0.5, 1.0]}))
    assert text == "table 2 × 2"
    assert c["columns"] == ["prompt", "score"] and c["rows"] == [["a", 0.5], ["b", 1.0]]
    _, c = sample_content([{"p": "hi", "s": 0.5}, {"p": "yo", "t": 1}])
    assert c["columns"] == ["p", "s", "t"] and c["rows"][1] == ["yo", None, 1.0]
    # a wide, long table says its whole size and which part is shown (it read "5000 × 20")
    text, c = sample_content(pd.DataFrame(np.zeros((5000, 100))))
    assert text == "table 5000 × 100 (first 50 rows and first 20 columns)", text
    assert len(c["columns"]) == 20 and c["n_cols"] == 100


def test_text_stays_text_and_a_bad_image_names_the_fix():
    assert sample_content("def f():") == ("def f():", None)
    assert sample_content(3.5) == ("3.5", None)  # anything else: its str(), as before
    with pytest.raises(ValueError, match=r"a float image is in \[0, 1\]"):
        sample_content(np.full((4, 4), 2.0))
    with pytest.raises(ValueError, match="an image is"):
        sample_content(np.zeros((2, 2, 2, 2), np.uint8))


def test_an_image_sample_fn_is_recorded_at_each_eval_and_built_for_the_panel(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=6)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")

    def sample_fn(model):  # e.g. a ViT's prediction map: here the head's weights as grey
        w = model.head.weight.detach()[:16, :16]
        return (w - w.min()) / (w.max() - w.min())

    mon.start(demo.step_fn, demo.train, 6, eval_every=3, sample_fn=sample_fn,
              display=False).wait()
    assert mon.state == "finished"
    got = nbwatch.open_run(tmp_path / "r").samples
    assert list(got.step) == [3, 6] and list(got.text) == ["image 16×16"] * 2
    assert decoded(got.content[1]).shape == (16, 16)
    built = samples_panel.build([{"step": s, "text": t, "content": c}
                                 for s, t, c in zip(got.step, got.text, got.content)])
    assert [it["step"] for it in built["items"]] == [6, 3]  # newest first
    assert built["items"][0]["content"]["kind"] == "image"


def test_a_bad_sample_is_said_and_the_run_goes_on(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=4)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, 4, eval_every=2, display=False,
              sample_fn=lambda m: np.full((4, 4), 7.0)).wait()
    assert mon.state == "finished" and mon.step == 4
    said = mon.events.query("kind == 'probe'").message
    assert said.str.contains("a float image is in").any()


def test_text_and_image_samples_of_one_run_read_back_each_by_its_kind(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=4)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    calls = iter(range(100))  # the dry run's eval calls sample_fn too

    def sample_fn(model):  # text at one eval, an image at the next
        return "said hello" if next(calls) % 2 else np.zeros((4, 4), np.uint8)

    mon.start(demo.step_fn, demo.train, 4, eval_every=1, sample_fn=sample_fn,
              display=False).wait()
    got = nbwatch.open_run(tmp_path / "r").samples
    assert list(got.step) == [1, 2, 3, 4]
    assert list(got.text) == ["said hello", "image 4×4"] * 2
    assert [c is None for c in got.content] == [True, False, True, False]
    assert decoded(got.content[1]).shape == (4, 4)


def test_a_huge_text_sample_is_cut_and_says_so(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=2)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, 2, eval_every=2, display=False,
              sample_fn=lambda m: "x" * 1_000_000).wait()
    (text,) = nbwatch.open_run(tmp_path / "r").samples.text
    note = f"… [truncated {1_000_000 - MAX_SAMPLE_TEXT} chars]"
    assert len(text) == MAX_SAMPLE_TEXT + len(note) and text.endswith(note)


def test_a_sample_fn_that_raises_fails_the_run_naming_sample_fn(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=4)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    calls = iter(range(100))

    def sample_fn(model):  # fine in the dry run, raises at step 2's eval
        if next(calls) == 1:
            raise KeyError("prompt")
        return "ok"

    mon.start(demo.step_fn, demo.train, 4, eval_every=2, sample_fn=sample_fn, display=False)
    with pytest.raises(RuntimeError, match=r"sample_fn raised at the eval of step 2: "
                                           r"KeyError: 'prompt'") as got:
        mon.wait()
    assert isinstance(got.value.__cause__, KeyError)
    assert (mon.state, mon.step) == ("failed", 2)
