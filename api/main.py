"""The ASGI application as uvicorn imports it: ``uvicorn api.main:app`` (settings from DLRM_*)."""

from api.app import create_app

app = create_app()
