"""Alembic environment: run with the connection tuner.db.upgrade() hands over."""

from __future__ import annotations

from alembic import context

from tuner.db import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # `alembic` run by hand: connect to sqlalchemy.url
    from sqlalchemy import create_engine

    connection = create_engine(config.get_main_option("sqlalchemy.url")).connect()
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
