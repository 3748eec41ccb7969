"""The anchor for bench/proxy_overhead.py: the reverse proxy anyone writes in aiohttp first.

No auth, no classification, no gate, no header hygiene beyond dropping hop-by-hop framing.
Usage: ``python bench/naive_forwarder.py LISTEN_PORT TARGET_URL [--uvloop]``.
"""

import sys

import aiohttp
from aiohttp import web

DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


async def forward(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP}
    url = request.app["target"] + request.path_qs
    body = await request.read()
    async with session.request(request.method, url, headers=headers, data=body) as upstream:
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP}
        response = web.StreamResponse(status=upstream.status, headers=out)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def make_app(target: str) -> web.Application:
    app = web.Application()
    app["target"] = target.rstrip("/")
    app["session"] = aiohttp.ClientSession(auto_decompress=False)
    app.on_cleanup.append(lambda a: a["session"].close())
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


if __name__ == "__main__":
    port, target = int(sys.argv[1]), sys.argv[2]
    loop = None
    if "--uvloop" in sys.argv:
        import uvloop

        loop = uvloop.new_event_loop()
    web.run_app(
        make_app(target), host="127.0.0.1", port=port, print=None, access_log=None, loop=loop
    )
