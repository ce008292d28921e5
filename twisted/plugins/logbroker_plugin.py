"""The twistd dropin for ``twistd logbroker``; imports lazily so ``twistd --help`` stays fast."""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService, IServiceMaker
from twisted.plugin import IPlugin
from zope.interface import implementer


@implementer(IServiceMaker, IPlugin)
class _LogbrokerServiceMaker:
    tapname = "logbroker"
    description = "A replicated, append-only log broker."

    @property
    def options(self) -> Any:
        from logbroker.tap import Options

        return Options

    def makeService(self, options: Any) -> IService:
        from logbroker.tap import makeService

        return makeService(options)


serviceMaker = _LogbrokerServiceMaker()
