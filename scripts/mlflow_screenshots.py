"""Screenshots of what a user sees in MLflow, for the README: a finished job's run page, a sweep's comparison.

    .venv/bin/python scripts/mlflow_screenshots.py                  # -> docs/images/mlflow_*.png
    .venv/bin/python scripts/mlflow_screenshots.py --tracking-uri http://127.0.0.1:5000 --skip-jobs

It starts a real `mlflow server` on 127.0.0.1 (SQLite, a temporary folder), runs the main job on the
embedded pair (64 prompts, 16 shards) and a 6-cell sweep (`spectr.num_drafts=1,2,4 spectr.draft_length=2,4`)
against it, then opens the MLflow UI in headless Chromium (Debian's `chromium` package), driven over the
DevTools protocol (aiohttp's websocket client), and saves:

- `mlflow_run_page.png`: the job's run page, "Model metrics" tab, filtered to throughput, block efficiency,
  acceptance rate and prompts completed (step = prompts completed);
- `mlflow_run_system_metrics.png`: the same run's "System metrics" tab (the driver's monitor and
  each worker's `system/worker_<n>/*`);
- `mlflow_sweep_compare.png`: MLflow's run comparison of the sweep's cells (parallel coordinates of K, L,
  throughput and block efficiency).

The UI is opened with `workflowType=machine_learning` (MLflow's "Model training" pages). The assistant side
panel is closed and Plotly's hover toolbar hidden, so the charts show; nothing else on the page is changed.
Needs the `chromium` package (`apt-get install -y chromium`). Takes about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB_EXPERIMENT = "spectr-demo"
SWEEP_EXPERIMENT = "spectr-demo-sweep"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
]  # fmt: skip
HIDE_PLOTLY_TOOLBAR = (
    "const s = document.createElement('style');"
    "s.textContent = '.modebar-container{display:none!important}'; document.head.appendChild(s);"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    server = subprocess.Popen(
        [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--artifacts-destination", str(folder / "artifacts")],
        cwd=folder, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=open(folder / "server.log", "w"),
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server, uri
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}"
                ) from None
            time.sleep(0.5)


def run_jobs(uri: str, folder: Path) -> None:
    """The demo job and the demo sweep, as a user runs them (from the repository root)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = [f"mlflow.tracking_uri={uri}", "mlflow.log_every_s=2", "mlflow.system_metrics_interval_s=2",
              "progress=false", "shard_size=4"]  # fmt: skip
    job = [sys.executable, "-m", "jobs.generate", "data.limit=64", "spectr.max_new_tokens=48",
           f"output_dir={folder / 'job'}", f"mlflow.experiment={JOB_EXPERIMENT}", "mlflow.run_name=demo",
           *common]  # fmt: skip
    sweep = [sys.executable, "-m", "jobs.generate", "-m",
             "spectr.num_drafts=1,2,4", "spectr.draft_length=2,4",
             "data.limit=24", "spectr.max_new_tokens=32", f"output_dir={folder / 'sweep'}",
             f"mlflow.experiment={SWEEP_EXPERIMENT}", f"hydra.sweep.dir={folder / 'sweep-dir'}",
             *common]  # fmt: skip
    for command in (job, sweep):
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)


def find_runs(uri: str) -> tuple[dict, dict]:
    """(the demo run, {'parent': run, 'children': [runs]}) on the server, the latest of each."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    job = client.get_experiment_by_name(JOB_EXPERIMENT)
    sweep = client.get_experiment_by_name(SWEEP_EXPERIMENT)
    if job is None or sweep is None:
        raise SystemExit(
            f"no experiments {JOB_EXPERIMENT!r} / {SWEEP_EXPERIMENT!r} at {uri}: run without --skip-jobs"
        )
    (demo,) = client.search_runs([job.experiment_id], "attributes.run_name = 'demo'", max_results=1)
    (parent,) = client.search_runs([sweep.experiment_id], "tags.job = 'generate-sweep'", max_results=1)
    children = client.search_runs([sweep.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return demo, {"parent": parent, "children": children}


class Page:
    """One headless Chromium tab over the DevTools protocol: navigate, run JS, type, screenshot."""

    def __init__(self, width: int, height: int):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")  # a fresh profile each time
        self.browser = subprocess.Popen(
            ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.size, self.calls = (width, height), 0

    async def open(self) -> None:
        import aiohttp

        port_file = Path(self.profile) / "DevToolsActivePort"
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as response:
            target = next(t for t in json.loads(response.read()) if t["type"] == "page")
        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        width, height = self.size
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    async def send(self, method: str, **params) -> dict:
        self.calls += 1
        await self.ws.send_json({"id": self.calls, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive()).data)
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def js(self, expression: str):
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return result.get("result", {}).get("value")

    async def goto(self, url: str, wait_for: str, timeout_s: float = 60.0) -> None:
        """Navigate, then wait until `wait_for` (a JS expression) is true and the page settled."""
        await self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not await self.js(f"Boolean({wait_for})"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: the page never showed {wait_for}")
            await asyncio.sleep(0.5)
        await asyncio.sleep(3)  # charts animate in

    async def close_assistant(self) -> None:
        await self.js("document.querySelector('button[aria-label=\"Close\"]')?.click()")
        await asyncio.sleep(1)

    async def type_into(self, selector: str, text: str) -> None:
        await self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)
        await asyncio.sleep(2)

    async def screenshot(self, path: Path) -> None:
        await self.js(HIDE_PLOTLY_TOOLBAR)
        await asyncio.sleep(0.5)
        data = (await self.send("Page.captureScreenshot", format="png"))["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"{path} ({path.stat().st_size // 1024} KiB)")

    async def quit(self) -> None:
        await self.session.close()
        os.killpg(self.browser.pid, signal.SIGTERM)
        self.browser.wait(timeout=20)

    async def press(self, key: str, key_code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.send(
                "Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=key_code
            )

    async def choose(self, input_id: str, values: list[str]) -> None:
        """Pick `values` in one of the UI's searchable multi-selects (type, Enter), then close it."""
        for value in values:
            await self.js(f"document.getElementById({json.dumps(input_id)}).focus()")
            await self.send("Input.insertText", text=value)
            await asyncio.sleep(1)
            await self.press("Enter", 13)
            await asyncio.sleep(1)
        await self.press("Escape", 27)


async def shoot_run(page: Page, uri: str, run, out: Path) -> None:
    base = f"{uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    await page.goto(
        f"{base}/model-metrics?workflowType=machine_learning", "document.querySelector('.js-plotly-plot')"
    )
    await page.close_assistant()
    await page.type_into(
        'input[placeholder="Search metric charts"]',
        "throughput|block_efficiency|acceptance_rate|prompts_completed",
    )
    await page.screenshot(out / "mlflow_run_page.png")
    await page.goto(
        f"{base}/system-metrics?workflowType=machine_learning", "document.querySelector('.js-plotly-plot')"
    )
    await page.close_assistant()
    await page.screenshot(out / "mlflow_run_system_metrics.png")


async def shoot_sweep(page: Page, uri: str, sweep: dict, out: Path) -> None:
    children = sweep["children"]
    runs = json.dumps([r.info.run_id for r in children])
    experiments = json.dumps([children[0].info.experiment_id])
    url = f"{uri}/#/compare-runs?runs={runs}&experiments={experiments}&workflowType=machine_learning"
    await page.goto(url, "document.querySelector('.js-plotly-plot')")
    await page.close_assistant()
    await page.js("[...document.querySelectorAll('button')].find(b => b.innerText === 'Clear All')?.click()")
    await asyncio.sleep(1)
    inputs = await page.js("[...document.querySelectorAll('input[type=search]')].map(e => e.id)")
    if len(inputs) < 2:
        raise SystemExit(f"{url}: the comparison page has no parameter and metric pickers")
    await page.choose(inputs[0], ["spectr.num_drafts", "spectr.draft_length"])
    await page.choose(inputs[1], ["block_efficiency", "throughput_tokens_per_s"])
    await page.js("document.activeElement && document.activeElement.blur()")
    await asyncio.sleep(2)
    await page.screenshot(out / "mlflow_sweep_compare.png")


async def shoot(uri: str, out: Path) -> None:
    demo, sweep = find_runs(uri)
    page = Page(1440, 1000)
    try:
        await page.open()
        await shoot_run(page, uri, demo, out)
        await shoot_sweep(page, uri, sweep, out)
    finally:
        await page.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="where the PNGs go")
    parser.add_argument("--tracking-uri", help="use this MLflow server instead of starting one")
    parser.add_argument("--skip-jobs", action="store_true", help="the server already has the demo runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlflow-screenshots-") as tmp:
        folder = Path(tmp)
        server = None
        if args.tracking_uri:
            uri = args.tracking_uri.rstrip("/")
        else:
            server, uri = start_server(folder)
            print(f"mlflow server at {uri}")
        try:
            if not args.skip_jobs:
                run_jobs(uri, folder)
            asyncio.run(shoot(uri, args.out))
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)


if __name__ == "__main__":
    main()
