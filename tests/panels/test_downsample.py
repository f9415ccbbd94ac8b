import numpy as np
import pytest

from nbwatch.panels.downsample import Downsampler, bucket_width, downsample, reduce


def walk(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.arange(1, n + 1), np.cumsum(rng.normal(size=n)).astype(np.float32)


def test_bounded_and_min_max_of_every_bucket_kept():
    steps, values = walk(1_000_000)
    xs, ys = downsample(steps, values, 5000)
    assert len(xs) <= 5000
    w = bucket_width(int(steps[-1]), 5000)
    buckets = steps // w
    for b in np.unique(buckets)[::97]:
        sel = buckets == b
        kept = ys[(xs // w) == b]
        assert kept.min() == values[sel].min() and kept.max() == values[sel].max()
    assert ys.min() == values.min() and ys.max() == values.max()
    assert np.all(np.diff(xs) > 0)


def test_short_series_untouched_and_spike_survives():
    steps, values = walk(1000)
    values[456] = 1e6
    xs, ys = downsample(steps, values)
    np.testing.assert_array_equal(xs, steps)
    np.testing.assert_array_equal(ys, values)  # every point, the spike included
    big_s, big_v = walk(200_000)
    big_v[150_001] = 1e6
    xs, ys = downsample(big_s, big_v)
    assert 1e6 in ys and big_s[150_001] in xs


def test_non_finite_values_are_gaps():
    xs, ys = reduce(np.arange(6), np.array([1, np.nan, 3, np.inf, 2, 0], dtype=np.float32), 1)
    assert list(xs) == [0, 2, 4, 5]


@pytest.mark.parametrize("chunk", [1, 7, 250, 10_000])
def test_incremental_equals_full_and_stable_between_refreshes(chunk):
    steps, values = walk(60_000, seed=1)
    ds = Downsampler(2000)
    prev = None
    for i in range(0, len(steps), chunk):
        ds.extend(steps[i:i + chunk], values[i:i + chunk])
        if prev is not None and ds.width == prev[2]:
            # Only the open (last) bucket may change between refreshes: no flicker.
            closed = prev[0] < (prev[0][-1] // ds.width) * ds.width
            n = int(closed.sum())
            np.testing.assert_array_equal(ds.steps[:n], prev[0][:n])
            np.testing.assert_array_equal(ds.values[:n], prev[1][:n])
        prev = (ds.steps.copy(), ds.values.copy(), ds.width)
    xs, ys = downsample(steps, values, 2000)
    np.testing.assert_array_equal(ds.steps, xs)
    np.testing.assert_array_equal(ds.values, ys)
    assert len(ds) <= 2000


def test_steps_that_begin_far_from_0_keep_their_points():
    """A run whose steps begin at 1,000,001 (a Trainer resumed into a new folder): its
    3,000 steps keep every point, as from step 1, not the 12 of buckets sized from 0."""
    steps, values = walk(3000, seed=4)
    far = steps + 1_000_000
    xs, ys = downsample(far, values)
    np.testing.assert_array_equal(xs, far)
    ds = Downsampler()
    for i in range(0, 3000, 500):
        ds.extend(far[i:i + 500], values[i:i + 500])
    np.testing.assert_array_equal(ds.steps, far)
    long_s, long_v = walk(200_000, seed=5)
    xs, _ = downsample(long_s + 1_000_000, long_v, 2000)
    assert 1000 < len(xs) <= 2000  # the whole span fills the budget, no more


def test_width_doubling_merges_buckets():
    steps, values = walk(20_000, seed=2)
    once = reduce(steps, values, 16)
    np.testing.assert_array_equal(reduce(*once, 32)[0], reduce(steps, values, 32)[0])


@pytest.mark.parametrize("origin", [0, 1_000_000])
def test_the_browser_reduces_exactly_as_python(origin):
    """js/downsample.js folds new points into what the page holds: it must keep the same
    points as panels/downsample.py, or a reloaded page and a live one would differ."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    steps, values = walk(30_000, seed=3)
    values[[10, 20_000]] = [50.0, -50.0]  # spikes
    values = values.astype(np.float32)
    steps = steps + origin
    js = Path(__file__).resolve().parents[2] / "js" / "downsample.js"
    script = (f"import {{ reduce, Series }} from {json.dumps(js.as_uri())};\n"
              "import { readFileSync } from 'node:fs';\n"
              "const d = JSON.parse(readFileSync(0, 'utf8'));\n"
              "const r = reduce(d.x, d.y, 16);\n"
              "const s = new Series(2000);\n"
              "for (let i = 0; i < d.x.length; i += 777) s.extend(d.x.slice(i, i + 777),"
              " d.y.slice(i, i + 777));\n"
              "console.log(JSON.stringify({rx: r.x, ry: r.y, sx: s.x, sy: s.y}));\n")
    out = subprocess.run([node, "--input-type=module", "-e", script], capture_output=True,
                         text=True, check=True,
                         input=json.dumps({"x": steps.tolist(), "y": values.tolist()}))
    got = json.loads(out.stdout)
    xs, ys = reduce(steps, values, 16)
    assert got["rx"] == xs.tolist()
    np.testing.assert_array_equal(np.float32(got["ry"]), ys)
    ds = Downsampler(2000)
    for i in range(0, len(steps), 777):
        ds.extend(steps[i:i + 777], values[i:i + 777])
    assert got["sx"] == ds.steps.tolist()
    np.testing.assert_array_equal(np.float32(got["sy"]), ds.values)
