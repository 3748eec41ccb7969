"""A small closed-loop HTTP/1.1 load generator, used by bench/refusal_rate.py when ``wrk``
is not installed. Prints one JSON line: {"requests": int, "seconds": float, "statuses": {}}.

Usage: ``python bench/loadgen.py PORT PATH BODY_FILE CONNECTIONS SECONDS``. Each connection
sends a POST, reads the whole response (Content-Length framing), and sends the next.
"""

import asyncio
import json
import sys
import time
from collections import Counter


async def connection(port: int, request: bytes, until: float, counts: Counter[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            counts[status] += 1
    finally:
        writer.close()


async def main(body: bytes) -> None:
    port, path, _, conns, seconds = sys.argv[1:6]
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts: Counter[int] = Counter()
    t0 = time.monotonic()
    until = t0 + float(seconds)
    await asyncio.gather(
        *(connection(int(port), request, until, counts) for _ in range(int(conns)))
    )
    print(
        json.dumps(
            {
                "requests": sum(counts.values()),
                "seconds": time.monotonic() - t0,
                "statuses": {str(k): v for k, v in counts.items()},
            }
        )
    )


if __name__ == "__main__":
    with open(sys.argv[3], "rb") as f:
        payload = f.read()
    try:
        import uvloop

        uvloop.run(main(payload))
    except ImportError:
        asyncio.run(main(payload))
