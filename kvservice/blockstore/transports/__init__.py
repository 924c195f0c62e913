"""Data planes that move a store's pages to engines on other nodes without the store's Ray actor on the path.

`nixl`: the store exports its segment through a NIXL agent (`NixlExport`), engines READ pages with one NIXL
transfer per batch (`NixlImport.read` -> `Ticket`); `plan`: the descriptor arithmetic both share. NIXL is an
optional dependency (`pip install 'kvservice[nixl]'`): `nixl_available()` says whether it works here.
"""

from kvservice.blockstore.transports.nixl import (
    ExportInfo,
    NixlExport,
    NixlRegistrationError,
    NixlUnavailable,
    nixl_available,
    nixl_unavailable_reason,
)
from kvservice.blockstore.transports.nixl_read import NixlImport, Ticket, XferState

__all__ = ["ExportInfo", "NixlExport", "NixlImport", "NixlRegistrationError", "NixlUnavailable", "Ticket",
           "XferState", "nixl_available", "nixl_unavailable_reason"]
