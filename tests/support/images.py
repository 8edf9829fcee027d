"""Images for the multimodal tests: small PNGs of one colour, data URLs, and a loopback HTTP server of them."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from PIL import Image


def png(color: str = "red", size: tuple[int, int] = (96, 64)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@contextmanager
def png_server(fetched: list[str] | None = None) -> Iterator[str]:
    """A loopback HTTP server of `png(color)` at /<color>.png; yields its base URL. Each request's path is
    appended to `fetched`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if fetched is not None:
                fetched.append(self.path)
            try:
                body = png(Path(self.path).stem)
            except ValueError:  # not a colour: a missing image
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
