"""Per-tenant budgets (issue 29): money held at admission and settled when a request ends.

    protocol.py        BudgetBackend, Hold, BudgetView, Periods (what app/ depends on)
    state.py           BudgetState: the algorithm on in-memory state
    local_backend.py   LocalBudgets: BudgetState in this process (one ingress replica, tests)
    ray_backend.py     RayBudgets: BudgetState in one named Ray actor (the embedded default)
    redis_backend.py   RedisBudgets: the same algorithm as Lua scripts in Redis (production)
    factory.py         make_budgets: the backend of the rate limiter's kind
    guard.py           BudgetGuard: one request's money, held at admission and settled when it ends
    price_cache.py     PriceCache: a tenant's prices for a few seconds, so pricing costs no round trip
    view.py            budget_out: the BudgetOut a tenant (GET /v1/limits) or an admin reads

guard.py uses a backend for one request's reservation and settlement; only factory.py and the composition
roots name a backend.
"""
