"""The anchor for bench/refusal_rate.py: a bare aiohttp handler that only answers a refusal.

It sends the status, headers and body it is given (the envelope vacancyd answered), nothing
else: no auth, no classification, no gate, no metrics.
Usage: ``python bench/bare_refusal.py LISTEN_PORT ENVELOPE_JSON [--uvloop]``, where the
file holds ``{"status": int, "headers": {name: value}, "body": str}``.
"""

import json
import sys

from aiohttp import web

if __name__ == "__main__":
    port, path = int(sys.argv[1]), sys.argv[2]
    with open(path) as f:
        envelope = json.load(f)
    body = envelope["body"].encode()
    status, headers = envelope["status"], envelope["headers"]

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    loop = None
    if "--uvloop" in sys.argv:
        import uvloop

        loop = uvloop.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=loop)
