"""Alembic migrations for the billing database; billing.migrate runs them without an alembic.ini and
hands env.py the models and the engine factory, so nothing here imports billing."""
