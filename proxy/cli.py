"""The ``fleetcache`` command line: serve, warmup, stats, gen-fleet (API.md, "Running it")."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from features.models import DriverRecord
from features.readers import Row, iter_rows, write_records
from features.synthetic import iter_fleet
from proxy.settings import Settings

app = typer.Typer(
    help="fleetcache: an embedding cache in front of the inference GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
DEFAULT_URL = "http://127.0.0.1:8000"


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        console.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Run the proxy (settings from FLEETCACHE_* variables)."""
    import uvicorn

    from proxy.app import create_app

    settings = load_settings()
    setup_logging(log_level)
    base = f"http://{host}:{port}"
    console.print(
        f"fleetcache: engine={settings.engine} store={settings.store} "
        f"data={settings.data_dir} demo drivers={settings.demo_drivers}\n"
        f"  {base}/readyz turns 200 once the engine is warm and the fleet is loaded\n"
        f"  try: curl {base}/v1/stats | curl {base}/docs | fleetcache stats --url {base}"
    )
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level)


@dataclass
class WarmupSummary:
    rows: int = 0
    indexed: int = 0
    embedded: int = 0
    cached: int = 0
    rejected: list[Row] = field(default_factory=list)


def chunks(rows: Iterator[Row], size: int, summary: WarmupSummary) -> Iterator[list[DriverRecord]]:
    chunk: list[DriverRecord] = []
    for row in rows:
        summary.rows += 1
        if row.record is None:
            summary.rejected.append(row)
            continue
        chunk.append(row.record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


async def warmup_direct(
    path: Path, chunk_size: int, progress: Progress, task: Any
) -> WarmupSummary:
    from proxy.services import open_services

    summary = WarmupSummary()
    async with open_services(load_settings()) as services:
        for chunk in chunks(iter_rows(path), chunk_size, summary):
            n, result = await services.upsert_drivers(chunk, "warmup")
            summary.indexed += n
            summary.embedded += result.misses
            summary.cached += result.not_sent
            progress.update(
                task, completed=summary.rows, cached=summary.cached, embedded=summary.embedded
            )
    return summary


def warmup_remote(
    path: Path, url: str, chunk_size: int, progress: Progress, task: Any
) -> WarmupSummary:
    summary = WarmupSummary()
    with httpx.Client(base_url=url, headers={"X-Caller": "warmup"}, timeout=600) as client:
        for chunk in chunks(iter_rows(path), chunk_size, summary):
            body = {"drivers": [r.model_dump(mode="json") for r in chunk]}
            response = client.put("/v1/fleet/drivers", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
            summary.indexed += response.json()["upserted"]
            summary.embedded += int(response.headers["X-Cache-Misses"])
            summary.cached += int(response.headers["X-Cache-Hits"])
            progress.update(
                task, completed=summary.rows, cached=summary.cached, embedded=summary.embedded
            )
    return summary


@app.command()
def warmup(
    path: Annotated[Path, typer.Argument(help="CSV, JSONL or Parquet file of DriverRecords")],
    url: Annotated[str | None, typer.Option(help="go through a running proxy")] = None,
    chunk_size: Annotated[int, typer.Option(min=1, max=10_000)] = 500,
) -> None:
    """Fill the cache and the fleet index from a file; invalid rows are skipped and reported."""
    if not path.is_file():
        console.print(f"[red]no such file:[/red] {path}")
        raise typer.Exit(2)
    setup_logging("warning")
    columns = (
        TextColumn("warm-up"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows  {task.fields[cached]} cached  {task.fields[embedded]} embedded"),
        TimeRemainingColumn(),
    )
    started = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("warm-up", total=None, cached=0, embedded=0)
        try:
            if url:
                summary = warmup_remote(path, url, chunk_size, progress, task)
            else:
                summary = asyncio.run(warmup_direct(path, chunk_size, progress, task))
        except (httpx.HTTPError, RuntimeError, OSError, ValueError) as exc:
            console.print(f"[red]warm-up could not run:[/red] {exc}")
            raise typer.Exit(1) from None
    elapsed = time.perf_counter() - started
    for row in summary.rejected[:20]:
        console.print(f"  rejected line {row.line}: {row.error}")
    if len(summary.rejected) > 20:
        console.print(f"  ... and {len(summary.rejected) - 20} more rejected rows")
    console.print(
        f"warm-up done in {elapsed:.1f} s: {summary.rows} rows, {summary.indexed} indexed, "
        f"{summary.embedded} embedded, {summary.cached} already cached, "
        f"{len(summary.rejected)} rejected ({summary.indexed / max(elapsed, 1e-9):.0f} rows/s)"
    )


def stats_tables(stats: dict[str, Any]) -> list[Table]:
    cache, inference, latency = stats["cache"], stats["inference"], stats["latency"]
    overview = Table("cache", "value", title=f"fleetcache (up {stats['uptime_s']:.0f} s)")
    for key in ("hits", "misses", "coalesced", "hit_ratio"):
        overview.add_row(key, f"{cache[key]:.3f}" if key == "hit_ratio" else str(cache[key]))
    for window, values in cache["windows"].items():
        overview.add_row(f"hit_ratio {window}", f"{values['hit_ratio']:.3f}")
    for tier, values in cache["tiers"].items():
        overview.add_row(f"tier {tier}", ", ".join(f"{k}={v}" for k, v in values.items()))
    engine = Table("inference", "value")
    for key in (
        "items",
        "batches",
        "mean_batch",
        "per_item_ms",
        "p50_batch_ms",
        "p99_batch_ms",
        "calls_avoided",
        "ms_saved",
    ):
        value = inference[key]
        engine.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    for key, value in inference["engine"].items():
        engine.add_row(f"engine {key}", str(value))
    requests = Table("requests", "p50 ms", "p99 ms")
    for kind, values in latency.items():
        requests.add_row(kind, f"{values['p50_ms']:.2f}", f"{values['p99_ms']:.2f}")
    callers = Table("caller", "hits", "misses")
    for caller, values in stats["by_caller"].items():
        callers.add_row(caller, str(values["hits"]), str(values["misses"]))
    return [overview, engine, requests, callers]


@app.command()
def stats(url: Annotated[str, typer.Option(help="the proxy")] = DEFAULT_URL) -> None:
    """Print the proxy's /v1/stats as tables."""
    try:
        response = httpx.get(f"{url}/v1/stats", timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot read {url}/v1/stats:[/red] {exc}")
        raise typer.Exit(1) from None
    out = Console()
    for table in stats_tables(response.json()):
        out.print(table)


@app.command("gen-fleet")
def gen_fleet(
    n: Annotated[int, typer.Argument(min=1, help="number of drivers")],
    out: Annotated[Path, typer.Option(help=".jsonl, .csv or .parquet")],
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
) -> None:
    """Write a synthetic fleet of N DriverRecords."""
    try:
        write_records(iter_fleet(n, seed), out)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"wrote {n} drivers to {out}")


if __name__ == "__main__":  # python -m proxy.cli
    sys.exit(app())
