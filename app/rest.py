"""`POST /api/search`: the search API as one plain HTTP request, beside Gradio's.

Gradio's own API (`/search`, for `gradio_client`) takes an upload, a queue join and
an event stream per query: about 55 ms of the app's CPU and more in the client
(bench/app_load.py measures both).  This endpoint is one multipart POST answered
with the same JSON (`metric`, `note`, `results` with HIT_FIELDS and `has_image`), for
curl and for clients that are not Python:

  curl -F image=@q.png -F strategy=random -F r=0.4 -F seed=2 -F mode=bilinear -F k=6 \\
       -F rerank=aqe -F rerank_params="n=3, alpha=1" http://127.0.0.1:7860/api/search

Fields: `image` (required), `strategy` (default trained), `mode` (default cosine),
`k` (default 10), the strategy parameters by name (file parameters cannot be
given; another strategy's are not read), and optionally a re-ranker: `rerank`
(default none) with `rerank_params` (`key=value` pairs separated by commas or
spaces, or a JSON object; default: its own defaults), each size at most the
server's --max-rerank-size.  A field that is none of these is refused with the
valid ones.  Bad input is a 4xx with {"error": "..."}; uploads over the app's
--max-upload-mb are refused before they are decoded.  The search itself is
`RetrievalService.api_search`, as Gradio's; this module imports no UI.
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
