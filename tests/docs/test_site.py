"""The documentation site: its rendered notebooks are current, and the built site opens in headless Chromium.

The notebooks on the site are the stored executions in docs/notebooks/ (`docs/execute_notebooks.py` writes them;
`make docs` renders them without executing anything): each must have its source notebook's cells, outputs, and no
error. The browser test opens the built site (`make docs` → site/) in Debian's Chromium (`/usr/bin/chromium` with
its chromedriver) over a local HTTP server: the home page, one API page, one rendered notebook and a search, with no
console error. Without a built site or a browser it skips, unless OPTLAB_REQUIRE_SITE=1 (what .ci/run sets after it
builds the site and installs Chromium), where a missing piece fails.
"""

import functools
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site"
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
NAMES = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("name", NAMES)
def test_the_rendered_notebook_is_the_source_executed(name):
  source = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
  copy_path = ROOT / "docs" / "notebooks" / f"{name}.ipynb"
  assert copy_path.exists(), f"no rendered copy: run `.venv/bin/python docs/execute_notebooks.py {name}`"
  copy = nbformat.read(copy_path, as_version=4)
  assert [(c.cell_type, c.source) for c in copy.cells] == [(c.cell_type, c.source) for c in source.cells], (
      f"docs/notebooks/{name}.ipynb is stale: run `.venv/bin/python docs/execute_notebooks.py {name}`")
  code = [c for c in copy.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "a code cell was not executed"
  assert any(c.outputs for c in code), "no outputs stored"
  assert not [o for c in code for o in c.outputs if o.output_type == "error"]
  assert copy.metadata["optlab"]["commit"]


def _required(what: str):
  if os.environ.get("OPTLAB_REQUIRE_SITE") == "1":
    pytest.fail(f"{what} (OPTLAB_REQUIRE_SITE=1)")
  pytest.skip(what)


@pytest.fixture(scope="module")
def browser():
  if not (SITE / "index.html").exists():
    _required("no built site: run `make docs`")
  if not (shutil.which(CHROMIUM) and shutil.which(DRIVER)):
    _required(f"no {CHROMIUM} / {DRIVER}: `apt-get install chromium chromium-driver`")
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
  except ImportError:
    _required("selenium is not installed: `pip install -e .[docs]` (make docs does)")
  os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not try to download a driver
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SITE))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]:
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(DRIVER), options=options)
  driver.set_page_load_timeout(60)
  try:
    yield driver, f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    driver.quit()
    server.shutdown()


def _errors(driver) -> list[str]:
  return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_site_opens_in_a_browser_without_console_errors(browser):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.common.keys import Keys
  from selenium.webdriver.support import expected_conditions as ec
  from selenium.webdriver.support.ui import WebDriverWait
  driver, base = browser
  pages = {"index.html": "optlab", "api/optim.html": "scale_by_muon", "notebooks/quickstart.html": "optlab quick start"}
  for path, text in pages.items():
    driver.get(f"{base}/{path}")
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    assert text in driver.page_source, f"{path}: {text!r} not on the page"
    assert _errors(driver) == [], f"{path}: console errors"
  notebook = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output, .output_area")
  assert notebook, "the rendered notebook shows no outputs"
  driver.get(f"{base}/index.html")
  driver.find_element(By.CSS_SELECTOR, "label.md-search__icon, label[for='__search']").click()
  box = WebDriverWait(driver, 30).until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
  box.send_keys("Newton", Keys.ENTER)
  hits = WebDriverWait(driver, 30).until(
      lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item") or False)
  titles = json.dumps([h.text[:80] for h in hits[:5]])
  assert any("Newton" in h.text for h in hits), titles
  assert _errors(driver) == [], "search: console errors"
