"""Each panel builder: records in → plain dict out, values checked."""

import numpy as np
import pytest

from nbwatch.panels import alerts, attention, data, grads, header, loss, samples, system, weights
from nbwatch.panels.wire import pack


def s(steps, values):
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float32)


def test_header_progress_eta_and_failure():
    meta = {"name": "exp<1>", "state": "running", "max_steps": 100, "started": 1000.0}
    walls = [(10, 1010.0), (20, 1015.0)]  # 2 steps/s
    h = header.build(meta, 20, walls, {"throughput/tokens_per_s": 5000.0}, now=1020.0)
    assert h["name"] == "exp<1>" and h["progress"] == 0.2 and h["steps_per_s"] == 2.0
    assert h["eta_s"] == 40.0 and h["elapsed_s"] == 20.0 and h["tokens_per_s"] == 5000.0
    assert not h["failed"]
    assert h["spike_score"] is None and h["mfu"] is None  # not recorded: not shown
    h = header.build(meta, 20, walls, {"spike/score": 2.0, "throughput/mfu": 0.41,
                                       "throughput/tflops": 405.0}, now=1020.0)
    assert (h["spike_score"], h["mfu"], h["tflops"]) == (2.0, 0.41, 405.0)
    assert h["watch_share"] is None  # a run recorded before time/nbwatch
    h = header.build(meta, 20, walls, {"time/nbwatch": 0.0005, "time/step": 0.2}, now=1020.0,
                     watch=header.watch_share_of([0.0005], [0.2]))
    assert h["watch_share"] == 0.0025
    # over the newest steps: a batch's record (its rules, its rows) costs one step of the
    # next batch, so the newest step alone says too little or too much
    own, took = [0.001] * 9 + [0.011], [0.1] * 10
    assert header.watch_share_of(own, took) == pytest.approx(0.02)
    h = header.build(meta, 20, walls, {"time/nbwatch": 0.001, "time/step": 0.1}, now=1020.0,
                     watch=header.watch_share_of(own, took))
    assert h["watch_share"] == pytest.approx(0.02)
    assert header.watch_share_of([], []) is None
    err = {"message": "RuntimeError: boom", "data": {"traceback": "Traceback...\nboom"}}
    h = header.build({**meta, "state": "failed"}, 20, walls, {}, now=1100.0, error=err)
    assert h["failed"] and h["eta_s"] is None and "boom" in h["traceback"]
    assert h["elapsed_s"] == 15.0  # an ended run's clock stops at its last step
    assert "message" not in h


def test_header_says_why_a_run_stopped_when_its_process_went_away():
    meta = {"name": "r", "state": "stopped", "stopped_by": "kernel shut down at step 212"}
    assert header.build(meta, 212, [], {}, now=0.0)["message"] == (
        "stopped: kernel shut down at step 212")
    assert "message" not in header.build({**meta, "state": "running"}, 212, [], {}, now=0.0)


def test_loss_traces_gap_and_markers():
    series = {"loss/train": s([1, 2, 3, 4], [4, 3, 2, 1]), "loss/val": s([2, 4], [3.5, 2.0]),
              "loss/gap": s([2, 4], [0.0, 0.5]), "lr": s([1, 2, 3, 4], [1, 1, 0.5, 0.5])}
    ev = [{"step": 3, "kind": "action", "severity": "info", "message": "LR scaled ×0.5"},
          {"step": 3, "kind": "state", "severity": "info", "message": "run paused"}]
    d = loss.build(series, ev)
    assert d["train"]["y"].dtype == np.float32 and list(d["lr"]["y"]) == [1, 1, 0.5, 0.5]
    assert list(d["gap"]["x"]) == [2, 4] and list(d["gap"]["y"]) == [3.5, 1.5]
    assert [m["message"] for m in d["markers"]] == ["LR scaled ×0.5"]


def test_smooth_resumes_where_it_stopped():
    v = np.array([1, 2, np.nan, 4, 5, 6], dtype=np.float32)
    whole, _ = loss.smooth(v)
    a, carry = loss.smooth(v[:3])
    b, _ = loss.smooth(v[3:], carry)
    np.testing.assert_allclose(np.r_[a, b], whole)
    assert whole[0] == 1.0 and np.isnan(whole[2])


def test_grads_latest_layers_in_depth_order_and_clip_line():
    latest = {"grad_norm/global": (5, 2.0), "grad_norm/emb": (5, 0.1),
              "grad_norm/blocks.0.attn": (5, 0.7), "grad_norm/clipped": (5, 1.0),
              "grad_norm/head": (5, 0.3)}
    series = {"grad_norm/global": s([5], [2.0]), "grad_norm/emb": s([5], [0.1])}
    ev = [{"step": 3, "kind": "action", "severity": "info", "message": "",
           "data": {"command": "clip", "value": 1.0}}]
    d = grads.build(series, latest, ev)
    assert d["layers"] == ["emb", "blocks.0.attn", "head"]
    assert d["norms"] == [0.1, 0.7, 0.3] and d["step"] == 5
    assert d["clip"] == [{"step": 3, "value": 1.0}]


def test_weights_columns_and_ratios():
    cols = {"fc": [(1, np.linspace(-1, 1, 5), np.array([1, 2, 3, 4])),
                   (2, np.linspace(-2, 2, 5), np.array([4, 0, 0, 4]))]}
    d = weights.build(cols, {"update_ratio/fc": s([1, 2], [1e-3, 2e-3])})
    assert d["hist"]["fc"]["edges"].shape == (2, 5) and d["hist"]["fc"]["counts"].shape == (2, 4)
    assert list(d["ratios"]) == ["fc"]
    many = [(i, None, None) for i in range(1000)]
    thinned = weights.thin(many)
    assert len(thinned) <= weights.MAX_COLUMNS and thinned[-1][0] == 999
    # Thinned as columns arrive (what Feed does), every tenth of a long run keeps columns.
    cols: list = []
    for i in range(1, 20_001):
        cols = weights.thin([*cols, (50 * i, None, None)])
    steps = np.array([c[0] for c in cols])
    assert len(cols) <= weights.MAX_COLUMNS and steps[-1] == 1_000_000
    assert (np.histogram(steps, bins=10, range=(0, 1e6))[0] >= 10).all()


def test_attention_quantised_grid():
    maps = {"b0.attn": np.full((2, 3, 3), 1 / 3), "b1.attn": np.eye(3)[None].repeat(2, 0)}
    d = attention.build({"step": 10, "samples": [{"tokens": ["a", "<b>", "c"], "maps": maps}]},
                        maps=True)
    m = d["samples"][0]["maps"]
    assert m.shape == (2, 2, 3, 3) and m.dtype == np.uint8
    assert m[0, 0, 0, 0] == 85 and m[1, 1, 2, 2] == 255 and m[1, 1, 2, 1] == 0
    assert d["modules"] == ["b0.attn", "b1.attn"] and d["samples"][0]["tokens"][1] == "<b>"
    # The overview's numbers: uniform rows over 3 keys have entropy ln 3, one-hot rows 0.
    np.testing.assert_allclose(d["samples"][0]["entropy"], [[np.log(3)] * 2, [0, 0]], atol=1e-5)
    np.testing.assert_allclose(d["samples"][0]["peak"], [[1 / 3] * 2, [1, 1]], atol=1e-6)
    assert attention.build(None) == {}


def test_attention_overview_carries_no_maps():
    """An eval's panel: the per-head numbers, shapes, tokens, modules and step, and no map
    (a 32 × 32-head model's maps are MBs a sample; the page fetches the head it opens)."""
    rng = np.random.default_rng(1)
    maps = {f"h.{i}.attn": rng.random((32, 16, 16)) for i in range(32)}
    latest = {"attn/max_logit/h.3.attn/5": (7, 9.5)}
    d = attention.build({"step": 7, "samples": [{"tokens": list("abcdefghijklmnop"),
                                                 "maps": maps}] * 2}, latest)
    assert d["step"] == 7 and d["heads"] == 32 and d["modules"] == list(maps)
    assert d["logit"].shape == (32, 32) and d["logit"][3, 5] == 9.5
    for s in d["samples"]:
        assert set(s) == {"tokens", "shapes", "entropy", "peak"}
        assert s["entropy"].shape == s["peak"].shape == (32, 32)
        assert s["shapes"][0] == [32, 16, 16] and s["tokens"][1] == "b"
    buffers: list = []
    pack(d, buffers)
    assert sum(b.nbytes for b in buffers) < 32 * 32 * 4 * 6  # the numbers, not 256 kB of maps
    assert attention.head_map(maps, "h.3.attn", 5).shape == (16, 16)
    assert attention.head_map(maps, "h.3.attn", 32) is None
    assert attention.head_map(maps, "nope", 0) is None


def test_attention_overview_skips_padded_rows():
    """A padded query row (all zero) does not count; a causal row i has i+1 keys."""
    a = np.tril(np.ones((4, 4)))
    a = a / a.sum(-1, keepdims=True)
    a[3] = 0  # the last query is padding
    d = attention.build({"step": 1, "samples": [{"tokens": None, "maps": {"m": a[None]}}]})
    want = np.mean([np.log(1), np.log(2), np.log(3)])
    np.testing.assert_allclose(d["samples"][0]["entropy"], [[want]], atol=1e-5)


def test_system_gpus_or_cpu():
    gpu = system.build({"system/gpu0/util": (1, 90.0), "system/gpu0/mem_used_gb": (1, 10.0),
                        "system/gpu0/mem_total_gb": (1, 80.0), "system/gpu1/temp_c": (1, 60.0)})
    assert [g["index"] for g in gpu["gpus"]] == [0, 1]
    assert gpu["gpus"][0]["util"] == 90.0 and gpu["gpus"][1]["temp_c"] == 60.0
    cpu = system.build({"system/cpu/util": (1, 50.0), "system/ram/used_gb": (1, 3.0),
                        "system/ram/total_gb": (1, 8.0)})
    assert cpu["gpus"] == [] and cpu["cpu_util"] == 50.0 and cpu["ram_total_gb"] == 8.0


def test_system_timeline_is_drawn_against_wall_time():
    """Samples that share a step (one long step) are points at their own times."""
    t0 = 1000.0
    ticks = system.ticks(t0 + np.arange(16) * 0.2, t0)
    assert ticks.tolist() == list(range(0, 320, 20))  # hundredths of a second since t0
    timeline = {"system/cpu/util": s(ticks, np.linspace(0, 100, 16)),
                "system/ram/total_gb": s(ticks, np.full(16, 8.0)),
                "step": s(ticks, np.full(16, 2.0))}
    d = system.build({"system/cpu/util": (2, 100.0)}, timeline, t0)
    assert d["t0"] == t0 and d["tick"] == system.TICK and d["cpu_util"] == 100.0
    assert set(d["series"]) == {"system/cpu/util", "step"}  # a total is a gauge, not a line
    cpu = d["series"]["system/cpu/util"]
    np.testing.assert_allclose(cpu["x"] * d["tick"], np.arange(16) * 0.2, atol=1e-6)
    np.testing.assert_allclose(cpu["y"], np.linspace(0, 100, 16), rtol=1e-6)
    assert set(d["series"]["step"]["y"]) == {2.0}
    assert "series" not in system.build({"system/cpu/util": (2, 1.0)}, {}, t0)


def test_feed_sends_the_system_timeline_new_points_then_all(tmp_path):
    from nbwatch.panels import Feed
    from nbwatch.records import Scalars, SystemSample
    from nbwatch.store import RunReader, RunStore

    store = RunStore(tmp_path / "run")
    t0 = 5000.0
    store.put(Scalars(1, {"loss/train": 1.0}, wall=t0))
    for i in range(16):  # 3 s of samples at 0.2 s, all while the run stood at step 1
        store.put(SystemSample({"system/cpu/util": float(i), "system/ram/used_gb": 2.0}, 1,
                               wall=t0 + 0.5 + 0.2 * i))
    store.flush()
    feed = Feed(RunReader(tmp_path / "run"))
    first = feed.update(now=t0 + 4)["system"]
    assert first["t0"] == t0 + 0.5 and first["cpu_util"] == 15.0
    x = first["series"]["system/cpu/util"]["x"]
    assert len(x) == 16 and (np.diff(x) == 20).all()  # 16 samples, 0.2 s apart, none merged
    for i in range(16, 20):  # a later refresh sends only what is new
        store.put(SystemSample({"system/cpu/util": float(i), "system/ram/used_gb": 2.0}, 2,
                               wall=t0 + 0.5 + 0.2 * i))
    store.close()
    new = feed.update(now=t0 + 5)["system"]["series"]
    assert new["system/cpu/util"]["x"].tolist() == [320, 340, 360, 380]
    assert new["step"]["y"].tolist() == [2.0] * 4
    full = feed.full(now=t0 + 5)["system"]["series"]
    assert full["system/cpu/util"]["y"].tolist() == [float(i) for i in range(20)]


def test_data_series_and_seq_len():
    d = data.build({"data/padding_ratio": s([1, 2], [0.25, 0.5]), "time/data": s([1], [0.01])},
                   (50, np.array([0.0, 8, 16]), np.array([3, 5])))
    assert list(d["padding"]["y"]) == [0.25, 0.5] and "time_compute" not in d
    assert d["seq_len"]["step"] == 50 and list(d["seq_len"]["counts"]) == [3, 5]


def test_alerts_and_samples_newest_first():
    ev = [{"step": i, "kind": k, "severity": sev, "message": f"m{i}", "wall": float(i)}
          for i, (k, sev) in enumerate([("alert", "warning"), ("state", "info"),
                                        ("error", "critical"), ("checkpoint", "info")])]
    d = alerts.build(ev)
    assert [it["step"] for it in d["items"]] == [3, 2, 0]
    assert d["items"][1]["severity"] == "critical"
    d = samples.build([{"step": 1, "text": "<script>x</script>"}, {"step": 2, "text": "b"}])
    assert [it["step"] for it in d["items"]] == [2, 1]
    assert d["items"][1]["text"] == "<script>x</script>"  # escaped by the view, not mangled


def test_a_resumed_run_is_not_shown_as_failed(tmp_path):
    from nbwatch.panels import Feed
    from nbwatch.records import Event, Scalars
    from nbwatch.store import RunReader, RunStore

    store = RunStore(tmp_path / "r")
    store.put(Scalars(1, {"loss/train": 2.0}))
    store.put(Event(6, "error", "critical", "ZeroDivisionError: boom", {"traceback": "tb"}))
    store.set_meta("state", "failed")
    store.flush()
    feed = Feed(RunReader(store.run_dir))
    feed.update()
    assert feed.header()["failed"]
    store.put(Event(5, "state", "info", "run running at step 5"))
    store.set_meta("state", "running")
    store.put(Scalars(6, {"loss/train": 1.9}))
    store.flush()
    feed.update()
    assert not feed.header()["failed"]
    store.close()


def test_attention_of_modules_with_different_shapes():
    """Encoder-decoder: self-attention T×T, cross-attention T×S, in one grid."""
    rng = np.random.default_rng(0)
    maps = {"encoder.0": rng.random((2, 10, 10)), "decoder.0.self": rng.random((2, 6, 6)),
            "decoder.0.cross": rng.random((2, 6, 10))}
    d = attention.build({"step": 4, "samples": [{"tokens": None, "maps": maps}]}, maps=True)
    s = d["samples"][0]
    assert s["maps"].shape == (3, 2, 10, 10)
    assert s["shapes"] == [[2, 10, 10], [2, 6, 6], [2, 6, 10]]
    assert (s["maps"][2, :, 6:, :] == 0).all()  # the padding of the 6×10 cross map


def test_alert_feed_items_say_why_a_checkpoint_was_taken():
    """The controls bar acknowledges what was asked for, not a periodic checkpoint; the
    feed leaves out periodic checkpoints but the best (one every eval filled it)."""
    from nbwatch.panels import alerts

    items = alerts.build([
        {"step": 50, "kind": "checkpoint", "severity": "info", "wall": 1.0,
         "message": "periodic checkpoint at step 50", "data": {"reason": "periodic"}},
        {"step": 51, "kind": "action", "severity": "info", "wall": 2.0,
         "message": "resumed at step 51", "data": {}},
        {"step": 100, "kind": "checkpoint", "severity": "info", "wall": 3.0,
         "message": "periodic checkpoint at step 100 (best)",
         "data": {"reason": "periodic", "best": True}},
        {"step": 101, "kind": "checkpoint", "severity": "info", "wall": 4.0,
         "message": "manual checkpoint at step 101", "data": {"reason": "manual"}},
        # the frameworks' own routine saves: a Trainer's save_steps, a ModelCheckpoint's
        {"step": 110, "kind": "checkpoint", "severity": "info", "wall": 5.0,
         "message": "periodic (Trainer) checkpoint", "data": {"reason": "periodic (Trainer)"}},
        {"step": 120, "kind": "checkpoint", "severity": "info", "wall": 6.0,
         "message": "Lightning checkpoint", "data": {"reason": "Lightning"}},
    ])["items"]
    assert [(i["kind"], i.get("reason"), i["step"]) for i in items] == [
        ("checkpoint", "manual", 101), ("checkpoint", "periodic", 100), ("action", None, 51)]


def test_routine_best_checkpoints_one_after_another_are_one_feed_item():
    """A Trainer's save_steps with load_best_model_at_end (a ModelCheckpoint with monitor)
    marks most saves best: the feed says "best checkpoint ×N, last at step S" once for the
    saves in a row, alerts and asked-for checkpoints their own items between them; the
    report's checkpoints table keeps every save."""
    from nbwatch.panels import alerts, report

    def best(step, reason="periodic (Trainer)"):
        return {"step": step, "kind": "checkpoint", "severity": "info", "wall": float(step),
                "message": f"{reason} checkpoint at step {step}: checkpoint-{step} (best)",
                "data": {"reason": reason, "best": True, "path": f"/o/checkpoint-{step}"}}

    def other(step, kind, reason=None):
        return {"step": step, "kind": kind, "severity": "warning" if kind == "alert" else "info",
                "wall": float(step), "message": f"{kind} at {step}",
                "data": {"reason": reason, "best": True} if reason else {}}

    events = [best(100, "periodic"), best(200), best(300, "Lightning"),
              {**best(305), "data": {"reason": "periodic (Trainer)"}},  # not best: left out
              other(310, "alert"), best(400), best(500), other(510, "checkpoint", "manual"),
              best(600), other(601, "state")]
    items = alerts.build(events)["items"]
    assert [(i["kind"], i["step"], i["message"]) for i in items] == [
        ("checkpoint", 600, "periodic (Trainer) checkpoint at step 600: checkpoint-600 (best)"),
        ("checkpoint", 510, "checkpoint at 510"),  # asked for: its own item, always
        ("checkpoint", 500, "best checkpoint ×2, last at step 500"),
        ("alert", 310, "alert at 310"),
        ("checkpoint", 300, "best checkpoint ×3, last at step 300"),
    ]
    assert (items[2]["count"], items[2]["first"], items[4]["first"]) == (2, 400, 100)
    assert items[0]["count"] == 1 and "routine" not in items[1]
    # a refresh's oldest routine item folds into the newest shown, as the page does
    assert alerts.fold(items[2], items[0])["message"] == "best checkpoint ×3, last at step 600"
    ckpts = [e for e in events if e["kind"] == "checkpoint"][::-1]
    rows = report.checkpoints_table(ckpts, len(ckpts))["rows"]
    assert [r[0] for r in rows] == [600, 510, 500, 400, 305, 300, 200, 100]


@pytest.mark.parametrize("origin", [0, 1_000_000])
def test_grad_heat_map_shows_a_spike_at_its_layer_and_step_and_folds_like_a_full_build(
        tmp_path, origin):
    """Per-layer norms of 12 layers over 3,000 steps, 100× at layer 7, step 2,345: the heat
    map's cell for that layer and bin holds the spike; the columns a live view folds in
    refresh by refresh (as js/views/grads.js does) equal the full state a late view gets.
    A run whose steps begin at 1,000,001 (a Trainer resumed into a new folder) gets as
    many columns as one from step 1, not a few of bins sized from step 0."""
    from nbwatch.panels import Feed
    from nbwatch.records import Scalars
    from nbwatch.store import RunReader, RunStore

    layers = [f"h.{i}.attn" for i in range(12)]
    rng = np.random.default_rng(0)
    store = RunStore(tmp_path / "r")
    feed = Feed(RunReader(store.run_dir))
    held: dict = {}  # what a live browser holds: {"w", "c0", "z" columns}
    for step in range(origin + 1, origin + 3001):
        v = {f"grad_norm/{n}": float(0.5 + 0.1 * rng.random()) for n in layers}
        if step == origin + 2345:
            v["grad_norm/h.7.attn"] = 50.0
        store.put(Scalars(step, {"loss/train": 1.0, **v}))
        if step % 97 == 0 or step == origin + 3000:
            store.flush()
            h = feed.update()["grads"]["heat"]
            z = h["z"]
            if held.get("w") != h["w"] or h["c0"] <= held["c0"]:
                held = {"w": h["w"], "c0": h["c0"], "z": z.copy()}
            else:
                held["z"] = np.concatenate([held["z"][:, :h["c0"] - held["c0"]], z], axis=1)
    full = feed.full()["grads"]["heat"]
    w, c0 = full["w"], full["c0"]
    assert c0 == (origin + 1) // w and w <= 16
    assert full["z"].shape == (12, (origin + 3000) // w + 1 - c0)
    assert full["z"].shape[1] <= grads.HEAT_COLUMNS
    np.testing.assert_array_equal(held["z"], full["z"])
    row, col = np.unravel_index(np.nanargmax(full["z"]), full["z"].shape)
    assert (row, col) == (7, (origin + 2345) // w - c0) and full["z"][row, col] == 50.0
    assert np.nanmax(np.delete(full["z"], 7, axis=0)) < 0.61
    store.close()


def test_health_draws_modules_not_heads():
    from nbwatch.panels import health

    series = {"attn/entropy/h.0.attn": s([10, 20], [2.0, 1.5]),
              "attn/entropy/h.0.attn/0": s([10, 20], [2.1, 1.0]),
              "attn/max_logit/h.0.attn": s([10, 20], [5.0, 9.0]),
              "act/rms/h.0": s([10], [1.2]), "logits/z_mean": s([10], [4.8]),
              "loss/train": s([10], [3.0])}
    d = health.build(series)
    assert list(d["entropy"]) == ["h.0.attn"] and list(d["max_logit"]) == ["h.0.attn"]
    assert list(d["rms"]) == ["h.0"] and list(d["z"]["y"]) == [4.8] and "max_abs" not in d
    assert health.build({"loss/train": s([1], [1.0])}) == {}


def test_health_carries_the_training_batchs_logits_and_metrics_leaves_them_out():
    """`train_logits/*`, every step, go beside the probe pass's log Z (one panel for one
    signal), not into the Metrics picker as well."""
    from nbwatch.panels import health, metrics

    series = {"train_logits/log_z": s([1, 2, 3], [4.1, 4.2, 4.4]),
              "train_logits/max_abs": s([1, 2, 3], [3.0, 3.5, 3.9]),
              "logits/z_mean": s([2], [4.3]), "val/accuracy": s([2], [0.5])}
    d = health.build(series)
    assert list(d["train_z"]["y"]) == pytest.approx([4.1, 4.2, 4.4])
    assert list(d["train_max_abs"]["x"]) == [1, 2, 3] and list(d["z"]["y"]) == [4.3]
    assert list(metrics.build(series)["series"]) == ["val/accuracy"]


def test_feed_clock_maps_steps_onto_time_and_tokens_new_points_then_all(tmp_path):
    """The x axis switch's clock: each step's seconds since the run started (a 30 s stall
    stays in it, for the page to show as a gap) and the tokens seen by each step."""
    from nbwatch.panels import Feed
    from nbwatch.records import Scalars
    from nbwatch.store import RunReader, RunStore

    store = RunStore(tmp_path / "run")
    t0 = 7000.0
    store.set_meta("started", t0)
    walls = {s: t0 + 0.5 * s + (30.0 if s > 5 else 0.0) for s in range(1, 11)}  # step 6: +30 s
    for s in range(1, 9):
        store.put(Scalars(s, {"loss/train": 1.0, "tokens/real": 100.0}, wall=walls[s]))
    store.flush()
    feed = Feed(RunReader(tmp_path / "run"))
    first = feed.update(now=t0 + 40)["clock"]
    assert first["t0"] == t0
    assert first["wall"]["x"].tolist() == list(range(1, 9))
    assert first["wall"]["y"] == pytest.approx([walls[s] - t0 for s in range(1, 9)])
    assert first["tokens"]["y"].tolist() == [100.0 * s for s in range(1, 9)]
    for s in (9, 10):
        store.put(Scalars(s, {"loss/train": 1.0, "tokens/real": 50.0}, wall=walls[s]))
    store.close()
    new = feed.update(now=t0 + 41)["clock"]
    assert new["wall"]["x"].tolist() == [9, 10]  # only what is new
    assert new["tokens"]["y"].tolist() == [850.0, 900.0]  # the running total goes on
    full = feed.full(now=t0 + 41)["clock"]
    assert full["wall"]["x"].tolist() == list(range(1, 11))
    assert full["wall"]["y"][5] - full["wall"]["y"][4] == pytest.approx(30.5)


def test_feed_draws_the_baselines_its_meta_names_found_beside_it_when_moved(tmp_path):
    """A run's meta names its baselines; a copied `runs/` folder still finds them beside
    it, and a baseline still being written is read again (it follows live)."""
    import shutil

    from nbwatch.panels import Feed, baseline
    from nbwatch.records import Scalars
    from nbwatch.store import RunReader, RunStore

    def run(path, steps, config, state="finished", baselines=()):
        store = RunStore(path)
        store.set_meta("config", config)
        store.set_meta("state", state)
        store.set_meta("baselines", [str(b) for b in baselines])
        for s in range(1, steps + 1):
            store.put(Scalars(s, {"loss/train": 3.0 - s / steps, "lr": 0.1,
                                  **({"loss/val": 2.5} if s % 5 == 0 else {})}, wall=100.0 + s))
        return store

    base = run(tmp_path / "old" / "exp0", 20, {"lr": 0.1, "seed": 1}, state="running")
    base.flush()
    run(tmp_path / "old" / "exp1", 10, {"lr": 0.2, "seed": 1},
        baselines=[tmp_path / "old" / "exp0"]).close()
    feed = Feed(RunReader(tmp_path / "old" / "exp1"))
    feed.update(now=0.0)
    (b,) = feed.full(now=0.0)["loss"]["baselines"]
    assert b["step"] == 20 and b["state"] == "running" and b["val"]["x"].tolist() == [5, 10, 15, 20]
    assert b["diff"] == [["lr", "0.1", "0.2"]]
    assert b["train"]["y"][0] == pytest.approx(3.0 - 1 / 20)  # smoothed, debiased: starts there
    # the baseline goes on: read again once FOLLOW_EVERY has passed, not before
    for s in range(21, 26):
        base.put(Scalars(s, {"loss/train": 1.0}, wall=100.0 + s))
    base.flush()
    assert feed.update(now=1.0) is None
    moved = feed.update(now=baseline.FOLLOW_EVERY + 1)
    assert moved["loss"]["baselines"][0]["step"] == 25
    base.close()
    # the whole folder copied elsewhere: the baseline named by its old path is found beside
    shutil.copytree(tmp_path / "old", tmp_path / "new")
    shutil.rmtree(tmp_path / "old")
    feed = Feed(RunReader(tmp_path / "new" / "exp1"))
    feed.update(now=0.0)
    assert feed.full(now=0.0)["loss"]["baselines"][0]["path"] == str(tmp_path / "new" / "exp0")
    assert baseline.beside(tmp_path / "new" / "exp1") == ["exp0"]


def test_a_model_without_attention_says_so_in_the_attention_panel(tmp_path):
    """An LSTM through start() with a probe batch and three evals: the attention panel (live
    and exported) carries the probe's reason there are no maps, which the page shows in
    place of "no probe yet: attention maps come with the first eval"."""
    import itertools

    import torch

    import nbwatch
    from nbwatch.export import snapshot
    from nbwatch.panels import Feed
    from nbwatch.store import RunReader

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.rnn = torch.nn.LSTM(16, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0])

    torch.manual_seed(0)
    model = Lstm()
    ids = torch.randint(0, 32, (4, 12))
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    mon.start(lambda m, b: torch.nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten()),
              itertools.repeat(ids), max_steps=6, eval_every=2, probe_batch=ids,
              display=False).wait()
    assert mon.state == "finished", mon.error
    feed = Feed(RunReader(tmp_path / "r"))
    for panels in (feed.update(), feed.full(), snapshot(RunReader(tmp_path / "r"))["panels"]):
        note = panels["attention"].get("note", "")
        assert "saw no attention weights" in note, panels["attention"]


def test_the_headers_rates_are_the_newest_steps_median_not_one_steps(tmp_path):
    """A slow step (a checkpoint, a pause's end) read 4,221 tok/s beside a median of
    39.6k, and steps/s averaged over the same window: the header's tok/s, TFLOP/s and MFU
    are the median of the newest steps', as steps/s is over its window."""
    from nbwatch.panels import Feed
    from nbwatch.records import Scalars
    from nbwatch.store import RunReader, RunStore

    store = RunStore(tmp_path / "r")
    for s in range(1, 31):
        slow = s == 30
        store.put(Scalars(s, {"loss/train": 2.0, "throughput/tokens_per_s":
                              4_000.0 if slow else 40_000.0 + s,
                              "throughput/tflops": 0.1 if slow else 1.0}))
    store.close()
    feed = Feed(RunReader(tmp_path / "r"))
    feed.update()
    h = feed.header()
    assert h["tokens_per_s"] == pytest.approx(40_014.5) and h["tflops"] == 1.0


def test_attention_waiting_says_when_maps_come():
    """Until its first map the panel's line says when one comes (start()'s eval_every, a
    loop's probe_every, counted from the step the run stands at), that the probe is off, or
    that the run ended without one; not "no probe yet"."""
    run = {"eval_every": 50, "options": {"attention_samples": 2}}
    assert attention.waiting({"state": "running", "run": run}, 0).endswith("at step 50")
    assert attention.waiting({"state": "running", "run": run}, 50).endswith("at step 50")
    assert attention.waiting({"state": "running", "run": run}, 120).endswith("at step 150")
    loop = {"options": {"attention_samples": 2, "probe_every": 25}}
    assert attention.waiting({"state": "running", "run": loop}, 3).endswith(
        "or the probe at step 25")
    assert attention.waiting({}, 0) == "no attention maps yet: they come with the first eval"
    assert "probe is off" in attention.waiting(
        {"state": "running", "run": {"eval_every": 5, "options": {"attention_samples": 0}}}, 0)
    assert "ended" in attention.waiting({"state": "finished", "run": run}, 400)


def test_attention_waiting_past_the_runs_last_step():
    """eval_every past start()'s max_steps: no eval at step eval_every, which never comes;
    the maps come with the last step's eval where a val_fn gives one, else never."""
    run = {"eval_every": 500, "val_fn": True,
           "options": {"attention_samples": 2, "max_steps": 300}}
    assert attention.waiting({"state": "running", "run": run}, 10).endswith("at step 300")
    run["val_fn"] = False
    said = attention.waiting({"state": "running", "run": run}, 10)
    assert said.startswith("no attention maps:") and "past the run's last step, 300" in said
    run["options"]["max_steps"] = 1000
    assert attention.waiting({"state": "running", "run": run}, 10).endswith("at step 500")


def test_weights_waiting_says_why_there_is_no_histogram():
    off = {"state": "running", "run": {"options": {"hist_every": 0, "update_every": None}}}
    assert weights.waiting(off) == \
        "no weight histograms or update ratios: hist_every=0 turns them off"
    off["run"]["options"]["update_every"] = 10
    assert weights.waiting(off) == "no weight histograms: hist_every=0 turns them off"
    on = {"state": "running", "run": {"options": {"hist_every": 50}}}
    assert weights.waiting(on).endswith("then every 50 steps")
    assert weights.waiting({"state": "finished"}) == "no weight histograms in this run"
