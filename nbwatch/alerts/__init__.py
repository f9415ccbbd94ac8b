"""Alerts and analysis: the rules (`rules`: the Rule, its window and settings; `signals`:
the training rules; `health`: Transformer health), the engine that turns them into alerts
once per episode (`engine`), the spike score, each spike's post-mortem and `diagnose()`.

    Monitor(..., alerts={"grad_explosion": {"factor": 20}, "plateau": False})
"""

from .engine import AlertEngine, Schedule, configure, weight_std
from .rules import Rule, Window
from .signals import default_rules

__all__ = ["AlertEngine", "Rule", "Schedule", "Window", "configure", "default_rules",
           "weight_std"]
