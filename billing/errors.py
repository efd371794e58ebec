"""Billing's domain errors. app/errors.py alone maps them to HTTP."""

from adapters.errors import DomainError


class BillingError(DomainError):
    """Base of every billing error."""


class TenantNotFound(BillingError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} not found")
        self.tenant_id = tenant_id


class TenantNameTaken(BillingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"tenant name {name!r} is already taken")
        self.name = name


class TierNotFound(BillingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"tier {name!r} not found")
        self.name = name


class TierExists(BillingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"tier {name!r} already exists")
        self.name = name


class ApiKeyNotFound(BillingError):
    def __init__(self, key_id: str) -> None:
        super().__init__(f"API key {key_id!r} not found")
        self.key_id = key_id


class InvalidLimits(BillingError):
    """A rate-limit setting out of range; `field` names it (as the API and the columns do)."""

    def __init__(self, field: str, value: object, requirement: str) -> None:
        super().__init__(f"{field} must be {requirement}, got {value!r}")
        self.field = field
        self.value = value


class InvalidPrice(InvalidLimits):
    """A tier's price or currency out of range; `field` names it (a 400 naming the field, like limits)."""


class InvalidStripeCustomer(InvalidLimits):
    """A Stripe customer id that is not `cus_...`; `field` is "stripe_customer_id"."""
