"""`import nbwatch.hf`: the adapter in nbwatch/adapters/hf.py, under its
documented name (this module is that one: `nbwatch.hf.X` is
`nbwatch.adapters.hf.X`)."""

import sys

from .adapters import hf as _adapter

sys.modules[__name__] = _adapter
