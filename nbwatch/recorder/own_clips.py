"""The norms before a loop's own clipping: a loop that clipped its gradients itself before
`optimizer.step()` (`clip_grad_norm_`, `accelerator.clip_grad_norm_`; see
monitor/clip_watch.py) hands the pre-hook clipped ones. The norms before that clip are
recovered from the factor it scaled by, min(1, max_norm / (total + 1e-6)), from the norm it
computed (copied with the step's other figures, in the step's one host copy).
"""

from __future__ import annotations

import math

from ..probes.grads import Layers, clip_factor, layer_norms
from ..records import Event


class OwnClips:
    """Recovers the norms before the loop's own clips of each step; says once a run what
    it clips and, once for each reason, where the norms before it cannot be known."""

    def __init__(self, layers: Layers):
        self.layers = layers
        self.said: list[Event] = []  # events for the run, taken by the recorder after a call
        self.emit = self.said.append
        self._said = False  # the loop's own clipping was said
        self._notes: set[str] = set()  # why norms before it could not be known, said
        self._covers: dict[tuple[int, tuple[int, ...]], tuple[int, ...] | None] = {}

    def relayer(self, layers: Layers) -> None:
        """The run measures these layers from now on (its cache of which parameters a clip
        covered is of the layers before)."""
        self.layers = layers
        self._covers.clear()

    def before(self, step: int, host: list[float], layer_of: tuple[int, ...],
                      clips: list, totals: list[float], note: str | None,
                      present: tuple[int, ...] | None = None, layers: Layers | None = None
                      ) -> tuple[float, list[float | None], float]:
        """(global, per-layer norms before the loop's own clips of this step, the global
        norm the gradients have now) from the per-parameter norms measured now (after the
        clips) and each clip's factor. Where they cannot be known, says so in an event
        (once a run) and gives the norms measured now, or NaN for a layer. `present`: the
        parameters `host` are the norms of (those with a gradient at the step); `layers`:
        those the step measured, where the model changed since."""
        layers = layers if layers is not None else self.layers
        n_layers = len(layers)
        current = math.sqrt(math.fsum(n * n for n in host))
        if not self._said and clips:
            self._said = True
            limits = sorted({c.max_norm for c in clips})
            self.emit(Event(step, "probe", "info",
                             f"the loop clips its gradients itself (max_norm "
                             f"{', '.join(f'{m:g}' for m in limits)}): grad_norm/global and "
                             "grad_norm/<layer> are the norms before that clip (its scale "
                             "factor divided out), grad_norm/clipped the norm after it",
                             {"max_norm": limits}))
        if note is not None:
            self._say(step, note)
        if not clips:  # "changed": the norms the optimizer gets, said above
            total, per_layer = layer_norms(host, layer_of, n_layers)
            return total, per_layer, current
        scale_all = 1.0
        per_param: list[float] | None = None
        for c, t in zip(clips, totals):
            if not math.isfinite(t):  # a non-finite norm scaled the gradients by 0 or NaN
                return t, [math.nan for _ in range(n_layers)], current
            f = clip_factor(c.max_norm, t)
            if not f > 0.0:  # max_norm 0: every gradient zeroed, nothing to recover from
                self._say(step, "zeroed")
                total, per_layer = layer_norms(host, layer_of, n_layers)
                return total, per_layer, current
            covered = self._cover(c.ids, layers)
            if covered is None:
                scale_all *= f
                continue
            if per_param is None:
                per_param = [1.0] * len(layers.params)
            for i in covered:
                per_param[i] *= f
        if per_param is None:
            before = [n / scale_all for n in host]
        else:
            at = present if present is not None else range(len(layers.params))
            before = [n / (scale_all * per_param[i]) for n, i in zip(host, at)]
        total, per_layer = layer_norms(before, layer_of, n_layers)
        return total, per_layer, current

    def _cover(self, ids: tuple[int, ...], layers: Layers) -> tuple[int, ...] | None:
        """The monitored parameters a clip covered (indices into `layers.params`), None
        for all of them; kept per parameter list (a loop passes the same one each step)."""
        cache, key = self._covers, (id(layers), ids)
        if key not in cache:
            if len(cache) > 16:
                cache.clear()
            held = set(ids)
            covered = tuple(i for i, p in enumerate(layers.params) if id(p) in held)
            cache[key] = None if len(covered) == len(layers.params) else covered
        return cache[key]

    def _say(self, step: int, note: str) -> None:
        """Why this step's norms before the loop's own clip are not what they would be
        without it: said once a run for each reason."""
        if note in self._notes:
            return
        self._notes.add(note)
        message = {
            "partial": "the loop clipped the gradients before a later backward of the same "
                       "optimizer step (a clip on each accumulation micro-batch?): what that "
                       "clip cut cannot be recovered, so grad_norm/global is the norm before "
                       "the step's last clip; clip once per optimizer step, after its last "
                       "backward (with accelerate: under `if accelerator.sync_gradients:`)",
            "changed": "the gradients changed after the loop's clip_grad_norm_ and before "
                       "optimizer.step() (a backward, or a GradScaler's unscale, after the "
                       "clip): the norms before that clip cannot be known, so grad_norm/"
                       "global is the norm the optimizer got, after the clip; unscale, then "
                       "clip, then step",
            "zeroed": "the loop clipped the gradients with max_norm 0, which zeroes them: "
                      "the norms before that clip cannot be known, so the gradient norms "
                      "recorded are those after it",
        }[note]
        self.emit(Event(step, "probe", "warning", message, {"clip": note}))
