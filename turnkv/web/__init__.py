"""The chat page served at ``/``: static HTML, JS and CSS shipped in the package (no build step,
no external resources: the page works on a machine without network)."""

from __future__ import annotations

from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}


def asset(name: str) -> tuple[bytes, str] | None:
    """(bytes, media type) of a shipped file, None for any other name."""
    media = ASSETS.get(name)
    if media is None:
        return None
    return (WEB_DIR / name).read_bytes(), media
