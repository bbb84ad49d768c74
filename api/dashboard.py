"""The dashboard: static files served by the API at `/` (no build step, no CDN).

`api/static/` holds the page (plain JS modules, hash routes `#/studies`, `#/study/<id>`, `#/best`);
plotly.js comes from the installed plotly package, so an offline cluster needs nothing else. The
page reads the REST API with the same bearer token as any client; these routes carry no data and
stay open, and stay out of the OpenAPI schema.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
# The page's own files revalidate on every load (ETag), so an upgrade shows at once; plotly.js
# (4.8 MB, changes only with the plotly package) is cached for a day.
NO_CACHE = {"Cache-Control": "no-cache"}


def plotly_js_path() -> Path:
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


@functools.cache
def _plotly_js() -> tuple[bytes, bytes, str]:
    """(plain, gzipped, version): 4.8 MB -> ~1.4 MB over a cluster's login-node tunnel; compressed
    once per process (~0.2 s), on first request."""
    import plotly

    raw = plotly_js_path().read_bytes()
    return raw, gzip.compress(raw, compresslevel=6, mtime=0), plotly.__version__


def mount_dashboard(app: FastAPI) -> None:
    settings = app.state.settings

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=NO_CACHE)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/dashboard/config", include_in_schema=False)
    def config() -> dict:
        """What the page must know before its first read: whether reads need a token (so it asks
        for one instead of starting with a 401), and the model presets it can ask predictions for."""
        from trainer.config import MODEL_PRESETS

        presets = sorted(MODEL_PRESETS, key=lambda k: MODEL_PRESETS[k].num_params)
        return {"read_auth": settings.read_auth, "model_presets": presets}

    # Registered before the mount, which would otherwise answer every /static/ path.
    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_js(request: Request) -> Response:
        try:
            raw, zipped, version = _plotly_js()
        except ModuleNotFoundError:  # an image built without it: the page says the charts cannot load
            raise HTTPException(
                503, "the dashboard's charts need the plotly package (pip install plotly)"
            ) from None
        headers = {"Cache-Control": "public, max-age=86400", "Vary": "Accept-Encoding",
                   "X-Plotly-Version": version}  # fmt: skip
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(
                zipped, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"}
            )
        return Response(raw, media_type="text/javascript", headers=headers)

    app.mount("/static", _RevalidatedFiles(directory=STATIC), name="static")


class _RevalidatedFiles(StaticFiles):
    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response
