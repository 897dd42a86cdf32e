"""Drives the web console in Debian's Chromium over WebDriver (chromedriver),
against a real server: sign-in (a wrong key first), a sandbox created through
the API appearing live, its terminal, a command and its transcript, the file
browser, templates, and a delete from the page; another tenant's sandbox never
shows. Screenshots go to $SCREENSHOTS. Prints CONSOLE OK at the end."""

import json
import os
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

URL = os.environ["SPACE_URL"]
KEY_A = os.environ["KEY_A"]
KEY_B = os.environ["KEY_B"]
SHOTS = os.path.realpath(os.environ["SCREENSHOTS"])


def call(key, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(URL + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read()
        return json.loads(text) if text else None


def wait_operation(key, op):
    for _ in range(20):
        operation = call(key, "GET", f"/v1/operations/{op}?wait=30")
        if operation["state"] in ("succeeded", "failed", "cancelled"):
            return operation
    raise AssertionError(f"operation {op} never ended")


def shot(driver, name):
    os.makedirs(SHOTS, exist_ok=True)
    driver.save_screenshot(os.path.join(SHOTS, name))


def main():
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    # The page re-renders rows as events arrive: an element found a moment
    # ago may be gone, which only means "look again".
    wait = WebDriverWait(driver, 90, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    by_id = lambda name: driver.find_element(By.ID, name)

    def click(css):
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True)
    try:
        driver.get(URL + "/")
        wait.until(lambda d: by_id("sign-in-view").is_displayed())
        shot(driver, "01-sign-in.png")

        # A wrong key: a clear error, and nothing kept.
        by_id("key").send_keys("space_this_is_not_a_key")
        by_id("sign-in").submit()
        wait.until(lambda d: by_id("sign-in-error").is_displayed())
        error = by_id("sign-in-error").text
        assert "refused" in error and "not valid" in error, error
        assert driver.execute_script("return sessionStorage.getItem('space.key')") is None
        assert not by_id("nav").is_displayed() and not by_id("sign-out").is_displayed()
        shot(driver, "02-wrong-key.png")

        by_id("key").send_keys(KEY_A)
        by_id("sign-in").submit()
        wait.until(lambda d: by_id("sandboxes-view").is_displayed() and by_id("live").text == "live")
        assert by_id("key").get_attribute("value") == "", "the key must not stay in the form"
        assert driver.execute_script("return localStorage.length") == 0, "nothing in local storage"
        driver.get_log("browser")  # the wrong key's 401 is expected: start afresh

        # Sandboxes created through the API, one per tenant: A's appears without a reload.
        mine = call(KEY_A, "POST", "/v1/sandboxes", {"template": "base", "labels": {"from": "api"}})
        theirs = call(KEY_B, "POST", "/v1/sandboxes", {"template": "base"})
        sbx, other = mine["sandbox"]["id"], theirs["sandbox"]["id"]
        marker = driver.execute_script("window.__not_reloaded = true; return true")
        row = f'#sandboxes tr[data-id="{sbx}"]'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f"{row} .state").text == "running")
        assert driver.execute_script("return window.__not_reloaded === true") and marker, "the page reloaded"
        wait_operation(KEY_B, theirs["operation"]["id"])
        # Usage figures of the running sandbox show up in its row.
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f"{row} td:nth-child(6)").text.endswith("MiB"))
        wait.until(lambda d: by_id("usage").text.startswith("Usage 1 sandboxes"))
        shot(driver, "03-sandboxes.png")
        assert other not in driver.page_source, "another tenant's sandbox appeared"

        # Its page: usage, a terminal, a command with its transcript, files.
        click(f"{row} code")
        wait.until(lambda d: by_id("sandbox-view").is_displayed() and by_id("sbx-state").text == "running")
        wait.until(lambda d: "CPU" in by_id("sbx-usage").text)
        by_id("term-open").click()
        wait.until(lambda d: by_id("term-status").text == "connected")
        typing = driver.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea")
        rows = lambda d: [r.text.strip() for r in d.find_elements(By.CSS_SELECTOR, "#terminal .xterm-rows > div")]
        wait.until(lambda d: any(r.endswith("#") or r.endswith("$") for r in rows(d)))  # a prompt
        typing.send_keys("echo $((6*7))\n")
        wait.until(lambda d: "42" in rows(d))
        shot(driver, "04-terminal.png")
        wait.until(lambda d: any("bash -l" in c.text for c in d.find_elements(By.CSS_SELECTOR, "#commands tbody tr")))

        by_id("exec-cmd").send_keys("echo from-the-console; echo to-stderr >&2; exit 5")
        by_id("exec").submit()
        wait.until(lambda d: "from-the-console" in by_id("transcript-output").text)
        assert "to-stderr" in driver.find_element(By.CSS_SELECTOR, "#transcript-output .stderr").text
        wait.until(lambda d: by_id("transcript-result").text.startswith("exit 5"))

        call(KEY_A, "POST", f"/v1/sandboxes/{sbx}/exec", {"cmd": "mkdir -p /root/box && echo hi > /root/box/seen.txt"})
        by_id("files-path").clear()
        by_id("files-path").send_keys("/root/box")
        by_id("files-go").submit()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#files tr[data-name="seen.txt"]'))
        upload = os.path.join(SHOTS, "uploaded.txt")
        with open(upload, "w") as f:
            f.write("uploaded from the browser\n")
        by_id("files-upload").send_keys(upload)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#files tr[data-name="uploaded.txt"]'))
        ran = call(KEY_A, "POST", f"/v1/sandboxes/{sbx}/exec", {"cmd": "cat /root/box/uploaded.txt"})
        assert ran["stdout"] == "uploaded from the browser\n", ran
        shot(driver, "05-sandbox.png")

        # Templates, with the base template listed.
        by_id("nav-templates").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#templates tr[data-name="base"]'))
        shot(driver, "06-templates.png")

        # Delete from the page (two clicks) and see it go.
        by_id("nav-sandboxes").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
        delete = f'{row} button[data-action="delete"]'
        click(delete)
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, delete).text == "Confirm delete")
        click(delete)
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, row))
        assert call(KEY_A, "GET", f"/v1/sandboxes/{sbx}")["state"] == "deleted"
        shot(driver, "07-deleted.png")
        assert other not in driver.page_source, "another tenant's sandbox appeared"
        assert call(KEY_B, "GET", f"/v1/sandboxes/{other}")["state"] == "running", "B's sandbox was touched"
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]]
        assert not errors, errors
    except Exception:
        shot(driver, "failure.png")
        print(driver.get_log("browser"), file=sys.stderr)
        raise
    finally:
        driver.quit()
    print("CONSOLE OK")


main()
