"""The CLI's HTTP client for a `tuner serve` API (--url / TUNER_URL, --token / TUNER_API_TOKEN)."""

from __future__ import annotations

from typing import Any

import httpx


class ClientError(RuntimeError):
    """The server said no (its error message) or could not be reached."""


class Client:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach {self.http.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                message = f"{err['message']} (HTTP {r.status_code} {err['code']})"
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {r.status_code}: {r.text[:300]}"
            raise ClientError(message)
        return r

    def submit(self, yaml_text: str) -> dict[str, Any]:
        return self._call("POST", "/api/studies", content=yaml_text.encode(),
                          headers={"Content-Type": "application/yaml"}).json()  # fmt: skip

    def studies(self, **filters) -> list[dict[str, Any]]:
        items, offset = [], 0
        while True:
            page = self._call(
                "GET", "/api/studies", params={**filters, "limit": 500, "offset": offset}
            ).json()
            items += page["items"]
            offset += len(page["items"])
            if not page["items"] or offset >= page["total"]:
                return items

    def study(self, study_id: int) -> dict[str, Any]:
        return self._call("GET", f"/api/studies/{study_id}").json()

    def trials(self, study_id: int, after: int = -1) -> list[dict[str, Any]]:
        items = []
        while True:
            page = self._call("GET", f"/api/studies/{study_id}/trials", params={"after": after}).json()
            items += page["items"]
            if not page["items"]:
                return items
            after = page["last_number"]

    def trials_csv(self, study_id: int) -> str:
        return self._call("GET", f"/api/studies/{study_id}/trials.csv").text

    def best(self, **filters) -> list[dict[str, Any]]:
        return self._call(
            "GET", "/api/best", params={k: v for k, v in filters.items() if v is not None}
        ).json()

    def cancel(self, study_id: int) -> dict[str, Any]:
        return self._call("POST", f"/api/studies/{study_id}/cancel").json()

    def export(self, study_id: int, fmt: str) -> str:
        return self._call("GET", f"/api/studies/{study_id}/export", params={"format": fmt}).text
