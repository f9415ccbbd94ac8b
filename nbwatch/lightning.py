"""`import nbwatch.lightning`: the adapter in nbwatch/adapters/lightning.py, under its
documented name (this module is that one: `nbwatch.lightning.X` is
`nbwatch.adapters.lightning.X`)."""

import sys

from .adapters import lightning as _adapter

sys.modules[__name__] = _adapter
