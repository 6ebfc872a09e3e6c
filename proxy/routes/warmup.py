"""Warm-up jobs over HTTP (``/v1/warmup``) and roster coverage (``/v1/coverage``).

A job reads a file on the server (a path inside the data dir) or a JSONL body uploaded with
the request, and runs in the background as caller ``warmup`` on the batcher's low lane.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from features.models import NO_CONTROL, Identifier
from features.readers import FORMAT_SUFFIXES, check_jsonl, file_format
from proxy.body import JSONRoute, media_type, parse_json
from proxy.deps import ServicesDep
from proxy.errors import API_ERRORS, APIError
from proxy.warmup import LIVE, JobRunning, WarmupJobs, WarmupProgress, coverage

router = APIRouter(tags=["warm-up"], route_class=JSONRoute, responses=API_ERRORS)
CANCEL_WAIT_S = 10.0  # a DELETE waits this long at most for its job to stop
JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines")


def get_jobs(request: Request) -> WarmupJobs:
    jobs: WarmupJobs = request.app.state.jobs
    return jobs


JobsDep = Annotated[WarmupJobs, Depends(get_jobs)]


class WarmupFromPath(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str = Field(
        min_length=1,
        max_length=1024,
        pattern=NO_CONTROL,
        description="a file inside the server's data dir",
    )
    chunk_size: int = Field(500, ge=1, le=10_000)


class CoverageRequest(BaseModel):
    driver_ids: list[Identifier] = Field(min_length=1, max_length=1_000_000)


def job_json(job_id: str, progress: WarmupProgress) -> dict[str, Any]:
    return {"id": job_id, **progress.as_dict()}


def server_path(services: ServicesDep, raw: str) -> Path:
    """A file inside the data dir, of a format the readers know (a 422 naming ``path``; the
    answer never shows the server's directories)."""
    root = services.settings.data_dir.resolve()
    try:  # a name too long for the filesystem is no file either
        path = (root / raw).resolve()
        inside, found = path.is_relative_to(root), path.is_file()
    except (OSError, ValueError):
        inside, found = True, False
    if not inside:
        raise APIError(422, "path must name a file inside the data dir", param="path")
    if not found:
        raise APIError(422, f"no such file in the data dir: {raw}", param="path")
    try:
        file_format(path)
    except ValueError:
        known = ", ".join(sorted(FORMAT_SUFFIXES))
        raise APIError(
            422, f"unknown file format of {raw!r}; known extensions: {known}", param="path"
        ) from None
    try:
        check_jsonl(path)
    except ValueError as exc:
        raise APIError(422, f"{raw}: {exc}", param="path") from None
    return path


async def save_upload(request: Request, upload: Path) -> str:
    """Stream the body to ``upload``, answering its SHA-256 (what its job's checkpoint
    follows: the same body sent again resumes); nothing is left behind when it fails (a 413
    over FLEETCACHE_MAX_UPLOAD_MB, the client gone)."""
    upload.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with upload.open("wb") as out:
            async for block in request.stream():
                out.write(block)
                digest.update(block)
    except BaseException:
        await asyncio.to_thread(upload.unlink, missing_ok=True)
        raise
    return digest.hexdigest()


@router.post(
    "/v1/warmup",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": WarmupFromPath.model_json_schema()},
                "application/x-ndjson": {
                    "schema": {"type": "string", "description": "one DriverRecord a line"}
                },
            },
        }
    },
)
async def start_warmup(request: Request, services: ServicesDep, jobs: JobsDep) -> dict[str, Any]:
    content_type = media_type(request.headers.get("content-type"))
    if content_type in JSONL_TYPES:
        upload = services.settings.data_dir / "warmup" / f"upload-{time.time_ns()}.jsonl"
        digest = await save_upload(request, upload)
        try:
            # past any blank lines: off the loop
            await asyncio.to_thread(check_jsonl, upload, empty_ok=False)
        except ValueError as exc:
            upload.unlink(missing_ok=True)
            raise APIError(422, f"the body: {exc}", param="body") from None
        path, chunk_size, sha256 = upload, 500, digest
    else:
        raw = await request.body()
        if content_type != "application/json" and (content_type or raw.strip()):
            got = f"got '{content_type}'" if content_type else "no Content-Type was sent"
            raise APIError(
                415,
                f"send {{'path': ...}} as JSON ('Content-Type: application/json') or the rows "
                f"as a JSONL body ('Content-Type: {JSONL_TYPES[0]}'): {got}; for a CSV or "
                "Parquet file, place it in the data dir and name it in 'path'",
            )
        try:
            body = WarmupFromPath.model_validate(parse_json(raw) if raw.strip() else {})
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "path"
            raise APIError(
                422,
                f"send {{'path': ...}} as JSON or a JSONL body ({JSONL_TYPES[0]}): "
                f"{where}: {first['msg']}",
                param=where,
            ) from None
        path, chunk_size, sha256 = server_path(services, body.path), body.chunk_size, None
    try:
        job_id = await jobs.start(services, path, chunk_size=chunk_size, upload=sha256)
    except JobRunning as running:
        what = "body" if sha256 else "path"
        if sha256:
            path.unlink(missing_ok=True)  # this POST's copy of the body
        raise APIError(
            409,
            f"a warm-up job of this {what} is still running: {running.job_id} (wait for it "
            f"to end, or DELETE /v1/warmup/{running.job_id}: the same POST then resumes it)",
            param=what,
            type="conflict",
        ) from None
    progress = jobs.get(job_id)
    assert progress is not None
    return job_json(job_id, progress)


@router.get("/v1/warmup")
async def list_warmups(jobs: JobsDep) -> dict[str, Any]:
    return {"jobs": [job_json(i, p) for i, p in jobs.all().items()]}


def known_job(jobs: WarmupJobs, job_id: str, progress: WarmupProgress | None) -> dict[str, Any]:
    if progress is None:
        raise APIError(404, f"unknown warm-up job {job_id!r}", param="job_id", type="not_found")
    return job_json(job_id, progress)


@router.get("/v1/warmup/{job_id}")
async def get_warmup(job_id: str, jobs: JobsDep) -> dict[str, Any]:
    return known_job(jobs, job_id, jobs.get(job_id))


@router.delete("/v1/warmup/{job_id}")
async def cancel_warmup(job_id: str, jobs: JobsDep) -> dict[str, Any]:
    """Answers once the job stopped (it looks for the request every ``STOP_POLL_S``), so
    that the answer says ``cancelled`` and the rows it kept; at most ``CANCEL_WAIT_S``. Its
    texts already queued for the engine are still computed and cached (not counted as the
    job's: a later run finds them cached)."""
    progress = jobs.cancel(job_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while progress is not None and progress.state in LIVE:
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.02)
        progress = jobs.get(job_id)
    return known_job(jobs, job_id, progress)


@router.post("/v1/coverage")
async def roster_coverage(body: CoverageRequest, services: ServicesDep) -> dict[str, Any]:
    return await coverage(services, body.driver_ids)
