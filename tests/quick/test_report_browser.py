"""The HTML report in a real browser: headless Chromium (Debian's chromium + chromium-driver,
driven by selenium) loads the page and shows the verdict, the grid and the plots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import require
from stores import ERRORED, EXCLUDED, FIXED, NOT_FIXED, store

from dsmatrix.report.qualification import write_report

# Debian's chromium and chromium-driver (.ci/run installs them), or the Chrome and ChromeDriver of
# GitHub's hosted runners (CHROMEWEBDRIVER names the driver's folder there).
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver") or shutil.which("chromedriver", path=os.environ.get("CHROMEWEBDRIVER", ""))


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    require(CHROMIUM and DRIVER, "Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_headless_chromium_shows_the_verdict_grid_and_plots(tmp_path: Path, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    store(tmp_path / "results", [FIXED, NOT_FIXED, ERRORED], excluded=[EXCLUDED])
    page = write_report([tmp_path / "results"], tmp_path / "reports") / "qualification.html"
    browser.get(page.as_uri())

    verdict = browser.find_element(By.ID, "verdict")
    assert verdict.is_displayed() and verdict.text == "NOT QUALIFIED"
    assert verdict.value_of_css_property("background-color") == "rgba(255, 235, 233, 1)", "the inline stylesheet applies"
    grid = browser.find_element(By.ID, "grid")
    assert grid.is_displayed()
    rows = grid.find_elements(By.TAG_NAME, "tr")
    assert len(rows) == 3, "a header and one row per test"
    squares = [td.text for td in rows[1].find_elements(By.CSS_SELECTOR, "td.o")]
    assert squares == ["– / –", "FAIL / FAIL", "FAIL / pass"]
    assert all(td.is_displayed() for td in rows[1].find_elements(By.CSS_SELECTOR, "td.o"))
    assert browser.find_element(By.ID, "excluded").is_displayed() and browser.find_element(By.ID, "errors").is_displayed()
    widths = browser.execute_script("return Array.from(document.images).map(i => i.complete ? i.naturalWidth : 0)")
    assert len(widths) == 2 and min(widths) > 100, "both embedded plots decode and render"
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
