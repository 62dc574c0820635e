"""kvflow as a vLLM KV connector.

``kv_transfer_config={"kv_connector": "KVFlowConnector", "kv_connector_module_path":
"kvflow.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {...}}``

The connector classes import vLLM, so they are loaded on first use: the planner, the config
and the cache layouts (``kvflow.integrations.vllm.planner`` and its siblings) work without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVFlowConnector", "KVFlowConnectorMetadata", "KVFlowConnectorStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvflow.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
