"""Opens previews in Debian's Chromium over WebDriver (chromedriver), against
a real `space serve --preview-domain preview.space.test`: every *.space.test
name resolves to the server (`--host-resolver-rules`), as wildcard DNS would.
A small web app (absolute asset paths, a cookie of its own, a WebSocket echo)
runs in a polyglot sandbox. A private port without a link is refused; the
signed link opens it (the page renders, its script loads from an absolute
path, the WebSocket answers); the app's cookie never reaches the API's
origin; a public port opens without a link. Prints PREVIEWS OK at the end."""

import json
import os
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

URL = os.environ["SPACE_URL"]  # http://127.0.0.1:PORT
KEY = os.environ["KEY"]
WEBAPP = open(os.environ["WEBAPP"], "rb").read()
SHOTS = os.path.realpath(os.environ["SCREENSHOTS"])
PORT = URL.rsplit(":", 1)[1]
# The API as a browser would know it: a name of its own, outside the
# preview domain.
API_ORIGIN = f"http://api.space.test:{PORT}"


def call(method, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(URL + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {KEY}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read()
        return json.loads(text) if text else None


def wait_operation(op):
    for _ in range(20):
        operation = call("GET", f"/v1/operations/{op}?wait=30")
        if operation["state"] in ("succeeded", "failed", "cancelled"):
            return operation
    raise AssertionError(f"operation {op} never ended")


def shot(driver, name):
    os.makedirs(SHOTS, exist_ok=True)
    driver.save_screenshot(os.path.join(SHOTS, name))


def host(sandbox, port):
    return f"http://{port}-{sandbox.replace('_', '-')}.preview.space.test:{PORT}"


def main():
    accepted = call("POST", "/v1/sandboxes", {"template": "polyglot"})
    sandbox = accepted["sandbox"]["id"]
    assert wait_operation(accepted["operation"]["id"])["state"] == "succeeded"
    call("PUT", f"/v1/sandboxes/{sandbox}/files?path=/root/webapp.py", raw=WEBAPP)
    for port in (8000, 8001):
        ran = call("POST", f"/v1/sandboxes/{sandbox}/exec",
                   {"cmd": f"nohup python3 /root/webapp.py {port} >/tmp/app-{port}.log 2>&1 &"})
        assert ran["result"]["exit_code"] == 0, ran
    for port in (8000, 8001):
        for _ in range(100):
            try:
                call("GET", f"/v1/sandboxes/{sandbox}/ports/{port}/up")
                break
            except urllib.error.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"the app on {port} never answered")

    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900", "--host-resolver-rules=MAP *.space.test 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    wait = WebDriverWait(driver, 60, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    by_id = lambda name: driver.find_element(By.ID, name)
    try:
        # Private, without the link: refused, and nothing of the app shows.
        driver.get(host(sandbox, 8000) + "/")
        refused = driver.find_element(By.TAG_NAME, "body").text
        assert '"forbidden"' in refused and "private" in refused, refused
        shot(driver, "01-private.png")

        # The signed link: the cookie for that host, then the app itself.
        link = call("GET", f"/v1/sandboxes/{sandbox}/ports/8000/link")
        assert link["url"].startswith(host(sandbox, 8000) + "/"), link
        driver.get(link["url"])
        wait.until(lambda d: d.current_url == host(sandbox, 8000) + "/")
        wait.until(lambda d: by_id("title").text == "preview app")
        # Its script came from an absolute path, and its WebSocket answers.
        wait.until(lambda d: by_id("ws").text == "echo: hello")
        # The app got its own cookie back, never the server's.
        wait.until(lambda d: "app_session=from-the-app" in by_id("seen").text)
        seen = by_id("seen").text
        assert "space_preview" not in seen, seen
        # The server's cookie is HttpOnly: the page's script cannot read it.
        page_cookies = driver.execute_script("return document.cookie")
        assert "app_session" in page_cookies and "space_preview" not in page_cookies, page_cookies
        names = {c["name"]: c for c in driver.get_cookies()}
        assert names["space_preview"]["httpOnly"] and names["space_preview"]["sameSite"] == "Lax", names
        shot(driver, "02-opened-by-link.png")

        # The API's origin: none of the app's cookies (nor the preview's).
        driver.get(API_ORIGIN + "/v1/health")
        assert "ok" in driver.find_element(By.TAG_NAME, "body").text
        assert driver.get_cookies() == [], driver.get_cookies()
        assert driver.execute_script("return document.cookie") == ""
        # The console on the API's origin, and not on a preview's.
        driver.get(host(sandbox, 8000) + "/v1/health")
        wait.until(lambda d: '"path": "/v1/health"' in d.find_element(By.TAG_NAME, "body").text)

        # Another port of the same sandbox: its own host, so no cookie.
        driver.get(host(sandbox, 8001) + "/")
        assert '"forbidden"' in driver.find_element(By.TAG_NAME, "body").text
        # Public: it opens without a link.
        made = call("PUT", f"/v1/sandboxes/{sandbox}/ports/8001", {"public": True})
        assert made["public"] is True, made
        driver.get(host(sandbox, 8001) + "/")
        wait.until(lambda d: by_id("title").text == "preview app")
        wait.until(lambda d: by_id("ws").text == "echo: hello")
        shot(driver, "03-public.png")
    finally:
        driver.quit()
        wait_operation(call("DELETE", f"/v1/sandboxes/{sandbox}")["operation"]["id"])
    print("PREVIEWS OK")


if __name__ == "__main__":
    main()
