"""Probes: pure functions from tensors and timings to flat, `/`-grouped figures.

They know nothing of threads, disks or widgets; the runner calls them and the store
keeps what they return.
"""
