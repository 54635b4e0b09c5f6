"""The docs' picture of the dashboard (docs/img/dashboard.png): our page (freetoken_infra/dashboard.py)
drawn from the unit tests' known load, screenshotted by a real headless browser. Not Grafana.

    .venv/bin/python bench/dashboard_picture.py [--out docs/img/dashboard.png] [--window 1400x1960]

Needs Debian's prometheus, promtool and chromium. Starts the test fixture's Prometheus
(tests/unit/promfixture.py: the load backfilled with promtool, served on loopback), writes the
page for the load's six hours, and screenshots it with
``chromium --headless --no-sandbox --disable-gpu --screenshot``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken_infra import dashboard  # noqa: E402
from tests.unit.promfixture import SPAN_S, start_prometheus  # noqa: E402
from tests.unit.test_dashboard_page import png_colours, screenshot  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    ap.add_argument("--window", default="1400x1960", help="the browser's window, WIDTHxHEIGHT (default 1400x1960)")
    args = ap.parse_args()
    width, height = (int(n) for n in args.window.split("x"))
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "prometheus").mkdir()
        prometheus = start_prometheus(tmp / "prometheus")
        loaded = next(prometheus)
        try:
            page = tmp / "dashboard.html"
            argv = ["--prometheus", loaded.url, "--since", f"{SPAN_S}s", "--until", str(loaded.end)]
            if dashboard.main([*argv, "--out", str(page)]) != 0:
                return 1
            args.out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(page, args.out, tmp / "profile", window=(width, height))
        finally:
            prometheus.close()
    w, h, colours = png_colours(args.out, rows=height)
    print(f"{args.out}: {w}x{h}, {args.out.stat().st_size // 1024} KiB, {colours} colours")
    return 0


if __name__ == "__main__":
    sys.exit(main())
