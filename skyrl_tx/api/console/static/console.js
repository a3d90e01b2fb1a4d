// The skyrl_tx console's only script: the session page's live plots (its metrics endpoint, polled), the trace
// download (the API's trace_export, polled until its file is ready), and a confirmation before a delete.
"use strict";

const POLL_MS = 3000;  // the session page's refresh
const TRACE_POLL_MS = 2000;

function livePlots() {
  const box = document.getElementById("plots");
  if (!box) return;
  const url = box.dataset.metricsUrl;
  let busy = false;
  async function refresh() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const response = await fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}});
      if (!response.ok) return;  // signed out or gone: the next page load says why
      const body = await response.json();
      for (const [name, svg] of Object.entries(body.svg)) {
        const slot = box.querySelector(`[data-plot="${name}"]`);
        if (slot) slot.innerHTML = svg;  // drawn and escaped by the server (plots.py)
      }
      const now = document.getElementById("inflight-now");
      if (now) now.textContent = String(body.inflight_now);
      box.dataset.refreshed = String(Number(box.dataset.refreshed || 0) + 1);
    } catch (err) {
      // the server restarting: keep the last plots, try again at the next tick
    } finally {
      busy = false;
    }
  }
  setInterval(refresh, POLL_MS);
}

function traceDownload() {
  const button = document.getElementById("trace-download");
  if (!button) return;
  const status = document.getElementById("trace-status");
  button.addEventListener("click", async () => {
    button.disabled = true;
    status.textContent = "building the trace...";
    try {
      for (;;) {
        const response = await fetch(button.dataset.traceUrl, {credentials: "same-origin"});
        const body = await response.json();
        if (!response.ok) { status.textContent = body.message || `error ${response.status}`; return; }
        if (body.status === "ready") { status.textContent = "ready"; window.location.assign(body.url); return; }
        if (body.status === "failed") { status.textContent = `failed: ${body.error}`; return; }
        await new Promise((resolve) => setTimeout(resolve, TRACE_POLL_MS));
      }
    } catch (err) {
      status.textContent = `trace export: ${err}`;
    } finally {
      button.disabled = false;
    }
  });
}

function confirmations() {
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
}

document.addEventListener("DOMContentLoaded", () => { livePlots(); traceDownload(); confirmations(); });
