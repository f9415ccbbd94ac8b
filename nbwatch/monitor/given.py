"""What a Monitor was given, read-only: the model, optimizer, folder and settings of its
`Setup` (monitor/setup.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import controls as ctl
from ..alerts.rules import Rule
from ..checkpoint import Checkpointer
from .setup import Setup


class Given:
    """The read-only properties of what the Monitor was constructed with."""

    _setup: Setup

    @property
    def model(self) -> nn.Module:
        return self._setup.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that takes nbwatch's hooks (the one behind a framework's wrapper)."""
        return self._setup.optimizer

    @property
    def scheduler(self) -> Any:
        return self._setup.scheduler

    @property
    def scaler(self) -> Any:
        return self._setup.scaler

    @property
    def name(self) -> str:
        return self._setup.name

    @property
    def config(self) -> dict[str, Any]:
        return self._setup.config

    @property
    def checkpointer(self) -> Checkpointer:
        return self._setup.checkpointer

    @property
    def control(self) -> ctl.ControlState:
        """What the controls have set (clip, LR factor); saved in checkpoints."""
        return self._setup.control

    @property
    def rules(self) -> list[Rule]:
        """The alert rules in force (the defaults with `alerts=` applied)."""
        return self._setup.rules
