"""Deterministic simulation of the transfer protocol: the shipped hosts and state machines and real page pools,
a seeded scheduler, a network that loses, duplicates, delays, reorders and corrupts, nodes that crash and restart.

``world.py`` is the cluster and its invariants; ``decode.py``, ``prefill.py`` and ``router.py`` are its nodes
(each the shipped host with simulated ports); ``run.py`` runs and shrinks seeds.
``python -m kvseal.sim --seeds 2000`` (``make sim SEEDS=N``); ``--variant NAME`` runs a known-bad variant.
"""

from kvseal.sim.base import Violation
from kvseal.sim.run import run_seed, run_seeds, shrink
from kvseal.sim.world import World

__all__ = ["Violation", "World", "run_seed", "run_seeds", "shrink"]
