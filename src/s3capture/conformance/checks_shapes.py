"""The conformance check of the protocol shapes and the install functions.

``protocol_shapes_and_install``: every given client is an instance of its runtime-checkable protocol,
``install_token_sink``/``install_token_source``/``install_lineage_store`` install and clear it, and
``install_token_sink`` refuses an object that is not a sink.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from s3capture import protocols
from s3capture.conformance.framework import ConformanceError, _Ctx


# ---------------------------------------------------------------------------------------- shapes
async def protocol_shapes_and_install(ctx: _Ctx) -> None:
    suite = ctx.suite
    pairs: list[tuple[Any, type, Callable[[Any], None], Callable[[], Any]]] = [
        (suite.sink_factory, protocols.TokenSink, protocols.install_token_sink, protocols.installed_token_sink),
        (suite.source_factory, protocols.TokenSource, protocols.install_token_source, protocols.installed_token_source),
        (
            suite.resolver_factory,
            protocols.LineageResolver,
            protocols.install_lineage_store,
            protocols.installed_lineage_store,
        ),
        (
            suite.ledger_factory,
            protocols.CaptureLedger,
            protocols.install_lineage_store,
            protocols.installed_lineage_store,
        ),
    ]
    saved = (protocols.installed_token_sink(), protocols.installed_token_source(), protocols.installed_lineage_store())
    try:
        for factory, protocol, install, installed in pairs:
            if factory is None:
                continue
            client = await ctx._open(factory)
            ctx.require(isinstance(client, protocol), f"{type(client).__name__} lacks methods of {protocol.__name__}")
            if protocol is protocols.LineageResolver or protocol is protocols.CaptureLedger:
                ctx.require(isinstance(client.is_process_shared(), bool), "is_process_shared() is not a bool")
            install(client)
            ctx.require(installed() is client, f"{install.__name__} did not install the client")
            install(None)
            ctx.require(installed() is None, f"{install.__name__}(None) did not clear the default")
        try:
            protocols.install_token_sink(object())  # type: ignore[arg-type]  # the wrong type is the test
        except TypeError:
            pass
        else:
            raise ConformanceError(ctx.name, "install_token_sink accepted an object without put/mark_incomplete/close")
    finally:
        protocols.install_token_sink(saved[0])
        protocols.install_token_source(saved[1])
        protocols.install_lineage_store(saved[2])
