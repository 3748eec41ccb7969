"""The smallest OpenAI-compatible server, for a guest machine with nothing else: answers
``GET /v1/models`` with one model (what ``vacancyd init`` looks for) and 404 otherwise.
Standard library only, so it runs on the guest's bare Python.

    python3 fake_upstream.py PORT
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            data = b'{"error": "not found"}'
            self.send_response(404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
