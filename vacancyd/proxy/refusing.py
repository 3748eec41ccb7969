"""The refusal path: gate steps 1–5 and the reclaim check before a work body is read, and
the cached serialized 503 replies (:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

import logging

from aiohttp import web

from vacancyd.core import gate
from vacancyd.core.reasons import Refuse
from vacancyd.core.refusal import render_refusal_bytes
from vacancyd.core.snapshot import Snapshot
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

    def _reclaim_refusal(self) -> Refuse | None:
        return self.work.refusal(self.upstream.name)

    def _early_refusal(self) -> Refuse | None:
        """Gate steps 1–5 and the reclaim check, before the body is read: a refusal no fresh
        sample can change. A pool refuses only when every member does (the one that frees up
        first answers).

        The switches, the owner's holds and presence come first and need no snapshot, so a
        refusal for any of them (lending off, the owner present or pausing) builds none; a
        snapshot is built, once, only when they let a member through to the later steps,
        which then start again from step 1 on it (the same answer for the steps already
        asked).
        """
        state = self.state
        switched_off = gate.decide_switches(state.stopping, state.lending_enabled)
        if switched_off is not None:
            return switched_off  # the same for every member, and no snapshot needed
        proxies: list[Refusing] = list(self.members.values()) or [self]
        refusals: list[Refuse] = []
        now = state.clock()
        presence = state.presence_view(now)
        snap: Snapshot | None = None
        for proxy in proxies:
            policy = proxy.upstream.policy
            refusal = gate.decide_owner_steps(state.holds, presence, now, policy)
            if refusal is None:
                if snap is None:
                    snap = state.snapshot()
                refusal = gate.decide_before_body(snap, policy)
                if refusal is not None and refusal.refresh is not None:
                    refusal = None  # a fresh sample may still admit it: let the body come
                refusal = refusal or proxy._reclaim_refusal()
                if refusal is None:
                    return None
            refusals.append(refusal)
        if len(refusals) == 1:
            return refusals[0]
        return min(refusals, key=lambda r: r.retry_after_s)
