"""The ``fleetcache`` command line: serve, warmup, stats, coverage, gen-fleet, cache prune,
keys add | list | revoke (API.md, "Running it", "Authentication and scopes")."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import itertools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from cache.prune import NamespaceUsage, prune
from features.readers import check_jsonl, file_format, write_records
from features.synthetic import iter_fleet
from proxy.auth import KNOWN_SCOPES, KeysFileError, add_key, parse_scopes, read_keys, revoke_key
from proxy.settings import Settings, check_data_dir
from proxy.warmup import (
    CHECKPOINT_EVERY_S,
    RemoteSink,
    WarmupProgress,
    checkpoint_files,
    checkpoint_for,
    coverage,
    rejects_parts,
    run_warmup,
)

app = typer.Typer(
    help="fleetcache: an embedding cache in front of the inference GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="The embedding cache's store.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
keys_app = typer.Typer(
    help="API keys (the file of FLEETCACHE_API_KEYS_FILE; only hashes are kept).",
    no_args_is_help=True,
)
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)
DEFAULT_URL = "http://127.0.0.1:8000"
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="FLEETCACHE_API_KEY",
        show_default=False,
        help="the key sent as 'Authorization: Bearer KEY' (when the proxy has keys on)",
    ),
]
KeysFileOption = Annotated[
    Path,
    typer.Option("--file", envvar="FLEETCACHE_API_KEYS_FILE", help="the keys file"),
]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON of a 2xx; otherwise an ``httpx.HTTPStatusError`` carrying the service's own
    message (a 401 says the key is missing or unknown, a 403 which scope it lacks)."""
    if response.is_success:
        return dict(response.json())
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    raise httpx.HTTPStatusError(
        f"{response.status_code}: {message}", request=response.request, response=response
    )


def load_settings(writes: bool = False) -> Settings:
    """The settings; ``writes``: the command writes the data dir, so check that it can."""
    try:
        settings = Settings()
        if writes:
            check_data_dir(settings)
        return settings
    except ValidationError as exc:
        console.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    workers: Annotated[
        str | None,
        typer.Option(help="HTTP worker processes, or 'auto' (default: FLEETCACHE_WORKERS)"),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Run the proxy: an engine process, the fleet index owner and N HTTP workers on one port
    (settings from FLEETCACHE_* variables)."""
    from proxy.cores import usable_cores
    from proxy.supervisor import Supervisor, auto_workers

    settings = load_settings(writes=True)
    setup_logging(log_level)
    if settings.api_keys_file is not None:  # each worker reads it; a bad one stops us here
        try:
            read_keys(settings.api_keys_file)
        except KeysFileError as exc:
            console.print(f"[red]FLEETCACHE_API_KEYS_FILE:[/red] {exc}")
            raise typer.Exit(2) from None
    wanted = workers if workers is not None else settings.workers
    cores = usable_cores()
    try:
        count = auto_workers(cores) if wanted == "auto" else int(wanted)
        if count < 1:
            raise ValueError
    except ValueError:
        console.print(f"[red]--workers must be a positive number or 'auto', got {wanted!r}[/red]")
        raise typer.Exit(2) from None
    base = f"http://{host}:{port}"
    console.print(
        f"fleetcache: engine={settings.engine} store={settings.store} "
        f"data={settings.data_dir} demo drivers={settings.demo_drivers} workers={count}"
        f"{f' (auto: {cores} usable cores)' if wanted == 'auto' else ''}\n"
        f"  {base}/readyz turns 200 once the engine is warm and the fleet is loaded\n"
        f"  try: curl {base}/v1/stats | curl {base}/docs | fleetcache stats --url {base}"
    )
    try:
        code = Supervisor(settings, host=host, port=port, workers=count, log_level=log_level).run()
    except OSError as exc:
        console.print(f"[red]cannot serve on {host}:{port}:[/red] {exc.strerror or exc}")
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def count_rows(path: Path) -> int | None:
    """A quick total for the progress bar's ETA (newlines, or Parquet's metadata)."""
    try:
        fmt = file_format(path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        lines, last = 0, b"\n"
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                lines, last = lines + block.count(b"\n"), block[-1:]
        lines += last != b"\n"  # a last line without its newline
        return max(0, lines - (1 if fmt == "csv" else 0))
    except (OSError, ValueError):
        return None


def client_for(url: str, api_key: str | None = None) -> httpx.AsyncClient:
    """The client of ``warmup --url``: caller ``warmup``, generous timeouts (a busy server
    answers 429/503 and RemoteSink waits; a slow one may take long to answer a chunk)."""
    headers = {"X-Caller": "warmup", **auth_headers(api_key)}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=600)


async def closing(sink: RemoteSink | None, job: Awaitable[WarmupProgress]) -> WarmupProgress:
    try:
        return await job
    finally:
        if sink is not None:
            await sink.client.aclose()


def direct_warmup(
    path: Path,
    settings: Settings,
    progress: WarmupProgress,
    *,
    chunk_size: int,
    rejects: Path,
    checkpoint_every_s: float,
    on_progress: Callable[[WarmupProgress], None],
) -> WarmupProgress:
    """Directly on ``settings``' data dir: an engine process, the fleet index owner and
    the job's reader processes, as a server runs a job (``proxy.jobs``)."""
    from proxy.jobs import JobOptions, run_sharded, shard_count
    from proxy.supervisor import local_cluster

    options = JobOptions(
        path=str(path),
        chunk_size=chunk_size,
        checkpoint_every_s=checkpoint_every_s,
        rejects=str(rejects),
        cancel_file=str(settings.data_dir / "warmup" / f"{path.name}.cancel"),
    )
    with local_cluster(settings) as spec:
        shards = shard_count(settings)
        job = run_sharded(spec, options, progress, shards, on_progress, merge_stopped=False)
        return asyncio.run(job)


@app.command()
def warmup(
    path: Annotated[Path, typer.Argument(help="CSV, JSONL or Parquet file of DriverRecords")],
    url: Annotated[str | None, typer.Option(help="go through a running proxy")] = None,
    api_key: ApiKeyOption = None,
    chunk_size: Annotated[int, typer.Option(min=1, max=10_000)] = 500,
    dry_run: Annotated[bool, typer.Option(help="validate and count only")] = False,
    rejects: Annotated[
        Path | None, typer.Option(help="where invalid rows go (default PATH.rejects.jsonl)")
    ] = None,
    restart: Annotated[bool, typer.Option(help="ignore a checkpoint, start from row 1")] = False,
    checkpoint_every: Annotated[
        float, typer.Option(min=0.0, help="seconds between checkpoints")
    ] = CHECKPOINT_EVERY_S,
) -> None:
    """Fill the cache and the fleet index from a file; invalid rows are skipped and reported.

    Interrupted runs (Ctrl-C, kill -9) resume from their last checkpoint when run again.
    """
    try:
        file_format(path)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if not path.is_file():
        console.print(f"[red]no such file:[/red] {path}")
        raise typer.Exit(2)
    try:
        check_jsonl(path)
    except ValueError as exc:
        console.print(f"[red]{path}:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    from indexes.changelog import owned_elsewhere
    from proxy.index_host import LOG_DIR

    setup_logging("warning")
    settings = None if url else load_settings(writes=not dry_run)
    if settings is not None and not dry_run and owned_elsewhere(settings.index_dir / LOG_DIR):
        console.print(
            f"[red]warm-up could not run:[/red] a running server owns the data dir "
            f"{settings.data_dir}; warm it up through the server: "
            f"fleetcache warmup {path} --url http://HOST:PORT"
        )
        raise typer.Exit(1)
    # direct mode keeps its place in the data dir; through a proxy, in the working directory
    places = settings.data_dir / "warmup" if settings else Path(".fleetcache") / "warmup"
    checkpoint = checkpoint_for(places.parent, path)
    rejects = rejects or path.with_name(f"{path.name}.rejects.jsonl")
    resuming = not dry_run and (
        checkpoint.rows_done() > 0 if url else bool(checkpoint_files(places.parent, path))
    )
    if restart or not resuming:  # a run from row 1 starts its own list; a resumed one adds
        for old in (rejects, *rejects_parts(rejects)):
            old.unlink(missing_ok=True)  # with the readers' parts a stopped run left
    progress = WarmupProgress(source=str(path), dry_run=dry_run)
    columns = (
        TextColumn("warm-up"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "{task.fields[cached]} cached, {task.fields[embedded]} embedded, "
            "{task.fields[rejected]} rejected, {task.fields[rate]:.0f} rows/s"
        ),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(
            "warm-up", total=count_rows(path), cached=0, embedded=0, rejected=0, rate=0.0
        )

        def show(p: WarmupProgress) -> None:
            bar.update(
                task,
                completed=p.rows,
                cached=p.cached,
                embedded=p.embedded,
                rejected=p.rejected,
                rate=p.rate,
            )

        try:
            if restart:  # every shard's place, whatever the shard count was
                for place in checkpoint_files(places.parent, path):
                    place.unlink()
            if dry_run or url:
                with rejects.open("a") as out:
                    sink = RemoteSink(client_for(url, api_key)) if url else None
                    job = run_warmup(
                        path,
                        sink,
                        progress,
                        chunk_size=chunk_size,
                        rejects=out,
                        on_progress=show,
                        checkpoint_every_s=checkpoint_every,
                        checkpoint=checkpoint if url else None,
                        max_rejects=(settings or load_settings()).max_rejects,
                    )
                    asyncio.run(closing(sink, job))
            else:
                assert settings is not None
                direct_warmup(
                    path,
                    settings,
                    progress,
                    chunk_size=chunk_size,
                    rejects=rejects,
                    checkpoint_every_s=checkpoint_every,
                    on_progress=show,
                )
            if progress.state == "done":  # the total counted lines, blank ones too
                bar.update(task, total=progress.rows, completed=progress.rows)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: run the same command again to resume[/yellow]")
            raise typer.Exit(130) from None
        except (httpx.HTTPError, RuntimeError, OSError, ValueError) as exc:
            console.print(f"[red]warm-up could not run:[/red] {exc}")
            raise typer.Exit(1) from None
    p = progress
    if p.state == "failed":  # a reader process failed (one reader raises, above)
        console.print(
            f"[red]warm-up could not run:[/red] {p.error} ({p.rows} rows read, {p.indexed} "
            "indexed; run the same command again to resume)"
        )
        raise typer.Exit(1)
    verb = "would index" if dry_run else "indexed"
    resumed = f" (resumed after row {p.resumed_from})" if p.resumed_from else ""
    console.print(
        f"warm-up {p.state}{resumed}: {p.rows} rows, {p.indexed} {verb}, {p.embedded} embedded, "
        f"{p.cached} already cached, {p.rejected} rejected (see {rejects}), "
        f"{p.rate:.0f} rows/s"
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
    health = inference["engine_health"]
    state = (
        "unhealthy" if not health["healthy"] else "degraded" if health["degraded"] else "healthy"
    )
    reason = f": {health['reason']}" if health["reason"] else ""
    engine.add_row("engine health", f"{state}{reason} (serving {health['serving']})")
    drift = cache["drift"]
    if drift is not None and drift["sampled"]:
        engine.add_row(
            "drift",
            f"min cosine {drift['min_cosine']:.6f}, {drift['below_threshold']} of "
            f"{drift['sampled']} below {drift['threshold']:g}",
        )
    requests = Table("requests", "p50 ms", "p99 ms")
    for kind, values in latency.items():
        requests.add_row(kind, f"{values['p50_ms']:.2f}", f"{values['p99_ms']:.2f}")
    callers = Table("caller", "hits", "misses")
    for caller, values in stats["by_caller"].items():
        callers.add_row(caller, str(values["hits"]), str(values["misses"]))
    devices = inference.get("devices") or []  # a server older than the device list: none
    if len(devices) < 2:
        return [overview, engine, requests, callers]
    by_device = Table("engine on", "state", "items", "batches", "queue")
    for d in devices:
        state = "healthy"
        if not (d["up"] and d["healthy"]) or d["degraded"]:
            state = "down" if not d["up"] else "unhealthy" if not d["healthy"] else "degraded"
            state += f": {d['reason']}"
        by_device.add_row(
            d["device"], state, str(d["items"]), str(d["batches"]), str(d["queue_depth"])
        )
    return [overview, engine, by_device, requests, callers]


def fetch_stats(url: str, api_key: str | None = None) -> dict[str, Any]:
    return answer(httpx.get(f"{url}/v1/stats", headers=auth_headers(api_key), timeout=10))


def stats_frame(url: str, interval: float, api_key: str | None = None) -> RenderableType:
    """One refresh of ``stats --watch``; a failed read is shown, and the next one retried."""
    now = datetime.now().strftime("%H:%M:%S")
    try:
        tables: list[RenderableType] = list(stats_tables(fetch_stats(url, api_key)))
    except httpx.HTTPError as exc:
        tables = [Text(f"cannot read {url}/v1/stats: {exc}", style="red")]
    heading = Text(f"{url} at {now}, every {interval:g} s (Ctrl-C to stop)", style="dim")
    return Group(heading, *tables)


def watch_stats(url: str, interval: float, count: int | None, api_key: str | None) -> None:
    """Redraw in place on a terminal; elsewhere (a pipe, a log) print each refresh in turn."""
    out = Console()
    frames: Iterable[int] = range(count) if count is not None else itertools.count()
    try:
        with contextlib.ExitStack() as stack:
            live = None
            if out.is_terminal:
                live = stack.enter_context(Live(console=out, auto_refresh=False))
            for i in frames:
                if i:
                    time.sleep(interval)
                frame = stats_frame(url, interval, api_key)
                if live is not None:
                    live.update(frame, refresh=True)
                else:
                    out.print(frame)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends


@app.command()
def stats(
    url: Annotated[str, typer.Option(help="the proxy")] = DEFAULT_URL,
    api_key: ApiKeyOption = None,
    watch: Annotated[bool, typer.Option(help="redraw every --interval seconds")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between redraws")] = 2.0,
    count: Annotated[
        int | None, typer.Option(min=1, help="with --watch: stop after N redraws")
    ] = None,
) -> None:
    """Print the proxy's /v1/stats as tables (--watch: until Ctrl-C)."""
    if watch:
        watch_stats(url, interval, count, api_key)
        return
    try:
        data = fetch_stats(url, api_key)
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot read {url}/v1/stats:[/red] {exc}")
        raise typer.Exit(1) from None
    out = Console()
    for table in stats_tables(data):
        out.print(table)


def read_roster(path: Path) -> list[str]:
    """Driver ids: one per line, a CSV with a driver_id column, or JSONL of records."""
    text = path.read_text().splitlines()
    if path.suffix == ".csv":
        return [row["driver_id"] for row in csv.DictReader(text) if row.get("driver_id")]
    if path.suffix in (".jsonl", ".ndjson"):
        items = [json.loads(line) for line in text if line.strip()]
        return [i if isinstance(i, str) else str(i["driver_id"]) for i in items]
    return [line.strip() for line in text if line.strip()]


async def coverage_direct(ids: list[str]) -> dict[str, Any]:
    from proxy.services import open_local_services

    async with open_local_services(load_settings()) as services:
        return await coverage(services, ids)


@app.command("coverage")
def coverage_command(
    roster: Annotated[Path, typer.Argument(help="driver ids: lines, CSV or JSONL")],
    url: Annotated[str | None, typer.Option(help="ask a running proxy")] = None,
    api_key: ApiKeyOption = None,
) -> None:
    """The share of a roster whose current features are already cached."""
    try:
        ids = read_roster(roster)
        if url:
            body = {"driver_ids": ids}
            headers = auth_headers(api_key)
            result = answer(
                httpx.post(f"{url}/v1/coverage", json=body, headers=headers, timeout=600)
            )
        else:
            setup_logging("warning")
            result = asyncio.run(coverage_direct(ids))
    except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        console.print(f"[red]coverage could not run:[/red] {exc}")
        raise typer.Exit(1) from None
    Console().print(
        f"roster {result['roster']}: {result['known']} known to the fleet index, "
        f"{result['cached']} with current features cached ({result['share']:.1%})"
    )


def current_namespace(settings: Settings) -> str:
    """The cache namespace the server would use, from the engine's fingerprint: the engine
    is built (its model files hashed) but never loaded."""
    from engines.registry import create_engine
    from proxy.engine_host import cache_namespace, engine_options

    return cache_namespace(create_engine(settings.engine, **engine_options(settings)).info)


def prune_table(usage: list[NamespaceUsage], dry_run: bool, caption: str) -> Table:
    title = "cache prune (dry run: freed is what would be freed)" if dry_run else "cache prune"
    table = Table(title=title, caption=caption)
    table.add_column("namespace", no_wrap=True)
    table.add_column("state")
    for name in ("entries", "links", "bytes", "freed entries", "freed bytes"):
        table.add_column(name, justify="right")
    for u in usage:
        state = "current" if u.current else "old"
        counts = (u.entries, u.links, u.bytes, u.freed_entries, u.freed_bytes)
        table.add_row(u.namespace, state, *(f"{n:,}" for n in counts))
    totals = [sum(getattr(u, f) for u in usage) for f in ("freed_entries", "freed_bytes")]
    table.add_section()
    table.add_row("total", "", "", "", "", *(f"{n:,}" for n in totals))
    return table


@cache_app.command("prune")
def cache_prune(
    dry_run: Annotated[
        bool, typer.Option(help="count what would be removed, remove nothing")
    ] = False,
) -> None:
    """Remove cache entries (and entity links) of every engine fingerprint but the current
    one, and expired entries, from the store of FLEETCACHE_STORE (LMDB data dir or Redis)."""
    from proxy.services import build_tiers

    settings = load_settings()
    if settings.store == "memory":
        console.print("store 'memory' keeps nothing between runs: nothing to prune")
        return
    if settings.store == "lmdb" and not settings.lmdb_path.is_dir():
        console.print(f"no cache at {settings.lmdb_path}: nothing to prune")
        return
    try:
        namespace = current_namespace(settings)
        tiered = build_tiers(settings)
    except Exception as exc:  # an engine that cannot be built here, a store that cannot open
        console.print(f"[red]cache prune could not run:[/red] {exc}")
        raise typer.Exit(1) from None
    try:
        assert tiered.store is not None
        usage = prune(tiered.store, namespace, dry_run=dry_run)
    except Exception as exc:  # Redis unreachable, LMDB error
        console.print(f"[red]cache prune failed:[/red] {exc!r}")
        raise typer.Exit(1) from None
    finally:
        tiered.close()
    caption = f"store {settings.store}, current namespace {namespace}"
    Console().print(prune_table(usage, dry_run, caption))


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
    except OSError as exc:
        console.print(f"[red]could not write {out}:[/red] {exc.strerror or exc}")
        raise typer.Exit(1) from None
    console.print(f"wrote {n} drivers to {out}")


@keys_app.command("add")
def keys_add(
    name: Annotated[str, typer.Argument(help="who holds it: 1-64 of A-Z a-z 0-9 _ . -")],
    scopes: Annotated[str, typer.Option(help=f"comma-separated: {', '.join(KNOWN_SCOPES)}")],
    file: KeysFileOption,
) -> None:
    """Make a key: it is printed once (stdout) and only its SHA-256 is written to the file.
    A running proxy picks it up within a second."""
    try:
        key = add_key(file, name, parse_scopes(scopes))
    except (KeysFileError, OSError) as exc:
        console.print(f"[red]no key added:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"key {name!r} added to {file}; it is shown once, here:")
    print(key)


@keys_app.command("list")
def keys_list(file: KeysFileOption) -> None:
    """The keys' names and scopes (never their hashes)."""
    try:
        keys = read_keys(file)
    except KeysFileError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    table = Table("name", "scopes", "lane")
    for key in keys:
        table.add_row(key.name, ",".join(s for s in KNOWN_SCOPES if s in key.scopes), key.lane)
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    name: Annotated[str, typer.Argument(help="the key's name")], file: KeysFileOption
) -> None:
    """Remove a key's line: a running proxy refuses it within a second."""
    try:
        revoke_key(file, name)
    except (KeysFileError, OSError) as exc:
        console.print(f"[red]nothing revoked:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"key {name!r} revoked")


if __name__ == "__main__":  # python -m proxy.cli
    sys.exit(app())
