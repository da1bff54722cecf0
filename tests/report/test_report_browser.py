"""The report in a real browser: headless Chromium opens it with every host name unresolvable
(so it must be self-contained), and the test reads the DOM after the page has loaded.

The page itself has no JavaScript; the test renders a copy with a small probe script
appended that writes, on ``load``, what the browser decoded and laid out (each image's
natural and rendered size, each table's rendered height) into ``data-`` attributes, which
``--dump-dom`` then shows. Set AUTOFIT_CHROMIUM to a browser binary to use another one.
"""

import os
import shutil
import struct
import subprocess
from html.parser import HTMLParser

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

PROBE = """<script>
window.addEventListener("load", () => {
  for (const img of document.images) {
    const box = img.getBoundingClientRect();
    img.dataset.naturalWidth = img.naturalWidth;
    img.dataset.naturalHeight = img.naturalHeight;
    img.dataset.renderedWidth = Math.round(box.width);
    img.dataset.complete = img.complete;
  }
  for (const table of document.querySelectorAll("table")) {
    table.dataset.renderedHeight = Math.round(table.getBoundingClientRect().height);
  }
  document.body.dataset.probe = "loaded";
});
</script>"""


def find_chromium() -> str | None:
    wanted = os.environ.get("AUTOFIT_CHROMIUM")
    if wanted:
        return shutil.which(wanted) or (wanted if os.access(wanted, os.X_OK) else None)
    return next((path for path in map(shutil.which, NAMES) if path), None)


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium/Chrome binary on PATH (apt-get install chromium, or set AUTOFIT_CHROMIUM)",
)


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: no host name resolves
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
    ]
    env = {**os.environ, "HOME": str(tmp_path)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)


class Dom(HTMLParser):
    """The few things the test reads from the dumped DOM."""

    def __init__(self):
        super().__init__()
        self.images: dict[str, dict[str, str]] = {}
        self.tables: dict[str, dict[str, str]] = {}
        self.rows: dict[str, int] = {}
        self.body: dict[str, str] = {}
        self.text: list[str] = []
        self._table: str | None = None
        self._in_tbody = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images[a.get("id", "")] = a
        elif tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = a
            self.rows[self._table] = 0
        elif tag == "tbody":
            self._in_tbody = True
        elif tag == "tr" and self._table is not None and self._in_tbody:
            self.rows[self._table] += 1
        elif tag == "body":
            self.body = a

    def handle_endtag(self, tag):
        if tag == "table":
            self._table, self._in_tbody = None, False

    def handle_data(self, data):
        self.text.append(data)


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_report_renders_offline_with_its_plots_and_tables(tight_study, tight_report, tmp_path):
    files, st = tight_report, tight_report.standing
    probe = tmp_path / "probe.html"  # beside nothing: the page needs no file of its own
    probe.write_text(files.html.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")

    dumped = chromium(tmp_path, "--virtual-time-budget=10000", "--window-size=1280,2000", "--dump-dom", probe.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = Dom()
    dom.feed(dumped.stdout)
    assert dom.body.get("data-probe") == "loaded", "the page did not finish loading"

    # every plot decoded, at the size of the PNG beside the page, and laid out on the page
    assert sorted(dom.images) == ["plot-memory-anatomy", "plot-memory-vs-speed", "plot-technique-effects"]
    for plot in files.plots:
        img = dom.images[f"plot-{plot.name}"]
        width, height = png_size(plot.png)
        assert img["data-complete"] == "true"
        assert (int(img["data-natural-width"]), int(img["data-natural-height"])) == (width, height)
        assert int(img["data-rendered-width"]) > 300

    # the tables, with as many rows as the study has
    with tight_study.store() as store:
        n_trials = len(store.trials(store.get_study(tight_study.name).id))
    expected_rows = {
        "anatomy": 7 + 3 + 1,
        "best-per-method": 3,
        "runners-up": len(st.runners_up()),
        "losses": len(st.losses),
        "technique-effects": len(files.effects.toggles),
        "trials": n_trials,
    }
    for table, rows in expected_rows.items():
        assert dom.rows[table] == rows, table
        assert int(dom.tables[table]["data-rendered-height"]) > 20 * min(rows, 3), table
    text = " ".join(dom.text)
    assert st.best.plan.summary() in text and "Config files of the winner" in text
    assert "accelerate_config.yaml" in text

    shot = tmp_path / "report.png"
    taken = chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={shot}", files.html.as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    assert png_size(shot) == (1280, 2400)
