"""The web console (/console) in headless Chromium (Debian's `chromium`, driven by Playwright) against one live keyed
server: alice trains STEPS steps with the real SDK; she signs in and sees her session, a loss plot of exactly STEPS
points that stays STEPS after a live refresh, the trace download, her checkpoints (download links, publish, delete);
bob sees none of it; the admin key sees keys, usage and the audit log, which a user key gets a 403 for; no page logs a
console error. Each page's screenshot goes to ${SKYRL_TX_ARTIFACT_DIR:-build/artifacts}/console/<page>.png."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from keyed_server import keyed_server, service_clients
from live_server import REPO, ServerUrl
from tinker import types

from skyrl_tx.keys import revoke_key

STEPS = 3
KEYS = {"alice": {}, "bob": {}, "root": {"admin": True}, "carol": {}}
TOKENS = list(range(5, 21))
COOKIE = "skyrl_tx_console_key"


def chromium_or_skip() -> str:
    """Debian's chromium (tests/run_all.sh installs it); without it the module skips, except under CI=true."""
    path = os.environ.get("SKYRL_TX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    message = "no chromium on PATH: apt-get install chromium (or set SKYRL_TX_CHROMIUM)"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def shots() -> Path:
    root = Path(os.environ.get("SKYRL_TX_ARTIFACT_DIR") or REPO / "build" / "artifacts") / "console"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="module")
def server(preset_cache) -> Iterator[ServerUrl]:
    with keyed_server("sqlite", KEYS) as url:
        yield url


@pytest.fixture(scope="module")
def trained(server: ServerUrl) -> dict[str, Any]:
    """alice's session: STEPS forward_backward + optim_step steps, then two training checkpoints, "kept" published.
    Her clients are closed before the browser starts: Playwright's sync API runs an event loop in this thread, and the
    SDK's synchronous calls must not run inside one."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    with service_clients(server) as clients:
        training = clients["alice"].create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
        for _ in range(STEPS):
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        kept = training.save_state("kept").result().path
        doomed = training.save_state("doomed").result().path
        tinker.RestClient(base_url=server, api_key=server.keys["alice"]).publish_checkpoint_from_tinker_path(
            kept).result()
    return {"session_id": training.model_id.split(":")[0], "kept": kept, "doomed": doomed}


@pytest.fixture(scope="module")
def browser(trained) -> Iterator[Any]:
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True)
        yield launched
        launched.close()


class Tab:
    """A browser context signed in (or not) as one key; every console message of type error and every uncaught page
    error is collected, apart from the failed loads of pages a test asked for an error status of."""

    def __init__(self, browser: Any, base: str, shots: Path) -> None:
        self.context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.shots, self.errors, self.expected_status = shots, [], None
        self.page.on("console", lambda m: m.type == "error" and not self._expected(m.text)
                     and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _expected(self, text: str) -> bool:
        return self.expected_status is not None and f"status of {self.expected_status}" in text

    def go(self, path: str, status: int = 200, shot: str | None = None) -> Any:
        self.expected_status = status if status >= 400 else None
        response = self.page.goto(path)
        assert response is not None and response.status == status, (path, response and response.status)
        if shot:
            self.page.screenshot(path=str(self.shots / f"{shot}.png"), full_page=True)
        return response

    def sign_in(self, key: str) -> None:
        self.go("/console/sign-in")
        self.page.fill("input[name=api_key]", key)
        self.page.click("form.sign-in button[type=submit]")
        self.page.wait_for_url(re.compile(r".*/console/sessions$"))

    def close(self) -> None:
        self.context.close()
        assert not self.errors, f"console errors: {self.errors}"


@pytest.fixture
def tab(browser: Any, server: ServerUrl, shots: Path) -> Iterator[Any]:
    tabs: list[Tab] = []

    def open_tab() -> Tab:
        tabs.append(Tab(browser, server, shots))
        return tabs[-1]

    yield open_tab
    for t in tabs:
        t.close()


def test_sign_in_is_required_and_a_wrong_key_is_refused(tab, server: ServerUrl) -> None:
    t = tab()
    t.go("/console/sessions", shot="sign_in")
    assert t.page.url.endswith("/console/sign-in?next=/console/sessions")
    t.page.fill("input[name=api_key]", "tml-not-a-key")
    t.expected_status = 401
    t.page.click("form.sign-in button[type=submit]")
    assert "unknown API key" in t.page.inner_text("#sign-in-error")


def test_sign_out_and_a_revoked_key_send_the_browser_back_to_sign_in(tab, server: ServerUrl) -> None:
    t = tab()
    t.sign_in(server.keys["carol"])
    t.page.click("header button:text('Sign out')")
    t.page.wait_for_url(re.compile(r".*/console/sign-in$"))
    t.go("/console/checkpoints")
    assert t.page.url.endswith("/console/sign-in?next=/console/checkpoints")
    t.sign_in(server.keys["carol"])
    revoke_key(server.database_url, "carol")
    for _ in range(100):  # the server re-reads a key at least once a second (api/auth.py CACHE_TTL_S)
        t.go("/console/sessions")
        if "/console/sign-in" in t.page.url:
            break
        time.sleep(0.1)
    assert t.page.url.endswith("/console/sign-in?next=/console/sessions&reason=revoked")
    assert "revoked" in t.page.inner_text("#sign-in-error")
    assert COOKIE not in {c["name"] for c in t.context.cookies()}


def test_alice_sees_her_session_its_loss_plot_and_live_refresh(tab, server: ServerUrl, trained) -> None:
    t = tab()
    t.sign_in(server.keys["alice"])
    t.go("/console/sessions", shot="sessions")
    assert t.page.locator(f'tr[data-session="{trained["session_id"]}"]').count() == 1
    t.page.click(f'a:text("{trained["session_id"]}")')
    t.page.wait_for_selector("svg.plot.loss")
    assert t.page.locator("svg.plot.loss circle.pt").count() == STEPS
    assert t.page.locator("svg.plot.throughput circle.pt").count() == STEPS
    t.page.wait_for_selector("#plots[data-refreshed]", state="attached")  # console.js polled and redrew the plots
    assert t.page.locator("svg.plot.loss circle.pt").count() == STEPS
    assert t.page.locator("#runs tr[data-run]").count() == 1
    t.page.screenshot(path=str(t.shots / "session.png"), full_page=True)
    with t.page.expect_download(timeout=120_000) as download:  # the API's trace export, polled until ready
        t.page.click("#trace-download")
    assert download.value.suggested_filename == f"{trained['session_id']}.pftrace"


def test_checkpoints_download_publish_and_delete(tab, server: ServerUrl, trained) -> None:
    t = tab()
    t.sign_in(server.keys["alice"])
    t.go("/console/checkpoints", shot="checkpoints")
    kept, doomed = (t.page.locator(f'tr[data-path="{trained[n]}"]') for n in ("kept", "doomed"))
    assert kept.count() == 1 and doomed.count() == 1
    kept.locator("a:text('Download')").click()
    t.page.wait_for_selector("#files a")
    t.page.screenshot(path=str(t.shots / "checkpoint_files.png"), full_page=True)
    urls = [t.page.get_attribute(f"#files li:nth-child({i + 1}) a", "href")
            for i in range(t.page.locator("#files a").count())]
    assert urls and httpx.get(urls[0], timeout=60).status_code == 200  # the signed URL needs no key
    t.go("/console/checkpoints")
    assert kept.locator("td").nth(4).inner_text() == "yes"  # published by the fixture: unpublished, then again
    kept.locator("button.unpublish").click()
    t.page.wait_for_selector(f'tr[data-path="{trained["kept"]}"] button.publish')
    assert kept.locator("td").nth(4).inner_text() == "no"
    kept.locator("button.publish").click()
    t.page.wait_for_selector(f'tr[data-path="{trained["kept"]}"] button.unpublish')
    assert kept.locator("td").nth(4).inner_text() == "yes"
    t.page.once("dialog", lambda dialog: dialog.accept())
    doomed.locator("button.delete").click()
    t.page.wait_for_selector(f'tr[data-path="{trained["doomed"]}"]', state="detached")
    assert kept.count() == 1


def test_writes_need_the_csrf_token_and_this_origin_bad_input_is_a_400(server: ServerUrl, trained) -> None:
    run, kind, name = trained["kept"].removeprefix("tinker://").split("/")
    cookies = {COOKIE: server.keys["alice"]}
    with httpx.Client(base_url=server, cookies=cookies, timeout=60) as http:
        page = http.get("/console/checkpoints")
        token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
        action = f"/console/checkpoints/{run}/{kind}/{name}/publish"  # published already: stays so
        assert http.post(action, data={"csrf": "0" * 64}).status_code == 403
        assert http.post(action, data={"csrf": token}, headers={"Origin": "https://evil.example"}).status_code == 403
        assert http.post(action, data={"csrf": token}).status_code == 303  # and then it works
        naive = http.get("/console/sessions", params={"after_created": "2026-01-01T00:00:00", "after_id": "x"})
        assert naive.status_code == 400 and "after_created" in naive.text  # bad input: a 400 naming the field
        # the cookie reaches the trace export (the session page's download), checked there like a header
        assert http.get(f"/api/v1/sessions/{trained['session_id']}/trace_export").status_code != 401
    assert httpx.get(f"{server}/console/sessions", timeout=60).status_code == 303  # no cookie: to sign-in


def test_another_key_sees_none_of_it(tab, server: ServerUrl, trained) -> None:
    t = tab()
    t.sign_in(server.keys["bob"])
    t.go("/console/sessions", shot="sessions_other_key")
    assert t.page.locator("#no-sessions").count() == 1
    assert t.page.locator(f'tr[data-session="{trained["session_id"]}"]').count() == 0
    t.go(f"/console/sessions/{trained['session_id']}", status=404)
    t.go(f"/console/sessions/{trained['session_id']}/metrics", status=404)
    t.go("/console/checkpoints")
    assert t.page.locator("#no-checkpoints").count() == 1
    run, kind, name = trained["kept"].removeprefix("tinker://").split("/")
    t.go(f"/console/checkpoints/{run}/{kind}/{name}", status=200)  # published: every key may download it
    run, kind, name = trained["doomed"].removeprefix("tinker://").split("/")
    t.go(f"/console/checkpoints/{run}/{kind}/{name}", status=404)  # unpublished (or deleted): not found
    t.go(f"/console/admin/keys", status=403, shot="admin_refused")


def test_the_admin_key_sees_keys_usage_and_the_audit_log(tab, server: ServerUrl, trained) -> None:
    t = tab()
    t.sign_in(server.keys["root"])
    assert t.page.locator(f'tr[data-session="{trained["session_id"]}"]').count() == 1  # every key's sessions
    t.go("/console/admin/keys", shot="keys")
    rows = t.page.locator("#keys tr[data-key]")
    assert {rows.nth(i).get_attribute("data-key") for i in range(rows.count())} == set(KEYS)
    t.go("/console/admin/usage", shot="usage")
    assert "alice" in t.page.inner_text("#usage-totals")
    t.go("/console/admin/audit", shot="audit")
    events = t.page.locator("#audit tr[data-event]")
    assert {events.nth(i).get_attribute("data-event") for i in range(events.count())} >= {
        "model_create", "checkpoint_save", "checkpoint_publish", "key_create"}
    t.go(f"/console/sessions/{trained['session_id']}")
    assert t.page.locator("svg.plot.loss circle.pt").count() == STEPS
    for page in ("keys", "usage", "audit"):
        t2 = tab()
        t2.sign_in(server.keys["alice"])
        t2.go(f"/console/admin/{page}", status=403)
