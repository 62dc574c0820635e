"""Mooncake Store, the multi-node pool: ``MooncakeStore`` (store.py), its config, and a
``mooncake_master`` process for one node (master.py).

Importing this imports no part of Mooncake: ``mooncake.store`` is imported when a MooncakeStore
is built (``client.mooncake_module``), and the master is a program found on PATH.
"""

from kvflow.stores.mooncake.config import MooncakeConfig
from kvflow.stores.mooncake.master import MooncakeMaster
from kvflow.stores.mooncake.store import MooncakeStats, MooncakeStore

__all__ = ["MooncakeConfig", "MooncakeMaster", "MooncakeStats", "MooncakeStore"]
