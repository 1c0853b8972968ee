"""A real browser (headless Chromium driven by Selenium) labels pairs on the page.

Chromium is found on PATH (or $RLHFLAB_CHROMIUM / $RLHFLAB_CHROMEDRIVER); when it is
missing and we are root with apt-get, the test installs Debian's `chromium` and
`chromium-driver`, saying so on the terminal (RLHFLAB_NO_APT=1 skips the test instead). It
skips, saying why, only when neither works. Set
$RLHFLAB_SCREENSHOT_DIR to keep a screenshot of the page.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from label_helpers import SCRIPT, make_db, start_server

from rlhflab.label import db as labeldb

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TOKEN = "browser-token-42"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]


def _which_browser() -> tuple[str | None, str | None]:
    browser = os.environ.get("RLHFLAB_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = os.environ.get("RLHFLAB_CHROMEDRIVER") or shutil.which("chromedriver")
    return browser, driver


def announce(request, line: str) -> None:
    """Print `line` on the terminal now, past pytest's output capture: an install by apt-get
    must not happen silently."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}", flush=True)


def _find_or_install_chromium(request) -> tuple[str, str]:
    browser, driver = _which_browser()
    if browser and driver:
        return browser, driver
    if os.environ.get("RLHFLAB_NO_APT"):
        pytest.skip("headless Chromium not found and RLHFLAB_NO_APT is set: not installing it")
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.skip("headless Chromium not found and cannot be installed here (needs root and "
                    "apt-get): run `apt-get install chromium chromium-driver`, or set "
                    "RLHFLAB_CHROMIUM and RLHFLAB_CHROMEDRIVER")
    announce(request, "test_label_browser: installing chromium and chromium-driver with apt-get "
                      "(as root, none found; RLHFLAB_NO_APT=1 skips this test instead) ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = []
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium", "chromium-driver"]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(cmd)}` took over 15 minutes; install chromium by hand")
        log.append(proc.stdout[-800:] + proc.stderr[-800:])
        if proc.returncode != 0:
            break
    browser, driver = _which_browser()
    if not (browser and driver):
        pytest.skip("headless Chromium could not be installed with apt-get "
                    f"(chromium and chromium-driver): {' | '.join(log)[-600:]}")
    return browser, driver


@pytest.fixture(scope="module")
def chromium_paths(request):
    pytest.importorskip("selenium", reason="pip install selenium (it is in rlhflab's test extra)")
    return _find_or_install_chromium(request)


@pytest.fixture
def driver(chromium_paths, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, chromedriver = chromium_paths
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


def _wait(drv, cond, timeout=15.0, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: cond(d), message=f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_label_pairs_by_click_and_keyboard(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    db = make_db(tmp_path / "p.db", n_prompts=4, responses_per_prompt=2, script_in=0)
    server = start_server(db, tmp_path / "server.log", token=TOKEN)
    by_id = driver.find_element
    shot_dir = os.environ.get("RLHFLAB_SCREENSHOT_DIR")
    try:
        # 1. without the token the page is a 401 with a token form
        driver.get(server.url + "/")
        by_id(By.ID, "token").send_keys(TOKEN + Keys.ENTER)
        # 2. sign in with a name
        name = _wait(driver, lambda d: d.find_element(By.ID, "name"), what="the name form")
        _wait(driver, lambda d: name.is_displayed(), what="the name form")
        name.send_keys("browser-ann" + Keys.ENTER)

        seen_script = False
        prompts_seen = []

        def wait_for_new_pair():
            nonlocal seen_script
            _wait(driver, lambda d: by_id(By.ID, "done").is_displayed() or (
                by_id(By.ID, "task").is_displayed() and by_id(By.ID, "prompt").text
                and by_id(By.ID, "prompt").text not in prompts_seen), what="the next pair")
            if by_id(By.ID, "done").is_displayed():
                return False
            prompts_seen.append(by_id(By.ID, "prompt").text)
            shown = by_id(By.ID, "left").text + by_id(By.ID, "right").text
            if SCRIPT in shown:  # the <script> response shows as literal text
                seen_script = True
                if shot_dir:
                    driver.save_screenshot(str(Path(shot_dir) / "label_script.png"))
                assert driver.find_elements(By.CSS_SELECTOR, "#left script, #right script") == []
            assert driver.execute_script("return window.__pwned") is None
            return True

        assert wait_for_new_pair()
        # markdown renders (bold) and the panels carry the A / B captions
        assert driver.find_elements(By.CSS_SELECTOR, "#left strong, #right strong")
        if shot_dir:
            Path(shot_dir).mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(Path(shot_dir) / "label_page.png"))

        # 3. first pair: click "A much better"
        by_id(By.CSS_SELECTOR, "button.level-1").click()
        assert wait_for_new_pair()
        _wait(driver, lambda d: "you: 1" in by_id(By.ID, "progress").text, what="progress 1")
        assert "Labelled 1 / 4 pairs" in by_id(By.ID, "progress").text

        # 4. second pair: keyboard 5
        ActionChains(driver).send_keys("5").perform()
        assert wait_for_new_pair()

        # 5. third pair: criteria + comment, Esc leaves the comment box, then key 2
        by_id(By.CSS_SELECTOR, "#criteria input[value='clarity']").click()
        by_id(By.CSS_SELECTOR, "#criteria input[value='engagement']").click()
        comment = by_id(By.ID, "comment")
        comment.send_keys("more <b>engaging</b> 12345")  # digits in the box are text, not labels
        comment.send_keys(Keys.ESCAPE)
        ActionChains(driver).send_keys("2").perform()
        assert wait_for_new_pair()

        # 6. fourth pair: skip with the S key
        ActionChains(driver).send_keys("s").perform()
        assert not wait_for_new_pair()  # nothing left: the done screen
        assert seen_script, "the pair with the <script> response was never shown"
        assert driver.title.startswith("rlhflab")
        if shot_dir:
            driver.save_screenshot(str(Path(shot_dir) / "label_done.png"))
    finally:
        server.stop()

    conn = labeldb.connect(db)
    labels = [dict(r) for r in conn.execute("SELECT * FROM labels ORDER BY id")]
    skips = conn.execute("SELECT annotator FROM skips").fetchall()
    conn.close()
    assert [(r["annotator"], r["level"]) for r in labels] == [
        ("browser-ann", 1), ("browser-ann", 5), ("browser-ann", 2)]
    assert labels[2]["comment"] == "more <b>engaging</b> 12345"
    assert json.loads(labels[2]["criteria"]) == ["clarity", "engagement"]
    assert all(r["a_level"] == (6 - r["level"] if r["flipped"] else r["level"]) for r in labels)
    assert all(r["elapsed_ms"] is not None and r["elapsed_ms"] >= 0 for r in labels)
    assert [tuple(s) for s in skips] == [("browser-ann",)]


@pytest.mark.timeout(120)
def test_long_markdown_response_stays_readable(driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    long_md = ("# Heading\n\nSome *text* with `inline code`.\n\n- item one\n- item two\n\n"
               "```python\nfor i in range(3):\n    print(i)\n```\n\n> a quote\n\n"
               + "\n\n".join(f"Paragraph {k}: " + "word " * 80 for k in range(40))
               + "\n\n" + "x" * 3000)
    db = tmp_path / "p.db"
    conn = labeldb.connect(db, create=True)
    with labeldb.transaction(conn):
        labeldb.add_candidates(conn, "Explain loops", [long_md, "Short answer."])
    conn.close()
    server = start_server(db, tmp_path / "server.log")
    try:
        driver.get(server.url + "/")
        _wait(driver, lambda d: d.find_element(By.ID, "name").is_displayed(), what="name form")
        driver.find_element(By.ID, "name").send_keys("reader" + Keys.ENTER)
        _wait(driver, lambda d: d.find_element(By.ID, "task").is_displayed(), what="the pair")
        side = "left" if "Heading" in driver.find_element(By.ID, "left").text else "right"
        panel = driver.find_element(By.ID, side)
        assert panel.find_elements(By.CSS_SELECTOR, ".md-h1")
        assert panel.find_elements(By.CSS_SELECTOR, "pre code")
        assert len(panel.find_elements(By.CSS_SELECTOR, "ul li")) == 2
        # the panel scrolls inside itself and nothing overflows the page sideways
        dims = driver.execute_script(
            "const p = arguments[0]; return [p.scrollHeight, p.clientHeight, "
            "document.documentElement.scrollWidth, window.innerWidth]", panel)
        assert dims[0] > dims[1]
        assert dims[2] <= dims[3]
        if os.environ.get("RLHFLAB_SCREENSHOT_DIR"):
            driver.save_screenshot(str(Path(os.environ["RLHFLAB_SCREENSHOT_DIR"]) / "label_long.png"))
        # the raw view shows the markdown source as plain text
        driver.find_element(By.ID, "raw").click()
        time.sleep(0.2)
        assert "# Heading" in driver.find_element(By.ID, side).text
    finally:
        server.stop()


def test_missing_chromium_without_root_skips_with_instructions(monkeypatch, request):
    monkeypatch.delenv("RLHFLAB_CHROMIUM", raising=False)
    monkeypatch.delenv("RLHFLAB_CHROMEDRIVER", raising=False)
    monkeypatch.delenv("RLHFLAB_NO_APT", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium chromium-driver"):
        _find_or_install_chromium(request)
    # As root, RLHFLAB_NO_APT=1 skips instead of installing.
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setenv("RLHFLAB_NO_APT", "1")
    with pytest.raises(pytest.skip.Exception, match="RLHFLAB_NO_APT"):
        _find_or_install_chromium(request)


def test_missing_chromium_as_root_is_installed_with_apt(monkeypatch, request):
    import test_label_browser as this

    monkeypatch.delenv("RLHFLAB_CHROMIUM", raising=False)
    monkeypatch.delenv("RLHFLAB_CHROMEDRIVER", raising=False)
    monkeypatch.delenv("RLHFLAB_NO_APT", raising=False)
    installed, said = [], []
    monkeypatch.setattr(this, "announce", lambda request, line: said.append((line, list(installed))))
    paths = {"chromium": "/usr/bin/chromium", "chromedriver": "/usr/bin/chromedriver",
             "apt-get": "/usr/bin/apt-get"}
    monkeypatch.setattr(shutil, "which",
                        lambda name: paths[name] if name == "apt-get" or installed else None)
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)

    def fake_run(cmd, **kw):
        installed.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert _find_or_install_chromium(request) == ("/usr/bin/chromium", "/usr/bin/chromedriver")
    assert installed == [["apt-get", "update"], ["apt-get", "install", "-y", "chromium", "chromium-driver"]]
    # The install was announced on the terminal before apt-get ran.
    assert len(said) == 1 and "installing chromium and chromium-driver with apt-get" in said[0][0]
    assert said[0][1] == []
