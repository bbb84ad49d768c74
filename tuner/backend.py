"""Where the CLI reads and writes studies: the database itself, or a `tuner serve` API (--url).
Both return the same view types (tuner/views.py): the database backend builds them with the
functions the API's routers use, the HTTP backend parses the API's JSON into them."""

from __future__ import annotations

from typing import Protocol

from sqlalchemy.orm import sessionmaker

from tuner import store, views
from tuner.settings import SlurmSettings
from tuner.spec import StudySpec


class BackendError(RuntimeError):
    """An unknown study, a refusal, or a server that cannot be reached: one line for the user."""


class Backend(Protocol):
    def studies(self) -> list[views.StudySummary]: ...

    def study(self, ref: str) -> views.StudyDetail: ...

    def trials(self, ref: str) -> list[views.TrialOut]: ...

    def trials_csv(self, ref: str) -> str: ...

    def best(self, *, model: str | None, gpus: int | None, cluster: str | None,
             global_batch: int | None = None) -> list: ...  # fmt: skip

    def submit(self, text: str, spec: StudySpec) -> views.StudyCreated: ...

    def cancel(self, ref: str) -> str: ...

    def export(self, ref: str, fmt: str) -> str: ...


class DatabaseBackend:
    def __init__(self, sessions: sessionmaker, slurm: SlurmSettings | None = None):
        self.sessions = sessions
        self.slurm = slurm  # the site's TUNER_SLURM_* settings, for the sbatch export

    def _study(self, s, ref: str) -> store.Study:
        found = store.get_study(s, ref)
        if found is None:
            raise BackendError(f"no study {ref!r}; see `tuner studies`")
        return found

    def studies(self) -> list[views.StudySummary]:
        with self.sessions() as s:
            return views.summaries(s, list(reversed(store.list_studies(s))))

    def study(self, ref: str) -> views.StudyDetail:
        with self.sessions() as s:
            return views.detail(s, self._study(s, ref))

    def trials(self, ref: str) -> list[views.TrialOut]:
        with self.sessions() as s:
            return [views.trial(t) for t in store.trials(s, self._study(s, ref))]

    def trials_csv(self, ref: str) -> str:
        from tuner.frames import trials_frame

        with self.sessions() as s:
            return trials_frame(store.trials(s, self._study(s, ref))).to_csv(index=False)

    def best(
        self, *, model: str | None, gpus: int | None, cluster: str | None, global_batch: int | None = None
    ) -> list:
        with self.sessions() as s:
            return views.best_or_predicted(
                s, model=model, cluster=cluster, num_gpus=gpus, global_batch=global_batch
            )

    def submit(self, text: str, spec: StudySpec) -> views.StudyCreated:
        with self.sessions.begin() as s:
            try:
                study = store.create_study(s, spec)
            except store.StudyExists as e:
                raise BackendError(str(e)) from None
            return views.StudyCreated(id=study.id, name=study.name, status=study.status,
                                      url=f"/api/studies/{study.id}")  # fmt: skip

    def cancel(self, ref: str) -> str:
        with self.sessions.begin() as s:
            return store.cancel(s, self._study(s, ref).id, "cancelled from the CLI").message

    def export(self, ref: str, fmt: str) -> str:
        from tuner.exports import export_layout, export_site

        with self.sessions() as s:
            study = self._study(s, ref)
            best = store.best_trial(s, study)
            if best is None:
                raise BackendError(f"study {ref!r} has no completed trial yet")
            try:
                site = export_site(self.slurm) if fmt == "sbatch" and self.slurm else None
                return export_layout(
                    fmt, StudySpec.model_validate(study.spec), store.config_of(best), site=site
                )
            except ValueError as e:
                raise BackendError(str(e)) from None


class HttpBackend:
    def __init__(self, url: str, token: str | None):
        from tuner.client import Client

        self.client = Client(url, token)

    def _call(self, fn):
        from tuner.client import ClientError

        try:
            return fn()
        except ClientError as e:
            raise BackendError(str(e)) from None

    @staticmethod
    def _id(ref: str) -> int:
        if not ref.isdigit():
            raise BackendError(
                f"with --url, name the study by its id (see `tuner studies --url ...`), not {ref!r}"
            )
        return int(ref)

    def studies(self) -> list[views.StudySummary]:
        return [views.StudySummary.model_validate(r) for r in self._call(self.client.studies)]

    def study(self, ref: str) -> views.StudyDetail:
        return views.StudyDetail.model_validate(self._call(lambda: self.client.study(self._id(ref))))

    def trials(self, ref: str) -> list[views.TrialOut]:
        return [
            views.TrialOut.model_validate(t) for t in self._call(lambda: self.client.trials(self._id(ref)))
        ]

    def trials_csv(self, ref: str) -> str:
        return self._call(lambda: self.client.trials_csv(self._id(ref)))

    def best(
        self, *, model: str | None, gpus: int | None, cluster: str | None, global_batch: int | None = None
    ) -> list:
        from pydantic import TypeAdapter

        rows = self._call(
            lambda: self.client.best(model=model, gpus=gpus, cluster=cluster, global_batch=global_batch)
        )
        return TypeAdapter(list[views.best_row_type()]).validate_python(rows)

    def submit(self, text: str, spec: StudySpec) -> views.StudyCreated:
        return views.StudyCreated.model_validate(self._call(lambda: self.client.submit(text)))

    def cancel(self, ref: str) -> str:
        summary = views.StudySummary.model_validate(self._call(lambda: self.client.cancel(self._id(ref))))
        return f"study {summary.name!r} {summary.status.word}"

    def export(self, ref: str, fmt: str) -> str:
        return self._call(lambda: self.client.export(self._id(ref), fmt))
