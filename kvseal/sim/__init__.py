"""Deterministic simulation of the transfer protocol: the real state machines and real page pools, a seeded
scheduler, a network that loses, duplicates, delays, reorders and corrupts, nodes that crash and restart.

``python -m kvseal.sim --seeds 2000`` (``make sim SEEDS=N``); ``--variant NAME`` runs a known-bad variant.
"""

from kvseal.sim.world import Violation, World, run_seed, run_seeds, shrink

__all__ = ["Violation", "World", "run_seed", "run_seeds", "shrink"]
