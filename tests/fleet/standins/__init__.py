"""Stand-ins for the real things the fleet tests cannot have; each module says what it imitates."""


def send_text(handler, code: int, text: str) -> None:
    """Answer a BaseHTTPRequestHandler request with a one-line plain-text body."""
    body = (text + "\n").encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
