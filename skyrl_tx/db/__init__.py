"""The SQL database: models (tables), engine/session factories and Alembic migrations.

- `skyrl_tx.db.models`  — SessionRecord, ModelRecord, FutureRecord, CheckpointRecord, SamplingSessionRecord
- `skyrl_tx.db.session` — make_engine(url), make_session_factory(engine), default_database_url()
- `skyrl_tx.db.migrate` — upgrade(url), downgrade(url, rev), current(url): the only way the schema is made
"""
