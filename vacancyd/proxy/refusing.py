"""The refusal path: the early refusal before a work body is read (asked of
:class:`~vacancyd.control.admission.Admission`), and the cached serialized 503 replies
(:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

import logging

from aiohttp import web

from vacancyd.core.reasons import ErrorCode, ErrorType, Refuse
from vacancyd.core.refusal import render_refusal_bytes
from vacancyd.proxy import bodies, observe, reply
from vacancyd.proxy.base import TEMPLATE_CACHE_SIZE, ProxyBase

#: The whole proxy logs as ``vacancyd.proxy.app`` (docs/observability.md names it).
log = logging.getLogger("vacancyd.proxy.app")


class Refusing(ProxyBase):
    """Refusing work: the early gate steps before the body is read, and the serialized
    refusal replies."""

    def _refusal_response(self, request: web.BaseRequest, refusal: Refuse) -> web.StreamResponse:
        name = self.upstream.name
        flat = self._flat(request)
        last = self._last_refusal
        if last is not None and last[0] is refusal and last[1] is flat:
            template, reason = last[2], last[3]  # a switch's refusal: one shared value
        else:
            template = self._template(refusal, flat)
            reason = refusal.reason.value
            self._last_refusal = (refusal, flat, template, reason)
        request[observe.REFUSAL] = refusal
        self.metrics.decision(name, "refused", reason)
        self.metrics.borrower_request(self.auth.borrower(request), name, False)
        if refusal.credit is not None:
            self.metrics.residency(name, refusal.credit)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "refused %s %s on %s: %s (%s)",
                request.method,
                request.path,
                name,
                refusal.reason,
                refusal.detail,
            )
        return template.reply(request)

    def _template(self, refusal: Refuse, flat: bool) -> reply.Template:
        """The serialized reply for ``refusal`` (in the flat shape when ``flat``), kept per
        distinct rendering (a flood of the same refusal is one dictionary lookup after the
        first)."""
        settings = self.upstream.settings
        rendered = render_refusal_bytes(
            refusal, self.upstream.name, settings.refusal_status, settings.retry_after_max_s, flat
        )
        kept = self._templates.get(id(rendered))
        if kept is not None and kept[0] is rendered:
            return kept[1]
        template = reply.Template(rendered.status, rendered.headers, rendered.body)
        if len(self._templates) >= TEMPLATE_CACHE_SIZE:
            self._templates.clear()
        self._templates[id(rendered)] = (rendered, template)
        return template

    def _not_allowed(self, request: web.BaseRequest, why: str) -> web.StreamResponse:
        """403 for a named borrower off its ``upstreams`` (``why`` names both): counted as
        its refusal, never an admission decision."""
        self.metrics.borrower_request(self.auth.borrower(request), self.upstream.name, False)
        return self._json_error(
            request, 403, why, ErrorType.PERMISSION, ErrorCode.UPSTREAM_NOT_ALLOWED
        )

    async def _refuse(self, request: web.BaseRequest, refusal: Refuse) -> web.StreamResponse:
        return await self._answer_and_drain(request, self._refusal_response(request, refusal))

    async def _answer_and_drain(
        self, request: web.BaseRequest, response: web.StreamResponse
    ) -> web.StreamResponse:
        """Send ``response`` now, then drop what is left of the body (up to 2× the limit)."""
        if request.body_exists and not request.content.is_eof():
            await response.prepare(request)
            await response.write_eof()
            await bodies.drain(request, 2 * self.max_body, self.limits.body_read_timeout_s)
        return response

    def _early_refusal(self) -> Refuse | None:
        """Gate steps 1–5 and the reclaim check before the body is read, for this upstream
        or every member of a pool (:meth:`Admission.early`): a refusal no fresh sample can
        change, or None."""
        refused = self.admission.early(self.admits)
        return None if refused is None else refused.refusal
