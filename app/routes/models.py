"""GET /v1/models: the base models and the adapters this tenant may use."""

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from app.auth.authenticator import Principal
from app.deps import ReaderDep, ServicesDep
from app.errors import ModelNotFound
from app.route_guards import TenantRoute
from app.schemas.openai import ModelCard, ModelList
from app.services import Services

router = APIRouter(prefix="/v1", tags=["models"], route_class=TenantRoute)


async def _cards(services: Services, principal: Principal) -> list[ModelCard]:
    cards = [
        ModelCard(
            id=e.name, created=e.created, owned_by="loraplex", root=e.name, max_model_len=e.max_model_len
        )
        for e in services.catalog
    ]

    def limit(base: str) -> int | None:
        entry = services.catalog.get(base)
        return None if entry is None else entry.max_model_len

    adapters: list[ModelCard] = await run_in_threadpool(services.adapters.cards, principal, limit)
    return cards + adapters


@router.get("/models")
async def list_models(principal: ReaderDep, services: ServicesDep) -> ModelList:
    return ModelList(data=await _cards(services, principal))


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, principal: ReaderDep, services: ServicesDep) -> ModelCard:
    card = next((c for c in await _cards(services, principal) if c.id == model_id), None)
    if card is None:
        raise ModelNotFound(model_id)
    return card
