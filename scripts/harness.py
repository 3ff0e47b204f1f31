"""What every benchmark script repeats, in one place: the machine, interleaved rounds, medians, the report.

A benchmark script measures some arms (configurations, checkouts, jobs) on one workload. It uses this module
for the parts that are the same everywhere:

    from harness import Report, interleaved, summary

    report = Report("bench_foo")                       # the command line, date, machine and load, now
    runs = interleaved({"eager": run_eager, "compiled": run_compiled}, rounds=args.repeats, warmup=1)
    rows = [{"arm": arm, **summary([r["tokens_per_s"] for r in runs[arm]])} for arm in runs]
    report.write(args.out, {"rows": rows, "runs": runs}, markdown=table(rows))   # foo.json + foo.md

- `machine()`: host, CPU model, core count, GPU name, torch / transformers versions, load average.
- `interleaved(arms, rounds, warmup)`: warm-up runs of every arm (not kept), then `rounds` rounds that run
  each arm once in turn (optionally in a shuffled order per round), so the machine's drift hits every arm
  alike. An arm is a callable returning anything (usually a dict of numbers).
- `timed(fn)`: wall and process-CPU seconds of one call (CUDA synchronised on both sides).
- `summary(values)`: median and a distribution-free interval of the median (order statistics, ~95 %).
- `ratio_summary(a, b, key)`: the median over rounds of the per-round ratio a/b (paired rounds).
- `Report`: writes `<out>.json` (the results plus `meta`: command, date, commit, machine, load at start and
  end, seconds) and `<out>.md` (a heading, the command, machine and date, then the script's Markdown).
- `table(rows, columns)`: a Markdown table from a list of dicts.

Not here: what a script measures, how it loads models or parses its own options (each script keeps its
own command line), and any assertion about speed.
"""

from __future__ import annotations

import datetime as _datetime
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; `platform.processor()` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (without importing torch when it is not loaded already)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


def machine() -> dict:
    """Where a measurement ran: enough to tell two machines (or one machine's two loads) apart."""
    found = dict(host=socket.gethostname(), cpu=cpu_model(), cpus=os.cpu_count(), gpu=gpu_name(),
                 platform=platform.platform(), python=platform.python_version(), load_average=load_average())
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = getattr(module, "__version__", None)
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch_threads"] = torch.get_num_threads()
    return found


def machine_line(info: Mapping | None = None) -> str:
    """One line for a log or a report: 'host: CPU model (N cpus), GPU; load a b c'."""
    info = info or machine()
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    load = " ".join(f"{x:.2f}" for x in info["load_average"])
    return f"{info['host']}: {info['cpu']} ({info['cpus']} cpus){gpu}; load {load}"


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this script, as one shell line (relative to the repository where it can be)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
        except ValueError:
            pass
    return shlex.join(["python", *argv])


def commit() -> str | None:
    """The checkout's short commit (with `+` when the tree has changes), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def sync() -> None:
    """Wait for queued CUDA work (a no-op without CUDA): call before reading a clock."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> dict:
    """`fn()` once: its result, wall seconds and process-CPU seconds (CUDA synchronised on both sides)."""
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    sync()
    return dict(result=result, wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)


def interleaved(arms: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 0,
                shuffle: random.Random | None = None, alternate: bool = False,
                on_run: Callable[[int, str, object], None] | None = None) -> dict[str, list]:
    """Each arm's results over `rounds` rounds, every round running every arm once.

    `warmup` rounds run first and are dropped (compiles, caches, first-touch allocations). With `shuffle` (a
    seeded `random.Random`) each round runs the arms in its own order; with `alternate`, every other round runs
    them in reverse (ABC, CBA, ...); otherwise in the given order.
    `on_run(round, arm, result)` is called after each kept run (for progress lines)."""
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    runs: dict[str, list] = {name: [] for name in names}
    for round_index in range(rounds):
        order = list(names)
        if shuffle is not None:
            shuffle.shuffle(order)
        elif alternate and round_index % 2 == 1:
            order.reverse()
        for name in order:
            result = arms[name]()
            runs[name].append(result)
            if on_run is not None:
                on_run(round_index, name, result)
    return runs


def median_interval(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the median and a distribution-free interval for it from order statistics.

    The interval is the pair of order statistics (j, n+1-j) with the largest j whose binomial coverage is at
    least `confidence`; with fewer than 6 values no such pair exists and it is (min, max)."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("median_interval of no values")
    n = len(ordered)
    median = statistics.median(ordered)
    low, high = ordered[0], ordered[-1]
    for j in range(1, n // 2 + 1):  # coverage of [x_(j), x_(n+1-j)] = 1 - 2 P(Binomial(n, 1/2) < j)
        tail = sum(math.comb(n, i) for i in range(j)) / 2**n
        if 1 - 2 * tail < confidence:
            break
        low, high = ordered[j - 1], ordered[n - j]
    return median, low, high


def summary(values: Iterable[float], confidence: float = 0.95) -> dict:
    """{median, low, high, n} of `values` (see `median_interval`)."""
    values = list(values)
    median, low, high = median_interval(values, confidence)
    return dict(median=median, low=low, high=high, n=len(values))


def ratio_summary(runs_a: list[Mapping], runs_b: list[Mapping], key: str) -> dict:
    """The per-round ratio a[key] / b[key] over paired rounds, summarised (the drift between rounds cancels)."""
    return summary(a[key] / b[key] for a, b in zip(runs_a, runs_b, strict=True))


_JOB_NUMBERS = (("throughput_tokens_per_s", r"throughput\s+([\d.]+) tokens/s"),
                ("generation_s", r"generation ([\d.]+) s"),
                ("generated_tokens", r"generated tokens\s+([\d,]+)"),
                ("target_calls", r"target calls\s+([\d,]+)"),
                ("block_efficiency", r"block efficiency\s+([\d.]+)"),
                ("acceptance", r"acceptance rate\s+([\d.]+)"),
                ("planner_wasted_s", r"wasted ([\d.]+) s"))


def job_summary(text: str) -> dict:
    """The numbers of `python -m jobs.generate`'s printed summary (those it printed), and its method line."""
    found: dict = {}
    for key, pattern in _JOB_NUMBERS:
        match = re.search(pattern, text)
        if match:
            found[key] = float(match.group(1).replace(",", ""))
    method = re.search(r"^\s+method\s+(.*)$", text, re.M)
    if method:
        found["method_line"] = method.group(1).strip()
    return found


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def table(rows: list[Mapping], columns: list[str] | None = None) -> str:
    """A Markdown table of `rows` (dicts), one column per key of `columns` (default: the first row's keys)."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class Report:
    """A run's record: made at the start (command, date, machine, load), written at the end.

    `write(path, results, markdown=)` writes `path` as JSON ({**results, "meta": ...}) and, with `markdown`,
    the same stem with `.md`: a heading, the command, machine and date, then `markdown`. `path` may be a
    file (`.json`) or a folder without a suffix (then `<folder>/<name>.json`). Returns the JSON path."""

    def __init__(self, name: str, argv: list[str] | None = None, args: object = None):
        self.name = name
        self.started = time.perf_counter()
        self.meta = dict(command=command_line(argv), date=_datetime.datetime.now(_datetime.timezone.utc)
                         .strftime("%Y-%m-%d %H:%M UTC"), commit=commit(), machine=machine())
        if args is not None:
            self.meta["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}

    def header(self) -> str:
        """The lines a script prints first: its command and the machine."""
        return f"command: {self.meta['command']}\nmachine: {machine_line(self.meta['machine'])}"

    def finish(self) -> dict:
        """The meta at the end of the run: the load average then and the run's seconds."""
        self.meta["load_average_end"] = load_average()
        self.meta["seconds"] = round(time.perf_counter() - self.started, 1)
        return self.meta

    def markdown(self, body: str) -> str:
        meta = self.meta
        return (f"# {self.name}\n\n`{meta['command']}`\n\n{meta['date']}, commit {meta['commit']}; "
                f"{machine_line(meta['machine'])}"
                f" (start) -> {' '.join(f'{x:.2f}' for x in meta.get('load_average_end', []))} (end)\n\n{body}")

    def write(self, path: str | os.PathLike, results: Mapping, markdown: str | None = None) -> Path:
        path = Path(path)
        if not path.suffix:
            path = path / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.finish()
        path.write_text(json.dumps({**results, "meta": {**results.get("meta", {}), **self.meta}}, indent=1,
                                   default=str))
        if markdown is not None:
            path.with_suffix(".md").write_text(self.markdown(markdown))
        return path
