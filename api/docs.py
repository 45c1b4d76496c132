"""The interactive documentation (Swagger UI at ``/docs``, ReDoc at ``/redoc``), offline and
usable with keys on.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (blank on a machine without internet)
and fetch ``/openapi.json`` without a key (401 once keys are required). Here:

    - the assets come from a pinned Python package (``fastapi-offline``'s bundled copies of
      Swagger UI and ReDoc), served under ``/docs/assets``; the pages reference nothing else;
    - the pages and assets are static shells, open without a key (they hold nothing of the
      model); ``/openapi.json``, which does, still needs one;
    - with keys on, each page shows a key field: the key is kept in the tab's ``sessionStorage``
      and sent as ``Authorization: Bearer`` on the document's fetch and (Swagger UI's
      ``requestInterceptor``) on every "Try it out" request.
"""

from __future__ import annotations

import json
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS, REDOC, ASSETS = "/docs", "/redoc", "/docs/assets"
ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
OPEN_PREFIXES = (ASSETS + "/",)
"""Path prefixes served without a key (the assets); the pages are in :data:`OPEN_PAGES`."""
OPEN_PAGES = frozenset({DOCS, REDOC})

_KEY_FORM = """
<form id="dlrm-key" style="font-family:sans-serif;padding:8px 16px;background:#f4f4f4;margin:0"
      onsubmit="sessionStorage.setItem('dlrm-api-key', this.key.value);
                location.reload(); return false">
  <label>API key <input name="key" type="password" autocomplete="off" size="48"></label>
  <button type="submit">Use key</button>
  <span id="dlrm-key-state"></span>
</form>
<script>
  const dlrmKey = () => sessionStorage.getItem('dlrm-api-key');
  document.getElementById('dlrm-key-state').textContent =
      dlrmKey() ? 'a key is set for this tab' : 'this server needs a key to show its API';
</script>
"""
_NO_KEY = "<script>const dlrmKey = () => null;</script>"


def _page(title: str, head: str, body: str, secured: bool) -> HTMLResponse:
    html = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><link rel="icon" href="{ASSETS}/favicon.png">{head}</head>
<body style="margin:0">{_KEY_FORM if secured else _NO_KEY}{body}</body></html>"""
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


def swagger_html(title: str, openapi_url: str, secured: bool) -> HTMLResponse:
    body = f"""<div id="swagger-ui"></div>
<script src="{ASSETS}/swagger-ui-bundle.js"></script>
<script>
  SwaggerUIBundle({{
    url: {json.dumps(openapi_url)}, dom_id: '#swagger-ui', validatorUrl: null, deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
    requestInterceptor: (req) => {{
      if (dlrmKey()) req.headers['Authorization'] = 'Bearer ' + dlrmKey();
      return req;
    }},
  }});
</script>"""
    head = f'<link rel="stylesheet" href="{ASSETS}/swagger-ui.css">'
    return _page(f"{title} - Swagger UI", head, body, secured)


def redoc_html(title: str, openapi_url: str, secured: bool) -> HTMLResponse:
    body = f"""<div id="redoc"></div>
<script src="{ASSETS}/redoc.standalone.js"></script>
<script>
  const headers = dlrmKey() ? {{'Authorization': 'Bearer ' + dlrmKey()}} : {{}};
  fetch({json.dumps(openapi_url)}, {{headers}})
    .then((r) => r.ok ? r.json() : Promise.reject(r.status))
    .then((spec) => Redoc.init(spec, {{}}, document.getElementById('redoc')))
    .catch((status) => {{
      document.getElementById('redoc').textContent =
          'the API document could not be loaded (' + status + ')';
    }});
</script>"""
    return _page(f"{title} - ReDoc", "", body, secured)


def install(app: FastAPI, secured: bool) -> None:
    """Serve both pages and their assets (the app is built with ``docs_url=None,
    redoc_url=None``)."""
    app.mount(ASSETS, StaticFiles(directory=ASSET_DIR), name="docs-assets")

    @app.get(DOCS, include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return swagger_html(app.title, app.openapi_url, secured)

    @app.get(REDOC, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return redoc_html(app.title, app.openapi_url, secured)


def is_open(path: str) -> bool:
    """Whether ``path`` is one of the documentation's static pages or assets (no key needed)."""
    return path in OPEN_PAGES or path.startswith(OPEN_PREFIXES)
