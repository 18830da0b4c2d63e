"""`POST /api/search`: the search API as one plain multipart HTTP request, beside Gradio's.

Answered with the same JSON as Gradio's API (`metric`, `note`, `results` with HIT_FIELDS and
`has_image`) by the same `RetrievalService.api_search`; this module imports no UI.  Its fields, refusals and
limits (`--max-rerank-size`, `--max-upload-mb`) and what it saves against Gradio's protocol:
docs/app-and-compare.md ("The same search is also one plain multipart POST").
"""
from __future__ import annotations

from fastapi import Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from core.errors import UserError

from .service import RetrievalService


def add_rest_routes(app, svc: RetrievalService, max_bytes: int) -> None:
    def error(status: int, msg: str):
        return JSONResponse({"error": msg}, status_code=status)

    async def search(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_bytes + 65536:  # + the form's own fields
            return error(413, f"upload too large: {int(size):,} bytes (the limit is {max_bytes:,})")
        try:
            form = await request.form(max_files=1, max_fields=32)
        except Exception as e:
            return error(400, f"not a multipart form: {e}")
        image = form.get("image")
        if image is None or isinstance(image, str):
            return error(400, "no image: send the query image as the multipart file field `image`")
        data = await image.read(max_bytes + 1)
        if len(data) > max_bytes:
            return error(413, f"upload too large (the limit is {max_bytes:,} bytes)")
        fields = {k: v for k, v in form.items() if isinstance(v, str)}

        def work() -> dict:
            return svc.api_search(data, fields)

        try:
            return JSONResponse(await run_in_threadpool(work))
        except UserError as e:
            return error(400, str(e))

    app.add_api_route("/api/search", search, methods=["POST"], include_in_schema=False)
