"""The report opens in headless Chromium: every plot decodes, and a screenshot is taken."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_config

from forgetless.cli.app import main

CHECK = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-decoded', ok + '/' + imgs.length);
});
</script>"""
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: `make test` installs Debian's chromium package")
        pytest.skip("chromium not installed (make test installs it)")
    return found


def test_report_opens_in_headless_chromium(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    browser = _chromium()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir)), encoding="utf-8")
    out = tmp_path / "run"
    monkeypatch.setattr(
        sys, "argv", ["forgetless", "run", str(config), "--out", str(out), "--quiet"]
    )
    main()
    monkeypatch.setattr(sys, "argv", ["forgetless", "report", str(out)])
    main()
    page = (out / "report.html").read_text(encoding="utf-8")
    checked = out / "check.html"
    checked.write_text(page.replace("</body>", CHECK + "</body>"), encoding="utf-8")
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run(
        [browser, *FLAGS, *profile, "--virtual-time-budget=5000", "--dump-dom", checked.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    match = re.search(r'data-decoded="(\d+)/(\d+)"', dom)
    assert match, "the page did not load"
    assert match.group(1) == match.group(2) == "4"
    shot = Path(os.environ.get("FORGETLESS_SCREENSHOT", tmp_path / "report.png"))
    subprocess.run(
        [
            browser,
            *FLAGS,
            *profile,
            "--window-size=1200,2600",
            f"--screenshot={shot}",
            (out / "report.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.stat().st_size > 10_000
