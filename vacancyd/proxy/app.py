"""The per-upstream gated proxy (docs/architecture.md).

Order for every request: authenticate (borrow scope) -> classify -> by class:

* work: early 413 on Content-Length -> the early refusal (gate steps 1–5 and an open
  reclaim, asked of :class:`~vacancyd.control.admission.Admission`) -> buffer body within
  limits -> read the model name -> ``Admission.admit`` (gate step 6, a fresh observation if
  one could change the answer, the ledger reservation; a pool's member chosen first), which
  answers ``Admitted`` with the job's :class:`~vacancyd.control.job.JobHandle` or
  ``Refused`` -> forward, streaming the response, reporting the exchange through the
  handle (forwarding, reply arrived, ended or silent). Everything after that (release,
  tracking work the server still runs, holding a cut job) is ``Work``'s. The proxy never
  reads the shared store itself.
* reclaim (docs/reclaim.md): while a reclaim is open on the upstream, work is refused
  before the body is read; a reclaim may cut an admitted job — before response headers the
  borrower gets 503 with the edge's reason, after them the connection is aborted so the
  stream never ends cleanly. A cut calls the job's exchange
  (:class:`~vacancyd.proxy.forward.Exchange`), which closes the upstream connection at
  once, and resets a stalled borrower's, without cancelling the handler's task.
* pass-through and borrower results: forwarded unconditionally; a WebSocket upgrade is
  tunneled only on a route the adapter lists as a WebSocket (ComfyUI's ``/ws`` progress
  channel; :mod:`vacancyd.proxy.tunnel`) and refused (501) on every other route.
* management and unlisted GET/HEAD: 403 ``management_denied`` unless ``management = "allow"``.
* any other unlisted method: 501, always.

The code lives beside this module, one concern each: :mod:`~vacancyd.proxy.handler` (the
entry point), :mod:`~vacancyd.proxy.jobs` (work up to its admitted job),
:mod:`~vacancyd.proxy.refusing` (the early refusal path), :mod:`~vacancyd.proxy.forward`
(forwarding and streaming the reply), :mod:`~vacancyd.proxy.routes` (everything that is not
work), :mod:`~vacancyd.proxy.listener` (the aiohttp server) and :mod:`~vacancyd.proxy.base`
(what they share). The rest of vacancyd imports the proxy's names from here.
"""

from vacancyd.proxy.base import (
    MIB,
    NO_BODY_STATUSES,
    TEMPLATE_CACHE_SIZE,
    URL_CACHE_SIZE,
    Upstream,
    json_error,
    origin_form,
)
from vacancyd.proxy.handler import Proxy
from vacancyd.proxy.listener import ProxyRequest, ReplyHook, Trace, make_server

__all__ = [
    "MIB",
    "NO_BODY_STATUSES",
    "TEMPLATE_CACHE_SIZE",
    "URL_CACHE_SIZE",
    "Proxy",
    "ProxyRequest",
    "ReplyHook",
    "Trace",
    "Upstream",
    "json_error",
    "make_server",
    "origin_form",
]
