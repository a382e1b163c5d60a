"""/docs and /redoc that render without internet.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on an offline machine they render
blank. The same assets ship in the `fastapi-offline` wheel; this module serves them from the
installed package and points FastAPI's HTML at them (honouring --root-path).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS_URL = "/docs-assets"


def assets_dir() -> Path:
    """The folder holding swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png."""
    # Found without importing fastapi_offline: we only need its files, not its app factory.
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        raise RuntimeError("the fastapi-offline package (API docs assets) is not installed")
    return Path(spec.origin).parent / "static"


def install_docs(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """Adds /docs, its OAuth2 redirect, /redoc and the static assets they load."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    oauth2_redirect_url = "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url, title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + oauth2_redirect_url,
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
        )

    @app.get(oauth2_redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url, title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png", with_google_fonts=False,
        )
