"""schemathesis against /openapi.json: a bounded number of generated requests per operation, with
and without the token; the API must never answer 5xx."""

from __future__ import annotations

import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings

from api.main import create_app
from tuner.settings import Settings

TOKEN = "fuzz-token"
_DIR = Path(tempfile.mkdtemp(prefix="tuner-fuzz-"))
APP = create_app(
    Settings(database_url=f"sqlite:///{_DIR / 'fuzz.db'}", work_dir=_DIR / "runs", api_token=TOKEN)
)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_errors(case) -> None:
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, case.query, response.text[:300])
        ctype = response.headers.get("content-type") or [""]
        ctype = ctype[0] if isinstance(ctype, list) else ctype
        if response.status_code >= 400 and ctype.startswith("application/json"):
            assert set(response.json()) == {"error"}, response.text[:300]  # one error shape
