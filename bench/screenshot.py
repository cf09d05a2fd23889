"""The first screen of a Snakemake report, as headless Chromium shows it, saved as a PNG.

    python bench/screenshot.py report.html docs/report-first-screen.png
    python bench/screenshot.py report.html out.png --size 1280x800

Offline: the page is opened from its file with the browser's network switched off (the report
embeds everything). Needs Chromium and its driver (Debian: chromium, chromium-driver, which
.ci/install_system_deps.sh installs) and selenium (the dev extras); no driver download.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# The report's React app has rendered its landing page (the workflow description and the rule
# graph next to it): then the size of the page's CSS, which Tailwind generates in the browser
# while the app renders (a screenshot taken before it settles misses styles).
_RENDERED = (
    "if (!document.querySelector('#app .prose') || !document.querySelector('#app .vega-embed'))"
    " return -1;"
    " return [...document.querySelectorAll('style')].reduce((n, s) => n + s.textContent.length, 0)"
)


def chromium(width: int = 1400, height: int = 900) -> webdriver.Chrome:
    """Headless Chromium with a ``width`` x ``height`` viewport and no network."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars"]:  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.execute_cdp_cmd(  # the viewport exactly (--window-size counts the window's frame)
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.emulateNetworkConditions",
        {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )
    return driver


def open_report(driver: webdriver.Chrome, report: Path, timeout: float = 30) -> None:
    """Load ``report`` and wait until its landing page has rendered."""
    driver.get(Path(report).resolve().as_uri())
    sizes = [-1]

    def settled(d: webdriver.Chrome) -> bool:
        sizes.append(d.execute_script(_RENDERED))
        return sizes[-1] == sizes[-2] != -1

    WebDriverWait(driver, timeout, poll_frequency=0.3).until(settled)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="the report (snakemake --report report.html)")
    ap.add_argument("out", type=Path, help="PNG to write")
    ap.add_argument("--size", default="1400x900", help="viewport WIDTHxHEIGHT (1400x900)")
    args = ap.parse_args()
    if not args.report.is_file():
        ap.error(f"{args.report}: no such report (build it: snakemake --report report.html)")
    width, height = (int(x) for x in args.size.split("x"))
    driver = chromium(width, height)
    try:
        open_report(driver, args.report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if not driver.save_screenshot(str(args.out)):
            raise SystemExit(f"{args.out}: the browser could not write the screenshot")
    finally:
        driver.quit()
    print(f"{args.out}: the first screen of {args.report} at {width}x{height}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
