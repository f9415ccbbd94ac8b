"""The step boundary, shared by `Monitor.start()` (the runner's loop) and `Monitor.log()`
(a loop the user keeps): gradient probes at the optimizer's own step, one host copy,
records, alerts and their actions, evals, checkpoints, commands, and the run's end.

Gradient figures come from optimizer step hooks, so both modes measure the same thing at
the same moment, after backward (and a GradScaler's unscale) and before the update; on an
accelerator nothing on the step reads the device (host_copy.py):

    optimizer.step()  pre-hook   LR factor on · grad norms, clip and skip on the device
                                 (a CPU: read at once, decided on the host) · weights
                                 snapshot
                      (update)
                      post-hook  update ratios · LR factor off, so that the scheduler
                                 steps the plain schedule
    scheduler.step()
    end of the step              LR factor on · the step's figures: ONE non-blocking copy ·
                                 the previous step's copy read: "grads" rules, its record ·
                                 "step" rules · histograms · eval figures · checkpoint ·
                                 commands (pause blocks here, stop ends the loop here)

Its parts: spec.py (RunSpec, Progress, StopTraining), step_recorder.py (the recorder and
its lifecycle), optimizer_step.py (the hooks: measure), clip_skip.py (the clip and the
skip), lr_factor.py, own_clips.py, host_copy.py (the one copy, the one read),
step_end.py (the record), steering.py (commands, ranks, alert actions), outcomes.py,
eval_checkpoint.py, batches.py (which batch), rewind.py (rewind, skip).
"""

from .eval_checkpoint import plain
from .rewind import Rewound
from .spec import Progress, RunSpec, StopTraining
from .step_recorder import StepRecorder

__all__ = ["Progress", "Rewound", "RunSpec", "StepRecorder",
           "StopTraining", "plain"]
