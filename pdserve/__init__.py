"""pdserve: prefill/decode-disaggregated LLM serving. `pdserve.Client` / `pdserve.AsyncClient` talk to a router."""

from __future__ import annotations

__all__ = ["AsyncClient", "Client", "Result", "TokenEvent", "errors"]


def __getattr__(name: str):
    # Lazy, so that the engine and model packages never pull in grpc through `import pdserve`.
    if name == "errors":
        import importlib

        return importlib.import_module("pdserve.errors")
    if name in __all__:
        from pdserve import client

        return getattr(client, name)
    raise AttributeError(name)
