"""GET /v1/models: the base models and the adapters this tenant may use."""

from fastapi import APIRouter

from app.authenticator import Principal
from app.deps import ServicesDep, TenantDep
from app.errors import ModelNotFound
from app.routes.guarded import TenantRoute
from app.schemas.openai import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"], route_class=TenantRoute)


def _cards(services: ServicesDep, principal: Principal) -> list[ModelCard]:
    cards = [
        ModelCard(
            id=e.name, created=e.created, owned_by="loraplex", root=e.name, max_model_len=e.max_model_len
        )
        for e in services.catalog
    ]
    return cards + services.list_adapters(principal)


@router.get("/models")
async def list_models(principal: TenantDep, services: ServicesDep) -> ModelList:
    return ModelList(data=_cards(services, principal))


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, principal: TenantDep, services: ServicesDep) -> ModelCard:
    card = next((c for c in _cards(services, principal) if c.id == model_id), None)
    if card is None:
        raise ModelNotFound(model_id)
    return card
