"""Alembic migrations for the billing database; billing.migrate runs them without an alembic.ini."""
